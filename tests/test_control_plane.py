"""The coordinator's rules (coordinator.control.plane), driven as events against the in-memory state on a fake clock:
the lifecycle of a job, scheduling, the start barrier, the failure policy and elastic replanning, each in
milliseconds. The same scenarios run once on real agents in test_job_lifecycle, test_start_barrier and test_elastic.
"""

from __future__ import annotations

import math

import pytest

from coordinator.control.memory import MemoryState
from coordinator.control.plane import (
    MIN_SWITCH_MARGIN_STEPS,
    AssignmentsChanged,
    ControlPlane,
    Effect,
    JobEnded,
    JobEvent,
    Quarantined,
    QuarantineRefused,
    TopologyRefused,
)
from coordinator.control.records import Job
from coordinator.control.states import JobState, MemberState
from nodeagent.jobspec import JobSpecError, TopologySpec, parse_job_spec
from nodeagent.runtime import events
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.progress import EdgeCounters, MemberJudgement, Progress
from nodeagent.training.data import DatasetInfo

pytestmark = pytest.mark.unit

TIMEOUT_S = 15.0  # the heartbeat timeout
DATA = DatasetInfo((1, 28, 28), 10, 60_000, 10_000)
OTHER_DATA = DatasetInfo((1, 28, 28), 10, 50_000, 10_000)


