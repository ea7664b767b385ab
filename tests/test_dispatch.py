"""The agent's dispatch with fake transports: every route goes to its transport and nowhere else, and every outcome
comes back to the runner as a Reply or a Failure that says why."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest
import torch

from nodeagent.agent.agreement import MemberState
from nodeagent.agent.dispatch import Dispatch
from nodeagent.agent.quorum import GroupLost
from nodeagent.algorithms.base import ALLREDUCE_RANK, Route, Send, SendFailed
from nodeagent.ps.link import Answered, ServerLink
from nodeagent.ps.messages import SERVER_RANK, ReadyAnswer, ServerPull, ServerPush, StepReport
from nodeagent.runtime.driver import Failure, Reply, Transmission
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit

TENSORS = {"w": torch.ones(2)}


class FakePeers:
    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls: list[tuple] = []

    def _answer(self, call: tuple) -> Message:
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        return Message(Kind.PARAMS, call[1], 0, TENSORS)

    def exchange(self, message: Message) -> Message:
        return self._answer(("exchange", message.receiver))

    def pull(self, peer: int, kind: Kind) -> Message:
        return self._answer(("pull", peer))

    def push(self, message: Message) -> None:
        self._answer(("push", message.receiver))

    def begin_push(self, message: Message, done) -> bool:
        return False

    def poll(self) -> None:
        pass


class AheadPeers(FakePeers):
    """Takes every push ahead of its answer; `answer(failure)` answers the oldest one, as `poll` would."""

    def __init__(self) -> None:
        super().__init__()
        self.owed: list = []

    def begin_push(self, message: Message, done) -> bool:
        self.calls.append(("begin_push", message.receiver))
        self.owed.append(done)
        return True

    def answer(self, failure: SendFailed | None) -> None:
        self.owed.pop(0)(failure)


class FakeLink(ServerLink):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def push(self, push: ServerPush, call_id: str, answered: Answered) -> None:
        self.calls.append(("push", call_id))
        answered(SendFailed("unavailable", "the coordinator restarts", transient=True))

    def pull(self, pull: ServerPull, answered: Answered) -> None:
        self.calls.append(("pull", pull))

    def report(self, report: StepReport, step_s: float, answered: Answered) -> None:
        self.calls.append(("report", step_s))
        answered(ReadyAnswer(ready=True, steps_before_asking=1, version=report.version))


class FakeAllReduce:
    def mean(self, message: Message, state: MemberState | None = None) -> Message:
        return Message(message.kind, ALLREDUCE_RANK, message.receiver, {"w": message.tensors["w"] / 2},
                       clock=message.clock)


def dispatch(peers: FakePeers, link: ServerLink | None = None) -> tuple[Dispatch, list]:
    posted: list = []
    pool = futures.ThreadPoolExecutor(max_workers=1)
    return Dispatch(posted.append, pool, peers, link, FakeAllReduce()), posted


def perform(d: Dispatch, t: Transmission) -> None:
    d.perform(t)
    d.pool.shutdown(wait=True)


@pytest.mark.parametrize("route", [Route.EXCHANGE, Route.PULL, Route.PUSH])
def test_peer_routes_go_to_the_peer_transport_and_their_answers_come_back(route):
    peers = FakePeers()
    d, posted = dispatch(peers)
    send = Send(route, 3, Kind.PARAMS, None if route == Route.PULL else Message(Kind.PARAMS, 0, 3, TENSORS))
    t = Transmission(send)
    perform(d, t)
    assert peers.calls == [(route.value, 3)]
    (reply,) = posted
    assert isinstance(reply, Reply) and reply.transmission is t
    assert (reply.answer is None) == (route == Route.PUSH)


def test_a_delivered_push_is_settled_without_waking_the_runner_and_a_failed_one_wakes_it():
    posted: list = []
    settled: list = []
    d = Dispatch(posted.append, futures.ThreadPoolExecutor(max_workers=1), FakePeers(), settle=settled.append)
    t = Transmission(Send(Route.PUSH, 3, Kind.PARAMS, Message(Kind.PARAMS, 0, 3, TENSORS)))
    perform(d, t)
    assert settled == [Reply(t, None)] and posted == []
    failing = Dispatch(posted.append, futures.ThreadPoolExecutor(max_workers=1),
                       FakePeers(SendFailed("unavailable", "gone", transient=True)), settle=settled.append)
    perform(failing, t)
    assert posted == [Failure(t, "unavailable", True)] and len(settled) == 1


def test_a_push_written_ahead_takes_no_pool_thread_and_its_answer_settles_or_wakes_the_runner_later():
    posted: list = []
    settled: list = []
    peers = AheadPeers()
    pool = futures.ThreadPoolExecutor(max_workers=1)
    d = Dispatch(posted.append, pool, peers, settle=settled.append)
    first, second = (Transmission(Send(Route.PUSH, 3, Kind.PARAMS, Message(Kind.PARAMS, 0, 3, TENSORS)))
                     for _ in range(2))
    d.perform(first)
    d.perform(second)
    pool.shutdown(wait=True)
    assert peers.calls == [("begin_push", 3), ("begin_push", 3)] and posted == [] and settled == []
    peers.answer(None)
    peers.answer(SendFailed("unavailable", "the lane closed", transient=True))
    assert settled == [Reply(first, None)] and posted == [Failure(second, "unavailable", True)]


@pytest.mark.parametrize(
    ("error", "reason", "transient"),
    [(SendFailed("unavailable", "gone", transient=True), "unavailable", True),
     (SendFailed("rejected", "a bad answer"), "rejected", False),
     (RuntimeError("a defect"), "error", False)],
)
def test_a_failed_peer_call_comes_back_as_a_failure_saying_why(error, reason, transient):
    d, posted = dispatch(FakePeers(error))
    t = Transmission(Send(Route.EXCHANGE, 1, Kind.DUAL, Message(Kind.DUAL, 0, 1, TENSORS)))
    perform(d, t)
    assert posted == [Failure(t, reason, transient)]


def test_server_sends_go_to_the_link_with_their_call_id_and_step_duration():
    peers, link = FakePeers(), FakeLink()
    d, posted = dispatch(peers, link)
    report = Transmission(Send(Route.SERVER, SERVER_RANK, Kind.DELTA, StepReport(4, 2)), step_s=0.3, call_id="c1")
    push = Transmission(Send(Route.SERVER, SERVER_RANK, Kind.GRADIENT, ServerPush(Kind.GRADIENT, TENSORS, 4)),
                        step_s=0.2, call_id="c2")
    d.perform(report)
    d.perform(push)
    assert link.calls == [("report", 0.3), ("push", "c2")] and peers.calls == []
    assert posted == [Reply(report, ReadyAnswer(True, 1, 4)), Failure(push, "unavailable", transient=True)]


def test_an_allreduce_is_answered_in_the_calling_thread():
    d, posted = dispatch(FakePeers())
    t = Transmission(Send(Route.ALLREDUCE, ALLREDUCE_RANK, Kind.GRADIENT, Message(Kind.GRADIENT, 1, 1, TENSORS,
                                                                                  clock=7)))
    d.perform(t)  # no pool involved: the reply is there at once
    (reply,) = posted
    assert reply.answer.sender == ALLREDUCE_RANK and reply.answer.clock == 7
    assert torch.equal(reply.answer.tensors["w"], torch.full((2,), 0.5))


def test_a_server_send_without_a_link_is_a_defect_said_at_once():
    d, _ = dispatch(FakePeers())
    with pytest.raises(RuntimeError, match="has none"):
        d.perform(Transmission(Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, ServerPull())))


class BlockingAllReduce:
    """An all-reduce that answers once released, recording the state it was given and the thread it ran in."""

    def __init__(self, error: BaseException | None = None):
        self.release = threading.Event()
        self.error = error
        self.calls: list[tuple[MemberState | None, str]] = []

    def mean(self, message: Message, state: MemberState | None = None) -> Message:
        self.calls.append((state, threading.current_thread().name))
        assert self.release.wait(timeout=30)
        if self.error is not None:
            raise self.error
        return Message(message.kind, ALLREDUCE_RANK, message.receiver, dict(message.tensors), clock=message.clock)


def test_an_allreduce_on_the_collectives_thread_lets_the_caller_go_on_with_its_state_taken_when_asked():
    posted: list = []
    allreduce = BlockingAllReduce()
    states = iter([MemberState(Message(Kind.PARAMS, 1, ALLREDUCE_RANK, TENSORS, clock=7), applied=False)])
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="collectives") as collectives:
        d = Dispatch(posted.append, collectives, FakePeers(), None, allreduce, collectives=collectives,
                     state_of=lambda: next(states))
        t = Transmission(Send(Route.ALLREDUCE, ALLREDUCE_RANK, Kind.GRADIENT,
                              Message(Kind.GRADIENT, 1, 1, TENSORS, clock=7)))
        d.perform(t)
        assert posted == []  # the caller goes on (the node's next inner steps) while the collective runs
        allreduce.release.set()
    ((state, thread),) = allreduce.calls
    assert state is not None and state.message.clock == 7 and thread.startswith("collectives")
    (reply,) = posted
    assert reply.transmission is t and reply.answer.clock == 7
    d.check()  # nothing failed


def test_what_fails_the_collectives_thread_is_raised_in_the_callers():
    posted: list = []
    allreduce = BlockingAllReduce(GroupLost("ranks [2] did not come"))
    allreduce.release.set()
    with futures.ThreadPoolExecutor(max_workers=1) as collectives:
        d = Dispatch(posted.append, collectives, FakePeers(), None, allreduce, collectives=collectives)
        d.perform(Transmission(Send(Route.ALLREDUCE, ALLREDUCE_RANK, Kind.GRADIENT,
                                    Message(Kind.GRADIENT, 1, 1, TENSORS))))
    assert posted == []
    with pytest.raises(GroupLost, match="did not come"):
        d.check()
