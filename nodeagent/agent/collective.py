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

Each step (the algorithm's Route.ALLREDUCE message) is one gloo all-reduce over the quorum, under
`step_timeout_s`: the message's tensors flattened, plus one number, 1 from each member that saw `knocks` differ
from its value when the quorum was closed (a watcher thread looks at the store twice a second): a
rank came since. A store that restarted empty differs too, and the members form a quorum again once, which sets
`next` in the new store past their numbers, where a restarted rank then finds them. The mean is over the quorum's
members. The step is committed on a member when its all-reduce completes: gloo answers every member the same sum,
or fails (on some members or all). A member
lost mid-step (killed: its sockets close at once; stopped: it does not answer within `step_timeout_s`) fails the
all-reduce on the others, each drops its group (which fails its own peers' calls in turn), and forms the next
quorum without it at the step it was at. When the sum of the waiting flags is above zero, every member, having
all seen the same sum, leaves the quorum after that step and forms the next with the waiting rank.

Every new quorum first agrees on the state: each member gives (the last quorum it held the job's state in, its
step), -1 for a rank that restarted from its checkpoint; the greatest pair wins, held by the lowest rank with it,
whose `group_state()` (parameters, momentum, and for DiLoCo the outer and inner optimizers' state) is broadcast.
The same all-gather carries each member's token, a random number it wrote to the store with its presence: gloo's
pair connections have no credentials, and a process that reaches a member's gloo port before the member's peer
does can take the peer's place (gloo matches a connection to its pair by a small sequence number). A member whose
gathered tokens are not the store's drops the group before any state or gradient travels on it, and the quorum is
formed again.
A rank with another pair takes it up: the all-reduce answers it a PARAMS message at that step, instead of a mean,
and the algorithm takes the job up from it. A restarted rank never gives the state while a live one is present;
a member whose step completed where the others' failed (gloo failed after some had their answer) brings the
others forward to it; a member that was stopped while the others went on without it takes their state, not its
late one. So every step is applied once, by every member of the quorum that took it, and all replicas are equal
after each quorum's agreement. In the job's first quorum, when every member holds the same pair (all started from
the same seeded model and reached the same step, the first collective one), nothing is broadcast: a DiLoCo member's
first all-reduce comes after its first H inner steps, whose local results differ by design and must all count.

Fewer than `min_members` present (a majority by default: two halves cut apart never both train) for longer than the
wait time fails this rank's job with the absent ranks named, as does the coordinator after `failure.lost_grace_s`.

A rank that comes back after the others took the job's last step still gets the final state: a member that finished
keeps looking for a waiting rank until the job ends (`hand_over`), and forms a quorum with it, whose agreement hands
it the state at the last step.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from nodeagent.agent.rendezvous import CALL_TIMEOUT_S
from nodeagent.algorithms.base import ALLREDUCE_RANK
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.progress import Traffic, ring_allgather_bytes, ring_allreduce_bytes
from nodeagent.wire.message import Message

log = logging.getLogger("nodeagent")

PRESENCE_POLL_S = 0.1  # how often a rank forming a quorum looks at who came
WATCH_POLL_S = 0.5  # how often a member of a running quorum looks for a rank waiting in the next one
WAIT_LOGGED_AFTER_S = 10.0
MAX_FAILED_GROUPS = 3  # quorums in a row whose gloo group did not form (each within step_timeout_s) fail the job
ABANDONED = "-"


class GroupMember(Protocol):
    """What the collective family's algorithms give the all-reduce (nodeagent.algorithms.allreduce)."""

    def group_state(self) -> Message: ...


class GroupLost(RuntimeError):
    """Too few members for a quorum for longer than the wait time, or the job ended meanwhile."""


@dataclass(frozen=True)
class QuorumOptions:
    """The job's `failure` options for its all-reduce (nodeagent.jobspec.FailureSpec)."""

    step_timeout_s: float  # the longest one step's collective (and a group's forming) may take
    join_s: float  # how long a quorum waits for the ranks not there yet, once it has enough
    min_members: int  # the fewest members a quorum may have
    wait_s: float  # how long a rank waits for a quorum of at least min_members before it fails the job


@dataclass
class Quorum:
    number: int
    members: tuple[int, ...]  # job ranks, in the order of their gloo ranks
    group: dist.ProcessGroup


class Collective:
    def __init__(self, store: dist.Store, rank: int, world_size: int, metrics: Metrics,
                 job_id: str, node_id: str, traffic: Traffic, *, member: GroupMember, stop: threading.Event,
                 options: QuorumOptions, announce: Callable[[str, str, int], None] | None = None,
                 gloo_host: str = ""):
        """`store`: the job's rendezvous, whose calls raise RuntimeError when they fail (kept for gloo's groups,
        which call back into it); `member`: the node's algorithm, whose state the quorum hands on;
        `announce(message, level, step)`: a job event of this node (quorum changes), besides the log; `gloo_host`:
        the address the quorum's other members reach this rank's gloo pairs at (the agent's advertised host).
        Gloo's default resolves the machine's hostname, often to a loopback address that other machines, or agents
        in other network namespaces, cannot reach; '' keeps it."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.timeout = timedelta(seconds=options.step_timeout_s)
        self.gloo_host = gloo_host
        self.seconds = metrics.exchange_seconds.labels(job_id, node_id, ALLREDUCE_NAME)
        self.quorum_size = metrics.quorum_size.labels(job_id, node_id)
        self.aborted_steps = metrics.aborted_steps.labels(job_id, node_id)
        self.traffic = traffic
        self.job_id = job_id
        self.member = member
        self.stop = stop
        self.announce = announce
        self.quorum: Quorum | None = None
        self.last_number = -1  # the last quorum this rank was in
        self.held_in = -1  # the last quorum whose state this rank holds; -1: restarted, from its checkpoint
        self.waiting = threading.Event()  # a rank waits in the quorum after this one
        self._knocks = 0  # `knocks` when this rank's quorum was closed
        self._token = (-1, 0)  # the quorum number this rank came to last, and its token there
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"quorum-watch-{job_id}", daemon=True)
        self._finisher = threading.Thread(target=self._serve_finished, name=f"quorum-final-{job_id}", daemon=True)

    def mean(self, message: Message) -> Message:
        """The mean of the message's tensors over the members of the quorum, as a message from ALLREDUCE_RANK; or,
        when this rank took up a new quorum's state instead, that state (a PARAMS message at its step)."""
        return self._collect(message, self._all_reduce)

    def gather(self, message: Message) -> Message:
        """Every member's tensors of the message, stacked in rank order along a new first dimension (tensors that
        cannot be summed: int8 codes); or, like `mean`, the state of a new quorum."""
        return self._collect(message, self._all_gather)

    def _collect(self, message: Message, collective: Callable[[Quorum, Message], Message]) -> Message:
        while True:
            agreeing = self.quorum is None
            try:
                if self.quorum is None:
                    self.quorum = self._form(message.clock)
                    taken = self._agree(self.quorum)
                    if taken is not None:
                        return taken
                    agreeing = False
                return collective(self.quorum, message)
            except GroupLost:
                raise
            except RuntimeError as error:  # gloo: a member went away, or did not answer within the step's timeout
                self._leave()
                what = "the agreement of a new quorum at" if agreeing else "the all-reduce of"
                if not agreeing:
                    self.aborted_steps.inc()
                self._tell(f"rank {self.rank}: {what} step {message.clock} failed ({_first_line(error)}); the step "
                           "is aborted and the quorum formed again", "WARNING", message.clock)

    def _all_reduce(self, quorum: Quorum, message: Message) -> Message:
        started = time.perf_counter()
        tensors = message.tensors
        flat = on_host([t.detach().reshape(-1) for t in tensors.values()])
        flat = torch.cat([flat, torch.tensor([1.0 if self.waiting.is_set() else 0.0], dtype=flat.dtype)])
        quorum.group.allreduce([flat]).wait()
        waiting = bool(flat[-1].item() > 0)
        flat = flat[:-1] / len(quorum.members)
        self.held_in = quorum.number
        self.seconds.observe(time.perf_counter() - started)
        moved = ring_allreduce_bytes(flat.numel() * flat.element_size(), len(quorum.members))
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        if waiting:  # every member saw the same sum: all leave after this step, for the quorum with the newcomer
            self._leave()
        return Message(message.kind, ALLREDUCE_RANK, self.rank, _split(flat, tensors), clock=message.clock,
                       loss=message.loss)

    def _all_gather(self, quorum: Quorum, message: Message) -> Message:
        """One all-gather of the message's tensors as raw bytes over the quorum (gloo gathers any dtype that way;
        every member's message has the same tensors), cut back into each member's tensors (copied: a view at an odd
        byte offset cannot be read as a wider dtype). A last byte carries the waiting flag, as in `_all_reduce`."""
        started = time.perf_counter()
        tensors = message.tensors
        flat = on_host([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
        flat = torch.cat([flat, torch.tensor([1 if self.waiting.is_set() else 0], dtype=torch.uint8)])
        gathered = [torch.empty_like(flat) for _ in quorum.members]
        quorum.group.allgather([gathered], [flat]).wait()
        waiting = any(int(part[-1]) > 0 for part in gathered)
        self.held_in = quorum.number
        self.seconds.observe(time.perf_counter() - started)
        moved = ring_allgather_bytes(flat.numel() - 1, len(quorum.members))
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        if waiting:  # every member saw the same flags: all leave after this step, for the quorum with the newcomer
            self._leave()
        out, offset = {}, 0
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            out[name] = torch.stack([
                part[offset : offset + size].clone().view(tensor.dtype).view(tensor.shape) for part in gathered
            ]).to(tensor.device)
            offset += size
        return Message(message.kind, ALLREDUCE_RANK, self.rank, out, clock=message.clock, loss=message.loss)

    def _leave(self) -> None:
        """Drop this rank's group (its sockets close, which fails any peer still in a call on it)."""
        self.quorum = None
        self.waiting.clear()

    # -- forming a quorum --------------------------------------------------------------------------------------

    def _form(self, step: int) -> Quorum:
        """Join the quorum being formed and wait until it is closed with this rank in it (see the module's text)."""
        started = time.monotonic()
        deadline = started + self.options.wait_s
        number, arrived, knocked_in, again = -1, 0.0, -1, False
        logged, error, failed_groups = False, "", 0
        joined: tuple[int, ...] = ()  # the members of the quorum closed with this rank, whose group it forms
        while True:
            if self.stop.is_set():
                raise GroupLost("the job ended while the all-reduce quorum was being formed")
            now = time.monotonic()
            try:
                if number < 0:
                    number = self._next_number(self.last_number + 1)
                    arrived = 0.0
                elif again:  # after a store error: a store that came back empty never goes below this quorum
                    self._next_number(number)
                closed = self._members(number)
                if closed is None:
                    if not arrived or again:  # (again: a store that came back empty lost this rank's key)
                        # The knock before the presence: a rank found present has been counted (_maybe_close).
                        if knocked_in != number:
                            self.store.add("knocks", 1)
                            knocked_in = number
                        self.store.set(f"q/{number}/here/{self.rank}", str(self._token_in(number)))
                        arrived = arrived or now
                    closed = self._maybe_close(number, now - arrived)
                again = False
                if closed is not None:
                    knocks, members = closed
                    if self.rank not in members:  # closed without this rank: wait in the next one
                        number = self._next_number(number + 1)
                        arrived = 0.0
                        continue
                    self._knocks = knocks
                    with contextlib.suppress(RuntimeError):  # every member moves `next` on: one is enough
                        self._next_number(number + 1)
                    joined = members
            except RuntimeError as failure:  # the store away (perhaps back fresh): this quorum again, once it answers
                if _first_line(failure) != error:
                    log.info("job %s: rank %d, forming quorum %d: the rendezvous store failed: %s", self.job_id,
                             self.rank, number, _first_line(failure))
                error = _first_line(failure)
                again = number >= 0
            if joined:
                try:
                    return self._group(number, joined, step)
                except RuntimeError as failure:  # a member did not come (lost since it came), or is not reachable
                    failed_groups += 1
                    error = _first_line(failure)
                    self._tell(f"rank {self.rank}: the group of all-reduce quorum {number} {list(joined)} was not "
                               f"formed for step {step} ({error}); forming the next", "WARNING", step)
                    if failed_groups >= MAX_FAILED_GROUPS:
                        raise GroupLost(f"the all-reduce's quorums for step {step} did not form their groups "
                                        f"{failed_groups} times in a row (last error: {error})") from failure
                    self.last_number, number, joined = number, -1, ()
                    deadline = time.monotonic() + self.options.wait_s  # enough ranks had come: wait for them again
                    continue
            if now >= deadline:
                absent = f"ranks {self._absent(number)}" if number >= 0 else "ranks (the store does not answer)"
                raise GroupLost(f"{absent} of the all-reduce did not come to a quorum of at least "
                                f"{self.options.min_members} members for step {step} within "
                                f"{self.options.wait_s:.0f} s{f' (last error: {error})' if error else ''}")
            if not logged and now - started >= WAIT_LOGGED_AFTER_S:
                log.warning("job %s: rank %d waits for a quorum for step %d (quorum %d)", self.job_id, self.rank,
                            step, number)
                logged = True
            if self.stop.wait(PRESENCE_POLL_S):
                continue

    def _next_number(self, at_least: int) -> int:
        """Move `next` on to at least `at_least` (never back), atomically; its value now."""
        while True:
            current = int(self.store.add("next", 0))
            if current >= at_least:
                return current
            if int(self.store.compare_set("next", str(current), str(at_least))) == at_least:
                return at_least

    def _token_in(self, number: int) -> int:
        """This rank's token in quorum `number`: a new random one for each quorum (one seen on a taken gloo pair
        is of no use in the next)."""
        if self._token[0] != number:
            self._token = (number, secrets.randbits(62))
        return self._token[1]

    def _members(self, number: int) -> tuple[int, tuple[int, ...]] | None:
        """`knocks` when quorum `number` was closed and its members (() when it was given up), or None while it is
        not closed."""
        key = f"q/{number}/members"
        if not self.store.check([key]):
            return None
        return _closed(self.store.get(key).decode())

    def _present(self, number: int) -> list[int]:
        return [rank for rank in range(self.world_size) if self.store.check([f"q/{number}/here/{rank}"])]

    def _absent(self, number: int) -> list[int]:
        try:
            present = set(self._present(number))
        except RuntimeError:
            return []
        return [rank for rank in range(self.world_size) if rank not in present]

    def _maybe_close(self, number: int, waited_s: float) -> tuple[int, tuple[int, ...]] | None:
        """Close quorum `number` if it may be closed now, or give it up when the ranks went on past it; its members
        once closed (by this rank or another), else None."""
        key = f"q/{number}/members"
        if int(self.store.add("next", 0)) > number:
            closed = self.store.compare_set(key, "", ABANDONED).decode()
        else:
            # The presence first, then `knocks`: every rank present knocked before it said so, so the members never
            # take one of their own for a rank waiting (each a regroup, frequent with a store a call away). A rank
            # counted here but not present knocks again in the next quorum, where the members notice it.
            present = self._present(number)
            knocks = int(self.store.add("knocks", 0))
            everyone = len(present) == self.world_size
            # The job's first quorum: its ranks start together, and one later than a step's timeout counts as lost.
            join_s = self.options.join_s if number > 0 else max(self.options.join_s, self.options.step_timeout_s)
            if not everyone and (len(present) < self.options.min_members or waited_s < join_s):
                return None
            value = f"{knocks}|{','.join(map(str, present))}"
            closed = self.store.compare_set(key, "", value).decode()
        return _closed(closed)

    def _group(self, number: int, members: tuple[int, ...], step: int) -> Quorum:
        options: dist.ProcessGroupGloo._Options | timedelta = self.timeout  # a timeout alone: gloo's default device
        if self.gloo_host:  # a device of its own for each group, as gloo's default: none outlives its group
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.gloo_host)]
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"q/{number}/pg/", self.store),
                                      members.index(self.rank), len(members), options)
        previous = self.last_number
        self.last_number = number
        self.quorum_size.set(len(members))
        missing = [rank for rank in range(self.world_size) if rank not in members]
        self._tell(f"rank {self.rank} in all-reduce quorum {number} of {len(members)} members {list(members)} at "
                   f"step {step}{f', without ranks {missing}' if missing else ''}"
                   f"{' (restarted)' if previous < 0 and self.held_in < 0 and number > 0 else ''}",
                   "INFO", step)
        if self._watcher.ident is None:
            self._watcher.start()
        return Quorum(number, members, group)

    def _agree(self, quorum: Quorum) -> Message | None:
        """The state every member of a new quorum takes the job up from (see the module's text): a PARAMS message
        when this rank's state is not it, else None (its own state is the quorum's)."""
        state = self.member.group_state()
        mine = torch.tensor([self.held_in, state.clock, self._token_in(quorum.number)], dtype=torch.int64)
        keys = [torch.zeros(3, dtype=torch.int64) for _ in quorum.members]
        quorum.group.allgather([keys], [mine]).wait()
        for rank, key in zip(quorum.members, keys, strict=True):
            if int(key[2]) != int(self.store.get(f"q/{quorum.number}/here/{rank}")):
                raise RuntimeError(f"the gloo connection of rank {rank} in quorum {quorum.number} is not from rank "
                                   f"{rank} (its token differs from the rendezvous store's): the group is dropped")
        pairs = [(int(k[0]), int(k[1])) for k in keys]
        best = max(pairs)
        source = pairs.index(best)  # the lowest member with it
        if all(pair == best for pair in pairs) and (best[0] >= 0 or quorum.number == 0):
            self.held_in = quorum.number
            return None
        flat = on_host([t.detach().reshape(-1) for t in state.tensors.values()])
        quorum.group.broadcast(flat, source).wait()
        size = flat.numel() * flat.element_size()
        if quorum.members[source] == self.rank:
            self.traffic.add_sent(ALLREDUCE_RANK, size * (len(quorum.members) - 1))
        else:
            self.traffic.add_received(ALLREDUCE_RANK, size)
        self.held_in = quorum.number  # only now: a rank whose broadcast failed keeps claiming its old state
        mine_pair = (int(mine[0]), int(mine[1]))
        if mine_pair == best:
            return None
        origin = ", from its checkpoint" if mine_pair[0] < 0 else ""
        self._tell(f"rank {self.rank} took up the state of rank {quorum.members[source]} at step {best[1]} in quorum "
                   f"{quorum.number} (it was at step {state.clock}{origin})", "INFO", best[1])
        return Message(state.kind, ALLREDUCE_RANK, self.rank, _split(flat, state.tensors), clock=best[1])

    def _watch(self) -> None:
        """Look for a rank waiting in the quorum after this rank's (it raises the flag of the next step); a store
        that is away is tried again at the next look."""
        while not self._closed.wait(WATCH_POLL_S) and not self.stop.is_set():
            quorum = self.quorum
            if quorum is None or self.waiting.is_set():
                continue
            try:
                if self._knocked() and self.quorum is quorum:
                    self.waiting.set()
            except RuntimeError as error:
                log.debug("job %s: the rendezvous store does not answer (%s)", self.job_id, _first_line(error))

    def _knocked(self) -> bool:
        """Whether a rank came to form a quorum since this one did (or the store restarted empty)."""
        return int(self.store.add("knocks", 0)) != self._knocks

    def hand_over(self) -> None:
        """This rank took the job's last step: from now on, until the job ends, it hands the final state to a rank
        that comes back late (it forms a quorum with it, as at any step), in a thread of its own: the node's
        algorithm no longer changes."""
        if self._finisher.ident is None:
            self._finisher.start()

    def _serve_finished(self) -> None:
        while not self._closed.wait(WATCH_POLL_S) and not self.stop.is_set():
            try:
                if not self._knocked():  # the runner is done with this store
                    continue
                self._leave()
                step = self.member.group_state().clock
                self.quorum = self._form(step)
                self._agree(self.quorum)
            except RuntimeError as error:  # the store away, a member lost: the next look tries again
                self.quorum = None
                log.debug("job %s: handing the final state over failed (%s)", self.job_id, _first_line(error))

    def _tell(self, message: str, level: str, step: int) -> None:
        if self.announce is not None:
            self.announce(message, level, step)
        else:
            log.log(logging.getLevelName(level), "job %s: %s", self.job_id, message)

    def close(self) -> None:
        self._closed.set()
        self.quorum = None
        for thread in (self._watcher, self._finisher):
            if thread.ident is not None and thread is not threading.current_thread():  # not left in a store call
                thread.join(timeout=WATCH_POLL_S + CALL_TIMEOUT_S)  # when the process exits


def _closed(value: str) -> tuple[int, tuple[int, ...]]:
    """A closed quorum's `members` value: `knocks` then, and its members (none when it was given up)."""
    if value == ABANDONED:
        return 0, ()
    knocks, members = value.split("|")
    return int(knocks), tuple(int(rank) for rank in members.split(","))


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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
