"""Elastic jobs (`nodes: {min, max}`, issue 15): the schema and validation, planning over members whose ranks have
gaps, push-sum's mass across a join, gossip's change of topology, and the coordinator (in process) starting such a
job on its least members, letting idle agents join as the graph is planned again, and a lost member leave."""

from __future__ import annotations

import time

import grpc
import pytest
import test_coordinator
import torch
import yaml
from exact_linear import ZeroLoss, batch, linear_model
from test_coordinator import first_assignment, register

import coordinator.cli as cli
from coordinator.cli import main as coordinator_main
from coordinator.jobs import plan_member, plan_node, validate_job, validate_membership
from coordinator.simulate import build_nodes
from coordinator.topology import build_topology
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.algorithms import lookup
from nodeagent.algorithms.base import NodeContext, Route
from nodeagent.algorithms.gossip import SCORE_MIN, PairwiseGossip
from nodeagent.algorithms.sgp import SGP
from nodeagent.jobspec import JobSpec, JobSpecError, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import JOIN_PULL_ATTEMPTS, Action, Failure, NodeDriver, Reply
from nodeagent.runtime.events import JOINED, LEFT, read_events
from nodeagent.wire import Kind, Message

pytestmark = pytest.mark.integration

coordinator = test_coordinator.coordinator  # the fixture: (start, stop_all) of in-process coordinators


def elastic(low: int, high: int, **overrides) -> dict:
    return {"name": "e", "nodes": {"min": low, "max": high}, "steps": 1000, "algorithm": {"name": "gossip"},
            "topology": {"kind": "ring"}, **overrides}


# -- the schema and validation ---------------------------------------------------------------------------------------


def test_an_elastic_job_reads_as_a_range_and_plans_at_its_largest_size():
    spec = parse_job_spec(elastic(3, 6, slowdown={5: 2.0}))
    assert spec.elastic and (spec.min_nodes, spec.max_nodes) == (3, 6)
    assert spec.sized().nodes == 6 and spec.sized(4).nodes == 4 and not spec.sized().elastic
    assert JobSpec.from_json(spec.to_json()) == spec
    fixed = parse_job_spec({"nodes": 4})
    assert not fixed.elastic and (fixed.min_nodes, fixed.max_nodes) == (4, 4)
    assert validate_job(spec).nodes == 6


@pytest.mark.parametrize(("nodes", "error"), [
    ({"min": 5, "max": 4}, "nodes.elastic: Value error, min 5 is larger than max 4"),
    ({"min": 1, "max": 4}, "nodes.elastic.min: Input should be greater than or equal to 2"),
    ({"min": 2, "max": 10_001}, "nodes.elastic.max: Input should be less than or equal to 10000"),
    ({"min": 2}, "nodes.elastic.max: Field required"),
    ({"min": 2, "max": 4, "step": 1}, "nodes.elastic.step: Extra inputs are not permitted"),
    (0, "nodes.fixed: Input should be greater than or equal to 1"),
])
def test_a_bad_size_is_refused_naming_the_field(nodes, error):
    with pytest.raises(JobSpecError) as refusal:
        parse_job_spec({"nodes": nodes})
    assert str(refusal.value) == error


def test_a_rank_of_an_elastic_job_is_checked_against_its_most_members():
    with pytest.raises(JobSpecError, match=r"slowdown: rank 6 is not in 0\.\.5"):
        parse_job_spec(elastic(3, 6, slowdown={6: 2.0}))


@pytest.mark.parametrize(("algorithm", "words"), [
    ({"name": "ssgd"}, "ssgd has no topology to change (its nodes talk to the parameter server)"),
    ({"name": "allreduce"}, "allreduce has no topology to change (its nodes talk all at once)"),
    ({"name": "ad-psgd"}, "ad-psgd cannot change its topology while it runs"),
])
def test_only_algorithms_that_change_their_topology_run_elastic_jobs(algorithm, words):
    with pytest.raises(JobSpecError) as refusal:
        validate_job(parse_job_spec(elastic(2, 4, algorithm=algorithm)))
    assert str(refusal.value).startswith("nodes: an elastic job ({min, max}) is planned again as agents join and "
                                         "leave")
    assert words in str(refusal.value)