class Cluster:
    """A control plane on the memory state, a fake clock, and nodes that beat when told."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.state = MemoryState(self.clock)
        self.plane = ControlPlane(self.state, self.clock, TIMEOUT_S)
        self.effects: list[Effect] = []
        self.count = 0

    def clock(self) -> float:
        return self.now

    def apply(self, effects: list[Effect]) -> list[Effect]:
        self.effects.extend(effects)
        return effects

    def register(self, *names: str, device: str = "cpu") -> None:
        for name in names:
            self.state.register_node(name, name, f"127.0.0.1:{7000 + self.count}", "", device, "1", "", 0)
            self.count += 1
            self.now += 0.001  # registration order
            self.apply(self.plane.nodes_changed())

    def submit(self, spec: dict) -> str:
        job_id = f"job{len(self.state.all_jobs(1000))}"
        self.state.add_job(job_id, parse_job_spec(spec), "", f"/runs/{job_id}")
        self.apply(self.plane.submitted())
        return job_id

    def beat(self, *names: str) -> None:
        for name in names:
            self.state.touch_node(name)

    def advance(self, seconds: float, beating: tuple[str, ...] = ()) -> None:
        """Time passes a second at a time; the nodes `beating` beat every second, the monitor ticks."""
        for _ in range(int(seconds)):
            self.now += 1
            self.beat(*beating)
            self.apply(self.plane.tick())

    def ready_all(self, job_id: str, data: DatasetInfo = DATA) -> None:
        job = self.state.job(job_id)
        for member in self.state.members(job_id):
            self.apply(self.plane.ready(job, member.rank, member.node_id, data)[1])

    def report(self, job_id: str, rank: int, step: int, finished: bool = False, elapsed_s: float = 0.0) -> None:
        member = {m.rank: m for m in self.state.members(job_id)}[rank]
        self.state.record_progress(Progress(job_id, rank, member.node_id, step=step, finished=finished,
                                            elapsed_s=elapsed_s, local_steps=step, time=self.now))
        if finished:
            self.apply(self.plane.reported(self.state.job(job_id)))

    def job(self, job_id: str) -> Job:
        job = self.state.job(job_id)
        assert job is not None
        return job

    def events(self, kind: str) -> list[str]:
        return [e.message for e in self.effects if isinstance(e, JobEvent) and e.kind == kind]


def spec(nodes: int | dict = 2, algorithm: str = "dsgd", mode: str | None = None, **fields: object) -> dict:
    chosen: dict = {"name": algorithm}
    if mode is not None:
        chosen["mode"] = mode
    return {"name": "t", "nodes": nodes, "steps": 100, "algorithm": chosen, "topology": {"kind": "ring"}, **fields}


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


# -- lifecycle and scheduling ------------------------------------------------------------------------------------------


def test_a_job_starts_on_idle_nodes_and_finishes_when_every_rank_has(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(2))
    job = cluster.job(job_id)
    assert job.state == JobState.RUNNING
    assert [(m.rank, m.node_id) for m in cluster.state.members(job_id)] == [(0, "a"), (1, "b")]
    assert cluster.events(events.STARTED) == ["running on rank 0 a, rank 1 b"]
    assert AssignmentsChanged() in cluster.effects
    cluster.report(job_id, 0, 100, finished=True)
    assert cluster.job(job_id).state == JobState.RUNNING
    cluster.report(job_id, 1, 100, finished=True)
    assert cluster.job(job_id).state == JobState.FINISHED
    assert [e.state for e in cluster.effects if isinstance(e, JobEnded)] == [JobState.FINISHED]
    assert cluster.events(events.FINISHED) == ["job finished"]


def test_a_job_that_does_not_fit_waits_with_the_reason_and_starts_when_nodes_join(cluster):
    cluster.register("a")
    job_id = cluster.submit(spec(3))
    assert cluster.job(job_id).state == JobState.PENDING
    assert cluster.job(job_id).reason == ("needs 3 agents; 1 is up and not draining (1 registered): it starts when 2 "
                                          "more join")
    cluster.register("b", "c")
    assert cluster.job(job_id).state == JobState.RUNNING and cluster.job(job_id).reason == ""


def test_a_big_job_waiting_does_not_hold_back_a_smaller_one_that_fits(cluster):
    cluster.register("a", "b")
    first = cluster.submit(spec(2))
    big = cluster.submit(spec(3))
    small = cluster.submit(spec(2))
    cluster.register("c", "d")
    assert [cluster.job(j).state for j in (first, big, small)] == [JobState.RUNNING, JobState.PENDING,
                                                                 JobState.RUNNING]
    cluster.advance(1, beating=("a", "b", "c", "d"))  # the next pass says what the big job waits for now
    assert cluster.job(big).reason == ("needs 3 idle agents; 0 are idle now, the others run jobs: it starts when they "
                                       "end")
    cluster.apply(cluster.plane.stopped(cluster.job(first)))
    assert cluster.job(first).state == JobState.STOPPED
    assert cluster.job(big).state == JobState.PENDING  # 2 idle: still one short
    cluster.report(small, 0, 100, finished=True)
    cluster.report(small, 1, 100, finished=True)
    assert cluster.job(big).state == JobState.RUNNING


def test_draining_and_fp16_keep_nodes_out_of_new_jobs(cluster):
    cluster.register("a", "b")
    cluster.register("gpu", device="cuda:0")
    cluster.state.set_draining("a", True)
    cluster.apply(cluster.plane.drained("a"))
    job_id = cluster.submit(spec(2, training={"precision": "fp16"}))
    assert cluster.job(job_id).reason.startswith("needs 2 agents on a CUDA device (training.precision fp16); 1 is up")
    cluster.register("gpu2", device="cuda:1")
    assert [m.node_id for m in cluster.state.members(job_id)] == ["gpu", "gpu2"]


# -- the start barrier -------------------------------------------------------------------------------------------------


def test_the_barrier_releases_every_rank_once_the_last_is_ready(cluster):
    cluster.register("a", "b")
    job_id = cluster.submit(spec(2))
    job = cluster.job(job_id)
    outcome, _ = cluster.plane.ready(job, 0, "a", DATA)
    assert outcome.running and not outcome.released
    assert cluster.plane.not_ready(cluster.job(job_id)) == "rank 1 (node b)"
    outcome, effects = cluster.plane.ready(job, 1, "b", DATA)
    assert outcome.released and AssignmentsChanged() in effects
    assert [e.kind for e in effects if isinstance(e, JobEvent)] == [events.RELEASED]
    assert cluster.job(job_id).released_unix == cluster.now


def test_without_the_barrier_a_rank_starts_once_it_is_ready(cluster):
    cluster.register("a", "b")
    job_id = cluster.submit(spec(2, start={"barrier": False}))
    outcome, _ = cluster.plane.ready(cluster.job(job_id), 0, "a", DATA)
    assert outcome.released


def test_a_barrier_that_times_out_fails_the_job_naming_the_ranks_never_ready(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(3, start={"timeout_s": 30}))
    cluster.plane.ready(cluster.job(job_id), 1, "b", DATA)
    cluster.advance(30, beating=("a", "b"))
    assert cluster.job(job_id).state == JobState.RUNNING
    cluster.advance(1, beating=("a", "b"))
    job = cluster.job(job_id)
    assert job.state == JobState.FAILED
    assert job.reason == "start barrier: ranks 0 (node a), 2 (node c, down) not ready within start.timeout_s " \
                         "(30 s) of the job's start"


def test_two_ranks_with_other_data_fail_the_job_naming_what_differs_and_blaming_neither(cluster):
    cluster.register("a", "b")
    job_id = cluster.submit(spec(2))
    cluster.plane.ready(cluster.job(job_id), 0, "a", DATA)
    outcome, _ = cluster.plane.ready(cluster.job(job_id), 1, "b", OTHER_DATA)
    assert not outcome.running
    job = cluster.job(job_id)
    assert job.state == JobState.FAILED
    assert job.reason.startswith("no majority of the ranks agrees on the data (rank 0 (node a); rank 1 (node b) "
                                 "differ): ") and "60000" in job.reason


def test_a_rank_that_reports_other_data_first_is_blamed_once_the_majority_is_known(cluster):
    # A lying member reports ready first with another data description: the honest ranks that follow are not
    # blamed for disagreeing with it; the job waits until a majority is known, then names the minority.
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(spec(4))
    cluster.plane.ready(cluster.job(job_id), 3, "d", OTHER_DATA)
    outcome, _ = cluster.plane.ready(cluster.job(job_id), 0, "a", DATA)
    assert outcome.running and not outcome.released  # 1 against 1: no verdict yet
    cluster.plane.ready(cluster.job(job_id), 1, "b", DATA)
    assert cluster.job(job_id).state == JobState.RUNNING  # 2 of 4: not a majority
    outcome, _ = cluster.plane.ready(cluster.job(job_id), 2, "c", DATA)
    assert not outcome.running
    job = cluster.job(job_id)
    assert job.state == JobState.FAILED
    assert job.reason.startswith("rank 3 (node d) has other data than ranks 0, 1, 2: ") and "60000" in job.reason


# -- the failure policy ------------------------------------------------------------------------------------------------


def test_a_node_that_reports_a_failure_fails_its_job(cluster):
    cluster.register("a", "b")
    job_id = cluster.submit(spec(2))
    assert cluster.plane.failed(job_id, 1, "a", "not a's rank") == (False, [])
    held, effects = cluster.plane.failed(job_id, 1, "b", "out of memory")
    assert held and [e.state for e in effects if isinstance(e, JobEnded)] == [JobState.FAILED]
    cluster.apply(effects)
    assert cluster.job(job_id).state == JobState.FAILED
    assert cluster.job(job_id).reason == "rank 1 (node b) failed: out of memory"
    assert cluster.state.members(job_id)[1].state == MemberState.FAILED


def test_silence_counts_only_a_heartbeat_timeout_after_the_coordinator_started(cluster):
    cluster.register("a")
    cluster.advance(TIMEOUT_S - 1)
    assert cluster.state.node("a").up  # its last heartbeat went to the coordinator before this one
    cluster.advance(2)
    assert not cluster.state.node("a").up


@pytest.mark.parametrize(("mode", "ends"), [("sync", JobState.FAILED), ("async", JobState.RUNNING)])
def test_a_lost_node_fails_a_synchronous_job_and_not_an_asynchronous_one(cluster, mode, ends):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(3, mode=mode, failure={"lost_grace_s": 5}))
    cluster.ready_all(job_id)
    cluster.advance(TIMEOUT_S + 4, beating=("a", "b"))
    assert cluster.job(job_id).state == JobState.RUNNING  # within the timeout and the grace
    cluster.advance(2, beating=("a", "b"))
    job = cluster.job(job_id)
    assert job.state == ends
    if ends == JobState.FAILED:
        assert job.reason.startswith("lost rank 2 (node c, silent for 2") and "synchronous job" in job.reason
        return
    cluster.report(job_id, 0, 100, finished=True)
    cluster.report(job_id, 1, 100, finished=True)
    cluster.advance(1, beating=("a", "b"))
    assert cluster.job(job_id).state == JobState.FINISHED
    assert cluster.job(job_id).reason.startswith("without the lost rank 2 (node c")


@pytest.mark.parametrize(("lost", "ends"), [(("d",), JobState.RUNNING), (("c", "d"), JobState.FAILED)])
def test_an_all_reduce_job_goes_on_while_its_quorum_keeps_its_minimum(cluster, lost, ends):
    nodes = ("a", "b", "c", "d")
    cluster.register(*nodes)
    job_id = cluster.submit(spec(4, algorithm="allreduce", failure={"lost_grace_s": 5}))
    assert cluster.job(job_id).spec.quorum_minimum == 3
    cluster.ready_all(job_id)
    cluster.advance(TIMEOUT_S + 7, beating=tuple(n for n in nodes if n not in lost))
    job = cluster.job(job_id)
    assert job.state == ends
    if ends == JobState.FAILED:
        assert "the all-reduce has 2 members left, fewer than its quorum's minimum of 3" in job.reason


# -- elastic jobs and topology changes ---------------------------------------------------------------------------------


def elastic(low: int, high: int, **fields: object) -> dict:
    return spec({"min": low, "max": high}, algorithm="gossip", **fields)


def test_an_elastic_job_grows_once_released_and_a_drained_member_leaves(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(elastic(3, 5))
    assert cluster.job(job_id).world_size == 3
    cluster.register("d")
    assert cluster.job(job_id).world_size == 3  # not released yet: it grows after its start
    cluster.ready_all(job_id)
    cluster.advance(1, beating=("a", "b", "c", "d"))
    job = cluster.job(job_id)
    assert (job.world_size, job.topology_version, job.switch_step) == (4, 2, MIN_SWITCH_MARGIN_STEPS)
    assert cluster.events(events.JOINED) == [f"node d joined as rank 3: 4 members; ring planned again (version 2) "
                                             f"from step {MIN_SWITCH_MARGIN_STEPS}"]
    for rank in range(4):
        cluster.report(job_id, rank, MIN_SWITCH_MARGIN_STEPS)
    cluster.state.set_draining("b", True)
    cluster.apply(cluster.plane.drained("b"))
    job = cluster.job(job_id)
    assert (job.world_size, job.topology_version) == (3, 3)
    assert [m.node_id for m in cluster.state.members(job_id)] == ["a", "c", "d"]
    assert cluster.events(events.LEFT)[0].startswith("rank 1 (node b) left: drained by an operator; 3 members")


def test_an_elastic_job_waits_for_its_members_to_switch_before_the_next_change(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(elastic(2, 5))
    cluster.ready_all(job_id)
    cluster.register("d")
    cluster.advance(1, beating=("a", "b", "c", "d"))
    assert cluster.job(job_id).world_size == 4
    cluster.register("e")
    cluster.advance(1, beating=("a", "b", "c", "d", "e"))
    assert cluster.job(job_id).world_size == 4  # no member has reached the switch step of the last change
    with pytest.raises(TopologyRefused, match="has not reached step"):
        cluster.plane.topology_requested(cluster.job(job_id), TopologySpec(kind="complete"))
    for rank in range(4):
        cluster.report(job_id, rank, MIN_SWITCH_MARGIN_STEPS)
    cluster.advance(1, beating=("a", "b", "c", "d", "e"))
    assert cluster.job(job_id).world_size == 5


def test_a_lost_member_leaves_an_asynchronous_elastic_job_that_keeps_its_least(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(elastic(2, 3, failure={"lost_grace_s": 5}))
    cluster.ready_all(job_id)
    cluster.advance(TIMEOUT_S + 7, beating=("a", "b"))
    job = cluster.job(job_id)
    assert (job.state, job.world_size) == (JobState.RUNNING, 2)
    assert cluster.events(events.LEFT)[0].startswith("rank 2 (node c) left: no heartbeat for longer than")


def test_a_topology_change_switches_every_node_at_one_step_ahead_of_the_fastest(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(3, algorithm="dsgd", mode="async"))
    cluster.report(job_id, 0, 40, elapsed_s=2.0)  # 20 steps/s: 100 steps in SWITCH_LEAD_S
    cluster.report(job_id, 1, 30, elapsed_s=2.0)
    with pytest.raises(TopologyRefused, match="ends at step 100, before the earliest step its nodes could all "
                                              "switch at \\(140\\)"):
        cluster.plane.topology_requested(cluster.job(job_id), TopologySpec(kind="complete"))
    cluster.report(job_id, 0, 4, elapsed_s=2.0)
    cluster.report(job_id, 1, 3, elapsed_s=2.0)
    changed, effects = cluster.plane.topology_requested(cluster.job(job_id), TopologySpec(kind="complete"))
    assert (changed.version, changed.switch_step, changed.previous_kind) == (2, 4 + MIN_SWITCH_MARGIN_STEPS, "ring")
    assert cluster.job(job_id).running_spec.topology.kind == "complete"
    assert AssignmentsChanged() in effects


def test_a_topology_that_does_not_fit_the_job_is_refused_before_anything_changes(cluster):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(3, algorithm="dsgd", mode="async"))
    with pytest.raises(JobSpecError):
        cluster.plane.topology_requested(cluster.job(job_id), TopologySpec(kind="torus", options={"rows": 5}))
    assert cluster.job(job_id).topology_version == 1


def test_each_member_is_planned_in_the_graph_its_job_runs_now(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(spec(4))
    job = cluster.job(job_id)
    plan = cluster.plane.plan(job, cluster.state.members(job_id), 0)
    assert sorted(n.rank for n in plan.neighbors) == [1, 3]



# -- suspicion, quarantine and withheld rounds (issue 28) --------------------------------------------------------------


def robust_spec(nodes: int, algorithm: str = "dsgd", quarantine: dict | None = None, **fields: object) -> dict:
    robust: dict = {"rule": "self-centered-clip" if algorithm == "dsgd" else "trimmed-mean", "window_s": 10}
    if quarantine is not None:
        robust["quarantine"] = quarantine
    chosen = spec(nodes, algorithm=algorithm, **fields)
    chosen["algorithm"]["robust"] = robust
    return chosen


def judge(cluster: Cluster, job_id: str, rank: int, outlying: dict[int, tuple[int, int]]) -> None:
    """Rank `rank` reports what its robust rule found of its neighbours: rank -> (outlying, received), cumulative."""
    nodes = {m.rank: m.node_id for m in cluster.state.members(job_id)}
    edges = tuple(EdgeCounters(nodes[peer], robust_outlying=bad, messages_received=received)
                  for peer, (bad, received) in sorted(outlying.items()))
    progress = Progress(job_id, rank, nodes[rank], step=1, local_steps=1, time=cluster.now, edges=edges)
    cluster.state.record_progress(progress)
    cluster.apply(cluster.plane.progress_reported(cluster.job(job_id), progress))


def lie(cluster: Cluster, job_id: str, seconds: int, liar: int = 3) -> None:
    """A 4-node ring where `liar`'s neighbours find all its contributions outlying, and the liar says the same of
    its honest neighbours; each second 10 contributions a neighbour."""
    nodes = ("a", "b", "c", "d")
    for second in range(1, seconds + 1):
        received = 10 * second
        for rank in range(4):
            neighbours = ((rank - 1) % 4, (rank + 1) % 4)
            judge(cluster, job_id, rank, {peer: (received if peer == liar or rank == liar else 0, received)
                                          for peer in neighbours})
        cluster.advance(1, beating=nodes)


def test_a_member_its_neighbours_find_outlying_is_flagged_and_a_liar_alone_flags_no_one(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4))
    cluster.ready_all(job_id)
    lie(cluster, job_id, 3)
    job = cluster.job(job_id)
    assert cluster.plane.flagged(job_id) == {3}
    assert cluster.plane.suspicion_of(job, 3) == 1.0
    # Ranks 0 and 2 have the liar and one honest neighbour: the lower median of their judges' shares is 0.
    assert [cluster.plane.suspicion_of(job, r) for r in (0, 1, 2)] == [0.0, 0.0, 0.0]
    assert cluster.events(events.SUSPECTED) == ["rank 3 (node d): 100% of its contributions in the last 10 s were "
                                                "outlying (suspect_fraction 0.5): suspected"]
    assert not cluster.plane.quarantined(job_id)  # the job does not ask for it
    assert job.topology_version == 1


def test_an_all_reduce_member_whose_gathered_rows_the_others_find_outlying_is_flagged_not_the_ones_it_blames(
        cluster):
    """A robust all-reduce job: each member judges every other member's all-gathered rows (the all-reduce's edge,
    per rank); the liar says every honest member's rows are outlying, a rank outside the job is ignored."""
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4, algorithm="allreduce"))
    cluster.ready_all(job_id)
    liar = 3
    for second in range(1, 4):
        rows = 10 * second
        for rank, node in enumerate("abcd"):
            judged = (*(MemberJudgement(member, rows, 0, rows if liar in (member, rank) else 0)
                        for member in range(4) if member != rank), MemberJudgement(9, rows, 0, rows))
            edge = EdgeCounters(ALLREDUCE_NAME, judged=judged)
            progress = Progress(job_id, rank, node, step=second, local_steps=second, time=cluster.now, edges=(edge,))
            cluster.state.record_progress(progress)
            cluster.apply(cluster.plane.progress_reported(cluster.job(job_id), progress))
        cluster.advance(1, beating=tuple("abcd"))
    job = cluster.job(job_id)
    assert cluster.plane.flagged(job_id) == {liar}
    assert [cluster.plane.suspicion_of(job, rank) for rank in range(4)] == [0.0, 0.0, 0.0, 1.0]
    assert cluster.events(events.SUSPECTED) == ["rank 3 (node d): 100% of its contributions in the last 10 s were "
                                                "outlying (suspect_fraction 0.5): suspected"]


