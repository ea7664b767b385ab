"""DSGD as a state machine, driven without any network."""


import pytest
import torch
from exact_linear import race
from torch import nn

from nodeagent.algorithms import Neighbor, NodeContext, Route, build_algorithm
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def make(rank, neighbors, self_weight, lr=0.1, interval=4, mode="async"):
    spec = AlgorithmSpec(name="dsgd", lr=lr, interval=interval, mode=mode)
    context = NodeContext(rank=rank, world_size=3, neighbors=neighbors, spec=spec, self_weight=self_weight)
    return build_algorithm(linear_model(), context)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=generator), torch.randint(0, 2, (8,), generator=generator)


def test_model_parameters_are_views_of_the_flat_vector():
    algorithm = make(0, (Neighbor(1, 1, 0, 0.5),), 0.5)
    algorithm.w.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in algorithm.model.parameters())
    assert algorithm.w.numel() == 3 * 2 + 2


def test_step_is_sgd_then_uniform_mix_with_last_copies():
    neighbors = (Neighbor(1, 1, 0, 1 / 3), Neighbor(2, 1, 1, 1 / 3))
    algorithm = make(0, neighbors, 1 / 3, lr=0.1)
    reference = linear_model()
    copy_1 = torch.full_like(algorithm.w, 2.0)
    copy_2 = torch.full_like(algorithm.w, -1.0)
    algorithm.receive(Message(Kind.PARAMS, 1, 0, algorithm.params.views(copy_1)))
    algorithm.receive(Message(Kind.PARAMS, 2, 0, algorithm.params.views(copy_2)))
    x, y = batch(1)
    loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    grad = torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad])
    w0 = torch.cat([reference.weight.detach().reshape(-1), reference.bias.detach()])
    expected = ((w0 - 0.1 * grad) + copy_1 + copy_2) / 3
    returned = algorithm.step(x, y)
    assert returned == pytest.approx(float(loss.detach()))
    assert torch.allclose(algorithm.w, expected, atol=1e-6)
    assert algorithm.clock == 1


def test_exchanges_follow_the_edge_phases():
    neighbors = (Neighbor(1, 1, 0, 0.25), Neighbor(2, 1, 2, 0.25))
    algorithm = make(0, neighbors, 0.5, interval=4)
    due_by_step = []
    for step in range(8):
        algorithm.step(*batch(step))
        sends = algorithm.sends()
        assert all(s.route == Route.EXCHANGE and s.kind == Kind.PARAMS for s in sends)
        due_by_step.append([s.peer for s in sends])
    # Step t (clock t+1) serves the edges whose phase is t mod K.
    assert due_by_step == [[1], [], [2], [], [1], [], [2], []]


def test_sent_message_is_a_snapshot_not_a_live_view():
    algorithm = make(0, (Neighbor(1, 1, 0, 0.5),), 0.5)
    algorithm.step(*batch(0))
    (send,) = algorithm.sends()
    sent = torch.cat([t.reshape(-1) for t in send.message.tensors.values()]).clone()
    algorithm.step(*batch(1))
    assert torch.equal(torch.cat([t.reshape(-1) for t in send.message.tensors.values()]), sent)
    assert not torch.equal(algorithm.w, sent)
    assert send.message.clock == 1 and send.message.sender == 0 and send.message.receiver == 1


def test_expected_rejects_strangers_and_other_kinds():
    algorithm = make(0, (Neighbor(1, 1, 0, 0.5),), 0.5)
    assert [s.name for s in algorithm.expected(1, Kind.PARAMS)] == ["weight", "bias"]
    with pytest.raises(WireError) as stranger:
        algorithm.expected(2, Kind.PARAMS)
    assert stranger.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        algorithm.expected(1, Kind.DUAL)
    assert kind.value.reason == "unexpected_kind"


def test_pure_mixing_on_a_ring_reaches_the_average():
    """With no gradient (lr tiny, zero data effect ignored) mixing alone is a doubly stochastic averaging."""
    ring = {0: (1, 2), 1: (0, 2), 2: (0, 1)}
    nodes = [make(r, tuple(Neighbor(p, 1, 0, 1 / 3) for p in ring[r]), 1 / 3, interval=1) for r in range(3)]
    for rank, node in enumerate(nodes):
        node.w.fill_(float(rank * 3))
    target = torch.stack([n.w.clone() for n in nodes]).mean(0)
    for _ in range(50):
        snapshots = [n.w.clone() for n in nodes]
        for rank, node in enumerate(nodes):
            for peer in ring[rank]:
                node.receive(Message(Kind.PARAMS, peer, rank, node.params.views(snapshots[peer])))
            with torch.no_grad():
                node._mix(node.last_copy)
    for node in nodes:
        assert torch.allclose(node.w, target, atol=1e-5)


