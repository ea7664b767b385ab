"""A job's topology changed while it runs, in the simulator (the node driver's path that agents take too): push-sum
stays exact, PDMM-ISVR still reaches the centralised optimum, new edges start clean, traffic moves onto the new
edges, and the job file's `simulation.topology_changes` is validated."""

from __future__ import annotations

import logging

import pytest
import torch
from exact_linear import ZeroLoss, batch, linear_model
from test_ecl import SAMPLES, FullBatch, least_squares, optimum, relative_error, step_size
from torch import nn

from coordinator.jobs import plan_node, validate_job, validate_topology_change, with_topology
from coordinator.simulate import schedule_topology_changes, simulate, topology_events
from nodeagent.algorithms import build_algorithm, lookup
from nodeagent.algorithms.base import Neighbor, NodeContext
from nodeagent.algorithms.ecl import PDMMISVR, released_eta
from nodeagent.jobspec import JobSpec, JobSpecError, TopologySpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import NodeDriver, TopologyChange
from nodeagent.runtime.events import TOPOLOGY, EventLog, read_events
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.job import Node
from nodeagent.wire import Kind, Message

pytestmark = pytest.mark.unit

NODES = 6


class Batches:
    def __init__(self, rank: int):
        self.rank = rank
        self.count = 0

    def next(self):
        self.count += 1
        return batch(self.rank * 1000 + self.count % 7)


def job(name: str, steps: int, at_step: int, **algorithm) -> JobSpec:
    return parse_job_spec({
        "nodes": NODES, "steps": steps, "eval_every": steps, "topology": {"kind": "ring", "seed": 1},
        "algorithm": {"name": name, **algorithm},
        "simulation": {"step_time_s": 0.01, "jitter": 0.3, "network": {"latency_s": 0.003}, "seed": 2,
                       "topology_changes": [{"at_step": at_step, "kind": "multiplex-ring", "seed": 4}]},
    })


def mesh_of(spec: JobSpec, model, loss_fn, batches, events: EventLog | None = None) -> VirtualMesh:
    """The job's nodes on exact problems, planned as the coordinator plans them, with the job's changes scheduled."""
    topology = validate_job(spec)
    nodes = []
    for rank in range(spec.nodes):
        plan = plan_node(spec, topology, rank)
        context = NodeContext(rank, spec.nodes, plan.neighbors, spec.algorithm, plan.self_weight, spec.seed,
                              plan.peer_schedule)
        algorithm = lookup(spec.algorithm.name)(model(), context, loss_fn)
        nodes.append(Node(spec, rank, algorithm, batches(rank), None, SAMPLES))
    mesh = VirtualMesh(nodes, spec.name, spec.simulation, Metrics(),
                       on_switch=topology_events(events) if events is not None else None)
    schedule_topology_changes(mesh, spec)
    return mesh


def distance(a: int, b: int) -> int:
    return min((a - b) % NODES, (b - a) % NODES)


# -- push-sum: the average stays exact -------------------------------------------------------------------------------


@pytest.mark.parametrize(("algorithm", "options"), [("sgp", {}), ("osgp", {"synch_freq": 1})])
def test_push_sum_keeps_the_exact_average_across_a_change(algorithm, options):
    spec = job(algorithm, steps=160, at_step=40, lr=0.1, options=options)
    mesh = mesh_of(spec, linear_model, ZeroLoss(), Batches)
    generator = torch.Generator().manual_seed(0)
    initial = 5.0 + torch.randn(NODES, mesh.nodes[0].node.algorithm.x.numel(), generator=generator,
                                dtype=torch.float64)
    for sim, vector in zip(mesh.nodes, initial, strict=True):
        sim.node.algorithm.x.copy_(vector)
        sim.node.algorithm._debias()
        sim.visible = sim.node.algorithm.snapshot()
    mesh.run()
    assert mesh.finished
    assert all(len(sim.driver.switches) == 1 and not sim.driver.switches[0].late for sim in mesh.nodes)
    average = initial.mean(dim=0)
    algorithms = [sim.node.algorithm for sim in mesh.nodes]
    if algorithm == "sgp":
        # Synchronous: every round is absorbed at the end, so the mass is all there, to rounding.
        assert float(sum(a.weight for a in algorithms)) == pytest.approx(NODES, abs=1e-12)
        assert torch.allclose(sum(a.x for a in algorithms), initial.sum(dim=0), atol=1e-10, rtol=0)
    for a in algorithms:
        assert torch.allclose(a.w, average, atol=1e-9, rtol=0), (a.context.rank, a.w - average)


