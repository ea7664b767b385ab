"""All-reduce for the collective family that survives lost members: gloo behind a per-step quorum (as torchft).

Why gloo behind a quorum, not a ring on peertrain's own transport: the design forbids a hand-written ring
all-reduce, gloo is already the job's collective and is fast on loopback and Ethernet, and what it
lacks (taking members out and back in) sits well outside it: a gloo group is fixed, so each change of membership
forms a new one, a *quorum*, through the job's rendezvous store at the coordinator (a torch.distributed Store over
the coordinator's Rendezvous call, which only the job's members reach: nodeagent.agent.rendezvous). Running
quorums need the store only to notice a member that waits to come back; a store that is away (the coordinator
restarting) holds no step up.

Quorums are numbered. The job's store holds `next`, the number of the quorum being formed; `knocks`, counting the
ranks that came to form one (what running members look at); and per quorum n: `q/n/here/R` for each rank R that
came (its token, below), `q/n/members`, written once (compare-and-set) by the first rank that closes it: `knocks`
then and the ranks present then, in order; or `-` when it was given up; and `q/n/pg/`, the gloo group's own keys. A
rank forms quorum max(`next`, its last + 1): a fresh store (coordinator restarted) thus never takes the numbers back
below the ones the ranks have seen. It says it is there and closes the quorum once every rank of the job is there,
or once at least `min_members` are and it has waited `join_s` for the rest (`step_timeout_s` for the job's first
quorum, whose ranks start together). A rank that the quorum was closed without goes on to the next number and waits
there; a rank that sees `next` pass the quorum it waits in gives that one up. A rank whose call to the store fails
tries the same quorum again once the store answers (a store that came back empty gets its key again, and `next` no
lower): a rank the quorum was closed with never skips it. A quorum whose gloo group does not form within
`step_timeout_s` (a member lost after it came) is followed by the next, and the wait for enough ranks starts again;
MAX_FAILED_GROUPS in a row fail the job.

The pieces, each in its own place: the store client (nodeagent.agent.rendezvous), quorum forming
(nodeagent.agent.quorum, on an injected store, clock and pause), the state agreement (typed messages and pure
rules: nodeagent.agent.agreement), the process group (nodeagent.agent.process_group: gloo, or a fake),
and this module, the runner that performs a round with them.

Each step (the algorithm's Route.ALLREDUCE message) is one all-reduce over the quorum's group, under
`step_timeout_s`, of the message's tensors flattened and one element more: the count of members that saw `knocks`
differ from its value when the quorum was closed (a watcher thread looks at the store twice a second): a rank came
since. A store that restarted empty differs too, and the members form a quorum again once, which sets `next` in the
new store past their numbers, where a restarted rank then finds them. The mean is over the quorum's members. When
the count is not zero every member, having seen the same sum, leaves the quorum after that step and forms the next
with the waiting rank.

All or nothing, committed by the next round. A member applies a round's answer at once, and the quorum's next round
commits it: a member enters a round only with its answer of the round before, so a round that completes anywhere
proves that every member had that answer. (torchft asks every member `should_commit` in a second exchange each
step; that vote, an all-gather of one integer after each all-reduce, took 8 agents on loopback from 44 to 30 steps/s
of a logistic model, benchmarks/faults.py.) A member lost mid-step (killed: its sockets close at once; stopped: it
does not answer within `step_timeout_s`), or whose all-reduce failed after the others had their answer, drops its
group, which fails the others' next round; each member forms the next quorum at the step it was at, and the state
agreement there settles the round in doubt: a member that applied it holds the greater key and brings every member
to it (applied everywhere); when no member of the new quorum applied it, the new quorum takes it again (applied
nowhere: a DiLoCo sync, the job's last one included, is sent again, not lost). The job's last round has no next
one: a member that did not get its answer forms a quorum with the members that finished (`hand_over`) and takes
their state.

Every new quorum first agrees on the state: each member gives (the last quorum it held the job's state in, its step,
whether the round of that step is applied: `round_applied()`), -1 for a rank that restarted from its checkpoint; the
greatest key wins, held by the lowest rank with it, whose `group_state()` (parameters, momentum, and for DiLoCo the
outer and inner optimizers' state) is broadcast. The same all-gather carries each member's token, a random number it
wrote to the store with its presence: gloo's pair connections have no credentials, and a process that reaches a
member's gloo port before the member's peer does can take the peer's place (gloo matches a connection to its pair by
a small sequence number). A member whose gathered tokens are not the store's drops the group before any state or
gradient travels on it, and the quorum is formed again. A rank with another key takes it up: the all-reduce answers
it a PARAMS message at that step, instead of a mean, and the algorithm takes the job up from it. A restarted rank
never gives the state while a live one is present; a member that applied the round in doubt brings the others
forward to it (a DiLoCo sync applied wins over the same sync pending: the job's last sync cannot be taken for one
still to send); a member that was stopped while the others went on without it takes their state, not its late one.
So every step is applied once, by every member of the quorum that took it, and all replicas are equal after each
quorum's agreement. In the job's first quorum, when every member holds the same key (all started from the same
seeded model and reached the same step, the first collective one), nothing is broadcast: a DiLoCo member's first
all-reduce comes after its first H inner steps, whose local results differ by design and must all count.

Fewer than `min_members` present (a majority by default: two halves cut apart never both train) for longer than the
wait time fails this rank's job with the absent ranks named, as does the coordinator after `failure.lost_grace_s`.

A rank restarted from its checkpoint heals before its first step: the node driver sends its group state as a
PARAMS message on the all-reduce route (`mean`), which forms a quorum and answers the group's state (or its own,
when it is the quorum's) without an all-reduce; the members join that quorum after their next round.

A rank that comes back after the others took the job's last step still gets the final state: a member that finished
keeps looking for a waiting rank until the job ends (`hand_over`), and forms a quorum with it, whose agreement hands
it the state at the last step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from nodeagent.agent.agreement import MemberState, StateKey, agree
from nodeagent.agent.process_group import GroupFactory, ProcessGroup, gloo_groups
from nodeagent.agent.quorum import MAX_FAILED_GROUPS, GroupLost, QuorumForming, QuorumOptions, first_line
from nodeagent.agent.rendezvous import CALL_TIMEOUT_S
from nodeagent.algorithms.base import ALLREDUCE_RANK
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.progress import Traffic, ring_allgather_bytes, ring_allreduce_bytes
from nodeagent.wire.message import Kind, Message

__all__ = ["MAX_FAILED_GROUPS", "Collective", "GroupLost", "GroupMember", "QuorumOptions"]

log = logging.getLogger("nodeagent")

WATCH_POLL_S = 0.5  # how often a member of a running quorum looks for a rank waiting in the next one


class GroupMember(Protocol):
    """What the collective family's algorithms give the all-reduce (nodeagent.algorithms.allreduce)."""

    def group_state(self) -> Message: ...

    def round_applied(self) -> bool:
        """Whether the collective round of this member's step is applied already (see StateKey)."""


