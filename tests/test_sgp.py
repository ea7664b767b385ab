"""SGP and Overlap SGP as state machines, driven without any network: push-sum mixing and the round structure."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from exact_linear import ZeroLoss, batch, linear_model, race
from torch import nn

from coordinator.topology import directed_mixing_matrix, in_peers, is_column_stochastic, is_row_stochastic
from coordinator.topology import offsets as schedule_offsets
from coordinator.topology import out_peers as schedule_out_peers
from nodeagent.algorithms.base import Neighbor, NodeContext, Route
from nodeagent.algorithms.sgp import SGP, OverlapSGP
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit


def make(cls, rank, world, schedule, neighbors, lr=0.1, options=None, loss_fn=None):
    spec = AlgorithmSpec(name=cls.name, lr=lr, options=options or {})
    context = NodeContext(
        rank=rank, world_size=world, neighbors=tuple(Neighbor(p) for p in sorted(neighbors)), spec=spec,
        peer_schedule=schedule,
    )
    return cls(linear_model(), context, loss_fn)


def graph(cls, schedules, **kwargs):
    """One node per rank; schedules[rank] is its out-peers per iteration. Neighbours: every peer it talks to."""
    neighbors = defaultdict(set)
    for rank, schedule in enumerate(schedules):
        for peers in schedule:
            for peer in peers:
                neighbors[rank].add(peer)
                neighbors[peer].add(rank)
    return [make(cls, r, len(schedules), s, neighbors[r], **kwargs) for r, s in enumerate(schedules)]


def start_from(nodes, seed=0):
    """Distinct initial vectors (offset away from 0 so that a bias is a large relative error); their average."""
    generator = torch.Generator().manual_seed(seed)
    initial = 5.0 + torch.randn(len(nodes), nodes[0].x.numel(), generator=generator, dtype=torch.float64)
    for node, vector in zip(nodes, initial, strict=True):
        node.x.copy_(vector)
        node._debias()
    return initial


def exponential_schedule(nodes, rank, k):
    period = len(schedule_offsets("dynamic-exponential", nodes, k))
    return tuple(tuple(schedule_out_peers("dynamic-exponential", nodes, rank, t, k)) for t in range(period))


def deliver(nodes, message: Message) -> None:
    """Hand a share to its receiver, which would keep it: never beyond the receiver's rounds_ahead()."""
    receiver = nodes[message.receiver]
    assert message.clock <= receiver.clock + receiver.rounds_ahead(), (message.clock, receiver.clock)
    receiver.receive(message)


def run_rounds(nodes, iterations, delay=0):
    """Every node steps once per iteration; the pushes of iteration t are delivered after iteration t + delay.
    Returns the senders of each (receiver, round)."""
    senders = defaultdict(set)
    in_transit = []
    for t in range(iterations):
        for node in nodes:
            assert node.ready()
            node.step(*batch(t))
            for send in node.sends():
                assert send.route == Route.PUSH and send.kind == Kind.PUSHSUM and send.message.clock == t
                senders[(send.peer, t)].add(send.message.sender)
                in_transit.append((t, send))
        due = [item for item in in_transit if item[0] <= t - delay]
        in_transit = [item for item in in_transit if item[0] > t - delay]
        for _, send in due:
            deliver(nodes, send.message)
    for _, send in in_transit:
        deliver(nodes, send.message)
    return senders


def test_push_sum_on_a_directed_graph_reaches_the_exact_average_where_plain_averaging_is_biased():
    """The mixing parts alone on a strongly connected digraph whose in-degrees differ from the out-degrees."""
    out = {0: (1, 2), 1: (2,), 2: (0,)}  # in-degrees 1, 1, 2
    matrix = directed_mixing_matrix(3, [out[r] for r in range(3)])
    assert is_column_stochastic(matrix) and not is_row_stochastic(matrix)
    nodes = [make(SGP, r, 3, (), set(out[r]) | {s for s in out if r in out[s]}) for r in range(3)]
    initial = start_from(nodes)
    for iteration in range(200):
        shares = [node._split(len(out[rank])) for rank, node in enumerate(nodes)]
        for rank, (x_share, weight_share) in enumerate(shares):
            for peer in out[rank]:
                nodes[peer]._absorb(x_share, weight_share)
        if iteration == 0:  # one round is x <- W x with the topology's push-sum matrix
            expected = torch.from_numpy(matrix) @ initial
            assert torch.allclose(torch.stack([n.x for n in nodes]), expected, rtol=0, atol=1e-14)
    for node in nodes:
        node._debias()
    average = initial.mean(0)
    for node in nodes:
        assert torch.allclose(node.w, average, rtol=0, atol=1e-10)
    # x alone (averaging without the push-sum weights) converges to weight_i * average: the right Perron vector.
    assert [n.weight for n in nodes] == pytest.approx([1.0, 2 / 3, 4 / 3], abs=1e-12)
    for node in nodes:
        assert torch.allclose(node.x, node.weight * average, rtol=0, atol=1e-9)
    bias = max(float((n.x - average).abs().max()) for n in nodes)
    assert bias > 1.0