@pytest.mark.parametrize("name", ["gossip", "sgp", "osgp", "dsgd", "pdmm-isvr", "admm-isvr"])
def test_the_algorithms_that_change_their_topology_accept_elastic_jobs(name):
    validate_job(parse_job_spec(elastic(2, 5, algorithm={"name": name})))


def test_a_graph_that_does_not_fit_the_least_or_most_members_is_refused():
    with pytest.raises(JobSpecError, match="topology"):
        validate_job(parse_job_spec(elastic(4, 8, topology={"kind": "ecl-random8"})))
    spec = parse_job_spec(elastic(4, 8, topology={"kind": "random-regular", "options": {"degree": 3}}))
    validate_job(spec)  # 4 and 8 nodes of degree 3 fit; 5 do not (nodes x degree must be even)
    with pytest.raises(JobSpecError, match="topology"):
        validate_membership(spec, 5)
    with pytest.raises(JobSpecError, match=r"nodes: 9 members are not in 4\.\.8"):
        validate_membership(spec, 9)


# -- planning over members ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ring", "multiplex-ring", "exponential", "dynamic-exponential"])
def test_members_with_gaps_in_their_ranks_are_planned_as_positions_with_their_ranks_put_back(kind):
    spec = parse_job_spec(elastic(3, 8, topology={"kind": kind, "seed": 2}, algorithm={"name": "sgp"}))
    ranks = [0, 2, 3, 6, 7]  # ranks 1, 4 and 5 left
    topology = build_topology(spec.topology, len(ranks))
    for position, rank in enumerate(ranks):
        plan = plan_member(spec, topology, ranks, rank)
        by_position = plan_node(spec.sized(len(ranks)), topology, position)
        assert [n.rank for n in plan.neighbors] == [ranks[n.rank] for n in by_position.neighbors]
        assert all(n.sign == (1 if rank < n.rank else -1) for n in plan.neighbors)  # ECL's A_ij, in ranks
        assert [(n.phase, n.weight, n.peer_phase) for n in plan.neighbors] == \
            [(n.phase, n.weight, n.peer_phase) for n in by_position.neighbors]
        assert plan.peer_schedule == tuple(tuple(ranks[p] for p in peers) for peers in by_position.peer_schedule)
    with pytest.raises(ValueError, match="rank 1 is not a member"):
        plan_member(spec, topology, ranks, 1)


# -- the algorithms across a join ------------------------------------------------------------------------------------


def sgp_node(spec: JobSpec, ranks: list[int], rank: int) -> SGP:
    plan = plan_member(spec, build_topology(spec.topology, len(ranks)), ranks, rank)
    context = NodeContext(rank, spec.max_nodes, plan.neighbors, spec.algorithm, plan.self_weight, spec.seed,
                          plan.peer_schedule)
    algorithm = lookup("sgp")(linear_model(), context, ZeroLoss())
    assert isinstance(algorithm, SGP)
    return algorithm


def sgp_round(nodes: dict[int, SGP], step: int) -> None:
    """One synchronous round: every node steps, then every share is delivered."""
    sends = []
    for node in nodes.values():
        assert node.ready()
        node.step(*batch(step))
        sends += node.sends()
    for send in sends:
        nodes[send.peer].receive(send.message)


