"""Pairwise gossip (Dpwa) as a state machine, driven without any network."""

import itertools
import math

import pytest
import torch
from torch import nn

from nodeagent.algorithms import Neighbor, NodeContext, Route, Send
from nodeagent.algorithms.gossip import (
    BONUS_MAX,
    BONUS_MIN,
    FAILURE_PENALTY,
    RECOVERY_PER_DRAW,
    SCORE_MAX,
    SCORE_MIN,
    SCORE_START,
    GossipOptions,
    PairwiseGossip,
    PeerScores,
    peer_weight,
)
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit


class FlatLoss(nn.Module):
    """A loss of fixed value and zero gradient: local steps leave w unchanged. The schema requires lr > 0, so
    this is how a test runs with lr = 0 while the loss rules still see a loss."""

    def __init__(self, value: float = 1.0):
        super().__init__()
        self.value = value

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return outputs.sum() * 0.0 + self.value


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def make(rank=0, neighbors=(1, 2), lr=0.1, seed=0, loss_fn=None, mode="async", **options) -> PairwiseGossip:
    spec = AlgorithmSpec(name="gossip", lr=lr, mode=mode, options=options)
    context = NodeContext(
        rank=rank, world_size=4, neighbors=tuple(Neighbor(peer) for peer in neighbors), spec=spec, seed=seed
    )
    return PairwiseGossip(linear_model(), context, loss_fn)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=generator), torch.randint(0, 2, (8,), generator=generator)


def reply(node: PairwiseGossip, sender: int, vector: torch.Tensor, clock: int = 0, loss: float = 1.0) -> Message:
    return Message(Kind.PARAMS, sender, node.context.rank, node.params.views(vector), clock=clock, loss=loss)


def pulled(node: PairwiseGossip) -> list[int]:
    sends = node.sends()
    assert all(s.route == Route.PULL and s.kind == Kind.PARAMS and s.message is None for s in sends)
    return [s.peer for s in sends]


# -- options ---------------------------------------------------------------------------------------------------


def test_options_have_the_documented_defaults():
    assert GossipOptions.model_validate({}) == GossipOptions(
        interpolation="constant", factor=0.5, divergence_threshold=0.0, fetch_probability=1.0)
    node = make()
    assert node.name == "gossip" and node.options == GossipOptions()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"timeout_ms": 2500}, "timeout_ms"),
        ({"interpolation": "average"}, "interpolation"),
        ({"factor": 1.5}, "factor"),
        ({"factor": True}, "factor"),
        ({"factor": "0.5"}, "factor"),
        ({"divergence_threshold": -0.1}, "divergence_threshold"),
        ({"divergence_threshold": math.inf}, "divergence_threshold"),
        ({"fetch_probability": math.nan}, "fetch_probability"),
        ({"fetch_probability": 1.01}, "fetch_probability"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=rf"algorithm\.options\.{field}"):
        make(**options)


def test_there_is_no_synchronous_mode():
    with pytest.raises(ValueError, match=r"algorithm\.mode"):
        make(mode="sync")


# -- the interpolation factor ------------------------------------------------------------------------------------


def test_constant_factor_ignores_clocks_and_losses():
    options = GossipOptions(factor=0.3)
    assert peer_weight(options, clock=5, peer_clock=1, loss=2.0, peer_loss=0.1) == pytest.approx(0.3)


def test_clock_factor_is_the_peers_share_of_the_clocks():
    options = GossipOptions(interpolation="clock")
    assert peer_weight(options, clock=3, peer_clock=1, loss=1.0, peer_loss=1.0) == pytest.approx(0.25)
    assert peer_weight(options, clock=0, peer_clock=5, loss=1.0, peer_loss=1.0) == 1.0  # a fresh node copies
    assert peer_weight(options, clock=5, peer_clock=0, loss=1.0, peer_loss=1.0) == 0.0
    assert peer_weight(options, clock=0, peer_clock=0, loss=1.0, peer_loss=1.0) == 0.5  # 0 / 0