def test_sgp_steps_reach_the_exact_average_on_a_directed_graph_with_unequal_in_degrees():
    """The whole state machine (step, sends, receive) on a digraph whose in-degree equals the out-degree at every
    node, as SGP's round accounting needs, but differs between nodes (2, 1, 1, 1): weights are not 1."""
    out = {0: (1, 3), 1: (2,), 2: (0,), 3: (0,)}
    nodes = graph(SGP, [(out[r],) for r in range(4)], loss_fn=ZeroLoss())
    initial = start_from(nodes)
    run_rounds(nodes, 150)
    average = initial.mean(0)
    for node in nodes:
        assert node.ready() and node.clock == 150
        assert torch.allclose(node.w, average, rtol=0, atol=1e-10)
        assert torch.allclose(node.x, node.weight * average, rtol=0, atol=1e-9)
    assert [n.weight for n in nodes] == pytest.approx([4 / 3, 8 / 9, 8 / 9, 8 / 9], abs=1e-12)
    assert max(float((n.x - average).abs().max()) for n in nodes) > 1.0


@pytest.mark.parametrize("k", [1, 2])
def test_sgp_on_the_dynamic_exponential_graph_reaches_the_average_with_weights_one(k):
    nodes = graph(SGP, [exponential_schedule(8, r, k) for r in range(8)], loss_fn=ZeroLoss())
    initial = start_from(nodes)
    senders = run_rounds(nodes, 60)
    # Each round every node hears from exactly its in-peers of that iteration.
    for (receiver, t), ranks in senders.items():
        assert ranks == set(in_peers("dynamic-exponential", 8, receiver, t, k))
    assert len(senders) == 8 * 60
    for node in nodes:
        assert node.weight == pytest.approx(1.0, abs=1e-12)
        assert torch.allclose(node.w, initial.mean(0), rtol=0, atol=1e-10)


def test_synchronous_sgp_follows_the_push_sum_recursion_with_gradients_at_z():
    """X_{t+1} = W (X_t - lr G(Z_t)), weights_{t+1} = W weights_t, Z = X / weights, with W column-stochastic."""
    out = {0: (1, 3), 1: (2,), 2: (0,), 3: (0,)}
    nodes = graph(SGP, [(out[r],) for r in range(4)], lr=0.5)
    matrix = torch.from_numpy(directed_mixing_matrix(4, [out[r] for r in range(4)]))
    x = start_from(nodes)
    weights = torch.ones(4, dtype=torch.float64)
    reference = linear_model()
    for t in range(4):
        gradients = []
        for rank in range(4):
            z = x[rank] / weights[rank]
            with torch.no_grad():
                reference.weight.copy_(z[:6].view(2, 3))
                reference.bias.copy_(z[6:])
            reference.zero_grad()
            inputs, targets = batch(10 * t + rank)
            nn.functional.cross_entropy(reference(inputs), targets).backward()
            gradients.append(torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad]))
        x = matrix @ (x - 0.5 * torch.stack(gradients))
        weights = matrix @ weights
        outbox = []
        for rank, node in enumerate(nodes):
            node.step(*batch(10 * t + rank))
            outbox += node.sends()
        for send in reversed(outbox):
            nodes[send.peer].receive(send.message)
        for rank, node in enumerate(nodes):
            assert node.ready() and node.clock == t + 1
            assert node.weight == pytest.approx(float(weights[rank]), abs=1e-14)
            assert torch.allclose(node.x, x[rank], rtol=0, atol=1e-12)
            assert torch.allclose(node.w, x[rank] / weights[rank], rtol=0, atol=1e-12)
    assert not np.allclose(weights.numpy(), 1.0)


