"""Performs the node driver's transmissions on the agent: each route to its transport, the outcome back to the
runner as a Reply or a Failure (nodeagent.runtime.driver).

Peer calls block until their answer, so they run on a small pool; the all-reduce (or all-gather) runs on a pool
of its own, one thread (collectives in the order they were asked for), so that the node goes on while it runs:
streaming DiLoCo's overlapped inner steps proceed while a fragment is averaged, and the driver keeps reporting
progress while a quorum forms (without that pool, the collective runs in the calling thread). The member's state
that a new quorum's agreement may need is taken in the calling thread when the collective is asked for
(`state_of`), as the node trains on meanwhile; what fails the collective's thread (too few members for a quorum)
is raised in the caller's by `check()`. Calls to the parameter server go to the node's ServerLink, which chooses
its own threads. The transports are injected, so the routing can be tested with fakes.

A delivered push's receipt changes nothing the runner waits for (only the edge's accounting), so it is `settle`d:
handed over with the next arrival instead of waking the runner (a wake-up per receipt cost a synchronous round two
extra passes of the runner per neighbour). A small push to a neighbour whose direct lane is free is written by the
runner itself, ahead of its answer (`PeerTransport.begin_push`), and its answer taken up later (`poll`): a pool
thread woken to write it, and woken again by its answer, cost a synchronous round two thread wake-ups per neighbour.
A failed one wakes the runner as before, and the driver sends it again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Protocol

from nodeagent.agent.agreement import MemberState
from nodeagent.algorithms.base import Route, SendFailed
from nodeagent.ps.link import ServerLink
from nodeagent.ps.messages import ServerAnswer
from nodeagent.runtime.driver import Arrival, Failure, Reply, Transmission
from nodeagent.wire.message import Kind, Message

log = logging.getLogger("nodeagent")

Collect = Callable[[Message, MemberState | None], Message]


class PeerTransport(Protocol):
    """How a node reaches its neighbours (nodeagent.runtime.peer_service.GrpcPeers). Calls block until done and
    raise SendFailed when they fail."""

    def exchange(self, message: Message) -> Message: ...

    def pull(self, peer: int, kind: Kind) -> Message: ...

    def push(self, message: Message) -> None: ...

    def begin_push(self, message: Message, done: Callable[[SendFailed | None], None]) -> bool:
        """Send a push from the calling thread without waiting for its answer, where that needs no waiting; `done`
        hears later how it went (None: delivered), from `poll` or another call. False: nothing sent (`push` it)."""
        ...

    def poll(self) -> None:
        """Hand the answers that have come to pushes begun earlier to their `done`."""
        ...


class AllReduce(Protocol):
    """The mean of a message's tensors over every rank, or every rank's tensors gathered, given the member's state
    when it asked (nodeagent.agent.collective.Collective)."""

    def mean(self, message: Message, state: MemberState | None = None) -> Message: ...

    def gather(self, message: Message, state: MemberState | None = None) -> Message: ...


class Dispatch:
    def __init__(self, post: Callable[[Arrival], None], pool: futures.Executor, peers: PeerTransport,
                 server: ServerLink | None = None, allreduce: AllReduce | None = None, *,
                 collectives: futures.Executor | None = None, state_of: Callable[[], MemberState] | None = None,
                 settle: Callable[[Arrival], None] | None = None):
        self.post = post
        self.settle = settle if settle is not None else post
        self.pool = pool
        self.peers = peers
        self.server = server
        self.allreduce = allreduce
        self.collectives = collectives
        self.state_of = state_of
        self.failure: BaseException | None = None  # what ended the collectives' thread, for `check()`

    def perform(self, t: Transmission) -> None:
        send = t.send
        if send.route == Route.SERVER:
            if self.server is None:
                raise RuntimeError(f"a call to the parameter server, but this job has none: {send}")
            self.server.call(send.message, t.call_id, t.step_s, lambda result: self.post(_outcome(t, result)))
        elif send.route in (Route.ALLREDUCE, Route.ALLGATHER):
            if self.allreduce is None:
                raise RuntimeError(f"an all-reduce, but this job has none: {send}")
            collect = self.allreduce.mean if send.route == Route.ALLREDUCE else self.allreduce.gather
            state = self.state_of() if self.state_of is not None else None
            if self.collectives is None:
                self.post(Reply(t, self._collective(t, collect, state)))
            else:
                self.collectives.submit(self._collect, t, collect, state)
        elif send.route == Route.PUSH and self.peers.begin_push(send.message, functools.partial(self._pushed, t)):
            return
        else:
            self.pool.submit(self._call_peer, t)

    def poll(self) -> None:
        """Take up the answers to pushes begun in this thread (`PeerTransport.begin_push`) that have come."""
        self.peers.poll()

    def _pushed(self, t: Transmission, failure: SendFailed | None) -> None:
        if failure is None:
            self.settle(Reply(t, None))
        else:
            log.debug("push to rank %d failed: %s", t.send.peer, failure)
            self.post(Failure(t, failure.reason, failure.transient))

    @staticmethod
    def _collective(t: Transmission, collect: Collect, state: MemberState | None) -> Message:
        assert isinstance(t.send.message, Message)
        return collect(t.send.message, state)

    def _collect(self, t: Transmission, collect: Collect, state: MemberState | None) -> None:
        try:
            self.post(Reply(t, self._collective(t, collect, state)))
        except BaseException as error:  # GroupLost, or a defect: the job fails in the runner's thread
            self.failure = error

    def check(self) -> None:
        """Raise what ended a collective in its own thread, as it would have been raised inline."""
        if self.failure is not None:
            raise self.failure

    def _call_peer(self, t: Transmission) -> None:
        send = t.send
        try:
            if send.route == Route.PULL:
                answer: Message | None = self.peers.pull(send.peer, send.kind)
            else:
                assert isinstance(send.message, Message)
                if send.route == Route.EXCHANGE:
                    answer = self.peers.exchange(send.message)
                else:
                    self.peers.push(send.message)
                    self.settle(Reply(t, None))
                    return
        except SendFailed as failure:
            log.debug("%s with rank %d failed: %s", send.route, send.peer, failure)
            self.post(Failure(t, failure.reason, failure.transient))
            return
        except Exception:  # a defect: say so, and let the node go on as after any failed call
            log.exception("%s with rank %d broke", send.route, send.peer)
            self.post(Failure(t, "error"))
            return
        self.post(Reply(t, answer))


def _outcome(t: Transmission, result: ServerAnswer | SendFailed) -> Arrival:
    if isinstance(result, SendFailed):
        return Failure(t, result.reason, result.transient)
    return Reply(t, result)