def test_loss_factor_gives_the_higher_loss_more_of_the_peer():
    options = GossipOptions(interpolation="loss")
    assert peer_weight(options, clock=1, peer_clock=1, loss=3.0, peer_loss=1.0) == pytest.approx(0.75)
    assert peer_weight(options, clock=1, peer_clock=1, loss=0.0, peer_loss=2.0) == 0.0  # a perfect node keeps w
    assert peer_weight(options, clock=1, peer_clock=1, loss=0.0, peer_loss=0.0) == 0.5  # 0 / 0
    assert peer_weight(options, clock=1, peer_clock=1, loss=0.4, peer_loss=math.nan) == 0.5  # untrained peer


@pytest.mark.parametrize("interpolation", ["constant", "clock", "loss"])
def test_divergence_threshold_scales_the_factor_below_the_threshold(interpolation):
    plain = GossipOptions(interpolation=interpolation, factor=0.4)
    damped = GossipOptions(interpolation=interpolation, factor=0.4, divergence_threshold=0.2)
    args = {"clock": 3, "peer_clock": 5, "peer_loss": 0.3}
    base = peer_weight(plain, loss=0.05, **args)
    assert base > 0
    assert peer_weight(damped, loss=0.05, **args) == pytest.approx(base * 0.05 / 0.2)
    assert peer_weight(damped, loss=0.0, **args) == 0.0
    above = peer_weight(plain, loss=0.25, **args)
    assert peer_weight(damped, loss=0.25, **args) == pytest.approx(above)


# -- mixing --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "local_loss", "peer_clock", "peer_loss", "factor"),
    [
        ({"interpolation": "constant", "factor": 0.25}, 1.0, 9, 0.5, 0.25),
        ({"interpolation": "clock"}, 1.0, 6, 0.5, 6 / (2 + 6)),  # the local clock is 2 when it mixes
        ({"interpolation": "loss"}, 0.75, 9, 0.25, 0.75 / (0.75 + 0.25)),
        ({"interpolation": "constant", "factor": 0.5, "divergence_threshold": 1.5}, 0.75, 9, 0.25, 0.5 * 0.75 / 1.5),
    ],
)
def test_mix_on_known_vectors_and_the_clock_that_follows(options, local_loss, peer_clock, peer_loss, factor):
    node = make(loss_fn=FlatLoss(local_loss), **options)
    with torch.no_grad():
        node.w.copy_(torch.arange(8, dtype=torch.float32))
    node.step(*batch(0))
    (peer,) = pulled(node)
    peer_w = torch.full_like(node.w, 4.0)
    node.receive(reply(node, peer, peer_w, clock=peer_clock, loss=peer_loss))
    assert torch.equal(node.w, torch.arange(8, dtype=torch.float32))  # its batch is not trained yet
    node.step(*batch(1))
    expected = (1 - factor) * torch.arange(8, dtype=torch.float32) + factor * peer_w
    assert torch.allclose(node.w, expected, atol=1e-6)
    assert node.gossip_clock == pytest.approx(factor * peer_clock + (1 - factor) * 2)
    assert node.clock == 2  # the step counter is not mixed
    published = node.snapshot()
    assert published.clock == round(node.gossip_clock) and published.loss == local_loss
    assert torch.equal(node.params.flatten(published.served[(None, Kind.PARAMS)]), node.w)


def test_the_next_step_waits_for_the_fetch_and_the_reply_mixes_at_once():
    node = make(loss_fn=FlatLoss())
    node.step(*batch(0))
    (peer,) = pulled(node)
    assert node.ready()  # the fetch travels while the next batch is trained
    node.step(*batch(1))
    assert not node.ready()
    before = node.w.clone()
    node.receive(reply(node, peer, before + 2.0, clock=2))
    assert node.ready()
    assert torch.allclose(node.w, before + 1.0)
    # The mix completes the step: what peers are served from now on is the mixed model.
    assert torch.equal(node.params.flatten(node.snapshot().served[(None, Kind.PARAMS)]), node.w)


