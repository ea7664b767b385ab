"""DiLoCo (nodeagent.algorithms.diloco): its mathematics with an in-test all-reduce and push-sum, the low-precision
codec, the streaming schedule, recovery from the group's state, validation, and short simulated jobs."""

from collections import defaultdict

import pytest
import torch
from exact_linear import ZeroLoss, batch, linear_model
from torch import nn

from coordinator.jobs import validate_job
from coordinator.simulate import simulate
from coordinator.topology import out_peers as schedule_out_peers
from coordinator.topology import schedule_period
from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.base import ALLREDUCE_RANK, FlatParameters, Neighbor, NodeContext, Route
from nodeagent.algorithms.diloco import FINAL_ROUNDS_FACTOR, DiLoCo, GossipDiLoCo, ServerDiLoCo
from nodeagent.jobspec import AlgorithmSpec, JobSpecError, parse_job_spec
from nodeagent.ps import OuterServer, ProtocolError
from nodeagent.ps.messages import ServerPush
from nodeagent.runtime.progress import ring_allgather_bytes, ring_allreduce_bytes
from nodeagent.wire import Kind, Message, WireError, lowprecision

pytestmark = pytest.mark.unit

SGD_INNER = {"inner_optimizer": "sgd"}


def make(rank, world, model, options, lr=0.1, loss_fn=None, cls=DiLoCo, schedule=(), neighbors=()):
    spec = AlgorithmSpec(name=cls.name, lr=lr, options=options)
    context = NodeContext(rank=rank, world_size=world, neighbors=tuple(Neighbor(p) for p in sorted(neighbors)),
                          spec=spec, peer_schedule=schedule)
    return cls(model, context, loss_fn)


def scalar_model():
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    return model


def collect(nodes, sends):
    """What the runtime does with every node's sync: the mean (all-reduce) or every rank's tensors (all-gather)."""
    (route,) = {send.route for send in sends}
    names = list(sends[0].message.tensors)
    stacked = {name: torch.stack([s.message.tensors[name] for s in sends]) for name in names}
    gather = route == Route.ALLGATHER
    tensors = stacked if gather else {name: t.mean(0) for name, t in stacked.items()}
    members = tuple(node.context.rank for node in nodes) if gather else ()
    for node, send in zip(nodes, sends, strict=True):
        node.receive(Message(Kind.DELTA, ALLREDUCE_RANK, node.context.rank, tensors, clock=send.message.clock,
                             members=members))


def run(nodes, batches, steps):
    """Every node steps; a sync any sends is completed as soon as every node sent it."""
    for step in range(steps):
        sends = []
        for node, batch_of in zip(nodes, batches, strict=True):
            assert node.ready()
            node.step(*batch_of(step))
            sends.extend(node.sends())
        if sends:
            assert len(sends) == len(nodes)
            collect(nodes, sends)