@dataclass
class Quorum:
    number: int
    members: tuple[int, ...]  # job ranks, in the order of their group ranks
    group: ProcessGroup


# One round's collective over a quorum: (quorum, message, this member's flag of a waiting rank) -> (its answer,
# whether any member saw a rank waiting).
RoundCall = Callable[[Quorum, Message, bool], tuple[Message, bool]]


class Collective:
    def __init__(self, store: dist.Store, rank: int, world_size: int, metrics: Metrics,
                 job_id: str, node_id: str, traffic: Traffic, *, member: GroupMember, stop: threading.Event,
                 options: QuorumOptions, announce: Callable[[str, str, int], None] | None = None,
                 gloo_host: str = "", groups: GroupFactory | None = None):
        """`store`: the job's rendezvous, whose calls raise RuntimeError when they fail (kept for gloo's groups,
        which call back into it); `member`: the node's algorithm, whose state the quorum hands on;
        `announce(message, level, step)`: a job event of this node (quorum changes), besides the log; `gloo_host`:
        the address the quorum's other members reach this rank's gloo pairs at (the agent's advertised host).
        Gloo's default resolves the machine's hostname, often to a loopback address that other machines, or agents
        in other network namespaces, cannot reach; '' keeps it. `groups`: the quorums' process groups (gloo over
        `store` unless given: tests give fakes)."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.groups = groups or gloo_groups(store, timedelta(seconds=options.step_timeout_s), gloo_host)
        self.seconds = metrics.exchange_seconds.labels(job_id, node_id, ALLREDUCE_NAME)
        self.quorum_size = metrics.quorum_size.labels(job_id, node_id)
        self.aborted_steps = metrics.aborted_steps.labels(job_id, node_id)
        self.traffic = traffic
        self.job_id = job_id
        self.member = member
        self.stop = stop
        self.announce = announce
        self.forming = QuorumForming(store, rank, world_size, options, clock=time.monotonic, pause=stop.wait,
                                     tell=self._tell, job_id=job_id)
        self.quorum: Quorum | None = None
        self.held_in = -1  # the last quorum whose state this rank holds; -1: restarted, from its checkpoint
        self.waiting = threading.Event()  # a rank waits in the quorum after this one
        self._knocks = 0  # `knocks` when this rank's quorum was closed
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"quorum-watch-{job_id}", daemon=True)
        self._finisher = threading.Thread(target=self._serve_finished, name=f"quorum-final-{job_id}", daemon=True)

    @property
    def last_number(self) -> int:
        """The last quorum this rank was in."""
        return self.forming.last_number

    def mean(self, message: Message, state: MemberState | None = None) -> Message:
        """The mean of the message's tensors over the members of the quorum, as a message from ALLREDUCE_RANK; or,
        when this rank took up a new quorum's state instead, that state (a PARAMS message at its step). A PARAMS
        message (this rank's group state) heals instead: it forms a quorum and answers the group's state, or the
        message itself when this rank's state is the quorum's. `state`: the member's state when it asked (what a new
        quorum's agreement uses); None: read from the member then (one that does not change meanwhile)."""
        return self._collect(message, self._all_reduce, state)

    def gather(self, message: Message, state: MemberState | None = None) -> Message:
        """Every member's tensors of the message, stacked in rank order along a new first dimension (tensors that
        cannot be summed: int8 codes); or, like `mean`, the state of a new quorum."""
        return self._collect(message, self._all_gather, state)

    def _collect(self, message: Message, collective: RoundCall, state: MemberState | None) -> Message:
        while True:
            agreeing = self.quorum is None
            try:
                if self.quorum is None:
                    taken = self._enter(message.clock, state)
                    if taken is not None:
                        return taken
                    agreeing = False
                if message.kind == Kind.PARAMS:  # healing: this rank's state is the quorum's
                    return message
                return self._round(self.quorum, message, collective)
            except GroupLost:
                raise
            except RuntimeError as error:  # a member went away, or did not answer within the step's timeout
                self._leave()
                what = "the agreement of a new quorum at" if agreeing else "the all-reduce of"
                if not agreeing:
                    self.aborted_steps.inc()
                self._tell(f"rank {self.rank}: {what} step {message.clock} failed ({first_line(error)}); the step "
                           "is aborted and the quorum formed again (its agreement settles whether a member applied it)",
                           "WARNING", message.clock)

    def _round(self, quorum: Quorum, message: Message, collective: RoundCall) -> Message:
        """One round: the collective, which carries each member's flag of a waiting rank; its answer is applied at
        once, and its completion commits the quorum's round before it (see the module's text)."""
        started = time.perf_counter()
        answer, waiting = collective(quorum, message, self.waiting.is_set())
        self.held_in = quorum.number
        self.seconds.observe(time.perf_counter() - started)
        if waiting:  # every member saw the same flags: all leave after this round, for the newcomer's quorum
            self._leave()
        return answer

    def _all_reduce(self, quorum: Quorum, message: Message, waiting: bool) -> tuple[Message, bool]:
        """The mean of the message's tensors, flattened, with one more element: the number of members that saw a
        rank waiting (a member's flag is 0 or 1; anything above one half, a liar's included, makes every member
        leave alike)."""
        tensors = message.tensors
        parts = [t.detach().reshape(-1) for t in tensors.values()]
        flat = on_host([*parts, torch.full((1,), float(waiting), dtype=parts[0].dtype, device=parts[0].device)])
        quorum.group.all_reduce_sum(flat)
        leave = bool(flat[-1] > 0.5)
        flat = flat[:-1] / len(quorum.members)
        moved = ring_allreduce_bytes(flat.numel() * flat.element_size(), len(quorum.members))
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        return Message(message.kind, ALLREDUCE_RANK, self.rank, _split(flat, tensors), clock=message.clock,
                       loss=message.loss), leave

    def _all_gather(self, quorum: Quorum, message: Message, waiting: bool) -> tuple[Message, bool]:
        """One all-gather of the message's tensors as raw bytes over the quorum (gloo gathers any dtype that way;
        every member's message has the same tensors), and one byte more, the member's flag of a waiting rank; cut
        back into each member's tensors (copied: a view at an odd byte offset cannot be read as a wider dtype)."""
        tensors = message.tensors
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
        flat = on_host([*parts, torch.full((1,), int(waiting), dtype=torch.uint8, device=parts[0].device)])
        gathered = quorum.group.all_gather(flat)
        leave = any(int(part[-1]) != 0 for part in gathered)
        moved = ring_allgather_bytes(flat.numel() - 1, len(quorum.members))
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        out, offset = {}, 0
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            out[name] = torch.stack([
                part[offset : offset + size].clone().view(tensor.dtype).view(tensor.shape) for part in gathered
            ]).to(tensor.device)
            offset += size
        return Message(message.kind, ALLREDUCE_RANK, self.rank, out, clock=message.clock, loss=message.loss,
                       members=quorum.members), leave

    def _leave(self) -> None:
        """Drop this rank's group (its pairs close, which fails any peer still in a call on it)."""
        if self.quorum is not None:
            self.quorum.group.close()
        self.quorum = None
        self.waiting.clear()

    # -- a new quorum ------------------------------------------------------------------------------------------

    def _enter(self, step: int, state: MemberState | None) -> Message | None:
        """Form the next quorum with this rank in it and agree on its state (see `_agree`)."""
        previous = self.forming.last_number

        def make_group(number: int, members: tuple[int, ...]) -> ProcessGroup:
            return self.groups(number, members, members.index(self.rank))

        formed = self.forming.form(step, make_group)
        self.quorum = Quorum(formed.number, formed.members, formed.group)
        self._knocks = formed.knocks
        self.quorum_size.set(len(formed.members))
        missing = [rank for rank in range(self.world_size) if rank not in formed.members]
        self._tell(f"rank {self.rank} in all-reduce quorum {formed.number} of {len(formed.members)} members "
                   f"{list(formed.members)} at step {step}{f', without ranks {missing}' if missing else ''}"
                   f"{' (restarted)' if previous < 0 and self.held_in < 0 and formed.number > 0 else ''}",
                   "INFO", step)
        if self._watcher.ident is None:
            self._watcher.start()
        return self._agree(self.quorum, state or MemberState(self.member.group_state(), self.member.round_applied()))

    def _agree(self, quorum: Quorum, member: MemberState) -> Message | None:
        """The state every member of a new quorum takes the job up from (nodeagent.agent.agreement): a PARAMS
        message when this rank's state is not it, else None (its own state is the quorum's)."""
        state = member.message
        mine = StateKey(self.held_in, state.clock, member.applied, self.forming.token_in(quorum.number))
        keys = [StateKey.decode(key) for key in quorum.group.all_gather(mine.encode())]
        for rank, key in zip(quorum.members, keys, strict=True):
            if key.token != self.forming.token_of(quorum.number, rank):
                raise RuntimeError(f"the gloo connection of rank {rank} in quorum {quorum.number} is not from rank "
                                   f"{rank} (its token differs from the rendezvous store's): the group is dropped")
        agreement = agree(keys, quorum.number == 0)
        if agreement.source is None:
            self.held_in = quorum.number
            return None
        flat = on_host([t.detach().reshape(-1) for t in state.tensors.values()])
        quorum.group.broadcast(flat, agreement.source)
        size = flat.numel() * flat.element_size()
        if quorum.members[agreement.source] == self.rank:
            self.traffic.add_sent(ALLREDUCE_RANK, size * (len(quorum.members) - 1))
        else:
            self.traffic.add_received(ALLREDUCE_RANK, size)
        self.held_in = quorum.number  # only now: a rank whose broadcast failed keeps claiming its old state
        best = agreement.best
        if mine.rank == best.rank:
            return None
        origin = ", from its checkpoint" if mine.held_in < 0 else ""
        self._tell(f"rank {self.rank} took up the state of rank {quorum.members[agreement.source]} at step "
                   f"{best.step} in quorum {quorum.number} (it was at step {state.clock}{origin})", "INFO", best.step)
        return Message(state.kind, ALLREDUCE_RANK, self.rank, _split(flat, state.tensors), clock=best.step)

    def _watch(self) -> None:
        """Look for a rank waiting in the quorum after this rank's (this rank's next round carries its flag); a store
        that is away is tried again at the next look."""
        while not self._closed.wait(WATCH_POLL_S) and not self.stop.is_set():
            quorum = self.quorum
            if quorum is None or self.waiting.is_set():
                continue
            try:
                if self.forming.knocked_since(self._knocks) and self.quorum is quorum:
                    self.waiting.set()
            except RuntimeError as error:
                log.debug("job %s: the rendezvous store does not answer (%s)", self.job_id, first_line(error))

    def hand_over(self) -> None:
        """This rank took the job's last step: from now on, until the job ends, it hands the final state to a rank
        that comes back late (it forms a quorum with it, as at any step), in a thread of its own: the node's
        algorithm no longer changes."""
        if self._finisher.ident is None:
            self._finisher.start()

    def _serve_finished(self) -> None:
        while not self._closed.wait(WATCH_POLL_S) and not self.stop.is_set():
            try:
                if not self.forming.knocked_since(self._knocks):  # the runner is done with this store
                    continue
                self._leave()
                self._enter(self.member.group_state().clock, None)  # the algorithm no longer changes
            except RuntimeError as error:  # the store away, a member lost: the next look tries again
                self._leave()
                log.debug("job %s: handing the final state over failed (%s)", self.job_id, first_line(error))

    def _tell(self, message: str, level: str, step: int) -> None:
        if self.announce is not None:
            self.announce(message, level, step)
        else:
            log.log(logging.getLevelName(level), "job %s: %s", self.job_id, message)

    def close(self) -> None:
        self._closed.set()
        self._leave()
        for thread in (self._watcher, self._finisher):
            if thread.ident is not None and thread is not threading.current_thread():  # not left in a store call
                thread.join(timeout=WATCH_POLL_S + CALL_TIMEOUT_S)  # when the process exits


def on_host(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated in host memory, where gloo reduces them: a GPU's are concatenated on the device and
    copied over once, into pinned memory."""
    flat = torch.cat(tensors)
    if flat.device.type == "cpu":
        return flat
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    return host.copy_(flat)


def _split(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`flat` (in host memory) cut into tensors of the shapes, dtypes and devices of `like`, under its names."""
    out, offset = {}, 0
    for name, tensor in like.items():
        part = flat[offset : offset + tensor.numel()].view(tensor.shape)
        out[name] = part.to(device=tensor.device, dtype=tensor.dtype)
        offset += tensor.numel()
    return out