def test_when_the_reply_arrives_does_not_change_the_parameters():
    early, late = make(), make()
    for node in (early, late):
        node.step(*batch(0))
    (peer,) = pulled(early)
    assert pulled(late) == [peer]
    message = reply(early, peer, torch.linspace(-1, 1, 8), clock=3, loss=0.9)
    early.receive(message)  # before its batch: kept until the batch is trained
    early.step(*batch(1))
    late.step(*batch(1))
    assert not late.ready()
    late.receive(message)
    assert torch.equal(early.w, late.w) and early.gossip_clock == late.gossip_clock
    assert early.ready() and late.ready()


def test_only_the_fetching_node_changes():
    fetcher, peer = make(rank=0, neighbors=(1,), loss_fn=FlatLoss()), make(rank=1, neighbors=(0,))
    with torch.no_grad():
        peer.w.add_(5.0)
    peer.step(*batch(7))
    served = peer.snapshot()
    served_w = peer.params.flatten(served.served[(None, Kind.PARAMS)]).clone()
    peer_w = peer.w.clone()
    fetcher_w = fetcher.w.clone()
    fetcher.step(*batch(0))
    assert pulled(fetcher) == [1]
    message = served.message_for(0, Kind.PARAMS)
    fetcher.receive(message)
    fetcher.step(*batch(1))
    assert torch.allclose(fetcher.w, (fetcher_w + served_w) / 2, atol=1e-6)
    with torch.no_grad():
        fetcher.w.add_(100.0)  # no aliasing of the peer's tensors either
    assert peer.snapshot() is served and torch.equal(peer.w, peer_w) and peer.clock == 1
    assert torch.equal(peer.params.flatten(served.served[(None, Kind.PARAMS)]), served_w)
    assert torch.equal(peer.params.flatten(message.tensors), served_w)


def test_served_snapshot_is_a_copy_with_clock_and_loss():
    node = make()
    first = node.snapshot()
    assert first.clock == 0 and math.isnan(first.loss) and first.rank == 0
    kept = node.params.flatten(first.served[(None, Kind.PARAMS)]).clone()
    loss = node.step(*batch(0))
    assert torch.equal(node.params.flatten(first.served[(None, Kind.PARAMS)]), kept)
    second = node.snapshot()
    assert second.clock == 1 and second.loss == loss
    message = second.message_for(2, Kind.PARAMS)
    assert message.sender == 0 and message.receiver == 2 and message.clock == 1 and message.loss == loss


# -- flow control ----------------------------------------------------------------------------------------------


def test_score_rule_on_a_scripted_sequence():
    scores = PeerScores([1, 2])
    assert scores.scores == {1: SCORE_START, 2: SCORE_START} == {1: 1000, 2: 1000}
    scores.succeeded(2)
    assert scores.scores[2] == SCORE_MAX  # clamped at the top
    for expected in (900, 800, 700, 600, 500, 400, 300, 200, 100, 10, 10):
        scores.failed(1)
        assert scores.scores[1] == expected  # clamped at the bottom
    assert scores.pick([500, 500]) == 2  # 510 < 1500
    assert scores.scores == {1: 10 + RECOVERY_PER_DRAW, 2: SCORE_MAX}  # passed over: one point back
    assert scores.pick([BONUS_MAX, BONUS_MIN]) == 1  # 1011 > 1010: within reach of the top again
    assert scores.scores == {1: 11, 2: SCORE_MAX}  # clamped at the top
    assert scores.pick([BONUS_MAX - 2, BONUS_MIN]) == 2  # 1009 < 1010
    # With equal bonuses the floored peer climbs back one point per draw until it ties, then wins the tie.
    for _ in range(SCORE_MAX - 12):
        assert scores.pick([BONUS_MIN, BONUS_MIN]) == 2
    assert scores.scores == {1: SCORE_MAX, 2: SCORE_MAX}
    assert scores.pick([BONUS_MIN, BONUS_MIN]) == 1
    scores.failed(2)
    scores.succeeded(1)
    assert scores.scores == {1: SCORE_MAX, 2: SCORE_MAX - FAILURE_PENALTY}
    assert scores.pick([BONUS_MIN, BONUS_MAX], exclude=2) == 1
    assert PeerScores([7]).pick([BONUS_MIN], exclude=7) == 7  # the only peer is never excluded


