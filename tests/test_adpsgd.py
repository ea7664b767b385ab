"""AD-PSGD as a state machine, driven without any network: who initiates, with whom, and what both ends hold."""

from collections import defaultdict

import pytest
import torch
from exact_linear import ZeroLoss, batch, linear_model

from coordinator.topology import in_peers, is_passive, offsets, out_peers
from nodeagent.algorithms.adpsgd import ADPSGD
from nodeagent.algorithms.base import Neighbor, NodeContext, Route
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit

KIND = "bipartite-exponential"


def make(rank, world, schedule, neighbors, loss_fn=None):
    spec = AlgorithmSpec(name="ad-psgd", lr=0.1)
    context = NodeContext(
        rank=rank, world_size=world, neighbors=tuple(Neighbor(p) for p in sorted(neighbors)), spec=spec,
        peer_schedule=schedule,
    )
    return ADPSGD(linear_model(), context, loss_fn)


def bipartite_nodes(nodes, loss_fn=None):
    """The coordinator's plan for the bipartite exponential graph: out-peers per iteration, neighbours both ways."""
    period = len(offsets(KIND, nodes))
    made = []
    for rank in range(nodes):
        schedule = tuple(tuple(out_peers(KIND, nodes, rank, t)) for t in range(period))
        neighbors = {p for t in range(period) for p in out_peers(KIND, nodes, rank, t) + in_peers(KIND, nodes, rank, t)}
        made.append(make(rank, nodes, schedule, neighbors, loss_fn))
    return made


def flat(message: Message) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in message.tensors.values()])


def exchange(initiator, peer, send):
    """What the runtime does with an exchange: the peer receives the request and answers with its snapshot."""
    reply = peer.snapshot().message_for(initiator.context.rank, send.kind)
    peer.receive(send.message)
    return reply


def test_passive_nodes_never_initiate_and_never_wait():
    for node in (bipartite_nodes(8)[2], make(0, 4, (), {1, 2, 3})):  # even 2 is no reason to initiate either
        for step in range(12):
            assert node.ready()
            node.step(*batch(step))
            assert node.sends() == []


def test_active_nodes_rotate_over_the_schedule_one_exchange_at_a_time():
    nodes = bipartite_nodes(8)
    active = nodes[3]
    peers = []
    for step in range(8):
        assert active.ready()
        active.step(*batch(step))
        (send,) = active.sends()
        assert send.route == Route.EXCHANGE and send.kind == Kind.PARAMS and send.message.clock == step + 1
        peers.append(send.peer)
        active.receive(exchange(active, nodes[send.peer], send))
    assert peers == [out_peers(KIND, 8, 3, n)[0] for n in range(8)] == [4, 2, 6, 0, 4, 2, 6, 0]


def test_static_neighbours_rotate_over_passive_peers_only():
    node = make(1, 4, (), {0, 2, 3})
    peers = []
    for step in range(4):
        node.step(*batch(step))
        (send,) = node.sends()
        peers.append(send.peer)
        node.failed(send, "unavailable")  # a failed exchange is dropped; the next step moves on
    assert peers == [0, 2, 0, 2]


def test_an_exchange_in_flight_blocks_no_step_and_no_second_exchange_starts():
    node = make(1, 4, (), {0, 2})
    node.step(*batch(0))
    (send,) = node.sends()
    for step in range(1, 4):
        assert node.ready()
        node.step(*batch(step))
        assert node.sends() == []
    node.failed(send, "deadline_exceeded")
    node.step(*batch(4))
    assert [s.peer for s in node.sends()] == [2]


def test_both_ends_hold_the_average_of_the_exchanged_models():
    active = make(1, 2, (), {0})
    passive = make(0, 2, (), {1})
    passive.step(*batch(1))  # the two models now differ
    active.step(*batch(0))
    w_active, w_passive = active.w.clone(), passive.w.clone()
    (send,) = active.sends()
    assert torch.equal(flat(send.message), w_active)
    reply = exchange(active, passive, send)
    assert torch.equal(flat(reply), w_passive)
    active.receive(reply)
    average = (w_active + w_passive) / 2
    assert torch.equal(active.w, average) and torch.equal(passive.w, average)
    # The passive node serves its averaged model from now on.
    assert torch.equal(flat(passive.snapshot().message_for(1, Kind.PARAMS)), average)


def test_steps_taken_while_an_exchange_is_in_flight_are_applied_to_the_averaged_model():
    active = make(1, 2, (), {0})
    passive = make(0, 2, (), {1})
    with torch.no_grad():
        passive.w.add_(1.0)
    passive.step(*batch(9))
    active.step(*batch(0))
    (send,) = active.sends()
    sent = flat(send.message).clone()
    reply = exchange(active, passive, send)
    active.step(*batch(1))
    active.step(*batch(2))
    progress = active.w - sent
    assert progress.abs().max() > 1e-3
    active.receive(reply)
    assert torch.allclose(active.w, (sent + flat(reply)) / 2 + progress, rtol=0, atol=1e-15)


@pytest.mark.parametrize("reply_delay", [0, 1, 3])
def test_gossip_alone_reaches_consensus_at_the_average_on_the_bipartite_graph(reply_delay):
    """Zero gradients: AD-PSGD is then pairwise averaging, which keeps the sum, so the nodes agree on the average.
    Replies reach the initiators `reply_delay` steps late; the initiators keep stepping meanwhile."""
    nodes = bipartite_nodes(8, ZeroLoss())
    generator = torch.Generator().manual_seed(0)
    initial = 5.0 + torch.randn(8, nodes[0].w.numel(), generator=generator, dtype=torch.float64)
    for node, vector in zip(nodes, initial, strict=True):
        node.w.copy_(vector)
        node._published = node._publish()
    initiated = defaultdict(list)
    replies = []
    for step in range(300):
        for node in nodes:
            assert node.ready()
            node.step(*batch(step))
            for send in node.sends():
                initiated[node.context.rank].append(send.peer)
                replies.append((step, node, exchange(node, nodes[send.peer], send)))
        due = [item for item in replies if item[0] <= step - reply_delay]
        replies = [item for item in replies if item[0] > step - reply_delay]
        for _, node, reply in due:
            node.receive(reply)
    for _, node, reply in replies:
        node.receive(reply)
    # Only odd ranks initiate, always towards even ones: no exchange can wait on another.
    assert sorted(initiated) == [1, 3, 5, 7]
    assert all(is_passive(KIND, peer) for peers in initiated.values() for peer in peers)
    assert all(len(peers) == 300 // (reply_delay + 1) for peers in initiated.values())
    for node in nodes:
        assert torch.allclose(node.w, initial.mean(0), rtol=0, atol=1e-10)


def test_expected_accepts_params_from_neighbours_only():
    node = make(1, 4, (), {0, 2})
    assert [s.name for s in node.expected(2, Kind.PARAMS)] == ["weight", "bias"]
    with pytest.raises(WireError) as stranger:
        node.expected(3, Kind.PARAMS)
    assert stranger.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        node.expected(0, Kind.PUSHSUM)
    assert kind.value.reason == "unexpected_kind"