def test_a_member_judged_by_one_neighbour_only_is_not_scored(cluster):
    """A path 0 - 1 - 2: rank 0's only judge is rank 1, which may be the liar."""
    cluster.register("a", "b", "c")
    job_id = cluster.submit(robust_spec(3, topology={"kind": "edge-list", "options": {"edges": "0 1\n1 2\n"}}))
    for second in range(1, 4):
        judge(cluster, job_id, 1, {0: (10 * second, 10 * second), 2: (10 * second, 10 * second)})
        cluster.advance(1, beating=("a", "b", "c"))
    assert math.isnan(cluster.plane.suspicion_of(cluster.job(job_id), 0)) and not cluster.plane.flagged(job_id)


def test_a_persistently_outlying_member_is_quarantined_its_edges_dropped_by_a_topology_change(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4, quarantine={"fraction": 0.8, "after_s": 5}))
    cluster.ready_all(job_id)
    lie(cluster, job_id, 4)
    assert not cluster.plane.quarantined(job_id)  # above the fraction for less than after_s
    lie(cluster, job_id, 3)
    job = cluster.job(job_id)
    assert cluster.plane.quarantined(job_id) == {3}
    assert (job.topology_version, job.running_spec.topology.kind) == (2, "edge-list")
    (message,) = cluster.events(events.QUARANTINED)
    assert message.startswith("rank 3 (node d) quarantined: 100% of its contributions") and \
        "its edges are dropped from step" in message
    members = cluster.state.members(job_id)
    plans = {rank: cluster.plane.plan(job, members, rank) for rank in range(4)}
    assert sorted(n.rank for n in plans[0].neighbors) == [1] and sorted(n.rank for n in plans[2].neighbors) == [1]
    assert plans[3].neighbors == () and plans[3].self_weight == 1.0
    assert sum(n.weight for n in plans[0].neighbors) + plans[0].self_weight == pytest.approx(1.0)
    # The job finishes without it, and its silence fails nothing.
    for rank in (0, 1, 2):
        cluster.report(job_id, rank, 100, finished=True)
    assert cluster.job(job_id).state == JobState.FINISHED