def test_ties_go_to_the_earlier_peer():
    assert PeerScores([4, 2]).pick([10, 10]) == 4
    assert PeerScores([2, 4]).pick([10, 10]) == 2


def test_failure_unblocks_costs_the_peer_and_the_next_fetch_goes_elsewhere():
    node = make(loss_fn=FlatLoss())
    node.step(*batch(0))
    (first,) = pulled(node)
    node.step(*batch(1))
    planned = pulled(node)  # planned while the first was outstanding
    assert not node.ready()
    node.failed(Send(Route.PULL, first, Kind.PARAMS), "deadline_exceeded")
    assert node.ready() and node.scores.scores[first] == SCORE_START - 100
    for peer in planned:
        node.receive(reply(node, peer, node.w.clone()))
    node.step(*batch(2))
    (retry,) = pulled(node)
    assert retry != first
    # A local skip of the runtime says nothing about the peer: no score lost.
    node.failed(Send(Route.PULL, retry, Kind.PARAMS), "in_flight")
    assert node.scores.scores[retry] == SCORE_START and node.ready()


def test_a_failed_fetch_is_always_retried_with_the_other_peer():
    """fetch_probability 0.3, and every fetch is refused: after the first, every step retries, alternately."""
    node = make(loss_fn=FlatLoss(), fetch_probability=0.3)
    peers = []
    for step in range(40):
        node.step(*batch(step))
        sends = node.sends()
        for send in sends:
            node.failed(send, "unavailable")
        peers.append([s.peer for s in sends])
    start = next(i for i, p in enumerate(peers) if p)
    chosen = [p for (p,) in peers[start:]]
    assert all(a != b for a, b in itertools.pairwise(chosen))
    # Each failure drops the peer to the floor; the one passed over on the last draw got a point back.
    assert sorted(node.scores.scores.values()) == [SCORE_MIN, SCORE_MIN + RECOVERY_PER_DRAW]


def test_a_failed_peer_is_never_dropped():
    """Peer 1 is down for 600 steps while peer 2 answers, then peer 1 comes back and peer 2 goes down: peer 1 is
    picked again, its score recovers, and it carries the node alone."""
    node = make(loss_fn=FlatLoss())
    picks = {"down": [], "back": []}
    for step in range(1200):
        phase = "down" if step < 600 else "back"
        dead = 1 if phase == "down" else 2
        node.step(*batch(0))
        for send in node.sends():
            picks[phase].append(send.peer)
            if send.peer == dead:
                node.failed(send, "deadline_exceeded")
            else:
                node.receive(reply(node, send.peer, node.w.clone()))
        assert min(node.scores.scores.values()) >= SCORE_MIN
    assert 0 < picks["down"].count(1) < picks["down"].count(2)
    assert node.scores.scores[1] == SCORE_MAX
    assert node.scores.scores[2] < SCORE_MAX // 2  # probed now and then, and pushed down again each time
    assert picks["back"][-100:].count(1) > 90


