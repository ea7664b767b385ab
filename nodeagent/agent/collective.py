"""All-reduce for the collective family: torch.distributed (gloo), joined through the coordinator's rendezvous
when the first all-reduce is asked for, and formed again when a rank is lost.

A gloo group cannot take a member back, so a lost rank (killed, restarted from its checkpoint) ends the group.
Every rank then joins a new one, a *generation*, at the coordinator's store: a generation's keys live under their
own prefix, and the store's "generation" counter names the one being formed. A rank that needs a group joins the
counter's generation unless it was in it already or that one was formed without it (a restarted rank coming back
before the others noticed it had gone); then it moves the counter on, atomically, so that every rank lands in the
same one. Once a generation after the first is formed, the ranks agree on where the job is before the next mean:
the latest step any of them reached, and the state (parameters, momentum) of the lowest rank at it, broadcast to
all. The all-reduce then answers that state instead of the mean it was asked for; the algorithm takes it up.

A rank that does not come back within the regroup time fails the job; so does the coordinator, after the job's
failure grace (nodeagent.jobspec.FailureSpec), and its stop ends the wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from nodeagent.algorithms.base import ALLREDUCE_RANK
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.progress import Traffic, ring_allgather_bytes, ring_allreduce_bytes
from nodeagent.wire.message import Message

log = logging.getLogger("nodeagent")

PRESENCE_POLL_S = 0.2
WAIT_LOGGED_AFTER_S = 10.0


class GroupMember(Protocol):
    """What the collective family's algorithms give the all-reduce (nodeagent.algorithms.allreduce)."""

    def group_state(self) -> Message: ...


class GroupLost(RuntimeError):
    """The all-reduce group lost a rank and could not be formed again in time, or the job ended meanwhile."""


