"""All or nothing: a round of the all-reduce is applied on every member of its quorum or on none. Members are threads
of this process running the real algorithms (allreduce SGD, DiLoCo) through the agent's Collective, on an
in-memory store and fake process groups (tests/fake_groups.py): no gloo, no sleeps.

A member whose all-reduce fails after the others had their answer drops its group, which fails the others' next
round; the next quorum's agreement brings it to the state of those that applied the round (at the job's last round,
the finished members hand it over): the round is applied everywhere, and every replica ends bit-identical (to a
run without the fault, except in a DiLoCo job's middle, where the member's inner steps since the sync are lost). A
DiLoCo sync applied is not taken for the same sync pending. A member restarted mid-job takes the group's state
before its first step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fake_groups import FailsAfterTheOthers, FakeGroups
from torch import nn

import nodeagent.agent.collective as collective_module
from nodeagent.agent.collective import Collective, QuorumOptions
from nodeagent.agent.process_group import GroupFactory
from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.base import Algorithm, NodeContext, Route
from nodeagent.algorithms.diloco import DiLoCo
from nodeagent.jobspec import AlgorithmSpec, RobustSpec
from nodeagent.metrics import Metrics
from nodeagent.runtime.progress import Traffic
from nodeagent.wire.message import Kind

pytestmark = pytest.mark.unit

WORLD = 3
STEPS = 6
INNER_STEPS = 2  # DiLoCo: syncs at steps 2, 4 and 6, the job's last
OPTIONS = {AllReduceSGD: {}, DiLoCo: {"inner_steps": INNER_STEPS, "outer_lr": 0.7}}
# The state every replica holds alike, and each node's own (DiLoCo's inner AdamW moments, of its own data).
REPLICATED = {AllReduceSGD: ("w", "_momentum_buffer"), DiLoCo: ("w", "global_w", "outer_momentum")}
OWN = {AllReduceSGD: (), DiLoCo: ("adam_m", "adam_v")}


def algorithm(cls: type[Algorithm], rank: int) -> Algorithm:
    torch.manual_seed(0)  # the same seeded model on every rank
    spec = AlgorithmSpec(name=cls.name, lr=0.05, momentum=0.9 if cls is AllReduceSGD else 0.0,
                         options=OPTIONS[cls])
    return cls(nn.Linear(4, 2), NodeContext(rank=rank, world_size=WORLD, neighbors=(), spec=spec))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)  # heterogeneous: each rank its own data
    return torch.randn(5, 4, generator=generator), torch.randint(0, 2, (5,), generator=generator)


def store() -> dist.Store:
    hashed = dist.HashStore()
    hashed.set_timeout(timedelta(seconds=30))
    return hashed


def collective(shared: dist.Store, rank: int, member: Algorithm, groups: GroupFactory,
               options: QuorumOptions | None = None) -> Collective:
    options = options or QuorumOptions(step_timeout_s=5.0, join_s=0.2, min_members=2, wait_s=30.0)
    return Collective(shared, rank, WORLD, Metrics(), "job", f"node{rank}", Traffic(), member=member,  # type: ignore[arg-type]
                      stop=threading.Event(), options=options, groups=groups)


def train(node: Algorithm, member: Collective, steps: int, on_step: Callable[[int], None] = lambda clock: None,
          ) -> list[int]:
    """What the runner does for a node of the collective family, with the all-reduce inline; the clocks at which
    it took steps."""
    stepped = []
    while True:
        sends = node.sends()
        while sends:
            for send in sends:
                collect = member.mean if send.route == Route.ALLREDUCE else member.gather
                node.receive(collect(send.message))
            sends = node.sends()
        if node.clock >= steps:
            return stepped
        on_step(node.clock)
        stepped.append(node.clock)
        node.step(*batch(node.context.rank, node.clock))


def run_job(cls: type[Algorithm], fault: Callable[[GroupFactory], FailsAfterTheOthers] | None = None,
            ) -> tuple[list[Algorithm], list[Collective], FailsAfterTheOthers | None]:
    """The job's WORLD ranks to the end, rank 1's groups wrapped by `fault`; every finished rank hands the final
    state over, as a runner does, until every rank finished."""
    shared, groups = store(), FakeGroups()
    faulty = fault(groups) if fault else None
    nodes = [algorithm(cls, rank) for rank in range(WORLD)]
    members = [collective(shared, rank, nodes[rank], faulty if rank == 1 and faulty else groups)
               for rank in range(WORLD)]
    run_ranks(lambda rank: train(nodes[rank], members[rank], STEPS), members)
    return nodes, members, faulty


def run_ranks(body: Callable[[int], object], members: list[Collective]) -> None:
    """`body(rank)` for every rank, each in a thread of its own; a rank that is done hands the final state over, as a
    runner does, until every rank is; a rank's error fails the test once all stopped."""
    finished = threading.Barrier(WORLD)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            body(rank)
            members[rank].hand_over()
            finished.wait(timeout=60)
        except BaseException as error:  # the test's answer
            errors.append(error)
            finished.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for member in members:
        member.close()
    assert not errors, errors