@pytest.mark.parametrize(("probability", "low", "high"), [(0.0, 0, 0), (1.0, 100, 100), (0.3, 15, 45)])
def test_fetch_probability(probability, low, high):
    node = make(loss_fn=FlatLoss(), fetch_probability=probability)
    fetches = 0
    for step in range(100):
        assert node.ready()
        node.step(*batch(step))
        for peer in pulled(node):
            fetches += 1
            node.receive(reply(node, peer, node.w.clone()))
    assert low <= fetches <= high


def peer_sequence(seed: int, rank: int = 0) -> list[int]:
    node = make(rank=rank, neighbors=(5, 6, 7), seed=seed, loss_fn=FlatLoss())
    sequence = []
    for step in range(40):
        node.step(*batch(step))
        for peer in pulled(node):
            sequence.append(peer)
            node.receive(reply(node, peer, node.w.clone()))
    return sequence


def test_peer_choice_replays_for_a_seed_and_rank():
    first = peer_sequence(seed=3)
    assert first == peer_sequence(seed=3)
    assert set(first) == {5, 6, 7}
    assert first != peer_sequence(seed=4)
    assert first != peer_sequence(seed=3, rank=1)


def test_expected_rejects_strangers_and_other_kinds():
    node = make()
    assert [s.name for s in node.expected(1, Kind.PARAMS)] == ["weight", "bias"]
    with pytest.raises(WireError) as stranger:
        node.expected(3, Kind.PARAMS)
    assert stranger.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        node.expected(1, Kind.DUAL)
    assert kind.value.reason == "unexpected_kind"


def test_a_reply_nobody_waits_for_is_dropped():
    node = make()
    before = node.w.clone()
    node.receive(reply(node, 1, torch.ones_like(node.w)))
    node.failed(Send(Route.PULL, 2, Kind.PARAMS), "unavailable")
    assert torch.equal(node.w, before) and node.scores.scores == {1: SCORE_START, 2: SCORE_START}


# -- a driven scenario -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpolation", ["constant", "clock", "loss"])
def test_ring_of_four_reaches_consensus_with_no_gradient(interpolation):
    """A deterministic driver in the runtimes' order: every node steps, then the pulls issued one round earlier
    are served from the peers' latest snapshots (their batch is trained by then, so each reply mixes at once).
    With zero gradients only the mixing moves the models: they agree, inside the hull of the starting points."""
    ring = {rank: ((rank - 1) % 4, (rank + 1) % 4) for rank in range(4)}
    nodes = [
        make(rank=r, neighbors=ring[r], seed=11, loss_fn=FlatLoss(1.0 + r), interpolation=interpolation)
        for r in range(4)
    ]
    generator = torch.Generator().manual_seed(5)
    for node in nodes:
        with torch.no_grad():
            node.w.copy_(torch.randn(8, generator=generator) * 3)
    starts = torch.stack([node.w.clone() for node in nodes])
    outstanding: list[tuple[PairwiseGossip, int]] = []
    for round_ in range(80):
        for node in nodes:
            assert node.ready()
            node.step(*batch(round_))
        issued = [(node, peer) for node in nodes for peer in pulled(node)]
        for node, peer in outstanding:
            assert not node.ready()
            node.receive(nodes[peer].snapshot().message_for(node.context.rank, Kind.PARAMS))
        outstanding = issued
    final = torch.stack([node.w for node in nodes])
    assert (final - final[0]).abs().max() < 1e-5
    assert torch.all(final >= starts.min(0).values - 1e-6) and torch.all(final <= starts.max(0).values + 1e-6)
    assert not torch.allclose(starts, final)


def test_checkpoint_keeps_the_gossip_clock():
    node = make(loss_fn=FlatLoss())
    for step in range(3):
        node.step(*batch(step))
    node.gossip_clock = 7.25
    restored = make(loss_fn=FlatLoss())
    restored.load_state_dict(node.state_dict())
    assert restored.gossip_clock == 7.25 and restored.clock == 3 and torch.equal(restored.w, node.w)
    assert restored.snapshot().clock == 7  # the served clock is the gossip clock, rounded