def test_a_push_sum_node_that_joins_brings_no_mass_and_the_average_stays_exact():
    spec = parse_job_spec(elastic(3, 4, algorithm={"name": "sgp", "lr": 0.1}, topology={"kind": "ring"}))
    nodes = {rank: sgp_node(spec, [0, 1, 2], rank) for rank in range(3)}
    generator = torch.Generator().manual_seed(0)
    initial = 5.0 + torch.randn(3, nodes[0].x.numel(), generator=generator, dtype=torch.float64)
    for node, vector in zip(nodes.values(), initial, strict=True):
        node.x.copy_(vector)
        node._debias()
    for step in range(5):
        sgp_round(nodes, step)
    switch = nodes[0].clock
    for rank, node in nodes.items():  # the graph planned again for 4 members: rank 3 joins
        plan = plan_member(spec, build_topology(spec.topology, 4), [0, 1, 2, 3], rank)
        node.change_topology(NodeContext(rank, 4, plan.neighbors, spec.algorithm, plan.self_weight))
    joiner = sgp_node(spec, [0, 1, 2, 3], 3)
    states = {n.rank: nodes[n.rank].snapshot().message_for(3, Kind.PARAMS) for n in joiner.context.neighbors}
    joiner.join(states, switch)
    assert (joiner.clock, joiner.weight, float(joiner.x.abs().sum())) == (switch, 0.0, 0.0)
    assert torch.equal(joiner.w, torch.stack([joiner.params.flatten(s.tensors) for s in states.values()]).mean(dim=0))
    nodes[3] = joiner
    for step in range(5, 200):
        sgp_round(nodes, step)
        assert float(sum(n.weight for n in nodes.values())) == pytest.approx(3.0, abs=1e-12)
        assert torch.allclose(sum(n.x for n in nodes.values()), initial.sum(dim=0), atol=1e-10, rtol=0)
    for node in nodes.values():  # all four at the three original nodes' average
        assert torch.allclose(node.w, initial.mean(dim=0), atol=1e-9, rtol=0)


def test_gossip_keeps_the_scores_of_kept_neighbours_and_forgets_a_dropped_ones_fetch():
    spec = parse_job_spec(elastic(3, 6, algorithm={"name": "gossip"}, topology={"kind": "ring"}))

    def context(ranks: list[int], rank: int) -> NodeContext:
        plan = plan_member(spec, build_topology(spec.topology, len(ranks)), ranks, rank)
        return NodeContext(rank, 6, plan.neighbors, spec.algorithm, plan.self_weight, spec.seed)

    node = PairwiseGossip(linear_model(), context([0, 1, 2, 3], 0), ZeroLoss())
    assert sorted(node.scores.scores) == [1, 3]
    node.step(*batch(0))
    [fetch] = node.sends()
    node.scores.scores[1] = SCORE_MIN
    node.change_topology(context([0, 1, 2, 4], 0))  # rank 3 left, rank 4 joined: neighbours 1 and 4
    assert node.scores.scores == {1: SCORE_MIN, 4: 1000}
    if fetch.peer == 3:
        assert node.ready()  # the step does not wait for the former neighbour's reply
    node.step(*batch(1))
    assert all(send.peer in (1, 4) for send in node.sends())


def joiner(name: str, mode: str | None = None):
    """Rank 3 of an elastic ring of 4 (neighbours 0 and 2), and what its neighbours serve: models 1 and 3 at steps
    40 and 44."""
    spec = parse_job_spec(elastic(3, 4, algorithm={"name": name, "mode": mode}))
    plan = plan_member(spec, build_topology(spec.topology, 4), [0, 1, 2, 3], 3)
    context = NodeContext(3, 4, plan.neighbors, spec.algorithm, plan.self_weight, spec.seed)
    node = lookup(name)(linear_model(), context, ZeroLoss())
    states = {rank: Message(Kind.PARAMS, rank, 3, node.params.views(torch.full_like(node.w, value)), clock=clock)
              for rank, value, clock in ((0, 1.0, 40), (2, 3.0, 44))}
    return node, states