class Collective:
    def __init__(self, host: str, port: int, key: str, rank: int, world_size: int, timeout_s: float,
                 metrics: Metrics,
                 job_id: str, node_id: str, traffic: Traffic, *, member: GroupMember,
                 stop: threading.Event, regroup_s: float):
        """`member`: the node's algorithm, whose state the group hands on; `regroup_s`: how long the ranks wait
        for a lost one to come back."""
        if port == 0:
            raise RuntimeError("the assignment names no rendezvous for this all-reduce job")
        self.host, self.port, self.key = host, port, key
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=max(timeout_s, 30.0))
        self.seconds = metrics.exchange_seconds.labels(job_id, node_id, ALLREDUCE_NAME)
        self.traffic = traffic
        self.job_id = job_id
        self.member = member
        self.stop = stop
        self.regroup_s = regroup_s
        self.store: dist.Store | None = None
        self.generation = -1  # the group this rank is in; -1 before its first

    def mean(self, message: Message) -> Message:
        """The mean of the message's tensors over every rank, as a message from ALLREDUCE_RANK; or, when the group
        had to be formed again, the state every rank takes the job up from (a PARAMS message at its step)."""
        return self._collect(message, self._all_reduce)

    def gather(self, message: Message) -> Message:
        """Every rank's tensors of the message, stacked in rank order along a new first dimension (tensors that
        cannot be summed: int8 codes); or, like `mean`, the group's state when it had to be formed again."""
        return self._collect(message, self._all_gather)

    def _collect(self, message: Message, collective: Callable[[Message], Message]) -> Message:
        if self.generation < 0:
            self._join(message.clock, time.monotonic() + self.regroup_s)
            if self.generation > 0:  # a restarted rank, in a group formed again for it
                return self._agree()
        try:
            return collective(message)
        except RuntimeError as error:  # gloo: a rank went away, or did not answer within the timeout
            log.warning("job %s: the all-reduce of step %d failed (%s); forming the group again", self.job_id,
                        message.clock, error)
            reason = str(error)
        deadline = time.monotonic() + self.regroup_s
        while True:
            try:
                self._join(message.clock, deadline)
                return self._agree()
            except GroupLost:
                raise
            except RuntimeError as error:  # lost another rank while forming: again, within the same time
                if time.monotonic() >= deadline:
                    raise GroupLost(f"the all-reduce group lost a rank at step {message.clock} ({reason}) and could "
                                    f"not be formed again: {error}") from error
                log.warning("job %s: forming the all-reduce group again failed (%s); trying again", self.job_id,
                            error)

    def _all_reduce(self, message: Message) -> Message:
        started = time.perf_counter()
        tensors = message.tensors
        flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
        dist.all_reduce(flat)
        flat /= self.world_size
        self.seconds.observe(time.perf_counter() - started)
        moved = ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world_size)
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        return Message(message.kind, ALLREDUCE_RANK, self.rank, _split(flat, tensors), clock=message.clock,
                       loss=message.loss)

    def _all_gather(self, message: Message) -> Message:
        """One all-gather of the message's tensors as raw bytes (gloo gathers any dtype that way; every rank's
        message has the same tensors), cut back into each rank's tensors (copied: a view at an odd byte offset
        cannot be read as a wider dtype)."""
        started = time.perf_counter()
        tensors = message.tensors
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        self.seconds.observe(time.perf_counter() - started)
        moved = ring_allgather_bytes(flat.numel(), self.world_size)
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        out, offset = {}, 0
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            out[name] = torch.stack([
                part[offset : offset + size].clone().view(tensor.dtype).view(tensor.shape) for part in gathered])
            offset += size
        return Message(message.kind, ALLREDUCE_RANK, self.rank, out, clock=message.clock, loss=message.loss)

    def _join(self, step: int, deadline: float) -> None:
        """Join the generation being formed (see the module's text), once every rank is there."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.store is None:
            server = dist.TCPStore(self.host, self.port, self.world_size + 1, is_master=False, timeout=self.timeout)
            self.store = dist.PrefixStore(f"{self.key}/", server)
        store = self.store
        generation = int(store.add("generation", 0))
        if generation <= self.generation or store.check([f"formed/{generation}"]):
            generation = int(store.compare_set("generation", str(generation), str(generation + 1)))
        self.generation = generation
        members = dist.PrefixStore(f"generation/{generation}/", store)
        members.set(f"here/{self.rank}", "1")
        started, logged = time.monotonic(), False
        while not members.check([f"here/{rank}" for rank in range(self.world_size)]):
            if self.stop.wait(PRESENCE_POLL_S):
                raise GroupLost("the job ended while the all-reduce group was being formed")
            now = time.monotonic()
            if now >= deadline:
                raise GroupLost(f"ranks {self._absent(members)} did not come back to the all-reduce of step {step} "
                                f"within {self.regroup_s:.0f} s")
            if not logged and now - started >= WAIT_LOGGED_AFTER_S:
                log.warning("job %s: rank %d waits for ranks %s to come back to the all-reduce of step %d",
                            self.job_id, self.rank, self._absent(members), step)
                logged = True
        dist.init_process_group("gloo", store=dist.PrefixStore("group/", members), rank=self.rank,
                                world_size=self.world_size, timeout=self.timeout)
        store.set(f"formed/{generation}", "1")

    def _absent(self, members: dist.PrefixStore) -> list[int]:
        return [rank for rank in range(self.world_size) if not members.check([f"here/{rank}"])]

    def _agree(self) -> Message:
        """Every rank of a group formed again: the latest step any reached, with the state of the lowest rank at
        it, handed to all."""
        state = self.member.group_state()
        step = torch.tensor([state.clock], dtype=torch.int64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        latest = int(step.item())
        source = torch.tensor([self.rank if state.clock == latest else self.world_size], dtype=torch.int64)
        dist.all_reduce(source, op=dist.ReduceOp.MIN)
        source_rank = int(source.item())
        flat = torch.cat([t.detach().reshape(-1) for t in state.tensors.values()])
        dist.broadcast(flat, src=source_rank)
        size = flat.numel() * flat.element_size()
        if self.rank == source_rank:
            self.traffic.add_sent(ALLREDUCE_RANK, size * (self.world_size - 1))
        else:
            self.traffic.add_received(ALLREDUCE_RANK, size)
        log.info("job %s: rank %d rejoined the all-reduce (group %d) at step %d, with the state of rank %d (it was "
                 "at step %d)", self.job_id, self.rank, self.generation, latest, source_rank, state.clock)
        return Message(state.kind, ALLREDUCE_RANK, self.rank, _split(flat, state.tensors), clock=latest)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _split(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`flat` cut into tensors of the shapes and dtypes of `like`, under its names."""
    out, offset = {}, 0
    for name, tensor in like.items():
        out[name] = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
        offset += tensor.numel()
    return out
