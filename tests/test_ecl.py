"""PDMM-ISVR and ADMM-ISVR: the update rules on known numbers, the exchange protocol, and convergence to the
centralised optimum on heterogeneous least squares (where asynchronous DSGD with a constant step does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nodeagent.algorithms.base import Algorithm, Neighbor, NodeContext, Route
from nodeagent.algorithms.dsgd import DSGD
from nodeagent.algorithms.ecl import ADMMISVR, PDMMISVR
from nodeagent.jobspec import AlgorithmSpec, JobSpec, NetworkSpec, SimulationSpec
from nodeagent.metrics import Metrics
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.job import Node
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit

DIM = 5
SAMPLES = 20
STEPS = 800  # lockstep rounds of the convergence tests
ECL_RANDOM8 = ((0, 1), (0, 4), (0, 6), (0, 7), (1, 6), (2, 4), (2, 5), (3, 6), (3, 7), (4, 5))

# -- helpers --------------------------------------------------------------------------------------------------------


def ring(nodes: int) -> tuple[tuple[int, int], ...]:
    return tuple((rank, (rank + 1) % nodes) for rank in range(nodes))


def plan(nodes: int, edges, interval: int, seed: int) -> list[tuple[Neighbor, ...]]:
    """Each rank's neighbours as the coordinator assigns them: sign +1 at the lower rank, a random phase per
    endpoint (the peer's phase too), uniform mixing weights."""
    draws = np.random.default_rng(seed).integers(0, interval, size=(len(edges), 2)).tolist()
    phase = {}
    peers: dict[int, list[int]] = {rank: [] for rank in range(nodes)}
    for (a, b), (phase_a, phase_b) in zip(edges, draws, strict=True):
        phase[(a, b)], phase[(b, a)] = phase_a, phase_b
        peers[a].append(b)
        peers[b].append(a)
    return [
        tuple(
            Neighbor(peer, 1 if rank < peer else -1, phase[(rank, peer)], 1 / (len(peers[rank]) + 1),
                     phase[(peer, rank)])
            for peer in sorted(peers[rank])
        )
        for rank in range(nodes)
    ]


def least_squares(nodes: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Heterogeneous data: node i's features have mean 0.3 * (i - nodes / 2) and its targets come from its own
    regressor. Returns each node's (A_i, b_i); node i's loss is f_i(w) = mean((A_i w - b_i)^2) (MSELoss)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for rank in range(nodes):
        features = torch.randn(SAMPLES, DIM, generator=generator, dtype=torch.float64) + 0.3 * (rank - nodes / 2)
        regressor = 2 * torch.randn(DIM, generator=generator, dtype=torch.float64)
        noise = 0.1 * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)
        data.append((features, (features @ regressor + noise).unsqueeze(1)))
    return data


def optimum(data, weights: list[float] | None = None) -> torch.Tensor:
    """The minimiser of sum_i c_i f_i (c_i = 1 by default: the centralised optimum). MSELoss averages over the
    samples, so grad f_i(w) = 2 A_i^T (A_i w - b_i) / n_i."""
    weights = weights or [1.0] * len(data)
    hessian = sum(c * a.T @ a / len(a) for c, (a, _) in zip(weights, data, strict=True))
    moment = sum(c * a.T @ b[:, 0] / len(a) for c, (a, b) in zip(weights, data, strict=True))
    return torch.linalg.solve(hessian, moment)


def step_size(data) -> float:
    """1 / L with L the largest smoothness constant of the f_i."""
    return 1 / max(2 * torch.linalg.eigvalsh(a.T @ a / len(a)).max().item() for a, _ in data)


def build(cls: type[Algorithm], plans, lr: float, interval: int, options: dict | None = None) -> list[Algorithm]:
    spec = AlgorithmSpec(name=cls.name, lr=lr, interval=interval, options=options or {})
    nodes = []
    for rank, neighbors in enumerate(plans):
        torch.manual_seed(0)  # the same seeded initial model on every node
        model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
        context = NodeContext(rank, len(plans), neighbors, spec, self_weight=1 / (len(neighbors) + 1))
        nodes.append(cls(model, context, loss_fn=nn.MSELoss()))
    return nodes


def run_atomic(nodes: list[Algorithm], data, steps: int) -> None:
    """Lockstep rounds as a runtime would drive them with no latency: every node steps and publishes; each
    due exchange delivers the initiator's message to the peer and the peer's published snapshot back."""
    for _ in range(steps):
        sends = []
        for node, (inputs, targets) in zip(nodes, data, strict=True):
            node.step(inputs, targets)
            sends += [(node, send) for send in node.sends()]
        published = [node.snapshot() for node in nodes]
        for node, send in sends:
            nodes[send.peer].receive(send.message)
            node.receive(published[send.peer].message_for(node.context.rank, send.kind))


def run_crossing(nodes: list[PDMMISVR], data, steps: int, refresh: bool) -> None:
    """A deliberately broken schedule: BOTH ends start an exchange on an edge at each of the two phases, so every
    exchange crosses one from the other end, and both are applied one after the other. With `refresh`, each end
    answers with y computed from its current z (as a runtime would that republished y on receipt); otherwise
    with its published snapshot."""
    for _ in range(steps):
        due = []
        for node, (inputs, targets) in zip(nodes, data, strict=True):
            node.step(inputs, targets)
            position = (node.clock - 1) % node.spec.interval
            due += [(node, n) for n in node.context.neighbors if position in (n.phase, n.peer_phase)]
        for node, neighbor in due:
            peer = nodes[neighbor.rank]
            back = next(n for n in peer.context.neighbors if n.rank == node.context.rank)
            if refresh:
                there, here = node.dual(neighbor), peer.dual(back)
            else:
                there = node.params.flatten(node.snapshot().served[(peer.context.rank, Kind.DUAL)])
                here = peer.params.flatten(peer.snapshot().served[(node.context.rank, Kind.DUAL)])
            peer.receive(Message(Kind.DUAL, node.context.rank, peer.context.rank, node.params.views(there)))
            node.receive(Message(Kind.DUAL, peer.context.rank, node.context.rank, node.params.views(here)))


def relative_error(nodes: list[Algorithm], target: torch.Tensor) -> float:
    return max(float((node.w - target).norm() / target.norm()) for node in nodes)


def single(rank: int, neighbors: tuple[Neighbor, ...], cls: type[PDMMISVR] = PDMMISVR, **spec) -> PDMMISVR:
    spec = {"lr": 0.5, "interval": 3, **spec}
    context = NodeContext(rank, 4, neighbors, AlgorithmSpec(name=cls.name, **spec))
    model = nn.Linear(2, 1, bias=False, dtype=torch.float64)
    return cls(model, context, loss_fn=nn.MSELoss())


def dual_message(node: PDMMISVR, sender: int, values: list[float]) -> Message:
    flat = torch.tensor(values, dtype=torch.float64)
    return Message(Kind.DUAL, sender, node.context.rank, node.params.views(flat))


def served(node: PDMMISVR, peer: int) -> torch.Tensor:
    return node.params.flatten(node.snapshot().served[(peer, Kind.DUAL)])


# -- the update rules on known numbers ------------------------------------------------------------------------------


def test_eta_default_is_the_released_codes_and_optimal_is_an_option():
    neighbors = (Neighbor(0, -1), Neighbor(2, 1))
    released = single(1, neighbors, lr=0.1, interval=4)
    assert released.eta_rule == "released"
    assert released.eta == pytest.approx(1 / (0.1 * (2 * 3 + 4)))  # 1.0
    optimal = single(1, neighbors, lr=0.1, interval=4, options={"eta": "optimal"})
    assert optimal.eta_rule == "optimal"
    assert optimal.eta == pytest.approx(1 / (0.1 * 2 * 3))
    with pytest.raises(ValueError, match=r"algorithm\.options\.eta.*unbounded"):
        single(1, neighbors, interval=1, options={"eta": "optimal"})
    assert single(1, neighbors, interval=1).eta == pytest.approx(1 / 0.5)  # the default is finite at K = 1
    with pytest.raises(ValueError, match=r"algorithm\.options\.eta: Input should be 'released' or 'optimal'"):
        single(1, neighbors, options={"eta": "fastest"})


def test_primal_update_and_published_duals_on_known_vectors():
    # Rank 1 between ranks 0 (A_10 = -1) and 2 (A_12 = +1); mu = 0.5, K = 3, E = 2: eta = 1 / 3.5 = 2 / 7.
    node = single(1, (Neighbor(0, -1), Neighbor(2, 1)), lr=0.5, interval=3, l2=1.0)
    node.w.copy_(torch.tensor([1.0, 2.0], dtype=torch.float64))
    node.receive(dual_message(node, 0, [7.0, 0.0]))
    node.receive(dual_message(node, 2, [0.0, 7.0]))
    inputs = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    targets = torch.zeros(1, 1, dtype=torch.float64)
    loss = node.step(inputs, targets)
    assert loss == pytest.approx(9.0)  # (1 + 2 - 0)^2
    # g = 2 * 3 * [1, 1] + l2 * w = [7, 8]; w / mu = [2, 4]; eta * (-z_10 + z_12) = (2/7) * [-7, 7] = [-2, 2];
    # numerator = [2 - 7 - 2, 4 - 8 + 2] = [-7, -2]; denominator = 1 / mu + eta * E = 2 + 4 / 7 = 18 / 7.
    expected = torch.tensor([-7.0, -2.0], dtype=torch.float64) * 7 / 18
    assert torch.allclose(node.w, expected, atol=1e-12)
    assert node.clock == 1
    # y_ij = z_ij - 2 A_ij w, one tensor set per edge, named like the parameters.
    assert torch.allclose(served(node, 0), torch.tensor([7.0, 0.0], dtype=torch.float64) + 2 * expected)
    assert torch.allclose(served(node, 2), torch.tensor([0.0, 7.0], dtype=torch.float64) - 2 * expected)
    assert set(node.snapshot().served) == {(0, Kind.DUAL), (2, Kind.DUAL)}
    assert list(node.snapshot().served[(0, Kind.DUAL)]) == ["weight"]
    assert node.snapshot().clock == 1 and node.snapshot().loss == pytest.approx(9.0)


def test_signs_must_follow_the_lower_rank_rule():
    """A_ij = -A_ji holds only if both ends use the same rule; a wrong sign would break consensus silently."""
    with pytest.raises(ValueError, match=r"sign A_ij must be -1"):
        single(1, (Neighbor(0, 1),))
    with pytest.raises(ValueError, match=r"sign A_ij must be \+1"):
        single(1, (Neighbor(2, -1),))
    low, high = build(PDMMISVR, plan(2, ((0, 1),), 4, seed=0), lr=0.1, interval=4)
    # Same initial w at both ends and z = 0: y_01 = -2w and y_10 = +2w, so after a swap A_ij z_ij = 2w at both ends.
    assert torch.equal(served(low, 1), -served(high, 0))


def test_admm_averages_where_pdmm_overwrites():
    neighbors = (Neighbor(0, -1),)
    pdmm, admm = single(1, neighbors), single(1, neighbors, ADMMISVR)
    for node in (pdmm, admm):
        for _ in range(2):  # the same dual delivered twice
            node.receive(dual_message(node, 0, [4.0, -8.0]))
    assert torch.equal(pdmm.z[0], torch.tensor([4.0, -8.0], dtype=torch.float64))  # idempotent
    assert torch.equal(admm.z[0], torch.tensor([3.0, -6.0], dtype=torch.float64))  # 0 -> y/2 -> 3y/4


# -- the protocol ---------------------------------------------------------------------------------------------------


def test_only_the_lower_rank_initiates_at_both_phases():
    neighbors = (
        Neighbor(0, -1, phase=1, peer_phase=2),  # the lower rank 0 initiates this edge
        Neighbor(2, 1, phase=0, peer_phase=3),
        Neighbor(3, 1, phase=2, peer_phase=2),  # both phases coincide: one exchange, not two
    )
    node = single(1, neighbors, interval=4)
    due = []
    for step in range(8):
        node.step(torch.full((1, 2), float(step), dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
        sends = node.sends()
        for send in sends:
            assert send.route == Route.EXCHANGE and send.kind == Kind.DUAL
            assert send.message.sender == 1 and send.message.receiver == send.peer
            assert torch.equal(node.params.flatten(send.message.tensors), served(node, send.peer))
        due.append([send.peer for send in sends])
    # Step t (clock t + 1) is at position t mod K.
    assert due == [[2], [], [3], [2], [2], [], [3], [2]]


def test_receipt_changes_z_but_not_the_published_dual_until_the_next_primal_update():
    node = single(0, (Neighbor(1, 1),))
    before = served(node, 1)
    node.receive(dual_message(node, 1, [1.0, 1.0]))
    assert torch.equal(node.z[1], torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert torch.equal(served(node, 1), before), "y must stay the dual of the state that produced w"
    node.step(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    assert torch.allclose(served(node, 1), node.z[1] - 2 * node.w)


def test_sent_duals_are_snapshots_not_live_views():
    node = single(0, (Neighbor(1, 1, phase=0, peer_phase=0),), interval=1)
    node.step(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    (send,) = node.sends()
    sent = node.params.flatten(send.message.tensors)
    node.receive(dual_message(node, 1, [5.0, 5.0]))
    node.step(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    assert torch.equal(node.params.flatten(send.message.tensors), sent)
    assert not torch.equal(served(node, 1), sent)


def test_expected_rejects_strangers_and_other_kinds():
    node = single(1, (Neighbor(0, -1), Neighbor(2, 1)))
    assert node.expected(0, Kind.DUAL) == node.params.specs
    with pytest.raises(WireError) as stranger:
        node.expected(3, Kind.DUAL)
    assert stranger.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        node.expected(2, Kind.PARAMS)
    assert kind.value.reason == "unexpected_kind"


def test_only_asynchronous_mode_and_the_plain_gradient():
    with pytest.raises(ValueError, match=r"algorithm\.mode"):
        single(0, (Neighbor(1, 1),), mode="sync")
    with pytest.raises(ValueError, match=r"algorithm\.momentum"):
        single(0, (Neighbor(1, 1),), ADMMISVR, momentum=0.9)


# -- convergence ----------------------------------------------------------------------------------------------------


def test_converges_to_the_centralised_optimum_where_dsgd_does_not():
    data = least_squares(6)
    plans, lr = plan(6, ring(6), 4, seed=1), step_size(data)
    errors = {}
    for cls in (PDMMISVR, ADMMISVR, DSGD):
        algorithms = build(cls, plans, lr, 4)
        run_atomic(algorithms, data, STEPS)
        errors[cls.name] = relative_error(algorithms, optimum(data))
    assert errors["pdmm-isvr"] < 1e-12, errors
    assert errors["admm-isvr"] < 1e-12, errors
    # The heterogeneity of the data keeps DSGD with a constant step a fixed distance away.
    assert errors["dsgd"] > 0.2, errors


def test_on_irregular_graphs_the_released_eta_weights_each_loss_by_one_over_eta_i():
    """eta_i depends on the node's own degree, and a fixed point has g_i = eta_i * sum_j (A_ij z_ij - w) whose
    edge terms cancel between the two ends only after dividing by eta_i: the nodes agree on the minimiser of
    sum_i (E_i (K - 1) + K) f_i. On the ECL random graph (degrees 2 to 4) that is not the centralised optimum;
    on regular graphs (rings) the weights are equal and it is."""
    data, interval = least_squares(8), 4
    plans = plan(8, ECL_RANDOM8, interval, seed=1)
    nodes = build(PDMMISVR, plans, step_size(data), interval)
    run_atomic(nodes, data, STEPS)
    weighted = optimum(data, [len(neighbors) * (interval - 1) + interval for neighbors in plans])
    assert relative_error(nodes, weighted) < 1e-9
    assert relative_error(nodes, optimum(data)) > 0.1


def test_crossing_exchanges_applied_twice_stall_pdmm():
    data = least_squares(6)
    plans, lr = plan(6, ring(6), 4, seed=1), step_size(data)
    atomic = build(PDMMISVR, plans, lr, 4)
    run_atomic(atomic, data, STEPS)
    corrupted = build(PDMMISVR, plans, lr, 4)
    run_crossing(corrupted, data, STEPS, refresh=True)
    # Two swaps with no primal update in between hand each end back its own dual: the nodes agree, on the
    # wrong point.
    assert relative_error(atomic, optimum(data)) < 1e-12
    assert relative_error(corrupted, optimum(data)) > 0.2
    assert relative_error(corrupted, corrupted[0].w) < 1e-9
    # Serving the published snapshot (y refreshed only by primal updates) makes a repeated PDMM swap idempotent,
    # so even crossing exchanges do no harm; the single initiator guards the other cases.
    snapshots = build(PDMMISVR, plans, lr, 4)
    run_crossing(snapshots, data, STEPS, refresh=False)
    assert relative_error(snapshots, optimum(data)) < 1e-12


class FullBatch:
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


@pytest.mark.parametrize("cls", [PDMMISVR, ADMMISVR], ids=lambda cls: cls.name)
def test_virtual_mesh_reaches_the_optimum_with_latency_and_jitter(cls):
    data = least_squares(4)
    steps, interval = 1000, 4
    job = JobSpec(
        nodes=4, steps=steps, eval_every=steps,
        algorithm=AlgorithmSpec(name=cls.name, lr=step_size(data), interval=interval),
        simulation=SimulationSpec(step_time_s=0.01, jitter=0.2, network=NetworkSpec(latency_s=0.002)),
    )
    nodes = []
    for rank, (algorithm, (inputs, targets)) in enumerate(
        zip(build(cls, plan(4, ring(4), interval, seed=3), job.algorithm.lr, interval), data, strict=True)
    ):
        nodes.append(Node(job, rank, algorithm, FullBatch(inputs, targets), None, SAMPLES))
    mesh = VirtualMesh(nodes, "ecl", job.simulation, Metrics())
    mesh.run()
    assert mesh.finished
    assert relative_error([node.algorithm for node in nodes], optimum(data)) < 1e-9
    # Only the lower rank of each edge initiates: ranks 0..2 do, rank 3 (the highest on the ring) never does.
    assert mesh.nodes[3].driver.exchanges == 0 and all(sim.driver.exchanges > 0 for sim in mesh.nodes[:3])
    # Only duals travel: one parameter-sized float64 tensor per message.
    answering = mesh.nodes[3].driver.progress()
    assert answering.bytes_sent == answering.bytes_received
    assert answering.bytes_sent % (DIM * 8) == 0


def test_checkpoint_keeps_the_duals():
    neighbors = (Neighbor(1, 1, 0, 0.0, 1), Neighbor(3, 1, 2, 0.0, 0))
    node = single(0, neighbors)
    for z in node.z.values():
        z.normal_()
    restored = single(0, neighbors)
    restored.load_state_dict(node.state_dict())
    assert all(torch.equal(restored.z[r], node.z[r]) for r in node.z)
    node.republish()
    assert torch.equal(served(restored, 1), served(node, 1)) and torch.equal(served(restored, 3), served(node, 3))