def test_a_push_sum_share_of_a_dropped_edge_sent_before_the_switch_is_still_absorbed():
    """multiplex-ring -> ring drops the distance-2 edges: their shares of the rounds before the switch must count."""
    spec = job("osgp", steps=120, at_step=30, lr=0.1, options={"synch_freq": 2})
    spec = spec.model_copy(update={
        "topology": TopologySpec(kind="multiplex-ring", seed=1),
        "simulation": spec.simulation.model_copy(update={"topology_changes": [
            spec.simulation.topology_changes[0].model_copy(update={"kind": "ring"})]}),
    })
    mesh = mesh_of(spec, linear_model, ZeroLoss(), Batches)
    generator = torch.Generator().manual_seed(1)
    initial = 5.0 + torch.randn(NODES, mesh.nodes[0].node.algorithm.x.numel(), generator=generator,
                                dtype=torch.float64)
    for sim, vector in zip(mesh.nodes, initial, strict=True):
        sim.node.algorithm.x.copy_(vector)
        sim.node.algorithm._debias()
    mesh.run()
    assert mesh.finished
    for sim in mesh.nodes:
        assert all(distance(sim.rank, peer) == 1 for peer in sim.node.algorithm.context.neighbor_ranks)
        assert torch.allclose(sim.node.algorithm.w, initial.mean(dim=0), atol=1e-9, rtol=0)


# -- PDMM-ISVR: the optimum, and clean new edges ---------------------------------------------------------------------


def test_pdmm_reaches_the_centralised_optimum_after_a_ring_to_multiplex_ring_change():
    data = least_squares(NODES)
    spec = job("pdmm-isvr", steps=1500, at_step=300, lr=step_size(data), interval=4)

    def model():
        torch.manual_seed(0)
        return nn.Linear(data[0][0].shape[1], 1, bias=False, dtype=torch.float64)

    mesh = mesh_of(spec, model, nn.MSELoss(), lambda rank: FullBatch(*data[rank]))
    mesh.run()
    assert mesh.finished
    algorithms = [sim.node.algorithm for sim in mesh.nodes]
    for a in algorithms:
        assert sorted(a.z) == sorted(peer for peer in range(NODES) if 0 < distance(a.context.rank, peer) <= 2)
    assert relative_error(algorithms, optimum(data)) < 1e-9


def test_new_edges_start_with_zero_duals_and_kept_edges_keep_theirs():
    spec = JobSpec(algorithm={"name": "pdmm-isvr", "lr": 0.5, "interval": 3})
    neighbors = (Neighbor(1, 1, 0, 0.0, 1), Neighbor(3, 1, 2, 0.0, 0))
    node = PDMMISVR(nn.Linear(2, 1, bias=False, dtype=torch.float64), NodeContext(0, 4, neighbors, spec.algorithm),
                    nn.MSELoss())
    for z in node.z.values():
        z.normal_()
    kept = node.z[1].clone()
    node.change_topology(NodeContext(0, 4, (Neighbor(1, 1, 0, 0.0, 1), Neighbor(2, 1, 1, 0.0, 2)), spec.algorithm))
    assert sorted(node.z) == [1, 2]
    assert torch.equal(node.z[1], kept)
    assert torch.count_nonzero(node.z[2]) == 0
    assert node.eta == released_eta(0.5, 2, 3)
    # The snapshot serves the new edges only; a late dual of the dropped edge is ignored.
    assert node.snapshot().message_for(3, Kind.DUAL) is None
    assert node.snapshot().message_for(2, Kind.DUAL) is not None
    before = {rank: z.clone() for rank, z in node.z.items()}
    node.receive(Message(Kind.DUAL, 3, 0, node.params.views(torch.ones(2, dtype=torch.float64)), clock=5))
    assert sorted(node.z) == [1, 2] and all(torch.equal(node.z[r], before[r]) for r in before)