def test_unknown_algorithm_names_the_field():
    context = NodeContext(0, 1, (), AlgorithmSpec(name="nope"))
    with pytest.raises(ValueError, match=r"algorithm\.name"):
        build_algorithm(linear_model(), context)


def test_synchronous_rounds_follow_the_d_psgd_recursion():
    """x_{t+1} = W x_t - lr * g(x_t), whatever order the pushes arrive in."""
    ring = {0: (1, 2), 1: (0, 2), 2: (0, 1)}
    nodes = [make(r, tuple(Neighbor(p, 1, 0, 0.25) for p in ring[r]), 0.5, mode="sync") for r in range(3)]
    references = [linear_model() for _ in range(3)]
    for rank, node in enumerate(nodes):
        with torch.no_grad():
            node.w.add_(float(rank))
            node._published = node._publish()  # start the nodes from different points
            for p in references[rank].parameters():
                p.add_(float(rank))
    for step in range(3):
        expected = []
        flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in references]
        for rank, model in enumerate(references):
            model.zero_grad()
            x, y = batch(10 * step + rank)
            nn.functional.cross_entropy(model(x), y).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            mixed = 0.5 * flat[rank] + sum(0.25 * flat[p] for p in ring[rank])
            expected.append(mixed - 0.1 * grad)
        outbox = []
        for rank, node in enumerate(nodes):
            assert node.ready()
            node.step(*batch(10 * step + rank))
            assert not node.ready() and node.clock == step
            outbox += node.sends()
        assert all(s.route == Route.PUSH for s in outbox) and len(outbox) == 6
        for send in reversed(outbox):
            nodes[send.peer].receive(send.message)
        for rank, node in enumerate(nodes):
            assert node.ready() and node.clock == step + 1
            assert torch.allclose(node.w, expected[rank], atol=1e-6)
        for rank, model in enumerate(references):
            with torch.no_grad():
                offset = 0
                for p in model.parameters():
                    p.copy_(expected[rank][offset : offset + p.numel()].view_as(p))
                    offset += p.numel()


def test_synchronous_round_waits_for_every_neighbour_and_keeps_early_copies():
    node = make(0, (Neighbor(1, 1, 0, 0.25), Neighbor(2, 1, 0, 0.25)), 0.5, mode="sync")
    node.step(*batch(0))
    views = node.params.views
    node.receive(Message(Kind.PARAMS, 1, 0, views(torch.ones_like(node.w)), clock=0))
    node.receive(Message(Kind.PARAMS, 1, 0, views(torch.ones_like(node.w)), clock=1))  # early: next round
    assert not node.ready()
    node.receive(Message(Kind.PARAMS, 2, 0, views(torch.ones_like(node.w)), clock=0))
    assert node.ready() and node.clock == 1
    assert list(node.round_copies) == [1]


def test_synchronous_step_pushes_even_when_the_round_completes_at_once():
    """Neighbours' copies of step t may arrive before this node steps; x_t must still go out."""
    node = make(0, (Neighbor(1, 1, 0, 0.5),), 0.5, mode="sync")
    x_0 = node.w.clone()
    node.receive(Message(Kind.PARAMS, 1, 0, node.params.views(torch.ones_like(node.w)), clock=0))
    node.step(*batch(0))
    assert node.ready() and node.clock == 1
    (send,) = node.sends()
    assert send.route == Route.PUSH and send.message.clock == 0
    assert torch.equal(node.params.flatten(send.message.tensors), x_0)
    assert node.sends() == []


def test_synchronous_neighbours_race_at_most_one_round_ahead_within_rounds_ahead():
    """Nodes of a ring step whenever they may and copies arrive in random order: a copy is never more than one
    round ahead of its receiver (rounds_ahead allows two, for a neighbour that rejoined after a restart)."""
    world = 4
    nodes = []
    for rank in range(world):
        neighbors = tuple(Neighbor(peer, 1, 0, 1 / 3) for peer in ((rank - 1) % world, (rank + 1) % world))
        spec = AlgorithmSpec(name="dsgd", mode="sync")
        nodes.append(build_algorithm(linear_model(), NodeContext(rank, world, neighbors, spec, self_weight=1 / 3)))

    def deliver(copy: Message) -> None:
        receiver = nodes[copy.receiver]
        assert copy.clock <= receiver.clock + receiver.rounds_ahead()
        receiver.receive(copy)

    leads = race(nodes, batch, deliver)
    assert max(leads) == 1 and nodes[0].rounds_ahead() == 2
    assert make(0, (Neighbor(1, 1, 0, 0.5),), 0.5).rounds_ahead() is None  # asynchronous: keeps one copy each
