"""One conformance test of the ControlState, run against both implementations: the coordinator's SQLite state and
its in-memory twin (coordinator.control). What one does, the other must."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.control import traffic
from coordinator.control.memory import MemoryState
from coordinator.control.sqlite import SqliteState
from coordinator.control.state import ControlState
from coordinator.control.states import JobState, MemberState, TransitionError
from nodeagent.jobspec import JobSpec, parse_job_spec
from nodeagent.runtime.progress import EdgeCounters, Progress

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "memory"])
def state(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[ControlState]:
    made: ControlState = SqliteState(tmp_path / "coordinator.db", clock) if request.param == "sqlite" \
        else MemoryState(clock)
    yield made
    made.close()


def spec(name: str = "job", nodes: int | dict = 2, **fields: object) -> JobSpec:
    return parse_job_spec({"name": name, "nodes": nodes, "steps": 20, "algorithm": {"name": "dsgd"},
                           "topology": {"kind": "ring"}, **fields})


def register(state: ControlState, *node_ids: str) -> None:
    for index, node_id in enumerate(node_ids):
        state.register_node(node_id, node_id, f"127.0.0.1:{7000 + index}", "", "cpu", "1", "", 0)


def running(state: ControlState, clock: FakeClock, job_id: str = "j1", nodes: tuple[str, ...] = ("a", "b"),
            job_spec: JobSpec | None = None) -> None:
    register(state, *[n for n in nodes if state.node(n) is None])
    state.add_job(job_id, job_spec or spec(nodes=len(nodes)), "yaml", "/runs/" + job_id)
    clock.now += 1
    state.start_job(job_id, list(nodes))


def test_a_node_registers_beats_goes_silent_and_comes_back(state, clock):
    made = state.register_node("", "anon", "127.0.0.1:7000", "", "cpu", "1", "", 0)
    assert made.startswith("node-") and state.node(made).up
    register(state, "a")
    assert sorted(n.node_id for n in state.nodes()) == sorted([made, "a"])
    assert state.touch_node("nobody") == (False, False)
    clock.now += 10
    assert state.touch_node("a") == (True, False)
    assert state.mark_silent_nodes_down(5) == [made]
    assert not state.node(made).up
    assert state.touch_node(made) == (True, True)
    assert state.node(made).last_seen_unix == clock.now


def test_nodes_come_in_registration_order_even_at_the_same_time(state, clock):
    for node_id in ("c", "a", "b"):
        register(state, node_id)
        clock.now += 1
    register(state, "z", "rank10", "rank2")  # at one time
    assert [n.node_id for n in state.nodes()] == ["c", "a", "b", "z", "rank10", "rank2"]


def test_a_known_node_registers_again_with_its_new_address_and_device(state, clock):
    register(state, "a")
    state.mark_down("a")
    clock.now += 5
    assert state.register_node("a", "alpha", "127.0.0.1:9999", "m:1", "cuda:0", "2", "H100", 2**36) == "a"
    node = state.node("a")
    assert (node.name, node.peer_address, node.device, node.up, node.device_name, node.device_memory_bytes,
            node.registered_unix, node.last_seen_unix) == ("alpha", "127.0.0.1:9999", "cuda:0", True, "H100", 2**36,
                                                           1000.0, 1005.0)


def test_mark_down_drain_and_remove(state):
    register(state, "a")
    assert state.mark_down("a") and not state.mark_down("a")
    assert state.set_draining("a", True) and state.node("a").draining
    assert not state.set_draining("nobody", True)
    state.remove_node("a")
    assert state.node("a") is None and state.nodes() == []


def test_a_job_is_added_pending_with_its_spec_parsed_once(state, clock):
    job_spec = spec(nodes={"min": 2, "max": 4})
    state.add_job("j1", job_spec, "name: job", "/runs/j1")
    job = state.job("j1")
    assert (job.state, job.world_size, job.created_unix, job.run_dir, job.spec_yaml) == \
        (JobState.PENDING, 2, 1000.0, "/runs/j1", "name: job")
    assert job.spec == job_spec and job.running_spec == job_spec
    assert state.job("j1").spec is state.job("j1").spec  # not parsed again on each read
    assert state.job("nope") is None


def test_jobs_are_found_by_id_name_or_unique_prefix_and_listed_newest_first(state, clock):
    for job_id, name in (("alpha-1", "alpha"), ("alpha-2", "alpha"), ("beta-1", "beta")):
        state.add_job(job_id, spec(name), "", "/runs")
        clock.now += 1
    assert state.find_job("alpha-1").job_id == "alpha-1"
    assert state.find_job("alpha").job_id == "alpha-2"  # the newest of that name
    assert state.find_job("bet").job_id == "beta-1"
    assert state.find_job("alpha-") is None  # two ids start so
    assert state.job_ids_starting("alpha-", 5) == ["alpha-2", "alpha-1"]  # newest first
    assert state.job_ids_starting("alpha-", 1) == ["alpha-2"] and state.job_ids_starting("zzz", 5) == []
    assert state.find_job("zzz") is None
    assert [j.job_id for j in state.all_jobs(2)] == ["beta-1", "alpha-2"]
    assert state.latest_job().job_id == "beta-1"
    assert [j.job_id for j in state.jobs((JobState.PENDING,))] == ["alpha-1", "alpha-2", "beta-1"]


def test_a_started_job_runs_on_its_nodes_in_rank_order(state, clock):
    running(state, clock, nodes=("b", "a"))
    job = state.job("j1")
    assert (job.state, job.world_size, job.started_unix, job.reason) == (JobState.RUNNING, 2, 1001.0, "")
    assert [(m.rank, m.node_id, m.state) for m in state.members("j1")] == \
        [(0, "b", MemberState.JOINED), (1, "a", MemberState.JOINED)]
    assert state.busy_node_ids() == {"a", "b"}
    membership = state.running_membership("a")
    assert membership is not None and (membership[0].job_id, membership[1]) == ("j1", 1)
    assert state.running_membership("c") is None


def test_a_pending_reason_is_kept_only_while_pending(state, clock):
    state.add_job("j1", spec(), "", "/runs")
    state.set_pending_reason("j1", "needs 2 agents")
    assert state.job("j1").reason == "needs 2 agents"
    register(state, "a", "b")
    state.start_job("j1", ["a", "b"])
    state.set_pending_reason("j1", "ignored")
    assert state.job("j1").reason == ""


def test_ending_a_job_is_final_and_frees_its_nodes(state, clock):
    running(state, clock)
    clock.now += 3
    assert state.end_job("j1", JobState.FAILED, "rank 1 failed")
    job = state.job("j1")
    assert (job.state, job.reason, job.ended_unix) == (JobState.FAILED, "rank 1 failed", 1004.0)
    assert not state.end_job("j1", JobState.STOPPED)  # ended already: a race, not a move
    assert state.busy_node_ids() == set() and state.running_membership("a") is None
    assert [j.job_id for j in state.jobs((JobState.RUNNING, JobState.PENDING))] == []


@pytest.mark.parametrize(("start", "target"), [
    (JobState.PENDING, JobState.FINISHED), (JobState.PENDING, JobState.FAILED), (JobState.RUNNING, JobState.RUNNING),
])
def test_a_move_not_in_the_table_raises(state, clock, start, target):
    if start is JobState.RUNNING:
        running(state, clock)
        with pytest.raises(TransitionError):
            state.start_job("j1", ["a", "b"])
        return
    state.add_job("j1", spec(), "", "/runs")
    with pytest.raises(TransitionError):
        state.end_job("j1", target)
    assert state.job("j1").state == JobState.PENDING


def test_a_pending_job_may_be_stopped(state):
    state.add_job("j1", spec(), "", "/runs")
    assert state.end_job("j1", JobState.STOPPED, "stopped by an operator")
    assert state.job("j1").state == JobState.STOPPED


def test_progress_is_recorded_for_the_rank_its_node_holds_and_an_evaluation_stays(state, clock):
    running(state, clock, nodes=("b", "a"))
    assert not state.record_progress(Progress("j1", 0, "a", step=3))  # rank 0 is b's
    assert state.record_progress(Progress("j1", 0, "b", step=3, loss=0.5, test_accuracy=0.8, test_loss=0.4,
                                          elapsed_s=2.0, time=1002.0, local_steps=3, bytes_sent=10))
    assert state.record_progress(Progress("j1", 0, "b", step=4, loss=0.4, elapsed_s=3.0, time=1003.0,
                                          local_steps=4, finished=True, bytes_sent=12))
    [first, second] = state.members("j1")
    p = first.progress
    assert (p.step, p.loss, p.test_accuracy, p.test_loss, p.elapsed_s, p.time, p.local_steps, p.finished,
            p.bytes_sent) == (4, 0.4, 0.8, 0.4, 3.0, 1003.0, 4, True, 12)
    assert first.state == MemberState.FINISHED
    assert math.isnan(second.progress.loss) and second.progress.time == 0


def report(state: ControlState, elapsed_s: float, sent: int, edges: dict[str, int]) -> Progress:
    """Rank 0's report (node a): its agent's total of bytes sent in this run and the edges it names."""
    recorded = state.record_progress(Progress(
        "j1", 0, "a", elapsed_s=elapsed_s, bytes_sent=sent, bytes_received=sent // 2,
        edges=tuple(EdgeCounters(peer, peer_sent, peer_sent // 2, exchanges=1)
                    for peer, peer_sent in sorted(edges.items()))))
    assert recorded is not None
    return recorded


def test_per_edge_traffic_adds_up_to_the_total_across_a_switch_and_a_restart(state, clock):
    running(state, clock, nodes=("a", "b", "c", "d"), job_spec=spec(nodes=4))
    report(state, 1.0, 200, {"b": 100, "d": 100})
    # A switch made c a neighbour instead of d: the report after it names d a last time, the next ones no more.
    report(state, 2.0, 370, {"b": 200, "c": 50, "d": 120})
    switched = report(state, 3.0, 570, {"b": 300, "c": 150})
    assert {e.peer: e.bytes_sent for e in switched.edges} == {"b": 300, "c": 150, "d": 120}
    assert switched.bytes_sent == sum(e.bytes_sent for e in switched.edges) == 570
    # The agent restarts: its counters start again at zero; the member's traffic goes on from where it was.
    restarted = report(state, 0.5, 60, {"b": 40, "c": 20})
    assert {e.peer: e.bytes_sent for e in restarted.edges} == {"b": 340, "c": 170, "d": 120}
    assert {e.peer: e.bytes_received for e in restarted.edges} == {"b": 170, "c": 85, "d": 60}
    assert restarted.bytes_sent == sum(e.bytes_sent for e in restarted.edges) == 630
    assert restarted.bytes_received == sum(e.bytes_received for e in restarted.edges) == 315
    later = report(state, 1.5, 100, {"b": 70, "c": 30})
    assert later.bytes_sent == sum(e.bytes_sent for e in later.edges) == 670
    [stored] = [m.progress for m in state.members("j1") if m.rank == 0]
    assert (stored.bytes_sent, stored.bytes_received) == (670, 335)  # what `coordinator status` shows


def test_a_members_traffic_ledger_keeps_no_more_peers_than_a_job_can_have(monkeypatch):
    monkeypatch.setattr(traffic, "MAX_PEERS", 3)
    ledger = traffic.TrafficLedger()
    for index in range(10):  # a report naming other peers each time
        ledger.add(Progress("j1", 0, "a", elapsed_s=index, bytes_sent=index + 1,
                            edges=(EdgeCounters(f"peer-{index}", 1, 0),)))
    assert sorted(ledger.last_edges) == ["peer-0", "peer-1", "peer-2"]
    assert traffic.TrafficLedger.from_json(ledger.to_json()) == ledger


def test_a_failure_is_recorded_for_the_rank_its_node_holds(state, clock):
    running(state, clock, nodes=("b", "a"))
    assert not state.record_failure("j1", 0, "a", "no")
    assert state.record_failure("j1", 1, "a", "out of memory")
    assert [m.state for m in state.members("j1")] == [MemberState.JOINED, MemberState.FAILED]
    assert state.members("j1")[1].failure == "out of memory"


def test_the_start_barrier_releases_the_job_when_its_last_rank_is_ready(state, clock):
    running(state, clock, nodes=("b", "a"))
    assert state.mark_ready("j1", 0, "a", "{}") is None  # not a's rank
    first = state.mark_ready("j1", 0, "b", '{"n": 1}')
    assert (first.data_json, first.released, first.released_now) == ('{"n": 1}', False, False)
    other = state.mark_ready("j1", 1, "a", '{"n": 2}')
    assert (other.data_json, other.released, other.released_now) == ('{"n": 1}', False, False)
    assert not state.members("j1")[1].ready
    clock.now += 2
    last = state.mark_ready("j1", 1, "a", '{"n": 1}')
    assert (last.released, last.released_now) == (True, True)
    job = state.job("j1")
    assert (job.data_json, job.released_unix) == ('{"n": 1}', 1003.0)
    again = state.mark_ready("j1", 1, "a", '{"n": 1}')
    assert (again.released, again.released_now) == (True, False)
    assert [m.state for m in state.members("j1")] == [MemberState.READY, MemberState.READY]
    state.end_job("j1", JobState.STOPPED)
    assert state.mark_ready("j1", 0, "b", '{"n": 1}') is None


def test_a_topology_change_takes_the_next_version_only(state, clock):
    running(state, clock)
    topology = '{"kind": "complete", "seed": 0, "options": {}}'
    assert not state.change_topology("j1", topology, 3, 10)
    assert state.change_topology("j1", topology, 2, 10)
    job = state.job("j1")
    assert (job.topology_version, job.switch_step, job.running_spec.topology.kind, job.spec.topology.kind) == \
        (2, 10, "complete", "ring")
    assert not state.change_topology("j1", topology, 2, 12)  # another change came first


def test_an_elastic_job_changes_members_and_a_rank_that_left_goes_to_a_newcomer(state, clock):
    running(state, clock, nodes=("a", "b", "c"), job_spec=spec(nodes={"min": 2, "max": 4}))
    register(state, "d")
    clock.now += 1
    assert state.change_members("j1", 2, 7, [(3, "d")], [1])
    job = state.job("j1")
    assert (job.world_size, job.topology_version, job.switch_step) == (3, 2, 7)
    assert [(m.rank, m.node_id, m.joined_step) for m in state.members("j1")] == [(0, "a", 0), (2, "c", 0),
                                                                                  (3, "d", 7)]
    assert [(m.rank, m.state) for m in state.members("j1", with_left=True)] == \
        [(0, MemberState.JOINED), (1, MemberState.LEFT), (2, MemberState.JOINED), (3, MemberState.JOINED)]
    assert state.busy_node_ids() == {"a", "c", "d"}
    assert state.running_membership("b") is None
    assert not state.record_progress(Progress("j1", 1, "b", step=1))  # b left: nothing of it is recorded
    assert not state.change_members("j1", 2, 9, [], [0])  # an older version
    register(state, "e")
    assert state.change_members("j1", 3, 9, [(1, "e")], [])
    assert [(m.rank, m.node_id) for m in state.members("j1", with_left=True)] == \
        [(0, "a"), (1, "e"), (2, "c"), (3, "d")]


def test_removing_a_node_keeps_its_rows_and_results_in_ended_jobs(state, clock):
    running(state, clock)
    clock.now += 1
    state.record_progress(Progress("j1", 0, "a", step=20, test_accuracy=0.75, finished=True, bytes_sent=9, time=1))
    state.end_job("j1", JobState.FINISHED)
    state.remove_node("a")
    assert state.node("a") is None
    kept = state.members("j1")
    assert [(m.rank, m.node_id, m.state) for m in kept] == [(0, "a", MemberState.FINISHED),
                                                            (1, "b", MemberState.JOINED)]
    assert (kept[0].progress.test_accuracy, kept[0].progress.bytes_sent) == (0.75, 9)


def test_the_barrier_waits_for_a_member_that_joined_and_not_for_one_that_left(state, clock):
    running(state, clock, nodes=("a", "b", "c"), job_spec=spec(nodes={"min": 2, "max": 4}))
    register(state, "d")
    assert not state.mark_ready("j1", 0, "a", "{}").released
    assert state.change_members("j1", 2, 5, [(3, "d")], [1])
    assert not state.mark_ready("j1", 2, "c", "{}").released
    assert state.mark_ready("j1", 3, "d", "{}").released_now


def test_an_ended_job_is_deleted_with_its_members_and_an_active_one_is_not(state, clock):
    running(state, clock, "j1", ("a", "b"))
    state.add_job("j2", spec(), "yaml", "/runs/j2")  # pending: the nodes are busy
    assert not state.delete_job("j1") and not state.delete_job("j2") and not state.delete_job("nope")
    assert state.job("j1") is not None and len(state.members("j1")) == 2
    clock.now += 1
    state.end_job("j1", JobState.FINISHED)
    assert state.delete_job("j1")
    assert state.job("j1") is None and state.members("j1", with_left=True) == []
    assert state.find_job("j1") is None and [j.job_id for j in state.all_jobs(10)] == ["j2"]
    assert not state.delete_job("j1")  # once
    # The nodes are still known, and the other job still pending.
    assert {n.node_id for n in state.nodes()} == {"a", "b"} and state.job("j2").state == JobState.PENDING


def test_job_counts_and_ended_ids_come_without_reading_the_jobs(state, clock):
    for index in range(3):
        running(state, clock, f"j{index}", ("a", "b"))
        clock.now += 1
        state.end_job(f"j{index}", JobState.STOPPED if index == 1 else JobState.FINISHED)
    running(state, clock, "live", ("a", "b"))
    state.add_job("queued", spec(), "yaml", "/runs/queued")
    assert state.job_counts() == {JobState.FINISHED: 2, JobState.STOPPED: 1, JobState.RUNNING: 1,
                                  JobState.PENDING: 1}
    assert state.ended_job_ids() == ["j2", "j1", "j0"]  # the latest ended first