def float64_batches(world: int, steps: int, size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """data[step][rank]: a seeded minibatch of `size` 5-feature float64 inputs and 3-class targets."""
    generator = torch.Generator().manual_seed(1)
    return [[(torch.randn(size, 5, generator=generator, dtype=torch.float64),
              torch.randint(0, 3, (size,), generator=generator)) for _ in range(world)] for _ in range(steps)]


# -- the mathematics --------------------------------------------------------------------------------------------


def test_with_inner_sgd_one_step_and_outer_lr_one_diloco_is_allreduce_sgd():
    world, steps = 4, 6
    torch.manual_seed(0)
    reference = nn.Linear(5, 3, dtype=torch.float64)
    diloco, allreduce = [], []
    for rank in range(world):
        for group, build in ((diloco, lambda m, r=rank: make(r, world, m, {
                **SGD_INNER, "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0}, lr=0.2)),
                             (allreduce, lambda m, r=rank: AllReduceSGD(m, NodeContext(
                                 r, world, (), AlgorithmSpec(name="allreduce", lr=0.2))))):
            model = nn.Linear(5, 3, dtype=torch.float64)
            model.load_state_dict(reference.state_dict())
            group.append(build(model))
    data = float64_batches(world, steps, 16)
    run(diloco, [lambda step, r=r: data[step][r] for r in range(world)], steps)
    for step in range(steps):
        sends = []
        for node, (inputs, targets) in zip(allreduce, data[step], strict=True):
            node.step(inputs, targets)
            sends.extend(node.sends())
        names = sends[0].message.tensors
        mean = {name: torch.stack([s.message.tensors[name] for s in sends]).mean(0) for name in names}
        for node in allreduce:
            node.receive(Message(Kind.GRADIENT, ALLREDUCE_RANK, node.context.rank, mean, clock=step))
    for a, b in zip(diloco, allreduce, strict=True):
        assert a.clock == b.clock == steps
        assert torch.allclose(a.w, b.w, rtol=0, atol=1e-12)
        assert torch.equal(a.w, diloco[0].w)


def test_outer_nesterov_step_on_known_numbers():
    """w x ~ y, squared error, w = 0, inner SGD lr 0.1, H = 1. Node 0 holds (x, y) = (1, 2), node 1 (3, 0).
    Round 1: gradients -4 and 0, so w_0 = 0.4, w_1 = 0; Delta = (-0.4 + 0) / 2 = -0.2; u = -0.2;
    theta = 0 - 0.7 (-0.2 + 0.9 * -0.2) = 0.266. Round 2 from 0.266: gradients 2 (0.266 - 2) = -3.468 and
    2 * 3 (3 * 0.266) = 4.788, so Delta = (-0.3468 + 0.4788) / 2 = 0.066; u = 0.9 * -0.2 + 0.066 = -0.114;
    theta = 0.266 - 0.7 (0.066 + 0.9 * -0.114) = 0.29162. torch's Nesterov SGD on Delta agrees."""
    nodes = [make(r, 2, scalar_model(), {**SGD_INNER, "inner_steps": 1}, loss_fn=nn.MSELoss()) for r in range(2)]
    data = [(torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)),
            (torch.tensor([[3.0]], dtype=torch.float64), torch.tensor([[0.0]], dtype=torch.float64))]
    theta = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True)
    for expected, delta in ((0.266, -0.2), (0.29162, 0.066)):
        run(nodes, [lambda step, r=r: data[r] for r in range(2)], 1)
        theta.grad = torch.tensor([delta], dtype=torch.float64)
        outer.step()
        for node in nodes:
            assert float(node.w) == pytest.approx(expected, abs=1e-12)
            assert float(node.global_w) == pytest.approx(float(theta.detach()), abs=1e-12)


def test_error_feedback_delays_the_rounding_and_loses_none_of_it():
    """One node over the all-gather, int8 with one scale: what was sent, summed over the rounds, plus the last
    residual is the sum of the true pseudo-gradients."""
    torch.manual_seed(3)
    node = make(0, 1, nn.Linear(20, 4), {**SGD_INNER, "inner_steps": 3, "precision": "int8", "outer_momentum": 0.0},
                lr=0.5)
    generator = torch.Generator().manual_seed(2)
    true_sum = torch.zeros_like(node.w)
    sent_sum = torch.zeros_like(node.w)
    for step in range(30):
        node.step(torch.randn(8, 20, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        sends = node.sends()
        if sends:
            true_sum += node.global_w - node.w.detach()
            (send,) = sends
            assert send.route == Route.ALLGATHER and send.message.tensors["codes"].dtype == torch.int8
            sent_sum += node.decode(send.message.tensors)
            collect([node], sends)
        assert step % 3 != 2 or not node.residual.eq(0).all()
    assert torch.allclose(sent_sum + node.residual, true_sum, rtol=0, atol=1e-5)
    assert not torch.allclose(sent_sum, true_sum, rtol=0, atol=1e-5)  # there was rounding to keep


@pytest.mark.parametrize("chunk", [0, 7, 64])
def test_int8_round_trip_is_within_half_a_step_of_each_chunks_scale(chunk):
    generator = torch.Generator().manual_seed(chunk)
    vector = torch.randn(200, generator=generator) * torch.logspace(-3, 1, 200)
    tensors = lowprecision.encode(vector, "int8", chunk)
    assert tensors["codes"].dtype == torch.int8 and tensors["codes"].shape == (200,)
    assert tensors["scales"].shape == (lowprecision.chunk_count(200, chunk),)
    assert [s.shape for s in lowprecision.specs(200, "int8", chunk, torch.float32)] == [(200,), tensors["scales"].shape]
    decoded = lowprecision.decode(tensors, "int8", chunk, torch.float32)
    size = 200 if chunk == 0 else chunk
    step = tensors["scales"].repeat_interleave(size)[:200]
    assert bool(((decoded - vector).abs() <= step / 2 + 1e-7).all())
    assert float(decoded.abs().max()) == pytest.approx(float(vector.abs().max()), rel=1e-6)  # absmax is exact
    assert torch.equal(lowprecision.decode(lowprecision.encode(torch.zeros(5), "int8", 0), "int8", 0, torch.float32),
                       torch.zeros(5))


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_gathered_row_that_does_not_decode_or_is_not_finite_is_dropped_on_every_member_and_counted(precision):
    """Four members over the all-gather; member 2's row is forged (a negative int8 scale, an infinite bf16 value):
    every member takes the outer step with the mean of the other three rows, and counts one row refused, member 2's."""
    options = {**SGD_INNER, "inner_steps": 1, "precision": precision, "outer_momentum": 0.0, "outer_lr": 1.0}
    nodes = [make(rank, 4, nn.Linear(3, 2, bias=False), options) for rank in range(4)]
    for node in nodes[1:]:
        node.w.data.copy_(nodes[0].w)
        node.global_w.copy_(nodes[0].global_w)
    generator = torch.Generator().manual_seed(5)
    sends = []
    for node in nodes:
        node.step(torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator))
        sends.extend(node.sends())
    forged = sends[2].message.tensors
    if precision == "int8":
        forged["scales"][0] = -1.0
    else:
        forged["delta"][1] = float("inf")
    honest = torch.stack([nodes[0].decode(sends[rank].message.tensors) for rank in (0, 1, 3)]).mean(dim=0)
    expected = nodes[0].global_w - honest
    assert not torch.allclose(expected, nodes[0].global_w - honest * 3 / 4)  # the mean is over the three kept rows
    collect(nodes, sends)
    for node in nodes:
        assert torch.allclose(node.global_w, expected, rtol=0, atol=1e-6)
        assert node.mixing.refused[ALLREDUCE_RANK] == 1
        assert dict(node.judged.refused) == ({} if node.context.rank == 2 else {2: 1})


def test_float_precisions_travel_in_their_dtype_and_forged_values_are_refused():
    vector = torch.randn(10)
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("full", torch.float32)):
        tensors = lowprecision.encode(vector, precision)
        assert tensors["delta"].dtype == dtype and tensors["delta"].nbytes == 10 * dtype.itemsize
        assert torch.allclose(lowprecision.decode(tensors, precision, 0, torch.float32), vector, rtol=1e-2, atol=1e-2)
    forged = lowprecision.encode(vector, "int8", 0)
    forged["scales"][0] = float("nan")
    # Counted under the reason every other NaN or infinity on the wire is (peertrain_stream_rejections_total).
    with pytest.raises(WireError) as refused:
        lowprecision.decode(forged, "int8", 0, torch.float32)
    assert refused.value.reason == "non_finite"
    with pytest.raises(WireError) as refused:
        lowprecision.decode({"delta": torch.tensor([float("inf")], dtype=torch.float16)}, "fp16", 0, torch.float32)
    assert refused.value.reason == "non_finite"


# -- push-sum gossip ---------------------------------------------------------------------------------------------


def gossip_graph(world, options, kind="npeer-exponential"):
    period = schedule_period(kind, world)
    schedules = [tuple(tuple(schedule_out_peers(kind, world, r, t)) for t in range(period)) for r in range(world)]
    neighbors = defaultdict(set)
    for rank, schedule in enumerate(schedules):
        for peers in schedule:
            for peer in peers:
                neighbors[rank].add(peer)
                neighbors[peer].add(rank)
    return [make(r, world, linear_model(), {**SGD_INNER, "outer_lr": 1.0, "outer_momentum": 0.0, **options},
                 loss_fn=ZeroLoss(), cls=GossipDiLoCo, schedule=schedules[r], neighbors=neighbors[r])
            for r in range(world)]


def gossip_round(nodes, seed=0):
    """Every node steps once (its sync starts), then the pushes are delivered, in a shuffled order, until none
    is left."""
    generator = torch.Generator().manual_seed(seed)
    in_transit = []
    for node in nodes:
        assert node.ready()
        node.step(*batch(0))
        in_transit += [send.message for send in node.sends()]
    while in_transit:
        message = in_transit.pop(int(torch.randint(len(in_transit), (1,), generator=generator)))
        receiver = nodes[message.receiver]
        assert message.clock <= receiver.clock + receiver.rounds_ahead()
        receiver.receive(message)
        in_transit += [send.message for send in receiver.sends()]


def spread(nodes, seed=0):
    """Local progress without gradients: each node's parameters moved to a distinct point; their mean."""
    generator = torch.Generator().manual_seed(seed)
    points = 5.0 + torch.randn(len(nodes), nodes[0].w.numel(), generator=generator, dtype=torch.float64)
    for node, point in zip(nodes, points, strict=True):
        node.w.copy_(point)
    return points.mean(0)


def test_gossip_over_one_period_of_the_exponential_graph_reaches_the_exact_average():
    """8 nodes, one-peer exponential graph: log2 8 = 3 push-sum rounds per sync give every node the exact mean
    pseudo-gradient; with outer lr 1 and no momentum every node then holds the mean of the local models."""
    nodes = gossip_graph(8, {"inner_steps": 1})
    assert nodes[0].rounds == 3
    mean = spread(nodes)
    gossip_round(nodes)
    for node in nodes:
        assert node.ready() and node.pending is None
        assert torch.allclose(node.w, mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("precision", ["full", "int8"])
def test_gossip_with_one_round_keeps_the_mass_exact_but_not_each_nodes_estimate(precision):
    nodes = gossip_graph(8, {"inner_steps": 1, "gossip_rounds": 1, "precision": precision})
    mean = spread(nodes, seed=1)
    gossip_round(nodes, seed=1)
    network_mean = torch.stack([node.w for node in nodes]).mean(0)
    assert torch.allclose(network_mean, mean, rtol=0, atol=1e-10)  # the rounding stays with the sender
    assert not torch.allclose(nodes[0].w, mean, rtol=0, atol=1e-3)


def ring(world, options):
    """Gossip DiLoCo nodes on a static ring, each pulled by its own data towards its rank (a scalar model, squared
    loss): as heterogeneous as data can be."""
    return [make(r, world, scalar_model(), {**SGD_INNER, **options}, lr=0.1, loss_fn=nn.MSELoss(), cls=GossipDiLoCo,
                 neighbors={(r - 1) % world, (r + 1) % world}) for r in range(world)]


def test_gossip_diloco_keeps_its_replicas_together_on_a_ring_with_heterogeneous_data():
    """One push-sum round per sync on a ring of 8 averages only the neighbours' pseudo-gradients: gossiping the
    pseudo-gradients alone integrated each node's error into its global parameters, which drifted apart without
    bound. With the global parameters gossiped too, their spread stays bounded, and their mean goes to the optimum
    of the union of the data (the mean of the ranks)."""
    world = 8
    nodes = ring(world, {"inner_steps": 2, "gossip_rounds": 1})
    spreads = []
    for step in range(600):  # 300 syncs
        in_transit = []
        for node in nodes:
            assert node.ready()
            rank = node.context.rank
            node.step(torch.ones(1, 1, dtype=torch.float64), torch.full((1, 1), float(rank), dtype=torch.float64))
            in_transit += [send.message for send in node.sends()]
        while in_transit:
            message = in_transit.pop(0)
            nodes[message.receiver].receive(message)
            in_transit += [send.message for send in nodes[message.receiver].sends()]
        if step % 2:
            thetas = torch.stack([node.global_w for node in nodes])
            spreads.append(float((thetas - thetas.mean(0)).abs().max()))
    # The disagreement settles (pseudo-gradients alone: past 1e5 after 50 syncs, growing geometrically), well
    # within the spread of the data (targets 0 to 7; 3.8 with the outer momentum kept local, which the ring's
    # negative eigenvalue -1/3 drives).
    assert max(spreads[150:]) <= 1.01 * min(spreads[150:]) and max(spreads) < 3.0
    mean = torch.stack([node.global_w for node in nodes]).mean()
    assert abs(float(mean) - 3.5) < 1e-6  # on a circulant graph the mean follows DiLoCo on the mean exactly


@pytest.mark.parametrize(("world", "inner_steps", "rounds"), [(8, 10, 3), (12, 10, 4), (6, 2, 2), (1, 5, 1)])
def test_gossip_rounds_left_unset_on_a_static_graph_are_log2_n_at_most_the_steps_to_the_next_sync(world, inner_steps,
                                                                                                 rounds):
    nodes = ring(world, {"inner_steps": inner_steps})
    assert [node.rounds for node in nodes] == [rounds] * world


def test_gossip_shares_that_come_early_or_twice_are_counted_once():
    nodes = gossip_graph(4, {"inner_steps": 1})
    mean = spread(nodes, seed=2)
    for node in nodes[1:]:  # they start first; their shares reach node 0 before it started its sync
        node.step(*batch(0))
    early = [s.message for node in nodes[1:] for s in node.sends()]
    for message in early:
        if message.receiver == 0:
            nodes[0].receive(message)
            nodes[0].receive(message)  # a retried push delivered twice
    nodes[0].step(*batch(0))
    in_transit = [s.message for s in nodes[0].sends()] + [m for m in early if m.receiver != 0]
    while in_transit:
        message = in_transit.pop(0)
        nodes[message.receiver].receive(message)
        nodes[message.receiver].receive(message)
        in_transit += [s.message for s in nodes[message.receiver].sends()]
    for node in nodes:
        assert node.pending is None
        assert torch.allclose(node.w, mean, rtol=0, atol=1e-12)
    nodes[early[0].receiver].receive(early[0])  # once more, after its sync was absorbed
    for node in nodes:
        node.step(*batch(0))  # the next sync keeps no share of the last one
        assert all(clock >= node.clock for clock in node.early)


# -- streaming ---------------------------------------------------------------------------------------------------


def test_streaming_syncs_each_fragment_once_per_outer_round_overlapped_with_the_next_steps():
    """H = 12, F = 3, tau = 2: fragment f is sent at steps 4 (f + 1) - 2 of each 12 and applied 2 steps later,
    on its own slice only."""
    world = 2
    nodes = []
    for rank in range(world):
        torch.manual_seed(0)  # the job's seeded initial model, on every node
        nodes.append(make(rank, world, nn.Linear(10, 3), {"inner_steps": 12, "fragments": 3, "overlap_steps": 2},
                          lr=1e-2))
    generator = torch.Generator().manual_seed(0)
    sent = []
    for _ in range(24):
        batches = [(torch.randn(4, 10, generator=generator), torch.randint(0, 3, (4,), generator=generator))
                   for _ in nodes]
        outstanding = []
        for node, data in zip(nodes, batches, strict=True):
            assert node.ready()
            before = node.global_w.clone()
            node.step(*data)
            outstanding += node.sends()
            changed = (node.global_w != before).nonzero().reshape(-1)
            if node.clock % 4 == 0:  # a fragment's update was applied: only its slice moved
                part = node.fragment_slice(node.clock % 12 // 4 - 1 if node.clock % 12 else 2)
                assert changed.numel() > 0 and part.start <= int(changed.min()) and int(changed.max()) < part.stop
            else:
                assert changed.numel() == 0
        if outstanding:
            sent.append((outstanding[0].message.clock, nodes[0].pending.fragment))
            assert all(s.message.tensors["delta"].numel() == nodes[0].fragment_length for s in outstanding)
            collect(nodes, outstanding)
            assert nodes[0].ready()  # the mean came before the fragment's point: no wait
    assert sent == [(2, 0), (6, 1), (10, 2), (14, 0), (18, 1), (22, 2)]
    assert torch.equal(nodes[0].global_w, nodes[1].global_w)


def test_a_node_waits_at_the_fragments_point_for_its_mean():
    node = make(0, 1, nn.Linear(3, 2), {"inner_steps": 4, "fragments": 2, "overlap_steps": 1}, lr=1e-2)
    node.step(torch.randn(2, 3), torch.tensor([0, 1]))
    (send,) = node.sends()  # fragment 0, sent at step 1, applied at step 2
    assert node.ready()
    node.step(torch.randn(2, 3), torch.tensor([0, 1]))
    assert not node.ready() and "fragment 0" in node.waiting_for()
    collect([node], [send])
    assert node.ready() and node.pending is None


# -- recovery ----------------------------------------------------------------------------------------------------


def two_nodes(options, cls=DiLoCo, device="cpu"):
    """Two nodes of `cls` on a 4x2 linear model on `device`, from the same seeded initial model, and a minibatch for
    each."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    nodes = []
    for rank in range(2):
        model = nn.Linear(4, 2)
        model.load_state_dict(reference.state_dict())
        nodes.append(make(rank, 2, model.to(device), options, lr=1e-2, cls=cls))
    return nodes, [(torch.randn(3, 4, device=device), torch.tensor([0, 1, 0], device=device)) for _ in range(2)]


def test_a_rank_behind_takes_up_the_group_state_with_the_optimizer_states_and_resends_the_sync(device):
    options = {"inner_steps": 2, "precision": "int8"}
    nodes, data = two_nodes(options, device=device)
    run(nodes, [lambda step, r=r: data[r] for r in range(2)], 4)
    healthy, behind = nodes
    healthy.step(*data[0])
    healthy.step(*data[0])
    (interrupted,) = healthy.sends()  # the sync of step 6, whose group lost rank 1
    state = healthy.group_state()
    assert state.kind == Kind.PARAMS and state.clock == 6
    assert {"w", "global", "outer_momentum", "adam_m", "adam_v", "residual"} <= set(state.tensors)
    for node in nodes:
        node.receive(Message(Kind.PARAMS, ALLREDUCE_RANK, node.context.rank, state.tensors, clock=state.clock))
    resent = [node.sends() for node in nodes]
    for (send,) in resent:
        assert send.message.clock == 6
        for name in send.message.tensors:
            assert torch.equal(send.message.tensors[name], resent[0][0].message.tensors[name])
            assert torch.equal(send.message.tensors[name], interrupted.message.tensors[name])
    collect(nodes, [r[0] for r in resent])
    for name in ("w", "global_w", "outer_momentum", "adam_m", "adam_v", "residual"):
        assert torch.equal(getattr(healthy, name), getattr(behind, name)), name
    assert behind.clock == healthy.clock == 6


def test_a_rank_back_after_the_others_finished_takes_their_final_state_and_sends_nothing(device):
    options = {"inner_steps": 2, "precision": "int8"}
    nodes, data = two_nodes(options, device=device)
    run(nodes, [lambda step, r=r: data[r] for r in range(2)], 6)  # the job's 6 steps: its last sync applied
    finished, late = nodes[0], make(1, 2, nn.Linear(4, 2).to(device), options, lr=1e-2)
    late.step(*data[1])  # restarted from step 0, one step in
    final = finished.group_state()
    assert final.clock == 6 and float(final.tensors["synced"][0]) == 1.0
    late.receive(Message(Kind.PARAMS, ALLREDUCE_RANK, 1, final.tensors, clock=final.clock))
    assert late.sends() == [] and late.ready() and late.clock == 6
    for name in ("w", "global_w", "outer_momentum", "adam_m", "adam_v", "residual"):
        assert torch.equal(getattr(finished, name), getattr(late, name)), name


def test_checkpoint_keeps_the_outer_and_inner_state():
    node = make(0, 1, nn.Linear(3, 2), {"inner_steps": 2, "precision": "fp16"}, lr=1e-2)
    for _ in range(2):
        node.step(torch.randn(2, 3), torch.tensor([0, 1]))
    collect([node], node.sends())
    state = node.state_dict()
    other = make(0, 1, nn.Linear(3, 2), {"inner_steps": 2, "precision": "fp16"}, lr=1e-2)
    other.load_state_dict(state)
    for name in ("w", "global_w", "outer_momentum", "adam_m", "adam_v", "residual"):
        assert torch.equal(getattr(node, name), getattr(other, name)), name
    assert other.clock == 2


# -- through the parameter server ----------------------------------------------------------------------------------


def server_of(nodes, options, model):
    """The coordinator's half of a `diloco-ps` job of these nodes, from the seeded model they all start from."""
    spec = parse_job_spec({"name": "d", "nodes": len(nodes), "steps": 100,
                           "algorithm": {"name": "diloco-ps", "options": options}})
    return ServerDiLoCo.server_half(spec, FlatParameters(model), ServerDiLoCo.options_of(spec.algorithm))


def serve(half, nodes, pushes, now=0.0):
    """What the coordinator does with a round's pushes: apply each once, and answer every released worker with the
    model."""
    released = set()
    for node, send in zip(nodes, pushes, strict=True):
        push = send.message
        assert isinstance(push, ServerPush) and send.route == Route.SERVER
        result = half.push(node.context.rank, push, f"{node.context.rank}-{push.clock}", now)
        released.update(result.release)
    for node in nodes:
        if node.context.rank in released:
            node.receive(half.pull(node.context.rank, node.version, False, now))
    return released


def test_diloco_through_the_server_is_diloco_over_the_all_reduce():
    """The same seeded model and minibatches: the server's outer step on the mean of the pushed pseudo-gradients
    is the all-reduce route's, round after round (float64: to rounding)."""
    world, steps, options = 3, 12, {"inner_steps": 4}
    torch.manual_seed(5)
    reference = nn.Linear(5, 3, dtype=torch.float64)
    over_allreduce, through_server = [], []
    for rank in range(world):
        for group, cls in ((over_allreduce, DiLoCo), (through_server, ServerDiLoCo)):
            model = nn.Linear(5, 3, dtype=torch.float64)
            model.load_state_dict(reference.state_dict())
            group.append(make(rank, world, model, options, lr=0.05, cls=cls))
    model = nn.Linear(5, 3, dtype=torch.float64)
    model.load_state_dict(reference.state_dict())
    half = server_of(through_server, options, model)
    data = float64_batches(world, steps, 8)
    run(over_allreduce, [lambda step, r=r: data[step][r] for r in range(world)], steps)
    for step in range(steps):
        pushes = []
        for node, batch_of in zip(through_server, data[step], strict=True):
            assert node.ready()
            node.step(*batch_of)
            pushes.extend(node.sends())
        if pushes:
            assert len(pushes) == world and not any(node.ready() for node in through_server)
            assert serve(half, through_server, pushes) == set(range(world))
    assert half.version == steps // options["inner_steps"]
    for a, b in zip(over_allreduce, through_server, strict=True):
        assert a.clock == b.clock == steps and b.ready()
        assert torch.allclose(a.w, b.w, rtol=0, atol=1e-12)
        assert torch.allclose(a.outer_momentum, half.rule.velocity, rtol=0, atol=1e-12)
        assert torch.equal(b.w, half.w) and torch.equal(b.global_w, half.w)


def test_a_worker_restarted_from_an_old_checkpoint_takes_up_the_current_round():
    """Its push of a round the server has passed is refused and answered with the current global parameters: it
    restarts from them at rounds * H, and the rounding its refused push took is not kept."""
    options = {"inner_steps": 2, "precision": "int8"}
    nodes, (data, _) = two_nodes(options, ServerDiLoCo)
    model = nn.Linear(4, 2)
    model.load_state_dict(nodes[0].model.state_dict())  # the seeded model: nothing trained yet
    half = server_of(nodes, options, model)
    checkpoint = nodes[1].state_dict()  # at step 0, version 0
    for _ in range(2):  # two rounds
        pushes = []
        for _ in range(2):
            for node in nodes:
                node.step(*data)
                pushes.extend(node.sends())
        serve(half, nodes, pushes)
    assert half.version == 2 and [node.clock for node in nodes] == [4, 4]
    restarted = make(1, 2, nn.Linear(4, 2), options, lr=1e-2, cls=ServerDiLoCo)
    restarted.load_state_dict(checkpoint)
    residual = restarted.residual.clone()
    for _ in range(2):
        restarted.step(*data)
    (push,) = restarted.sends()
    result = half.push(1, push.message, "restarted", 0.0)
    assert not result.applied and "round is 2" in result.rejected and result.release == (1,)
    restarted.receive(half.pull(1, restarted.version, False, 0.0))
    assert restarted.clock == 4 and restarted.version == 2 and restarted.ready()
    assert torch.equal(restarted.w, half.w) and torch.equal(restarted.global_w, half.w)
    assert torch.equal(restarted.residual, residual)


def test_the_server_refuses_a_forged_push_and_keeps_its_state_across_a_restart():
    options = {"inner_steps": 2, "precision": "int8"}
    nodes = [make(rank, 2, nn.Linear(4, 2), options, cls=ServerDiLoCo) for rank in range(2)]
    half = server_of(nodes, options, nn.Linear(4, 2))
    specs = half.push_specs(Kind.DELTA, [])
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("codes", torch.int8, (10,)),
                                                           ("scales", torch.float32, (1,))]
    with pytest.raises(WireError):
        half.push_specs(Kind.GRADIENT, [])
    forged = lowprecision.encode(torch.ones(10), "int8")
    forged["scales"][0] = float("inf")
    with pytest.raises(ProtocolError):
        half.push(0, ServerPush(Kind.DELTA, forged, 0, clock=2), "forged", 0.0)
    assert half.version == 0 and not half.holds_update(0)
    for rank in range(2):
        half.push(rank, ServerPush(Kind.DELTA, lowprecision.encode(torch.full((10,), 0.1), "int8"), 0, clock=2),
                  f"p{rank}", 0.0)
    assert half.version == 1 and torch.count_nonzero(half.rule.velocity) == 10
    restarted = server_of(nodes, options, nn.Linear(4, 2))
    restarted.load_state_dict(half.state_dict())
    assert torch.equal(restarted.w, half.w) and torch.equal(restarted.rule.velocity, half.rule.velocity)
    bad = half.state_dict()
    bad["rule"] = {**bad["rule"], "velocity": torch.zeros(3)}
    with pytest.raises(ValueError, match="velocity"):
        restarted.load_state_dict(bad)
    assert torch.equal(restarted.rule.velocity, half.rule.velocity)


def test_outer_server_on_known_numbers():
    """The numbers of test_outer_nesterov_step_on_known_numbers, as pseudo-gradients pushed to the server."""
    server = OuterServer(torch.zeros(1, dtype=torch.float64), 2, 0.7, 0.9, True)
    for expected, deltas in ((0.266, (-0.4, 0.0)), (0.29162, (-0.3468, 0.4788))):
        version = server.version
        for worker, delta in enumerate(deltas):
            server.push(worker, torch.tensor([delta], dtype=torch.float64), version)
        assert float(server.w) == pytest.approx(expected, abs=1e-12)


# -- validation --------------------------------------------------------------------------------------------------


def job(algorithm, options, steps=100, topology="ring", **extra):
    return parse_job_spec({"name": "d", "nodes": 4, "steps": steps, "algorithm": {"name": algorithm,
                           "options": options, **extra}, "topology": {"kind": topology}})


@pytest.mark.parametrize(("algorithm", "options", "steps", "topology", "extra", "field"), [
    ("diloco", {"inner_steps": 30}, 100, "ring", {}, r"steps: 100 is not a multiple"),
    ("diloco", {"inner_steps": 4, "fragments": 5}, 100, "ring", {}, r"options\.fragments"),
    ("diloco", {"inner_steps": 10, "fragments": 2, "overlap_steps": 5}, 100, "ring", {}, r"options\.overlap_steps"),
    ("diloco", {"inner_steps": 10, "int8_chunk": 64}, 100, "ring", {}, r"options\.int8_chunk"),
    ("diloco", {"inner_steps": 10, "overlap_mix": 0.3}, 100, "ring", {}, r"options\.overlap_mix: applies only"),
    ("diloco", {"inner_steps": 10, "precision": "int4"}, 100, "ring", {}, r"options\.precision"),
    ("diloco", {"inner_steps": 10, "outer_lr": 0}, 100, "ring", {}, r"options\.outer_lr"),
    ("diloco", {"inner_steps": 10, "outer_momentum": 1.0}, 100, "ring", {}, r"options\.outer_momentum"),
    ("diloco", {"inner_step": 10}, 100, "ring", {}, r"options\.inner_step"),
    ("diloco", {"inner_steps": 10}, 100, "ring", {"momentum": 0.9}, r"algorithm\.momentum: AdamW"),
    ("diloco", {"inner_steps": 10}, 100, "ring", {"mode": "async"}, r"algorithm\.mode"),
    ("diloco-gossip", {"inner_steps": 10}, 100, "bipartite-exponential", {}, r"passive"),
    ("diloco-ps", {"inner_steps": 10, "fragments": 2}, 100, "ring", {}, r"algorithm\.options: diloco-ps's rounds"),
    ("diloco-ps", {"inner_steps": 10, "max_update_norm": 0}, 100, "ring", {}, r"options\.max_update_norm"),
    ("diloco-gossip", {"inner_steps": 10, "fragments": 5, "gossip_rounds": 3}, 100, "ring", {},
     r"options\.gossip_rounds"),
])
def test_check_refuses_what_the_algorithm_cannot_run(algorithm, options, steps, topology, extra, field):
    with pytest.raises(JobSpecError, match=field):
        validate_job(job(algorithm, options, steps, topology, **extra))


def test_check_accepts_inner_sgd_with_momentum_and_streaming_with_int8():
    validate_job(job("diloco", {"inner_steps": 10, "inner_optimizer": "sgd"}, momentum=0.9))
    validate_job(job("diloco", {"inner_steps": 20, "fragments": 4, "overlap_steps": 2, "precision": "int8",
                                "int8_chunk": 1024}))
    validate_job(job("diloco-gossip", {"inner_steps": 10}, topology="npeer-exponential"))
    validate_job(job("diloco-ps", {"inner_steps": 10, "precision": "bf16", "max_update_norm": 5.0}))


def test_gossip_accepts_pushsum_of_its_precision_from_neighbours_only():
    (node, *_) = gossip_graph(4, {"inner_steps": 1, "precision": "int8", "int8_chunk": 4})
    specs = node.expected(1, Kind.PUSHSUM)
    # The pseudo-gradient in the job's precision, the global parameters in their own dtype.
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("codes", torch.int8, (8,)), ("scales", torch.float32, (2,)),
                                                           ("theta", node.w.dtype, (8,))]
    with pytest.raises(WireError):
        node.expected(1, Kind.PARAMS)


# -- simulated jobs ----------------------------------------------------------------------------------------------


def simulated(fashion_mnist_dir, algorithm, options, topology="ring", nodes=4, steps=40):
    spec = parse_job_spec({
        "name": f"sim-{algorithm}", "nodes": nodes, "steps": steps, "eval_every": steps, "seed": 0,
        "algorithm": {"name": algorithm, "lr": 1e-3, "mode": "sync", "options": options},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "test_limit": 500},
        "topology": {"kind": topology}, "simulation": {"step_time_s": 0.01},
    })
    return simulate(spec)


MODEL_BYTES = (784 * 10 + 10) * 4


@pytest.mark.parametrize(("options", "per_sync"), [
    ({"inner_steps": 10}, ring_allreduce_bytes(MODEL_BYTES, 4)),
    ({"inner_steps": 10, "precision": "int8"}, ring_allgather_bytes(MODEL_BYTES // 4 + 4, 4)),
    ({"inner_steps": 10, "precision": "bf16", "fragments": 2, "overlap_steps": 2}, ring_allgather_bytes(
        MODEL_BYTES // 4, 4)),
])
def test_simulated_diloco_over_the_collective_trains_counts_its_bytes_and_ends_identical(fashion_mnist_dir, options,
                                                                                        per_sync):
    result = simulated(fashion_mnist_dir, "diloco", options)
    syncs = 40 // 10 * options.get("fragments", 1)
    for progress in result.progress:
        assert progress.step == 40 and progress.test_accuracy > 0.6
        assert progress.bytes_sent == syncs * per_sync
    final = [sim.node.algorithm.global_w for sim in result.mesh.nodes]
    assert all(torch.equal(final[0], w) for w in final[1:])
    # The job ends on its global parameters, streamed and overlapped too: every node's model is theta.
    assert all(torch.equal(sim.node.algorithm.w, final[0]) for sim in result.mesh.nodes)


def test_a_streamed_gossip_job_ends_on_each_nodes_global_parameters(fashion_mnist_dir):
    result = simulated(fashion_mnist_dir, "diloco-gossip", {"inner_steps": 10, "fragments": 2, "overlap_steps": 2},
                       topology="npeer-exponential", nodes=4)
    for sim in result.mesh.nodes:
        assert sim.node.algorithm.clock == 40 and torch.equal(sim.node.algorithm.w, sim.node.algorithm.global_w)


def test_simulated_gossip_diloco_trains_without_a_collective(fashion_mnist_dir):
    result = simulated(fashion_mnist_dir, "diloco-gossip", {"inner_steps": 10, "precision": "int8"},
                       topology="npeer-exponential", nodes=4)
    one_push = MODEL_BYTES // 4 + 4 + MODEL_BYTES  # the int8 pseudo-gradient, and the global parameters in float32
    for progress in result.progress:
        assert progress.step == 40 and progress.test_accuracy > 0.6
        # 4 syncs, 2 rounds of one push each (log2 4), the last FINAL_ROUNDS_FACTOR times as many
        assert progress.bytes_sent == (3 * 2 + FINAL_ROUNDS_FACTOR * 2) * one_push
        assert "allreduce" not in {edge.peer for edge in progress.edges}
    final = [sim.node.algorithm.w for sim in result.mesh.nodes]
    assert all(torch.allclose(final[0], w, rtol=0, atol=1e-3) for w in final[1:])


def test_simulated_diloco_through_the_server_counts_int8_pushes_and_full_pulls(fashion_mnist_dir):
    result = simulated(fashion_mnist_dir, "diloco-ps", {"inner_steps": 10, "precision": "int8"})
    for progress in result.progress:
        assert progress.step == 40 and progress.test_accuracy > 0.6
        assert progress.bytes_sent == 4 * (MODEL_BYTES // 4 + 4)  # 4 rounds: int8 codes and one scale
        assert progress.bytes_received == 4 * MODEL_BYTES  # the new global parameters, in float32
    final = [sim.node.algorithm.w for sim in result.mesh.nodes]
    assert all(torch.equal(final[0], w) for w in final[1:])


def test_the_last_gossip_sync_takes_more_rounds_and_the_replicas_end_nearer_agreement(fashion_mnist_dir):
    """A ring of 6, where push-sum is not exact: 3 rounds a sync (ceil(log2 6)). Its last sync, which no sync
    follows, takes FINAL_ROUNDS_FACTOR times as many unless told otherwise, and the replicas' final models are
    nearer each other; the syncs before it are the same (the same pushes, the same bytes)."""
    def spread(result) -> float:
        final = torch.stack([sim.node.algorithm.w.detach() for sim in result.mesh.nodes])
        return float((final - final.mean(dim=0)).norm(dim=1).max())

    options = {"inner_steps": 10, "outer_lr": 1.0}
    default = simulated(fashion_mnist_dir, "diloco-gossip", options, topology="ring", nodes=6)
    one_round = simulated(fashion_mnist_dir, "diloco-gossip", {**options, "final_gossip_rounds": 3}, topology="ring",
                          nodes=6)
    push = MODEL_BYTES * 2  # the outer momentum and the global parameters, float32, to each of 2 neighbours
    assert [p.bytes_sent for p in one_round.progress] == [4 * 3 * 2 * push] * 6
    assert [p.bytes_sent for p in default.progress] == [(3 + FINAL_ROUNDS_FACTOR) * 3 * 2 * push] * 6
    assert spread(default) < spread(one_round) / 5
    with pytest.raises(JobSpecError, match="final_gossip_rounds: applies only with fragments 1"):
        validate_job(parse_job_spec({"name": "d", "nodes": 6, "steps": 40, "topology": {"kind": "ring"},
                                     "algorithm": {"name": "diloco-gossip", "options": {
                                         "inner_steps": 10, "fragments": 2, "final_gossip_rounds": 9}}}))


@pytest.mark.parametrize(("nodes", "inner_steps"), [(8, 1), (8, 2), (16, 2)])
def test_gossip_rounds_left_unset_are_held_to_the_bound_of_a_sync_that_the_nodes_could_not_finish(nodes, inner_steps):
    """The earlier hang: one period of the n-peer exponential graph (log2 n rounds) longer than a sync's steps."""
    spec = {"name": "d", "nodes": nodes, "steps": 10 * inner_steps, "topology": {"kind": "npeer-exponential"},
            "algorithm": {"name": "diloco-gossip", "options": {"inner_steps": inner_steps}}}
    with pytest.raises(JobSpecError, match=r"options\.gossip_rounds \(unset: one period of npeer-exponential's "
                       r"schedule, \d rounds\): at most inner_steps / fragments"):
        validate_job(parse_job_spec(spec))
    spec["algorithm"]["options"]["gossip_rounds"] = inner_steps  # what the user can run instead
    validate_job(parse_job_spec(spec))
