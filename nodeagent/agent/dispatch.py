"""Performs the node driver's transmissions on the agent: each route to its transport, the outcome back to the
runner as a Reply or a Failure (nodeagent.runtime.driver).

Peer calls block until their answer, so they run on a small pool; the all-reduce (or all-gather) runs in the
calling thread (the node can do nothing until every rank has contributed); calls to the parameter server go to the
node's ServerLink, which chooses its own threads. The transports are injected, so the routing can be tested with fakes.

A delivered push's receipt changes nothing the runner waits for (only the edge's accounting), so it is `settle`d:
handed over with the next arrival instead of waking the runner (a wake-up per receipt cost a synchronous round two
extra passes of the runner per neighbour).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Protocol

from nodeagent.algorithms.base import Route, SendFailed
from nodeagent.ps.link import ServerLink
from nodeagent.ps.messages import ServerAnswer
from nodeagent.runtime.driver import Arrival, Failure, Reply, Transmission
from nodeagent.wire.message import Kind, Message

log = logging.getLogger("nodeagent")


class PeerTransport(Protocol):
    """How a node reaches its neighbours (nodeagent.runtime.peer_service.GrpcPeers). Calls block until done and
    raise SendFailed when they fail."""

    def exchange(self, message: Message) -> Message: ...

    def pull(self, peer: int, kind: Kind) -> Message: ...

    def push(self, message: Message) -> None: ...


class AllReduce(Protocol):
    """The mean of a message's tensors over every rank, or every rank's tensors gathered
    (nodeagent.agent.collective.Collective)."""

    def mean(self, message: Message) -> Message: ...

    def gather(self, message: Message) -> Message: ...


class Dispatch:
    def __init__(self, post: Callable[[Arrival], None], pool: futures.Executor, peers: PeerTransport,
                 server: ServerLink | None = None, allreduce: AllReduce | None = None,
                 settle: Callable[[Arrival], None] | None = None):
        self.post = post
        self.settle = settle if settle is not None else post
        self.pool = pool
        self.peers = peers
        self.server = server
        self.allreduce = allreduce

    def perform(self, t: Transmission) -> None:
        send = t.send
        if send.route == Route.SERVER:
            if self.server is None:
                raise RuntimeError(f"a call to the parameter server, but this job has none: {send}")
            self.server.call(send.message, t.call_id, t.step_s, lambda result: self.post(_outcome(t, result)))
        elif send.route in (Route.ALLREDUCE, Route.ALLGATHER):
            if self.allreduce is None:
                raise RuntimeError(f"an all-reduce, but this job has none: {send}")
            assert isinstance(send.message, Message)
            collect = self.allreduce.mean if send.route == Route.ALLREDUCE else self.allreduce.gather
            self.post(Reply(t, collect(send.message)))
        else:
            self.pool.submit(self._call_peer, t)

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