# -- traffic moves onto the new edges --------------------------------------------------------------------------------


def edge_bytes(mesh: VirtualMesh, far: bool) -> list[int]:
    """Bytes each node sent on its distance-2 edges (far) or its ring edges."""
    out = []
    for sim in mesh.nodes:
        progress = sim.driver.progress()
        out.extend(edge.bytes_sent + edge.bytes_received for edge in progress.edges
                   if (distance(sim.rank, int(edge.peer.removeprefix("rank"))) == 2) == far)
    return out


def test_a_change_to_multiplex_ring_moves_traffic_onto_the_distance_two_edges(tmp_path):
    spec = job("dsgd", steps=200, at_step=100, lr=0.1, interval=2)
    mesh = mesh_of(spec, linear_model, nn.CrossEntropyLoss(), Batches, EventLog(tmp_path))
    mesh.run(until=0.8)  # about 80 steps: before the switch
    assert all(sim.node.algorithm.clock < 100 for sim in mesh.nodes)
    assert not any(edge_bytes(mesh, far=True)) and all(edge_bytes(mesh, far=False))
    mesh.run()
    assert mesh.finished
    assert len(edge_bytes(mesh, far=True)) == 2 * NODES and all(edge_bytes(mesh, far=True))
    # The change is in the run's events, once, at the virtual time the first node switched.
    events, _ = read_events(tmp_path)
    assert [(e.kind, e.message, e.step) for e in events] == [
        (TOPOLOGY, "topology ring -> multiplex-ring (version 2) at step 100", 100)]
    assert events[0].time == min(sim.driver.switches[0].time for sim in mesh.nodes) > 0.9


def fashion_mnist_job(data_dir, steps: int, changes: list[dict]) -> JobSpec:
    """The job of tests/test_topology_cluster.py (DSGD of a logistic model on class-window shards of Fashion-MNIST,
    4 nodes on a ring), simulated, for `steps`."""
    return parse_job_spec({
        "nodes": 4, "steps": steps, "eval_every": steps, "seed": 1,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 2},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(data_dir), "split": "class-window", "batch_size": 50, "train_limit": 10000,
                 "test_limit": 2000},
        "topology": {"kind": "ring", "seed": 3},
        "simulation": {"step_time_s": 0.01, "jitter": 0.3, "seed": 2, "topology_changes": changes},
    })


def test_a_ring_changed_to_a_multiplex_ring_mid_job_learns_as_well_as_the_kept_ring(fashion_mnist_dir):
    """The change neither helps nor hurts this job much: simulated (deterministic), the kept ring ends at 0.781 and the
    ring changed at step 200 at 0.780 (at 600 steps, changed at 300: 0.799 and 0.795). On agents
    (tests/test_topology_cluster.py) the same change goes over the network."""
    kept = simulate(fashion_mnist_job(fashion_mnist_dir, 400, []))
    changed = simulate(fashion_mnist_job(fashion_mnist_dir, 400, [{"at_step": 200, "kind": "multiplex-ring"}]))
    assert kept.mesh.finished and changed.mesh.finished
    assert [[(s.step, s.late) for s in sim.driver.switches] for sim in changed.mesh.nodes] == [[(200, False)]] * 4
    assert changed.mean_accuracy >= kept.mean_accuracy - 0.01, (changed.mean_accuracy, kept.mean_accuracy)