def assert_identical(nodes: list[Algorithm], reference: list[Algorithm], own: bool = True) -> None:
    """Every replica bit-identical to the run without faults (and, with `own`, each node's own state to its rank's
    in that run)."""
    cls = type(nodes[0])
    for node, same_rank in zip(nodes, reference, strict=True):
        for name in REPLICATED[cls]:
            assert torch.equal(getattr(node, name), getattr(reference[0], name)), (name, node.context.rank)
        for name in OWN[cls] if own else ():
            assert torch.equal(getattr(node, name), getattr(same_rank, name)), (name, node.context.rank)
    assert [node.clock for node in nodes] == [STEPS] * WORLD


def aborted(member: Collective) -> float:
    return member.aborted_steps._value.get()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def without_faults() -> dict[type[Algorithm], list[Algorithm]]:
    return {cls: run_job(cls)[0] for cls in (AllReduceSGD, DiLoCo)}


ROUNDS = {AllReduceSGD: STEPS, DiLoCo: STEPS // INNER_STEPS}  # all-reduces of the job


@pytest.mark.parametrize("cls", [AllReduceSGD, DiLoCo])
@pytest.mark.parametrize("at", ["middle", "last"])
def test_an_all_reduce_failing_on_a_member_after_the_others_answered_is_applied_everywhere(without_faults, cls, at,
                                                                                        monkeypatch):
    monkeypatch.setattr(collective_module, "WATCH_POLL_S", 0.01)  # finished members look for it often
    reference = without_faults[cls]
    assert_identical(reference, reference)
    rounds = ROUNDS[cls]
    nodes, members, faulty = run_job(cls, lambda groups: FailsAfterTheOthers(
        groups, rounds // 2 if at == "middle" else rounds))
    assert faulty is not None and faulty.failed
    # Rank 1 aborted the round; the others applied it and, in the middle, aborted their next one (rank 1 left the
    # group); the next quorum's agreement brought rank 1 to their state.
    assert [aborted(member) for member in members] == ([1.0] * WORLD if at == "middle" else [0.0, 1.0, 0.0])
    assert [member.last_number for member in members] == [1] * WORLD
    # In DiLoCo, rank 1 takes rank 0's state with its inner moments; in the middle that state is of rank 0's next
    # sync, pending: rank 1 sends rank 0's pseudo-gradient there (its own inner steps since were lost), so the
    # replicas are identical to each other, not to the run without the fault.
    assert_identical(nodes, nodes if cls is DiLoCo and at == "middle" else reference, own=cls is AllReduceSGD)


def test_a_member_restarted_mid_job_takes_the_groups_state_before_its_first_step(monkeypatch):
    monkeypatch.setattr(collective_module, "WATCH_POLL_S", 0.01)
    steps = 200
    shared, groups = store(), FakeGroups()
    # The first quorum waits a step's timeout for the rank that is not there, then goes on with two.
    options = QuorumOptions(step_timeout_s=0.5, join_s=0.1, min_members=2, wait_s=30.0)
    nodes = [algorithm(AllReduceSGD, rank) for rank in range(WORLD)]
    members = [collective(shared, rank, nodes[rank], groups, options) for rank in range(WORLD)]
    trained = threading.Event()  # ranks 0 and 1 took steps before rank 2 comes back
    stepped: dict[int, list[int]] = {}
    healed: list[int] = []

    def rank_body(rank: int) -> None:
        node = nodes[rank]
        if rank == 2:
            trained.wait(timeout=60)
            answer = members[2].mean(node.group_state())  # what the driver sends before a restarted node's step
            assert answer.kind == Kind.PARAMS
            node.receive(answer)
            healed.append(node.clock)
        stepped[rank] = train(node, members[rank], steps, on_step=lambda clock: trained.set() if clock == 5 else None)

    run_ranks(rank_body, members)
    (clock,) = healed
    assert 5 <= clock < steps  # the group's step, mid-job
    assert stepped[2][0] == clock  # its first step is the group's next: none trained from its old state
    for node in nodes[1:]:
        assert torch.equal(node.w, nodes[0].w)
        assert torch.equal(node._momentum_buffer, nodes[0]._momentum_buffer)


def test_a_robust_jobs_all_gather_names_the_member_of_each_row_so_each_member_judges_the_others():
    """A robust allreduce job all-gathers every member's gradient: the Collective names each row's job rank, so that
    each member counts every other member's rows under that member (the coordinator's suspicion scores them)."""
    shared, groups = store(), FakeGroups()
    spec = AlgorithmSpec(name="allreduce", lr=0.05, robust=RobustSpec(rule="median"))
    nodes = []
    for rank in range(WORLD):
        torch.manual_seed(0)
        nodes.append(AllReduceSGD(nn.Linear(4, 2), NodeContext(rank=rank, world_size=WORLD, neighbors=(), spec=spec)))
    members = [collective(shared, rank, nodes[rank], groups) for rank in range(WORLD)]
    run_ranks(lambda rank: train(nodes[rank], members[rank], STEPS), members)
    for node in nodes:
        others = {rank: STEPS for rank in range(WORLD) if rank != node.context.rank}
        assert dict(node.judged.seen) == others
    assert all(torch.equal(node.w, nodes[0].w) for node in nodes)