@pytest.mark.parametrize(("mode", "clock"), [("async", 44), ("sync", 50)])
def test_a_dsgd_node_that_joins_starts_from_its_neighbours_mean_with_their_models_as_its_copies(mode, clock):
    node, states = joiner("dsgd", mode)
    assert node.join_kind() == Kind.PARAMS
    node.join(states, 50)
    assert node.clock == clock  # asynchronous: where its neighbours are; synchronous: their first round with it
    assert torch.equal(node.w, torch.full_like(node.w, 2.0))
    assert {rank: float(copy.mean()) for rank, copy in node.last_copy.items()} == {0: 1.0, 2: 3.0}
    assert torch.equal(node.snapshot().served[(None, Kind.PARAMS)]["weight"].flatten(), node.w[:6])


def test_an_ecl_node_that_joins_starts_from_the_initial_model_with_zero_duals_at_the_switch_step():
    node, _states = joiner("pdmm-isvr")
    initial = node.w.clone()
    assert node.join_kind() is None
    node.join({}, 50)
    assert node.clock == 50 and torch.equal(node.w, initial)
    assert all(not z.any() for z in node.z.values()) and sorted(node.z) == [0, 2]


def test_a_gossip_node_that_joins_starts_from_its_neighbours_mean_at_their_latest_clock():
    node, states = joiner("gossip")
    node.join(states, 50)
    assert (node.clock, node.gossip_clock) == (44, 44.0)
    assert torch.equal(node.w, torch.full_like(node.w, 2.0))


def test_a_joining_node_pulls_its_neighbours_and_gives_up_on_one_that_does_not_answer(fashion_mnist_dir, caplog):
    spec = parse_job_spec(elastic(3, 3, data={"data_dir": str(fashion_mnist_dir), "train_limit": 600,
                                              "test_limit": 100}))
    nodes = build_nodes(spec)
    served = nodes[0].algorithm
    assert isinstance(served, PairwiseGossip)
    served.clock, served.gossip_clock = 30, 30.0  # gossip serves its (mixed) gossip clock
    served.republish()
    driver = NodeDriver(nodes[2], job="e", name="rank2", clock=time.monotonic, metrics=Metrics().node("e", "rank2"),
                        name_of=lambda rank: f"rank{rank}")
    driver.join(at_step=50)
    decision = driver.next()
    assert decision.action is Action.WAIT and not decision.reports  # not evaluated at the initial model
    pulls = {t.send.peer: t for t in decision.sends}
    assert sorted(pulls) == [0, 1] and all(t.send.route == Route.PULL for t in pulls.values())
    driver.arrived(Reply(pulls[0], served.snapshot().message_for(2, Kind.PARAMS)))
    for attempt in range(1, JOIN_PULL_ATTEMPTS + 1):
        due = driver.arrived(Failure(pulls[1], "unavailable", transient=True))
        assert (due is None) == (attempt == JOIN_PULL_ATTEMPTS)  # retried until the last try
        assert driver.next().action is (Action.STEP if attempt == JOIN_PULL_ATTEMPTS else Action.WAIT)
    joined = nodes[2].algorithm
    assert joined.clock == 30 and torch.equal(joined.w, served.w)  # rank 0's model, at its step
    assert "gave up pulling from rank1 to join (unavailable, 5 tries)" in caplog.text


def test_an_algorithm_that_cannot_change_its_topology_cannot_join():
    spec = parse_job_spec({"nodes": 4, "algorithm": {"name": "ad-psgd"}})
    plan = plan_node(spec, validate_job(spec), 1)
    node = lookup("ad-psgd")(linear_model(), NodeContext(1, 4, plan.neighbors, spec.algorithm), ZeroLoss())
    with pytest.raises(NotImplementedError, match="ad-psgd cannot join a running job"):
        node.join({}, 10)


# -- the coordinator ---------------------------------------------------------------------------------------------------


def submit(stub, **spec) -> str:
    return stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=yaml.safe_dump(spec)), timeout=5).job_id


def status_of(stub, job_id: str) -> pb.JobStatusReply:
    return stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)


def report(stub, job_id: str, members: dict[int, str], step: int) -> None:
    for rank, node_id in members.items():
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=step, elapsed_s=10.0),
                           timeout=5)