def test_a_quarantined_members_failure_does_not_end_the_job(cluster):
    """A liar, once quarantined, could otherwise stop a job by reporting a failure."""
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4, mode="sync", quarantine={"fraction": 0.8, "after_s": 1}))
    cluster.ready_all(job_id)
    lie(cluster, job_id, 3)
    assert cluster.plane.quarantined(job_id) == {3}
    recorded, effects = cluster.plane.failed(job_id, 3, "d", "it says it broke")
    cluster.apply(effects)
    assert recorded and cluster.job(job_id).state == JobState.RUNNING
    assert cluster.events(events.QUARANTINED)[-1] == ("rank 3 (node d), quarantined, failed: it says it broke; the "
                                                      "job goes on without it")
    cluster.apply(cluster.plane.failed(job_id, 1, "b", "a real failure")[1])  # an honest member's still does
    assert cluster.job(job_id).state == JobState.FAILED


def test_an_operator_quarantines_a_member_unless_the_others_would_be_cut_apart(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4))
    cluster.apply(cluster.plane.quarantine(cluster.job(job_id), 1, "by an operator"))
    assert cluster.plane.quarantined(job_id) == {1}
    with pytest.raises(QuarantineRefused, match="quarantined already"):
        cluster.plane.quarantine(cluster.job(job_id), 1, "by an operator")
    cluster.report(job_id, 0, 20)  # every member reached the switch step: another change may come
    cluster.report(job_id, 2, 20)
    cluster.report(job_id, 3, 20)
    with pytest.raises(QuarantineRefused, match="would not be connected"):
        cluster.plane.quarantine(cluster.job(job_id), 3, "by an operator")
    with pytest.raises(QuarantineRefused, match="change the job's topology"):
        cluster.plane.release(cluster.job(job_id), 1)


