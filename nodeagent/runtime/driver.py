"""The node driver: the policy that runs one node of a job, written once for both runtimes.

The driver owns the order of work and every rule of it; it performs no I/O, starts no thread and reads time
only through the clock it is given (the agent's monotonic clock, or the simulator's virtual one). Its executors,
the agent's runner thread (nodeagent.agent.runner) and the simulator (nodeagent.runtime.simulator), only perform
what it decides and tell it what happened:

    arrived(item)    a peer's message, a reply to one of this node's sends, or the failure of one
    next()           absorb what arrived, then: STEP, WAIT (until something arrives) or DONE, with the sends to
                     perform now and the progress reports to publish
    step()           run one local step (the executor then takes as long as the step takes)
    stepped(d)       the step took d seconds; the sends to perform now
    due_retries()    the sends to perform again now
    rejoin()         (before the first next()) this node's rank ran before: take the job up where its neighbours are
    join(at_step)    (before the first next()) this node joins a running elastic job: take the model up from its
                     neighbours

The rules, each in one place:
- Order of work: the initial model is evaluated before anything received is mixed in; then what arrived is
  handed to the algorithm (a message of a round beyond `Algorithm.rounds_ahead()` is dropped and counted instead;
  and, for algorithms whose answers make sends, those are sent); the node waits until
  the algorithm is ready; evaluation is due every `eval_every` steps and at the last; then the next step.
- Flow control: one exchange or pull per edge in flight; a due one on a busy edge is not sent, and the
  algorithm hears of it as a failure "in_flight" (no call was made, so it costs the peer nothing).
- Retries: a push to a peer is retried until it is delivered (synchronous rounds rely on every push, even after
  this node finished); a call to the parameter server that failed transiently is retried with the same call id
  (applied once), at once after a deadline. Both back off: RETRY_FIRST_S, doubling up to RETRY_MAX_S; the first
  failure of a send is logged, and its delivery after failures. Any other failure goes to the algorithm's
  `failed()`.
- Step reports: a call to the parameter server carries the duration of the step that made it.
- Accounting: compute time is the executor's measure of each step; wait time is the time from the end of a
  step (or the start) until the node is found ready again, less the time spent evaluating, counted as it passes;
  traffic is what the transports count where bytes are sent and received (`traffic`), per peer. A node that waits
  longer than WAIT_LOG_S says once what for (`Algorithm.waiting_for()`), and keeps reporting its progress.
- Per-edge accounting (what `coordinator edges` and the edge gauges show): per peer, the messages sent and
  received, the time of the last message (one received, or a call that completed), the mean time between them,
  since when an exchange or pull is in flight, failures by reason, the clock of the peer's last message (its
  staleness is this node's clock minus it) and, at report time only, the algorithm's `consensus_distance()`.
- Rejoining: a node restarted in a running job (its live state lost since its checkpoint) first pulls what each
  neighbour serves (`Algorithm.rejoin_kind()`), holding back everything else that arrives, then hands the states to
  `Algorithm.rejoin()`, whose sends let the neighbours finish the rounds they wait in; the pulls are retried like
  pushes. A node of the collective family heals instead: before its first step it sends its group state as a
  PARAMS message on the all-reduce route, and waits for the group's (the all-reduce's answer).
- Joining: a node that joins a running elastic job pulls what each neighbour serves (`Algorithm.join_kind()`) the
  same way, and hands the states to `Algorithm.join()` with the step its neighbours switch to the topology that
  includes it; it is not evaluated at the job's initial model (it starts from theirs). It gives up on a neighbour
  after JOIN_PULL_ATTEMPTS failed pulls (that neighbour may be leaving) and joins from the others' states.
- Topology changes (`change_topology`): every node of the job switches just before the same step, the change's
  `at_step`, so that a round is sent and absorbed in one topology. From the moment the change is known the
  algorithm accepts the new neighbours, whose messages are held until this node switches (they may switch
  first); after the switch the messages of the old neighbours that are no longer neighbours count only for the
  steps before it (a push-sum share sent before the switch must still be absorbed), later ones are dropped and
  counted. A node that learns of a change when it has passed its step already (a late assignment) switches at
  once and says so: its neighbours switched at the step, so rounds between the two are mixed in different
  topologies (the coordinator's margin makes this rare). The edges a switch drops leave the node's per-edge
  report (their bytes stay in its totals), so that a dropped edge is not taken for a stalled one.
- After the last step the node absorbs nothing more: it serves its final snapshot and only finishes its retries.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from nodeagent.algorithms.base import ALLREDUCE_RANK, Family, Loss, Neighbor, Route, Send
from nodeagent.ps.messages import SERVER_NAME, SERVER_RANK, ServerAnswer
from nodeagent.runtime.progress import IN_FLIGHT, EdgeCounters, MemberJudgement, Progress, Traffic
from nodeagent.training.job import Node
from nodeagent.wire.errors import Reason
from nodeagent.wire.message import Kind, Message

log = logging.getLogger("nodeagent")

RETRY_FIRST_S = 1.0  # the first retry of a failed push or server call comes this long after the failure,
RETRY_MAX_S = 30.0  # and each next one twice as long after its failure, up to this
WAIT_LOG_S = 10.0  # a wait longer than this is logged, once
# A node that joins a running job gives up pulling from a neighbour after this many failed tries (about 15 s with
# the back-off) and takes the model up from the others: that neighbour may be leaving the job.
JOIN_PULL_ATTEMPTS = 5
# Messages of a neighbour to come are held until this node switches, at most this many per neighbour: beyond, its
# oldest is dropped (counted as Reason.HELD_OVERFLOW). An asynchronous algorithm's newer message supersedes an older
# one, and a synchronous neighbour runs at most its `rounds_ahead()` ahead, far fewer.
HELD_PER_PEER = 16
ALLREDUCE_NAME = "allreduce"  # the all-reduce in edge metrics


@dataclass
class EdgeLog:
    """What the driver keeps about one edge between reports (times on the driver's clock)."""

    messages_sent: int = 0
    messages_received: int = 0
    first_message: float = math.nan
    last_message: float = math.nan
    messages: int = 0  # the messages whose times are kept: received ones and completed calls
    failure_reasons: dict[str, int] = field(default_factory=dict)
    last_failure: float = math.nan
    peer_clock: int | None = None  # the clock of the peer's last message

    def message(self, now: float) -> None:
        if self.messages == 0:
            self.first_message = now
        self.last_message = now
        self.messages += 1

    def failure(self, reason: str, now: float | None) -> None:
        """`now`: when a call failed; None for a send that was never made (an in_flight skip)."""
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1
        if now is not None:
            self.last_failure = now

    def counters(self, peer: str, now: float, traffic: tuple[int, int], exchanges: int, failures: int,
                 in_flight_since: float | None, clock: int, consensus_distance: float | None,
                 robust_clipped: int = 0, robust_outlying: int = 0, robust_judged: int = 0,
                 judged: tuple[MemberJudgement, ...] = ()) -> EdgeCounters:
        interval = (self.last_message - self.first_message) / (self.messages - 1) if self.messages > 1 else math.nan
        return EdgeCounters(
            peer, traffic[0], traffic[1], exchanges, failures, messages_sent=self.messages_sent,
            messages_received=self.messages_received, last_message_age_s=now - self.last_message,
            message_interval_s=interval, in_flight_s=0.0 if in_flight_since is None else now - in_flight_since,
            failure_reasons=dict(self.failure_reasons), last_failure_age_s=now - self.last_failure,
            staleness_steps=math.nan if self.peer_clock is None else float(clock - self.peer_clock),
            consensus_distance=math.nan if consensus_distance is None else consensus_distance,
            robust_clipped=robust_clipped, robust_outlying=robust_outlying, judged=judged, robust_judged=robust_judged,
        )


@dataclass(frozen=True)
class Transmission:
    """A send the driver asks its executor to perform."""

    send: Send
    step_s: float = math.nan  # the duration of the step that made it (calls to the parameter server carry it)
    call_id: str = ""  # names a call to the parameter server; a retry carries the same id


@dataclass(frozen=True)
class Reply:
    """A transmission completed: the exchange's or pull's reply, the all-reduce mean, the server's answer, or
    None for a delivered push."""

    transmission: Transmission
    answer: Message | ServerAnswer | None


@dataclass(frozen=True)
class Failure:
    """A transmission failed; `reason` is the failure label of the metrics, `transient` whether a retry may cure
    it."""

    transmission: Transmission
    reason: str
    transient: bool = False


Arrival = Message | Reply | Failure


@dataclass(frozen=True)
class TopologyChange:
    """A node's place in a job's new topology, and the step before which it switches to it."""

    at_step: int
    neighbors: tuple[Neighbor, ...]
    self_weight: float
    peer_schedule: tuple[tuple[int, ...], ...]
    description: str  # for the log, e.g. "ring -> multiplex-ring (version 2)"


@dataclass(frozen=True)
class Switch:
    """A topology change this node applied: at which step, at what time on the driver's clock, and whether late."""

    change: TopologyChange
    step: int
    time: float

    @property
    def late(self) -> bool:
        return self.step > self.change.at_step


class Action(enum.Enum):
    STEP = "step"  # call step(), take the step's time, then stepped()
    WAIT = "wait"  # call next() again once something arrived (or a retry is due)
    DONE = "done"  # the last step is done and evaluated; keep serving until the job ends


@dataclass(frozen=True)
class Report:
    """Progress to publish (to the coordinator, or to the run's log). `evaluated`: the model was just evaluated
    (the agent checkpoints then)."""

    progress: Progress
    evaluated: bool


@dataclass(frozen=True)
class Decision:
    action: Action
    sends: tuple[Transmission, ...] = ()
    reports: tuple[Report, ...] = ()


class NodeMetrics(Protocol):
    """What a driver reports for its node's metrics, as they happen: an executor passes its own series
    (nodeagent.metrics.NodeSeries, Prometheus), so that the driver holds no metrics library."""

    def stepped(self, seconds: float) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def trained(self, loss: float) -> None: ...
    def evaluated(self, accuracy: float, loss: float, perplexity: float) -> None: ...
    def exchange_failed(self, peer: str, reason: str) -> None: ...
    def stream_rejected(self, sender: str, reason: str) -> None: ...


class Unrecorded:
    """NodeMetrics that records nothing: for a run whose series no one reads (the `coordinator simulate` command
    serves no /metrics; at 10,000 nodes their upkeep cost a few percent of the run)."""

    def stepped(self, seconds: float) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def trained(self, loss: float) -> None:
        pass

    def evaluated(self, accuracy: float, loss: float, perplexity: float) -> None:
        pass

    def exchange_failed(self, peer: str, reason: str) -> None:
        pass

    def stream_rejected(self, sender: str, reason: str) -> None:
        pass


class NodeDriver:
    def __init__(self, node: Node, *, job: str, name: str, clock: Callable[[], float], metrics: NodeMetrics,
                 name_of: Callable[[int], str], report_every_s: float | None = None):
        """`name` labels this node in metrics and progress, `name_of(rank)` its peers; `report_every_s` adds a
        progress report between evaluations at most that often (None: only at evaluations)."""
        self.node = node
        self.algorithm = node.algorithm
        self.job = job
        self.name = name
        self.clock = clock
        self.metrics = metrics
        self.name_of = name_of
        self.report_every_s = report_every_s
        self.traffic = Traffic()
        self.done = False
        self.loss: Loss = math.nan
        self.accuracy = math.nan
        self.test_loss = math.nan
        self.perplexity = math.nan
        self.compute_s = 0.0
        self.wait_s = 0.0
        self.exchanges = 0
        self.failures = 0
        self.samples = 0  # trained on, over all local steps
        self.local_steps = 0
        self._exchanges_with: dict[int, int] = {}
        self._failures_with: dict[int, int] = {}
        self._started: float | None = None
        self._idle_since: float | None = None  # the end of the last step, until the node is found ready again
        self._evaluating_s = 0.0  # time spent evaluating since then
        self._waited_in_gap = 0.0  # the part of the time since then already counted as waiting
        self._wait_logged = False
        self._step_began = 0.0
        self._evaluated_at = -1
        self._reported = -math.inf
        self._reported_counters: tuple[tuple[int, int], int, int] | None = None
        self._in_flight: dict[int, float] = {}  # peer -> since when its exchange or pull is in flight
        self._edges: dict[int, EdgeLog] = {}
        self._waiting = False  # the algorithm is not ready: the node waits
        self._arrived: list[Message | ServerAnswer | Failure] = []
        self._retries: list[tuple[float, int, Transmission]] = []
        self._attempts: dict[int, int] = {}  # id of a transmission being retried -> its failed attempts
        self._joining: dict[int, Message | None] | None = None  # while rejoining: each neighbour's state, once pulled
        self._join_at: int | None = None  # joining a running job (not rejoining): its switch step
        self._changes: list[TopologyChange] = []  # topology changes to come, by step
        self._held: list[Message] = []  # messages of the next topology's new neighbours, until the switch
        self._former: frozenset[int] = frozenset()  # neighbours that the last switch dropped
        self._switched_at = 0  # the step of the last switch
        self._dropped: set[int] = set()  # neighbours that switches dropped and none brought back: not reported
        # Neighbours a switch dropped since the last report: reported once more, with the bytes they carried since
        # the report before (the coordinator adds each edge's traffic up to the node's total).
        self._dropping: set[int] = set()
        self.switches: list[Switch] = []
        self._join_pulls: set[int] = set()  # ids of the pulls of rejoining
        # A restarted node of the collective family: its request for the group's state, to send before its first
        # step (a Send), then sent (its Transmission) until the answer came (None).
        self._heal: Send | Transmission | None = None
        self._sequence = itertools.count()
        self._calls = itertools.count()
        self._incarnation = uuid.uuid4().hex[:12]  # call ids stay unique across restarts of the node

    # -- what the executor tells the driver ------------------------------------------------------------------------

    def arrived(self, item: Arrival) -> float | None:
        """Something arrived for this node; it is handed to the algorithm at the next `next()`. Returns the time
        at which a retry this failure calls for is due (`due_retries()` then returns it), or None."""
        if isinstance(item, Message):
            self._edge_message(item.sender, item)
            if not self.done:
                self._arrived.append(item)
            return None
        send = item.transmission.send
        if send.route in (Route.EXCHANGE, Route.PULL):
            self._in_flight.pop(send.peer, None)
        if isinstance(item, Reply):
            self._edge_message(send.peer, item.answer if isinstance(item.answer, Message) else None)
        if isinstance(item, Reply) and item.transmission is self._heal:
            self._heal = None  # the group's state, handed to the algorithm at the next next(): healed
        if isinstance(item, Reply) and id(item.transmission) in self._join_pulls and self._joining is not None:
            self._join_pulls.discard(id(item.transmission))
            assert isinstance(item.answer, Message)
            self._joining[send.peer] = item.answer
            self.exchanges += 1
            return None
        if isinstance(item, Reply):
            self.exchanges += 1
            self._exchanges_with[send.peer] = self._exchanges_with.get(send.peer, 0) + 1
            attempts = self._attempts.pop(id(item.transmission), 0)
            if attempts:
                log.info("job %s: %s to %s went through after %d failed tries", self.job, send.route,
                         self.peer_name(send.peer), attempts)
            if item.answer is not None and not self.done:
                self._arrived.append(item.answer)
            return None
        self._count_failure(send.peer, item.reason)
        if self._join_given_up(item):
            return None
        if not self._retried(item):
            if not self.done:
                self._arrived.append(item)
            return None
        attempts = self._attempts.get(id(item.transmission), 0) + 1
        self._attempts[id(item.transmission)] = attempts
        if attempts == 1:
            log.warning("job %s: %s to %s failed (%s); retrying with back-off", self.job, send.route,
                        self.peer_name(send.peer), item.reason)
        if item.reason == "deadline_exceeded" and send.route == Route.SERVER:
            delay = 0.0  # a slow round, not a lost server: ask again at once, with the same id
        else:
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
        due = self.clock() + delay
        heapq.heappush(self._retries, (due, next(self._sequence), item.transmission))
        return due

    def _join_given_up(self, failure: Failure) -> bool:
        """Whether a failed pull of joining was the last one tried (JOIN_PULL_ATTEMPTS): then the node joins
        without that neighbour's state."""
        key = id(failure.transmission)
        if self._join_at is None or self._joining is None or key not in self._join_pulls or \
                self._attempts.get(key, 0) + 1 < JOIN_PULL_ATTEMPTS:
            return False
        peer = failure.transmission.send.peer
        self._join_pulls.discard(key)
        self._attempts.pop(key, None)
        self._joining.pop(peer, None)
        log.warning("job %s: %s gave up pulling from %s to join (%s, %d tries): it joins from its other neighbours",
                    self.job, self.name, self.peer_name(peer), failure.reason, JOIN_PULL_ATTEMPTS)
        return True

    def _retried(self, failure: Failure) -> bool:
        """Whether a failed transmission is tried again; otherwise the algorithm hears of the failure."""
        route = failure.transmission.send.route
        if id(failure.transmission) in self._join_pulls:
            return True
        return route == Route.PUSH or (route == Route.SERVER and failure.transient)

    def rejoin(self) -> None:
        """This node's rank ran before, and its live state since its checkpoint is lost (a restart): before its next
        step it takes the job up where its neighbours are, if its algorithm needs to: from its neighbours' states, or
        in the collective family from the group's, which the all-reduce answers to its own state sent as a PARAMS
        message (nodeagent.agent.collective), before it trains steps it would throw away."""
        if type(self.algorithm).family is Family.COLLECTIVE:
            state = self.algorithm.group_state()  # type: ignore[attr-defined]
            self._heal = Send(Route.ALLREDUCE, ALLREDUCE_RANK, Kind.PARAMS, state)
            return
        if self.algorithm.rejoin_kind() is not None and self.algorithm.context.neighbors:
            self._joining = dict.fromkeys(self.algorithm.context.neighbor_ranks)

    def join(self, at_step: int) -> None:
        """This node joins a running job (elastic membership) whose nodes switch to the topology that includes it
        just before step `at_step`: before its first step it takes the model up from its neighbours."""
        self._join_at = at_step
        if self.algorithm.join_kind() is not None and self.algorithm.context.neighbors:
            self._joining = dict.fromkeys(self.algorithm.context.neighbor_ranks)
        else:
            self.algorithm.join({}, at_step)
            log.info("job %s: %s joined at step %d", self.job, self.name, self.algorithm.clock)

    def _join(self) -> tuple[bool, list[Transmission]]:
        """While rejoining or joining: whether the algorithm has taken the job up, and what to send (the pulls at
        first; the algorithm's sends once every neighbour's state is in)."""
        assert self._joining is not None
        if any(state is None for state in self._joining.values()):
            if self._join_pulls:
                return False, []  # pulled already: waiting for the answers (or their retries)
            kind = self.algorithm.rejoin_kind() if self._join_at is None else self.algorithm.join_kind()
            assert kind is not None
            pulls = self._transmissions([Send(Route.PULL, peer, kind) for peer in self._joining], math.nan)
            self._join_pulls = {id(t) for t in pulls}
            return False, pulls
        states = {rank: state for rank, state in self._joining.items() if state is not None}
        self._joining = None
        where = ", ".join(f"rank {rank} at {state.clock}" for rank, state in states.items())
        if self._join_at is not None:
            self.algorithm.join(states, self._join_at)
            log.info("job %s: %s joined at step %d, from its neighbours' models (%s)", self.job, self.name,
                     self.algorithm.clock, where)
            return True, []
        sends = self._transmissions(self.algorithm.rejoin(states), math.nan)
        log.info("job %s: %s rejoined at step %d, where its neighbours are (%s)", self.job, self.name,
                 self.algorithm.clock, where)
        return True, sends

    def change_topology(self, change: TopologyChange) -> None:
        """Switch to a new topology just before step `change.at_step` (at the next `next()` if this node is past
        it); the algorithm accepts the new neighbours from now on."""
        self._changes.append(change)
        self._changes.sort(key=lambda c: c.at_step)
        self.algorithm.expect_neighbors(tuple(n.rank for n in change.neighbors))

    def _switch(self) -> bool:
        """Apply the changes whose step has come, and queue what their new neighbours sent meanwhile; whether any
        was applied."""
        algorithm = self.algorithm
        switched = False
        while self._changes and self._changes[0].at_step <= algorithm.clock:
            change = self._changes.pop(0)
            before = set(algorithm.context.neighbor_ranks)
            algorithm.change_topology(replace(algorithm.context, neighbors=change.neighbors,
                                              self_weight=change.self_weight, peer_schedule=change.peer_schedule))
            after = set(algorithm.context.neighbor_ranks)
            self._former = frozenset(before - after)
            self._dropping = (self._dropping | self._former) - after
            self._dropped -= after
            self._switched_at = algorithm.clock
            switch = Switch(change, algorithm.clock, self.clock())
            self.switches.append(switch)
            if switch.late:
                log.warning("job %s: %s switched topology %s at step %d, late: the job switched at step %d",
                            self.job, self.name, change.description, algorithm.clock, change.at_step)
            else:
                log.info("job %s: %s switched topology %s at step %d: neighbours %s (new %s, dropped %s)", self.job,
                         self.name, change.description, algorithm.clock, sorted(after), sorted(after - before),
                         sorted(before - after))
            self._arrived[:0], self._held = self._held, []
            switched = True
        return switched

    def _hand_over(self, sends: list[Transmission]) -> None:
        """Hand what arrived to the algorithm (adding the sends its answers make to `sends`)."""
        if not self._arrived:
            return
        algorithm = self.algorithm
        arrived, self._arrived = self._arrived, []
        for item in arrived:
            if isinstance(item, Failure):
                algorithm.failed(item.transmission.send, item.reason)
            elif not (isinstance(item, Message) and (not self._admitted(item) or self._too_far_ahead(item))):
                algorithm.receive(item)
        if algorithm.sends_after_receive:
            sends.extend(self._transmissions(algorithm.sends(), math.nan))

    def _admitted(self, message: Message) -> bool:
        """Whether a peer's message goes to the algorithm now, across topology changes (see the module's rules);
        a message of a neighbour to come is held."""
        if not self._changes and not self._former:
            return True  # no topology change under way or behind
        sender = message.sender
        if sender in self.algorithm.context.neighbor_ranks or sender in (ALLREDUCE_RANK, SERVER_RANK):
            return True
        if any(sender in (n.rank for n in change.neighbors) for change in self._changes):
            held = [index for index, kept in enumerate(self._held) if kept.sender == sender]
            if len(held) >= HELD_PER_PEER:
                del self._held[held[0]]
                self.metrics.stream_rejected(self.peer_name(sender), Reason.HELD_OVERFLOW)
            self._held.append(message)
            return False
        if sender in self._former and message.clock >= self._switched_at:
            self.metrics.stream_rejected(self.peer_name(sender), Reason.FORMER_NEIGHBOR)
            return False
        return True

    def due_retries(self) -> list[Transmission]:
        now = self.clock()
        due = []
        while self._retries and self._retries[0][0] <= now:
            due.append(heapq.heappop(self._retries)[2])
        for transmission in due:
            self._edge(transmission.send.peer).messages_sent += 1
        return due

    # -- the order of work -----------------------------------------------------------------------------------------

    def next(self) -> Decision:
        now = self.clock()
        if self._started is None:
            self._started = self._idle_since = now
        if self.done:
            # A finished node still serves its neighbours' exchanges: what that adds to its traffic is reported too.
            if self.report_every_s is not None and now - self._reported >= self.report_every_s \
                    and self._counters() != self._reported_counters:
                return Decision(Action.DONE, reports=(self._report(evaluated=False),))
            return Decision(Action.DONE)
        algorithm = self.algorithm
        reports: list[Report] = []
        if self._evaluated_at < 0 and algorithm.clock == 0 and self._join_at is None:
            # The curve starts at the shared initial model, before anything received is mixed in.
            reports.append(self._evaluate())
        self._switch()
        sends: list[Transmission] = []
        if self._joining is not None:
            joined, sends = self._join()
            if not joined:  # what arrived meanwhile waits for the algorithm's new state
                return Decision(Action.WAIT, tuple(sends), tuple(reports))
        if isinstance(self._heal, Send):
            (self._heal,) = self._transmissions([self._heal], math.nan)
            return Decision(Action.WAIT, (*sends, self._heal), tuple(reports))
        if self._heal is not None:  # the group's state has not come yet
            return Decision(Action.WAIT, tuple(sends), tuple(reports))
        self._hand_over(sends)
        if self._switch():  # a synchronous round completed on receipt, and the switch step came with it
            self._hand_over(sends)
        if not algorithm.ready():
            now = self.clock()
            self._waiting = True
            self._count_wait(now)
            if not self._wait_logged and self._waited_in_gap > WAIT_LOG_S:
                self._wait_logged = True
                log.warning("job %s: %s has waited %.0f s at step %d for %s", self.job, self.name,
                            self._waited_in_gap, algorithm.clock, algorithm.waiting_for())
            if self.report_every_s is not None and now - self._reported >= self.report_every_s:
                reports.append(self._report(evaluated=False))
            return Decision(Action.WAIT, tuple(sends), tuple(reports))
        self._ready(self.clock())
        # A step is complete once the algorithm is ready again (synchronous modes finish it on receipt).
        spec = self.node.spec
        self.done = algorithm.clock >= spec.steps
        if (algorithm.clock % spec.eval_every == 0 or self.done) and algorithm.clock != self._evaluated_at:
            reports.append(self._evaluate())
        elif self.done or (self.report_every_s is not None and now - self._reported >= self.report_every_s):
            reports.append(self._report(evaluated=False))
        if self.done:
            self._arrived.clear()
            return Decision(Action.DONE, tuple(sends), tuple(reports))
        return Decision(Action.STEP, tuple(sends), tuple(reports))

    def step(self) -> float:
        """One local step on the next minibatch; returns its compute time on the driver's clock."""
        inputs, targets = self.node.batches.next()
        self.samples += inputs.shape[0]  # not len(): a tensor's __len__ is Python, and this runs every step
        self.local_steps += 1
        self._step_began = self.clock()
        self.loss = self.algorithm.step(inputs, targets)  # on a GPU: read at the next report, not now
        return self.clock() - self._step_began

    def stepped(self, duration_s: float) -> list[Transmission]:
        """The step took `duration_s` (the agent's measure with its slow-down, the simulator's virtual time);
        returns its sends."""
        self.compute_s += duration_s
        self._idle_since = self._step_began + duration_s
        self._evaluating_s = self._waited_in_gap = 0.0
        self._wait_logged = False
        self.metrics.stepped(duration_s)
        return self._transmissions(self.algorithm.sends(), duration_s)

    # -- the rules -------------------------------------------------------------------------------------------------

    def _transmissions(self, sends: list[Send], step_s: float) -> list[Transmission]:
        out = []
        for send in sends:
            if send.route in (Route.EXCHANGE, Route.PULL):
                if send.peer in self._in_flight:
                    self.metrics.exchange_failed(self.name_of(send.peer), IN_FLIGHT)
                    self._edge(send.peer).failure(IN_FLIGHT, None)
                    self._arrived.append(Failure(Transmission(send), IN_FLIGHT))
                    continue
                self._in_flight[send.peer] = self.clock()
            self._edge(send.peer).messages_sent += 1
            if send.route == Route.SERVER:
                out.append(Transmission(send, step_s, f"{self._incarnation}-{next(self._calls)}"))
            else:
                out.append(Transmission(send))
        return out

    def _too_far_ahead(self, message: Message) -> bool:
        """Whether a peer's message is of a round beyond the algorithm's window (then it is counted, and dropped
        rather than kept until that round). Checked as it is handed over, against the clock it meets there."""
        window = self.algorithm.rounds_ahead()
        if window is None or message.clock <= self.algorithm.clock + window:
            return False
        self.metrics.stream_rejected(self.peer_name(message.sender), Reason.FUTURE_CLOCK)
        return True

    def _count_wait(self, now: float) -> None:
        """Count the time since the last step ended, less evaluations, as waiting, as far as it has not been."""
        if self._idle_since is None:
            return
        waited = max(0.0, now - self._idle_since - self._evaluating_s)
        if waited > self._waited_in_gap:
            self.wait_s += waited - self._waited_in_gap
            self.metrics.waited(waited - self._waited_in_gap)
            self._waited_in_gap = waited

    def _ready(self, now: float) -> None:
        """The node is ready to go on: its wait (if any) is over."""
        self._count_wait(now)
        self._waiting = False
        if self._wait_logged:
            log.info("job %s: %s goes on after waiting %.0f s", self.job, self.name, self._waited_in_gap)
        self._idle_since = None

    def _evaluate(self) -> Report:
        began = self.clock()
        result = self.node.evaluate()
        self._evaluating_s += self.clock() - began
        self._evaluated_at = self.algorithm.clock
        self.accuracy, self.test_loss, self.perplexity = result.accuracy, result.loss, result.perplexity
        self.metrics.evaluated(result.accuracy, result.loss, result.perplexity)
        return self._report(evaluated=True)

    @property
    def figures(self) -> dict[str, float]:
        """The last evaluation's figures by their field of Progress (NaN: not a figure of the task, or none yet)."""
        return {"test_accuracy": self.accuracy, "test_loss": self.test_loss, "test_perplexity": self.perplexity}

    def _report(self, evaluated: bool) -> Report:
        self._reported = self.clock()
        self._reported_counters = self._counters()
        progress = self.progress()
        self._dropped |= self._dropping
        self._dropping = set()
        self.metrics.trained(progress.loss)
        return Report(progress, evaluated)

    def _counters(self) -> tuple[tuple[int, int], int, int]:
        return self.traffic.totals(), self.exchanges, self.failures

    def _count_failure(self, peer: int, reason: str) -> None:
        self.failures += 1
        self._failures_with[peer] = self._failures_with.get(peer, 0) + 1
        self._edge(peer).failure(reason, self.clock())
        self.metrics.exchange_failed(self.peer_name(peer), reason)

    def _edge(self, peer: int) -> EdgeLog:
        edge = self._edges.get(peer)
        if edge is None:
            edge = self._edges[peer] = EdgeLog()
        return edge

    def _edge_message(self, peer: int, message: Message | None) -> None:
        """A message on the edge to `peer`: one of the peer's, or a call to it that completed (with the peer's
        message as its reply, or none: a delivered push)."""
        edge = self._edge(peer)
        edge.message(self.clock())
        if message is not None:
            edge.messages_received += 1
            if peer >= 0:  # a neighbour's clock (not the server's or the all-reduce's)
                edge.peer_clock = message.clock

    def _waiting_for(self) -> str:
        return self.algorithm.waiting_for() if self._waiting and not self.algorithm.ready() else ""

    def peer_name(self, rank: int) -> str:
        if rank == SERVER_RANK:
            return SERVER_NAME
        if rank == ALLREDUCE_RANK:
            return ALLREDUCE_NAME
        return self.name_of(rank)

    def _judged(self) -> tuple[MemberJudgement, ...]:
        """Each member whose all-gathered rows this node's robust rule judged, with its counts (by rank)."""
        counts = self.algorithm.judged
        return tuple(MemberJudgement(rank, seen, counts.clipped.get(rank, 0) + counts.refused.get(rank, 0),
                                     counts.outlying.get(rank, 0) + counts.refused.get(rank, 0))
                     for rank, seen in sorted(counts.seen.items()))

    def progress(self) -> Progress:
        """The node's progress now; `finished` once its last step is done and evaluated."""
        now = self.clock()
        sent_to, received_from = self.traffic.snapshot()
        sent, received = sum(sent_to.values()), sum(received_from.values())
        peers = {*sent_to, *received_from, *self._exchanges_with, *self._failures_with, *self._edges} - self._dropped
        edges = sorted(
            (self._edge(peer).counters(
                self.peer_name(peer), now, (sent_to.get(peer, 0), received_from.get(peer, 0)),
                self._exchanges_with.get(peer, 0), self._failures_with.get(peer, 0), self._in_flight.get(peer),
                self.algorithm.clock, self.algorithm.consensus_distance(peer) if peer >= 0 else None,
                self.algorithm.robust_clipped(peer), self.algorithm.robust_outlying(peer),
                self.algorithm.robust_judged(peer), self._judged() if peer == ALLREDUCE_RANK else ())
             for peer in peers),
            key=lambda edge: edge.peer,
        )
        return Progress(
            job=self.job, rank=self.node.rank, node=self.name, step=self.algorithm.clock, loss=float(self.loss),
            test_accuracy=self.accuracy, test_loss=self.test_loss, test_perplexity=self.perplexity,
            elapsed_s=now - (self._started if self._started is not None else now), finished=self.done,
            bytes_sent=sent, bytes_received=received, compute_s=self.compute_s, wait_s=self.wait_s,
            exchanges=self.exchanges, exchange_failures=self.failures, time=now, edges=tuple(edges),
            local_steps=self.local_steps, waiting_for=self._waiting_for(),
        )