def test_a_step_descends_at_z_and_pushes_one_of_k_plus_1_shares():
    node = make(SGP, 0, 3, (), {1, 2})
    z = node.w.clone()
    node.x.mul_(2.0)  # x = 2 z with weight 2: the model still holds z
    node.weight = 2.0
    node._debias()
    reference = linear_model()
    inputs, targets = batch(0)
    expected_loss = nn.functional.cross_entropy(reference(inputs), targets)
    expected_loss.backward()
    grad = torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad])
    assert node.step(inputs, targets) == pytest.approx(float(expected_loss.detach()))
    share = (2.0 * z - 0.1 * grad) / 3
    sends = node.sends()
    assert [s.peer for s in sends] == [1, 2]
    for send in sends:
        assert send.route == Route.PUSH and send.kind == Kind.PUSHSUM
        assert send.message.clock == 0 and send.message.weight == pytest.approx(2 / 3)
        assert torch.allclose(node.params.flatten(send.message.tensors), share, rtol=0, atol=1e-15)
    assert torch.allclose(node.x, share, rtol=0, atol=1e-15) and node.weight == pytest.approx(2 / 3)
    assert not node.ready()


def test_synchronous_sgp_waits_for_every_share_of_its_round_once():
    node = make(SGP, 0, 3, (), {1, 2})
    views = node.params.views
    node.step(*batch(0))
    kept = node.x.clone()

    def share(sender, clock, value):
        return Message(Kind.PUSHSUM, sender, 0, views(torch.full_like(node.x, value)), clock=clock, weight=value)

    node.receive(share(1, 0, 0.25))
    node.receive(share(1, 1, 0.5))  # early: the next round's
    node.receive(share(1, 0, 0.25))  # a retried push delivered twice
    assert not node.ready() and node.clock == 1
    node.receive(share(2, 0, 0.125))
    assert node.ready()
    assert node.weight == pytest.approx(1 / 3 + 0.25 + 0.125)
    assert torch.allclose(node.x, kept + 0.375, rtol=0, atol=1e-15)
    node.receive(share(2, 0, 0.125))  # a repeat of an absorbed round changes nothing
    assert node.weight == pytest.approx(1 / 3 + 0.25 + 0.125)
    assert list(node.shares) == [1]


def test_synchronous_step_pushes_even_when_its_round_completed_early():
    node = make(SGP, 0, 2, (), {1})
    node.receive(Message(Kind.PUSHSUM, 1, 0, node.params.views(torch.ones_like(node.x)), clock=0, weight=0.5))
    node.step(*batch(0))
    assert node.ready() and node.clock == 1 and node.weight == pytest.approx(1.0)
    (send,) = node.sends()
    assert send.peer == 1 and send.message.clock == 0
    assert node.sends() == []


def test_overlap_sgp_absorbs_round_t_after_step_t_plus_1_without_waiting_for_it():
    node = make(OverlapSGP, 0, 2, (), {1}, loss_fn=ZeroLoss())
    node.step(*batch(0))
    assert node.ready()  # round 0 travels while step 1 computes
    node.step(*batch(1))
    assert not node.ready()  # step 2 needs round 0
    before = node.x.clone()
    share = torch.full_like(node.x, 3.0)
    node.receive(Message(Kind.PUSHSUM, 1, 0, node.params.views(share), clock=0, weight=0.5))
    assert node.ready() and list(node.open_rounds) == [1]
    assert torch.allclose(node.x, before + share, rtol=0, atol=1e-15)
    assert node.weight == pytest.approx(0.25 + 0.5)
    assert torch.allclose(node.w, node.x / 0.75, rtol=0, atol=1e-15)


@pytest.mark.parametrize("synch_freq", [0, 1, 3])
def test_overlap_sgp_blocks_once_synch_freq_further_steps_passed_without_a_round(synch_freq):
    node = make(OverlapSGP, 0, 2, (), {1}, options={"synch_freq": synch_freq})
    steps = 0
    while node.ready():
        node.step(*batch(steps))
        steps += 1
        assert steps < 10
    assert steps == 2 + synch_freq  # round 0 is missing from steps 1 .. 1 + s; step 2 + s waits
    node.receive(Message(Kind.PUSHSUM, 1, 0, node.params.views(torch.zeros_like(node.x)), clock=0, weight=0.5))
    assert node.ready()


