"""AllReduce SGD as a state machine, with an in-test all-reduce: the nodes stay identical to centralised SGD."""

import pytest
import torch
from torch import nn

from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.base import ALLREDUCE_RANK, NodeContext, Route
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.wire import Kind, Message, WireError

pytestmark = pytest.mark.unit


def make(rank, world, model, lr=0.1, momentum=0.0, nesterov=False, l2=0.0, loss_fn=None, options=None):
    spec = AlgorithmSpec(name="allreduce", lr=lr, momentum=momentum, nesterov=nesterov, l2=l2, options=options or {})
    return AllReduceSGD(model, NodeContext(rank=rank, world_size=world, neighbors=(), spec=spec), loss_fn)


def allreduce(nodes, batches):
    """One step of every node, then what the runtime does: the elementwise mean of the gradients to every rank."""
    sends = []
    for node, (inputs, targets) in zip(nodes, batches, strict=True):
        assert node.ready()
        node.step(inputs, targets)
        assert not node.ready()
        (send,) = node.sends()
        assert send.route == Route.ALLREDUCE and send.peer == ALLREDUCE_RANK and send.kind == Kind.GRADIENT
        assert send.message.clock == node.clock
        sends.append(send)
    names = list(sends[0].message.tensors)
    mean = {name: torch.stack([s.message.tensors[name] for s in sends]).mean(0) for name in names}
    for node in nodes:
        clock = node.clock
        node.receive(Message(Kind.GRADIENT, ALLREDUCE_RANK, node.context.rank, mean, clock=clock))
        assert node.ready() and node.clock == clock + 1


def test_two_nodes_follow_centralised_sgd_with_momentum_on_known_numbers():
    """w x ~ y with squared error, w = 0, lr 0.1, momentum 0.9. Node 0 holds (x, y) = (1, 2), node 1 (3, 0).
    Step 1: gradients 2x(wx - y) = -4 and 0, mean -2, w = 0.2. Step 2: -3.6 and 3.6, mean 0; the momentum
    buffer is 0.9 * -2 + 0 = -1.8, so w = 0.2 + 0.18 = 0.38. Centralised SGD on both samples gives the same."""
    nodes = []
    for rank in range(2):
        model = nn.Linear(1, 1, bias=False, dtype=torch.float64)
        nn.init.zeros_(model.weight)
        nodes.append(make(rank, 2, model, momentum=0.9, loss_fn=nn.MSELoss()))
    batches = [
        (torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)),
        (torch.tensor([[3.0]], dtype=torch.float64), torch.tensor([[0.0]], dtype=torch.float64)),
    ]
    for expected in (0.2, 0.38):
        allreduce(nodes, batches)
        for node in nodes:
            assert float(node.w) == pytest.approx(expected, abs=1e-15)


def test_nodes_stay_bit_identical_and_equal_to_centralised_sgd_on_the_union_of_batches():
    world, steps = 4, 6
    torch.manual_seed(0)
    centralised = nn.Linear(5, 3)
    nodes = []
    for rank in range(world):
        model = nn.Linear(5, 3)
        model.load_state_dict(centralised.state_dict())  # the job's seeded initial model, on every node
        nodes.append(make(rank, world, model, lr=0.2, momentum=0.9, nesterov=True, l2=0.01))
    optimizer = torch.optim.SGD(centralised.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batches = [(torch.randn(16, 5, generator=generator), torch.randint(0, 3, (16,), generator=generator))
                   for _ in range(world)]
        allreduce(nodes, batches)
        optimizer.zero_grad()
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        nn.functional.cross_entropy(centralised(inputs), targets).backward()
        optimizer.step()
        for node in nodes[1:]:
            assert torch.equal(node.w, nodes[0].w)
        reference = torch.cat([centralised.weight.detach().reshape(-1), centralised.bias.detach()])
        assert torch.allclose(nodes[0].w, reference, rtol=0, atol=1e-6)
    assert nodes[0].clock == steps


def test_with_adamw_the_nodes_follow_centralised_adamw_on_the_union_of_batches():
    """The synchronous baseline of language models (DiLoCo's): one AdamW step with every step's mean gradient; a
    rank that forms the group again takes up the moments with the parameters."""
    world, steps = 3, 5
    torch.manual_seed(0)
    centralised = nn.Linear(5, 3)
    options = {"optimizer": "adamw", "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.1}
    nodes = []
    for rank in range(world):
        model = nn.Linear(5, 3)
        model.load_state_dict(centralised.state_dict())
        nodes.append(make(rank, world, model, lr=0.01, options=options))
    optimizer = torch.optim.AdamW(centralised.parameters(), lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batches = [(torch.randn(16, 5, generator=generator), torch.randint(0, 3, (16,), generator=generator))
                   for _ in range(world)]
        allreduce(nodes, batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(centralised(torch.cat([b[0] for b in batches])),
                                    torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
        reference = torch.cat([centralised.weight.detach().reshape(-1), centralised.bias.detach()])
        assert all(torch.equal(node.w, nodes[0].w) for node in nodes)
        assert torch.allclose(nodes[0].w, reference, rtol=0, atol=1e-6)
    fresh = make(0, world, nn.Linear(5, 3), lr=0.01, options=options)
    fresh.receive(nodes[1].group_state())
    assert torch.equal(fresh.w, nodes[1].w) and all(torch.equal(fresh.adam[k], nodes[1].adam[k]) for k in fresh.adam)


def test_adamw_with_momentum_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^algorithm\.momentum: AdamW keeps its own moments"):
        make(0, 2, nn.Linear(2, 2), momentum=0.9, options={"optimizer": "adamw"})


def test_a_mean_of_another_step_is_refused():
    node = make(0, 2, nn.Linear(2, 1))
    node.step(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))
    stale = Message(Kind.GRADIENT, ALLREDUCE_RANK, 0, node.params.views(torch.zeros_like(node.w)), clock=5)
    with pytest.raises(RuntimeError, match="step 5 arrived at step 0"):
        node.receive(stale)


def test_expected_accepts_only_the_allreduce_gradient():
    node = make(0, 2, nn.Linear(2, 1))
    assert [s.name for s in node.expected(ALLREDUCE_RANK, Kind.GRADIENT)] == ["weight", "bias"]
    with pytest.raises(WireError) as peer:
        node.expected(1, Kind.GRADIENT)
    assert peer.value.reason == "not_neighbor"
    with pytest.raises(WireError) as kind:
        node.expected(ALLREDUCE_RANK, Kind.PARAMS)
    assert kind.value.reason == "unexpected_kind"