@pytest.mark.parametrize("at_step", [1, 37])
def test_synchronous_dsgd_goes_through_a_change_without_waiting_for_ever(at_step):
    """Its rounds from the switch on wait for the new neighbours' copies, which may come before the receiver has
    switched (they are held until it does): every node completes every round."""
    spec = job("dsgd", steps=80, at_step=at_step, lr=0.1, mode="sync")
    mesh = mesh_of(spec, linear_model, nn.CrossEntropyLoss(), Batches)
    mesh.run()
    assert mesh.finished
    for sim in mesh.nodes:
        assert sim.node.algorithm.clock == 80
        assert [(s.step, s.late) for s in sim.driver.switches] == [(at_step, False)]
        assert sorted(sim.node.algorithm.last_copy) == sorted(sim.node.algorithm.context.neighbor_ranks)
        assert len(sim.node.algorithm.context.neighbors) == 4


def test_a_node_that_learns_of_a_change_past_its_step_switches_at_once_and_says_so(caplog):
    spec = job("dsgd", steps=50, at_step=10)
    topology = validate_job(spec)
    plan = plan_node(spec, topology, 0)
    algorithm = build_algorithm(linear_model(), NodeContext(0, NODES, plan.neighbors, spec.algorithm,
                                                            plan.self_weight))
    driver = NodeDriver(Node(spec, 0, algorithm, Batches(0), None, SAMPLES), job="late", name="rank0",
                        clock=lambda: 0.0, metrics=Metrics().node("late", "rank0"), name_of=lambda rank: f"rank{rank}")
    for _ in range(12):
        driver.next()
        driver.step()
        driver.stepped(0.01)
    changed = with_topology(spec, TopologySpec(kind="multiplex-ring"))
    new = plan_node(changed, validate_topology_change(spec, changed.topology), 0)
    with caplog.at_level(logging.INFO, logger="nodeagent"):
        driver.change_topology(TopologyChange(10, new.neighbors, new.self_weight, new.peer_schedule, "ring -> x"))
        driver.next()
    assert algorithm.context.neighbor_ranks == (1, 2, 4, 5)
    assert driver.switches[0].step == 12 and driver.switches[0].late
    assert "late: the job switched at step 10" in caplog.text


def test_messages_of_a_neighbour_to_come_wait_for_the_switch_and_a_former_neighbours_later_ones_are_dropped():
    spec = job("dsgd", steps=50, at_step=5, lr=0.1)
    metrics = Metrics()
    plan = plan_node(spec, validate_job(spec), 0)
    algorithm = build_algorithm(linear_model(), NodeContext(0, NODES, plan.neighbors, spec.algorithm,
                                                            plan.self_weight))
    driver = NodeDriver(Node(spec, 0, algorithm, Batches(0), None, SAMPLES), job="held", name="rank0",
                        clock=lambda: 0.0, metrics=metrics.node("held", "rank0"), name_of=lambda rank: f"rank{rank}")
    changed = with_topology(spec, TopologySpec(kind="multiplex-ring"))
    new = plan_node(changed, validate_topology_change(spec, changed.topology), 0)
    driver.change_topology(TopologyChange(5, new.neighbors, new.self_weight, new.peer_schedule, "ring -> x"))
    assert algorithm.expected(2, Kind.PARAMS)  # accepted on the wire from now on

    def params(sender: int, value: float, clock: int) -> Message:
        return Message(Kind.PARAMS, sender, 0, algorithm.params.views(torch.full_like(algorithm.w, value)),
                       clock=clock)

    for value in range(20):  # rank 2, a neighbour from step 5 on, has switched and exchanges already
        driver.arrived(params(2, float(value), clock=6))
    driver.next()
    assert 2 not in algorithm.last_copy  # held: this node has not switched
    rejections = metrics.stream_rejections.labels("rank2", "rank0", "held_overflow")
    assert rejections._value.get() == 20 - 16
    while algorithm.clock < 5:
        driver.step()
        driver.stepped(0.01)
        driver.next()
    assert [s.step for s in driver.switches] == [5]
    assert torch.equal(algorithm.last_copy[2], torch.full_like(algorithm.w, 19.0))  # the newest held one

    # Back to the ring: rank 2 is a former neighbour, whose messages of steps from the switch on are dropped.
    ring = plan_node(spec, validate_job(spec), 0)
    driver.change_topology(TopologyChange(8, ring.neighbors, ring.self_weight, ring.peer_schedule, "x -> ring"))
    while algorithm.clock < 8:
        driver.step()
        driver.stepped(0.01)
        driver.next()
    driver.arrived(params(2, 7.0, clock=8))
    driver.next()
    assert 2 not in algorithm.last_copy
    assert metrics.stream_rejections.labels("rank2", "rank0", "former_neighbor")._value.get() == 1
    # The dropped edge is reported once more, with the bytes it carried since the last report (the coordinator
    # adds every edge's bytes up to the node's total), then leaves the per-edge report (it would look stalled).
    driver.traffic.add_sent(2, 100)
    last = driver._report(evaluated=False).progress
    assert {edge.peer: edge.bytes_sent for edge in last.edges}["rank2"] == 100 == last.bytes_sent
    assert "rank2" not in {edge.peer for edge in driver.progress().edges}
    assert driver.progress().bytes_sent == 100  # its bytes stay in the totals