def test_a_quarantined_member_leaves_an_asynchronous_elastic_job_and_its_node_does_not_join_again(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(elastic(3, 4))
    cluster.ready_all(job_id)
    assert cluster.job(job_id).world_size == 4
    cluster.apply(cluster.plane.quarantine(cluster.job(job_id), 1, "by an operator"))
    assert [m.node_id for m in cluster.state.members(job_id)] == ["a", "c", "d"]
    assert cluster.events(events.LEFT)[0].startswith("rank 1 (node b) left: quarantined: by an operator; 3 members")
    for rank in (0, 2, 3):
        cluster.report(job_id, rank, 2 * MIN_SWITCH_MARGIN_STEPS)
    cluster.advance(2, beating=("a", "b", "c", "d"))  # b is idle now, and stays out of the job
    assert cluster.job(job_id).world_size == 3


def test_a_revoked_member_is_quarantined(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(spec(4))  # no robust rule: a revoked member's contributions go all the same
    cluster.apply(cluster.plane.revoked(["c"]))
    assert cluster.plane.quarantined(job_id) == {2}
    assert "rank 2 (node c) quarantined: its certificate was revoked" in cluster.events(events.QUARANTINED)[0]


def test_a_parameter_server_ignores_a_quarantined_workers_pushes_until_released(cluster):
    cluster.register("a", "b", "c", "d")
    job_id = cluster.submit(robust_spec(4, algorithm="ssgd", quarantine={"after_s": 0}))
    cluster.ready_all(job_id)
    job = cluster.job(job_id)
    cluster.apply(cluster.plane.server_reported(job, {0: (0, 20), 1: (0, 20), 2: (20, 20), 3: (1, 20)}))
    cluster.advance(1, beating=("a", "b", "c", "d"))
    assert cluster.plane.quarantined(job_id) == {2}
    assert Quarantined(job, 2) in cluster.effects
    assert cluster.job(job_id).topology_version == 1
    cluster.apply(cluster.plane.release(job, 2))
    assert Quarantined(job, 2, released=True) in cluster.effects and not cluster.plane.quarantined(job_id)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_member_that_withholds_its_rounds_fails_a_synchronous_job_as_lost(cluster, mode):
    cluster.register("a", "b", "c")
    job_id = cluster.submit(spec(3, mode=mode, failure={"lost_grace_s": 5}))
    cluster.ready_all(job_id)
    nodes = {m.rank: m.node_id for m in cluster.state.members(job_id)}

    def stall(seconds: int) -> None:
        """Every node heartbeats; ranks 0 and 1 wait for rank 2's step-7 parameters; rank 2 reports nothing."""
        for _ in range(seconds):
            for rank in range(2):
                progress = Progress(job_id, rank, nodes[rank], step=7, local_steps=7, time=cluster.now,
                                    waiting_for="the step-7 parameters of ranks [2]")
                cluster.state.record_progress(progress)
                cluster.apply(cluster.plane.progress_reported(cluster.job(job_id), progress))
            cluster.advance(1, beating=("a", "b", "c"))

    stall(int(TIMEOUT_S))
    cluster.register("c")  # rank 2's agent restarted: a rejoin is given the bound again
    stall(int(TIMEOUT_S))
    assert cluster.job(job_id).state == JobState.RUNNING
    stall(6)
    job = cluster.job(job_id)
    if mode == "async":
        assert job.state == JobState.RUNNING  # nobody waits for anyone
        return
    assert job.state == JobState.FAILED
    assert job.reason.startswith("lost rank 2 (node c, at step 0): it heartbeats but has withheld its rounds")