def until(condition, timeout_s: float = 10.0, every=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        if every is not None:
            every()
        time.sleep(0.1)


def test_an_elastic_job_starts_on_its_least_members_and_idle_agents_join_one_change_at_a_time(coordinator, capsys,
                                                                                                monkeypatch):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(2)]
    job_id = submit(stub, **elastic(3, 5, start={"barrier": False}))
    assert status_of(stub, job_id).state == pb.JOB_PENDING  # it needs 3 idle agents
    ids.append(register(stub, "a2"))
    status = status_of(stub, job_id)
    assert (status.state, status.world_size, status.min_nodes, status.max_nodes) == (pb.JOB_RUNNING, 3, 3, 5)
    report(stub, job_id, dict(enumerate(ids)), 100)
    ids.append(register(stub, "a3"))  # joins at once as rank 3: the members switch 5 s of steps ahead
    joined = first_assignment(stub, ids[3])
    switch = 100 + 10 * 5  # the highest step reported plus what the fastest node steps in 5 s (10 steps/s)
    assert (joined.rank, joined.joined_at_step, joined.switch_step, joined.topology_version) == (3, switch, switch, 2)
    assert joined.world_size == 4 and sorted(n.rank for n in joined.neighbors) == [0, 2]
    assert JobSpec.from_json(joined.job_spec_json).nodes == 5  # built for its most members: 5 data shards
    for rank in range(3):
        assignment = first_assignment(stub, ids[rank])
        assert (assignment.topology_version, assignment.switch_step, assignment.joined_at_step) == (2, switch, 0)
    assert sorted(n.rank for n in first_assignment(stub, ids[0]).neighbors) == [1, 3]
    ids.append(register(stub, "a4"))  # waits: rank 3 has not reported from the switch step yet
    time.sleep(1.5)
    assert status_of(stub, job_id).world_size == 4
    report(stub, job_id, dict(enumerate(ids[:4])), switch)
    until(lambda: status_of(stub, job_id).world_size == 5)
    assert first_assignment(stub, ids[4]).rank == 4
    events, _ = read_events(status_of(stub, job_id).run_dir)
    # The second switch: 150 + 15 steps/s x 5 s.
    assert [e.message for e in events if e.kind == JOINED] == [
        f"node {ids[3]} joined as rank 3: 4 members; ring planned again (version 2) from step {switch}",
        f"node {ids[4]} joined as rank 4: 5 members; ring planned again (version 3) from step {switch + 75}"]
    monkeypatch.setattr(cli, "_stub", lambda args: stub)
    assert coordinator_main(["status", job_id]) == 0
    assert "running, 5 members (elastic, 3..5)" in capsys.readouterr().out
    assert coordinator_main(["jobs"]) == 0
    assert "5 (3..5)" in capsys.readouterr().out.splitlines()[1].split("running")[1]


def test_a_lost_member_of_an_elastic_job_leaves_and_its_rank_goes_to_the_next_agent_that_joins(coordinator):
    start, _ = coordinator
    _, stub = start(heartbeat_timeout_s=1.0)
    ids = [register(stub, f"a{i}") for i in range(4)]
    job_id = submit(stub, **elastic(3, 4, start={"barrier": False}, failure={"lost_grace_s": 0.5}))
    assert status_of(stub, job_id).world_size == 4
    members = dict(enumerate(ids))
    lost = members.pop(1)
    report(stub, job_id, members, 200)

    def beat() -> None:
        for node_id in members.values():
            stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5)

    until(lambda: status_of(stub, job_id).world_size == 3, every=beat)
    status = status_of(stub, job_id)
    assert status.state == pb.JOB_RUNNING
    assert {n.rank: n.state for n in status.nodes} == {0: "up", 1: "left", 2: "up", 3: "up"}
    assignment = first_assignment(stub, ids[0])
    assert (assignment.topology_version, assignment.switch_step) == (2, 300)  # 200 + 20 steps/s x 5 s
    assert sorted(n.rank for n in assignment.neighbors) == [2, 3]  # a ring of ranks 0, 2, 3
    assert first_assignment(stub, lost).job_id == ""  # the lost node is no member any more
    events, _ = read_events(status.run_dir)
    [left] = [e for e in events if e.kind == LEFT]
    assert left.message.startswith(f"rank 1 (node {lost}) left: no heartbeat for longer than the heartbeat timeout "
                                   "and failure.lost_grace_s (0.5 s); 3 members; ring planned again (version 2) "
                                   "from step 300")
    # A new agent takes the free rank 1 once the members switched; the job finishes with it.
    report(stub, job_id, members, 300)
    members[1] = register(stub, "a4")
    until(lambda: status_of(stub, job_id).world_size == 4, every=beat)
    assert first_assignment(stub, members[1]).rank == 1
    assert sorted(n.rank for n in first_assignment(stub, members[1]).neighbors) == [0, 2]
    for rank, node_id in members.items():
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=1000, finished=True),
                           timeout=5)
    assert status_of(stub, job_id).state == pb.JOB_FINISHED