def test_forget_edge_removes_a_dropped_edges_gauges_only():
    metrics = Metrics()
    metrics.edge_last_message.labels("j", "a", "b").set(5.0)
    metrics.neighbor_staleness.labels("j", "a", "b").set(2.0)
    metrics.edge_last_message.labels("j", "a", "c").set(5.0)
    metrics.edge_bytes_sent.labels("j", "a", "b").inc(10)
    metrics.forget_edge("j", "a", "b")

    def value(name: str, dst: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"job_id": "j", "src": "a", "dst": dst})

    assert value("peertrain_edge_last_message_timestamp_seconds", "b") is None
    assert value("peertrain_edge_last_message_timestamp_seconds", "c") == 5.0
    assert value("peertrain_edge_bytes_sent_total", "b") == 10


# -- the job file ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "error"), [
    ([{"at_step": 0, "kind": "ring"}], "simulation.topology_changes.0.at_step"),
    ([{"at_step": 100, "kind": "ring"}], "simulation.topology_changes[0].at_step: 100 is not in 1..99"),
    ([{"at_step": 50, "kind": "ring"}, {"at_step": 50, "kind": "complete"}], "ascending order"),
    ([{"at_step": 50, "kind": "ring", "colour": 1}], "simulation.topology_changes.0.colour"),
])
def test_topology_changes_in_the_job_file_are_validated(changes, error):
    with pytest.raises(JobSpecError, match=error.replace("[", r"\[").replace(".", r"\.")):
        parse_job_spec({"steps": 100, "simulation": {"topology_changes": changes}})


@pytest.mark.parametrize(("algorithm", "change", "error"), [
    ("dsgd", {"kind": "hypercube"}, r"simulation.topology_changes\[0\]: topology: unknown topology kind 'hypercube'"),
    ("dsgd", {"kind": "random-regular"}, r"option 'degree' is required"),
    ("sgp", {"kind": "bipartite-exponential"}, r"topology.kind: sgp needs every node to send"),
    ("ssgd", {"kind": "complete"}, r"algorithm.name: ssgd has no topology to change"),
    ("ad-psgd", {"kind": "complete"}, r"ad-psgd cannot change its topology while it runs"),
])
def test_a_change_the_job_cannot_take_is_refused_naming_the_field(algorithm, change, error):
    spec = parse_job_spec({"steps": 100, "algorithm": {"name": algorithm},
                           "simulation": {"topology_changes": [{"at_step": 50, **change}]}})
    with pytest.raises(JobSpecError, match=error):
        validate_job(spec)