@pytest.mark.parametrize(("k", "delay"), [(1, 1), (2, 1), (1, 2)])
def test_overlap_sgp_with_rounds_in_flight_still_reaches_the_exact_average(k, delay):
    nodes = graph(
        OverlapSGP, [exponential_schedule(8, r, k) for r in range(8)], loss_fn=ZeroLoss(),
        options={"synch_freq": delay - 1},
    )
    initial = start_from(nodes)
    run_rounds(nodes, 200, delay=delay)
    for node in nodes:
        assert not node.open_rounds
        assert torch.allclose(node.w, initial.mean(0), rtol=0, atol=1e-10)


def test_options_are_checked():
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"algorithm\.options\.synch_freq"):
            make(OverlapSGP, 0, 2, (), {1}, options={"synch_freq": bad})
    with pytest.raises(ValueError, match=r"algorithm\.options\.synch_frequency"):
        make(OverlapSGP, 0, 2, (), {1}, options={"synch_frequency": 1})
    with pytest.raises(ValueError, match=r"algorithm\.options\.synch_freq"):
        make(SGP, 0, 2, (), {1}, options={"synch_freq": 1})


def test_expected_accepts_pushsum_and_rejoin_pulls_from_neighbours_only():
    node = make(SGP, 0, 3, ((1,),), {1, 2})
    assert [s.name for s in node.expected(2, Kind.PUSHSUM)] == ["weight", "bias"]
    assert [s.name for s in node.expected(2, Kind.PARAMS)] == ["weight", "bias"]  # a restarted neighbour's pull
    with pytest.raises(WireError) as stranger:
        node.expected(5, Kind.PUSHSUM)
    assert stranger.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        node.expected(1, Kind.DUAL)
    assert kind.value.reason == "unexpected_kind"


def test_checkpoint_keeps_the_push_sum_state():
    """A node restored from its state dict continues exactly as the original would."""
    original = make(SGP, 0, 2, ((1,),), (1,))
    original.x.fill_(3.0)
    original.weight = 1.5
    original._debias()
    state = original.state_dict()
    restored = make(SGP, 0, 2, ((1,),), (1,))
    restored.load_state_dict(state)
    assert restored.weight == 1.5 and torch.equal(restored.x, original.x) and torch.equal(restored.w, original.w)
    assert torch.allclose(restored.w, torch.full_like(restored.w, 2.0))


def test_rounds_ahead_bounds_the_rounds_a_node_keeps_shares_of():
    static = graph(SGP, [((1,),), ((2,),), ((3,),), ((0,),)])  # a directed ring: rank 0 may run 3 rounds ahead of 1
    assert static[0].rounds_ahead() == 4 * (0 + 1)
    overlap = graph(OverlapSGP, [((1,),), ((2,),), ((3,),), ((0,),)], options={"synch_freq": 2})
    assert overlap[0].rounds_ahead() == 4 * (1 + 2 + 1)
    schedules = [exponential_schedule(8, rank, 1) for rank in range(8)]
    assert graph(SGP, schedules)[0].rounds_ahead() == 8 * len(schedules[0])


@pytest.mark.parametrize(("cls", "options", "lead"), [(SGP, {}, 2), (OverlapSGP, {"synch_freq": 1}, 8)],
                         ids=["sgp", "osgp"])
def test_a_node_racing_ahead_on_a_directed_ring_stays_within_its_receivers_rounds_ahead(cls, options, lead):
    """Rank 0 steps whenever it may and shares arrive in random order: it runs up to (n - 1) * (rounds_in_flight + 1)
    - 1 rounds ahead of rank 1, its out-peer, which it hears from only through the three others; `deliver` checks
    that no share is ever beyond the window, which is n * (rounds_in_flight + 1)."""
    nodes = graph(cls, [((1,),), ((2,),), ((3,),), ((0,),)], options=options)
    leads = race(nodes, batch, lambda share: deliver(nodes, share))
    assert 2 <= max(leads) <= lead