def test_a_lost_member_of_a_synchronous_elastic_job_fails_it(coordinator):
    """Push-sum waits for every in-peer's share: a member lost mid-round cannot be planned away (its neighbours
    never reach the switch step), so a synchronous elastic job keeps the synchronous policy for lost members."""
    start, _ = coordinator
    _, stub = start(heartbeat_timeout_s=1.0)
    ids = [register(stub, f"a{i}") for i in range(3)]
    job_id = submit(stub, **elastic(2, 3, algorithm={"name": "sgp"}, start={"barrier": False},
                                    failure={"lost_grace_s": 0.5}))

    def beat() -> None:
        for node_id in ids[:2]:
            stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5)

    until(lambda: status_of(stub, job_id).state != pb.JOB_RUNNING, every=beat)
    assert status_of(stub, job_id).state == pb.JOB_FAILED


def test_a_topology_change_of_an_elastic_job_is_planned_for_its_members_now(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(3)]
    job_id = submit(stub, **elastic(3, 8, start={"barrier": False}))
    reply = stub.ChangeTopology(pb.ChangeTopologyRequest(job_id=job_id, kind="complete"), timeout=5)
    assert reply.topology_version == 2
    assert sorted(n.rank for n in first_assignment(stub, ids[0]).neighbors) == [1, 2]
    with pytest.raises(grpc.RpcError) as error:
        stub.ChangeTopology(pb.ChangeTopologyRequest(job_id=job_id, kind="ecl-random8"), timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_drained_member_of_an_asynchronous_elastic_job_leaves_it_and_a_synchronous_ones_stays(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(4)]
    job_id = submit(stub, **elastic(3, 4, start={"barrier": False}))
    info = stub.DrainNode(pb.DrainRequest(node_id=ids[2], drain=True), timeout=5)
    assert info.draining and not info.job_id  # it left at once
    status = status_of(stub, job_id)
    assert status.world_size == 3 and {n.rank: n.state for n in status.nodes}[2] == "left"
    events, _ = read_events(status.run_dir)
    assert [e.message.split(";")[0] for e in events if e.kind == LEFT] == [f"rank 2 (node {ids[2]}) left: drained "
                                                                           "by an operator"]
    # Below its least members the job keeps the next one drained.
    report(stub, job_id, {rank: ids[rank] for rank in (0, 1, 3)}, 100)
    assert stub.DrainNode(pb.DrainRequest(node_id=ids[3], drain=True), timeout=5).job_id == job_id
    stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    for node_id in ids:
        stub.DrainNode(pb.DrainRequest(node_id=node_id, drain=False), timeout=5)
    sync_id = submit(stub, **elastic(3, 4, algorithm={"name": "sgp"}, start={"barrier": False}))
    assert stub.DrainNode(pb.DrainRequest(node_id=ids[0], drain=True), timeout=5).job_id == sync_id
    assert status_of(stub, sync_id).world_size == 4
