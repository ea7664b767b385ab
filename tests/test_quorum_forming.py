"""Forming an all-reduce quorum when things go wrong between a quorum's closing and its gloo group: ranks as threads
of this process, on an in-process store (the coordinator's rendezvous).

A rank that came to a quorum and was lost before the group formed (its key is there, it never joins gloo) costs
the others one failed group, not the job: they form the next quorum without it, even when the wait for a quorum is
shorter than the join time plus a step's timeout. A rank that keeps doing so fails the job after MAX_FAILED_GROUPS
groups, naming why. A rank whose store call fails just after the quorum was closed with it still joins that
quorum's group, rather than skipping to the next quorum while the others wait for it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from nodeagent.agent.collective import MAX_FAILED_GROUPS, Collective, GroupLost, QuorumOptions
from nodeagent.metrics import Metrics
from nodeagent.runtime.progress import Traffic
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit

STEP_TIMEOUT_S = 1.5
JOIN_S = 0.5


class Member:
    def __init__(self, rank: int):
        self.rank = rank

    def group_state(self) -> Message:
        return Message(Kind.PARAMS, self.rank, -1, {"w": torch.zeros(2)}, clock=0)

    def round_applied(self) -> bool:
        return False


def collective(store: dist.Store, rank: int, world: int, told: list[str], wait_s: float) -> Collective:
    options = QuorumOptions(step_timeout_s=STEP_TIMEOUT_S, join_s=JOIN_S, min_members=2, wait_s=wait_s)
    return Collective(store, rank, world, Metrics(), "job", f"node{rank}", Traffic(),
                      member=Member(rank), stop=threading.Event(), options=options,
                      announce=lambda message, level, step: told.append(f"{level} {message}"), gloo_host="127.0.0.1")


def mean_in_threads(collectives: list[Collective]) -> list[Message | BaseException]:
    """Each rank's answer to the step-0 all-reduce of its rank's value (or what it raised)."""
    answers: list[Message | BaseException] = [RuntimeError("no answer")] * len(collectives)

    def run(index: int) -> None:
        rank = collectives[index].rank
        gradient = Message(Kind.GRADIENT, rank, -1, {"g": torch.full((2,), float(rank))})
        try:
            answers[index] = collectives[index].mean(gradient)
        except BaseException as error:  # what it raised is the test's answer
            answers[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(collectives))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for member in collectives:
        member.close()
    return answers


@pytest.fixture
def store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    return store


def ghost(store: dist.Store, rank: int, quorums: range) -> None:
    """Rank `rank` came to these quorums, and was lost before their groups formed."""
    for number in quorums:
        store.set(f"q/{number}/here/{rank}", "1")


def test_a_rank_lost_between_a_quorum_and_its_group_costs_one_group_not_the_job(store):
    ghost(store, 2, range(1))  # in quorum 0, closed at once with all three
    told: list[str] = []
    # The wait for a quorum (2 s) is shorter than a failed group (1.5 s) plus the next quorum's join time: it starts
    # again once enough ranks came.
    ranks = [collective(store, rank, 3, told, wait_s=2.0) for rank in (0, 1)]
    answers = mean_in_threads(ranks)
    for answer in answers:
        assert isinstance(answer, Message), answer
        assert answer.tensors["g"].tolist() == [0.5, 0.5]  # the mean over the two that formed quorum 1
    assert [member.last_number for member in ranks] == [1, 1]
    assert sum("the group of all-reduce quorum 0 [0, 1, 2] was not formed" in line for line in told) == 2, told


def test_a_rank_that_keeps_being_lost_before_the_group_fails_the_job_naming_why(store):
    ghost(store, 2, range(MAX_FAILED_GROUPS + 1))
    told: list[str] = []
    ranks = [collective(store, rank, 3, told, wait_s=30.0) for rank in (0, 1)]
    answers = mean_in_threads(ranks)
    for answer in answers:
        assert isinstance(answer, GroupLost), answer
        assert f"did not form their groups {MAX_FAILED_GROUPS} times in a row" in str(answer)


def test_a_rank_whose_store_fails_after_the_quorum_closed_still_joins_its_group(store):
    told: list[str] = []
    ranks = [collective(store, rank, 2, told, wait_s=30.0) for rank in (0, 1)]
    failed = []

    def failing_once(look):  # the first look at the store that finds the quorum closed with rank 1 fails instead
        def looking(*args):
            closed = look(*args)
            if closed is not None and not failed:
                failed.append(args[0])
                raise RuntimeError("the rendezvous store went away")
            return closed
        return looking

    ranks[1].forming._members = failing_once(ranks[1].forming._members)
    ranks[1].forming._maybe_close = failing_once(ranks[1].forming._maybe_close)
    answers = mean_in_threads(ranks)
    assert failed == [0]
    for answer in answers:
        assert isinstance(answer, Message), answer
        assert answer.tensors["g"].tolist() == [0.5, 0.5]
    assert [member.last_number for member in ranks] == [0, 0]  # both in the quorum closed with them, none failed
    assert not any("was not formed" in line for line in told), told


def test_a_gloo_connection_on_a_members_place_that_is_not_the_member_drops_the_group(store):
    """Gloo's pair connections carry no credentials: a new quorum's agreement checks each member's token against
    the one it wrote to the rendezvous store. A token that differs, as from a process that took rank 1's place on a
    pair, drops the group on every member before any state travels, and the ranks form the next quorum."""
    told: list[str] = []
    ranks = [collective(store, rank, 2, told, wait_s=30.0) for rank in (0, 1)]
    form_group = ranks[0].groups

    def group_with_a_stranger(number, members, index):
        formed = form_group(number, members, index)
        if number == 0:
            store.set("q/0/here/1", "7")  # not the token rank 1 sends
        return formed

    ranks[0].groups = group_with_a_stranger
    answers = mean_in_threads(ranks)
    for answer in answers:
        assert isinstance(answer, Message), answer
        assert answer.tensors["g"].tolist() == [0.5, 0.5]
    assert [member.last_number for member in ranks] == [1, 1]
    assert sum("the gloo connection of rank 1 in quorum 0 is not from rank 1" in line for line in told) == 2, told


class SlowPresence(dist.Store):
    """An in-process store where rank 2's saying it is there (its `here` key) is slow to come back, as a call to the
    coordinator's rendezvous can be: another rank may close the quorum in the meantime."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.inner.set_timeout(timedelta(seconds=30))

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)
        if key.endswith("q/0/here/2"):
            time.sleep(0.3)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def test_a_member_slow_to_say_it_is_there_is_not_taken_for_a_rank_waiting_to_come_in():
    store = SlowPresence()
    told: list[str] = []
    collectives = [collective(store, rank, 3, told, wait_s=30.0) for rank in range(3)]
    members = []
    answers = []
    for member in collectives:  # the watcher's question, asked of each member once the step is done
        original = member._all_reduce

        def recording(quorum, message, waiting, member=member, original=original):
            answer = original(quorum, message, waiting)
            members.append(quorum.members)
            answers.append(member.forming.knocked_since(member._knocks))
            return answer

        member._all_reduce = recording
    results = mean_in_threads(collectives)
    assert all(isinstance(result, Message) for result in results), results
    assert members == [(0, 1, 2)] * 3
    # Every member knocked before it was found present: none of them counts as a rank that came since (each such
    # mistake costs the job a regroup after the step).
    assert answers == [False, False, False]
