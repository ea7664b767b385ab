"""The simulator: a job's nodes in one process, each run by the node driver the agents use, on a virtual clock.

Local steps run for real (real tensors, real gradients) but cost virtual time: the step time of a node is
`step_time_s / speed` (times a seeded jitter); a message on a directed link waits for the link to be free,
takes its fixed cost (`message_cost_s`: what the agents pay per message beside its bytes) and `bytes / bandwidth`,
then `latency`. Lost messages make the sender time out; nodes that are down or cut
off by a partition refuse connections at once, and a node that is down does not step. A step's sends leave when
its computation is done, and a peer answers an exchange from the snapshot it published at the end of its last
completed step, as the agent's servicer does. Everything else (what to do next, flow control, retries,
evaluation, accounting) is the driver's (nodeagent.runtime.driver).

The all-reduce (Route.ALLREDUCE and ALLGATHER, the collective family) is the agents' quorum policy in virtual time
(nodeagent.runtime.sim_collective): faults and partitions lose members, the others go on as a quorum without
them, and a member that comes back takes the group's state.

The parameter server (Route.SERVER, the centralised algorithms) is the same server half the coordinator hosts,
in this process, behind `SimulatedServer`, the simulator's ServerLink. It has one network interface: pushes
queue on its ingress and models on its egress, each at the network's bandwidth, plus the latency; step reports
and their answers (ESync) are small and cost the latency and their bytes, without queueing. The server's clock is
the virtual clock, so ESync's READY decision runs unchanged on virtual time; a report carries the step's virtual
duration. The server is always reachable (faults and partitions apply to peer links). Each worker's rounds (one
per model it receives) are measured as nodeagent.ps.RoundMetrics in `SimNode.rounds`: local steps, samples,
compute, aggregation (its push's and its model's time on the network, queueing included) and wait (the rest:
step reports, and waiting for the other workers).

Byzantine members (`simulation.byzantine`): a lying rank trains as the others do, and every tensor message it sends
(a push, an exchange's request or answer, a pull's answer, a push to the parameter server) is replaced by its
attack's (nodeagent.byzantine), forged against the latest honest messages of the same kind, which the mesh keeps.
A liar of an asynchronous server with `pushes: N` sends each forged update N times, one after the other through the
server's ingress, and gets the answer to the last (a worker that pushes as often as the server answers it, which a
simulated rank, whose steps end with its job, could not be otherwise). The copies of its step c claim steps c * N to
c * N + N - 1: the server applies a worker's push once per step (nodeagent.ps.server), so copies of one step would
be one push, and this liar spends the job's steps in its first steps / N.

Everything is deterministic for a given seed: one heap ordered by (time, sequence number) and one generator.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from prometheus_client import Counter

from nodeagent.agent.quorum import QuorumOptions
from nodeagent.algorithms import Family, Snapshot, build_server
from nodeagent.algorithms.base import Route, SendFailed
from nodeagent.byzantine import forge
from nodeagent.defaults import REPORT_INTERVAL_S
from nodeagent.jobspec import ByzantineSpec, SimulationSpec
from nodeagent.metrics import Metrics
from nodeagent.ps.esync import RoundMetrics
from nodeagent.ps.link import Answered, ServerLink
from nodeagent.ps.messages import (
    SERVER_NAME,
    SERVER_RANK,
    ReadyAnswer,
    ServerModel,
    ServerPull,
    ServerPush,
    StepReport,
)
from nodeagent.ps.server import ServerHalf
from nodeagent.runtime.driver import (
    Action,
    Arrival,
    Failure,
    NodeDriver,
    Reply,
    Report,
    Switch,
    Transmission,
    Unrecorded,
)
from nodeagent.runtime.sim_collective import SimulatedQuorum
from nodeagent.training.job import Node
from nodeagent.wire.message import Kind, Message

# Bytes of a request that carries no tensors (a pull, a step report, its answer): its frames' headers.
REQUEST_BYTES = 64

# Young collections between two full ones of the cyclic garbage collector while nodes are built and run (Python's
# default: 10, and no more often than the long-lived objects grow by a quarter).
FULL_COLLECTION_EVERY = 1000


@contextlib.contextmanager
def rare_full_collections() -> Iterator[None]:
    """Makes full collections rare while it lasts. Thousands of nodes are millions of long-lived objects (modules,
    tensors, Prometheus series), and each full collection walks them all: at 10,000 nodes they cost a quarter of the
    build and a tenth of a run. The simulator makes no reference cycles of note; young collections go on as usual."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, FULL_COLLECTION_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)


@dataclass
class RoundMeter:
    """A worker's current round with the parameter server (from one model received to the next)."""

    started: float = 0.0
    steps: int = 0
    samples: int = 0
    compute: float = 0.0
    network: float = 0.0
    sent: int = 0
    received: int = 0

    def end(self, now: float) -> RoundMetrics | None:
        """The round that ends now (None if it took no time); the meter starts the next one."""
        elapsed = now - self.started
        metrics = None
        if elapsed > 0:
            aggregation = min(self.network, elapsed)
            wait = max(0.0, elapsed - self.compute - aggregation)
            metrics = RoundMetrics(self.steps, self.samples, self.compute, wait, aggregation, elapsed, self.sent,
                                   self.received)
        self.started = now
        self.steps = self.samples = self.sent = self.received = 0
        self.compute = self.network = 0.0
        return metrics


@dataclass
class SimNode:
    node: Node
    driver: NodeDriver
    name: str
    step_time_s: float
    visible: Snapshot  # what peers are answered from: the snapshot of the last completed step
    computing: bool = False
    waiting: bool = False
    round: RoundMeter = field(default_factory=RoundMeter)
    switches_seen: int = 0  # of the driver's topology switches, those told to the mesh's on_switch
    rounds: list[RoundMetrics] = field(default_factory=list)
    link: ServerLink | None = None

    @property
    def rank(self) -> int:
        return self.node.rank

    @property
    def done(self) -> bool:
        return self.driver.done


Observer = Callable[["VirtualMesh", SimNode, Report], None]
SwitchObserver = Callable[["VirtualMesh", SimNode, Switch], None]


class VirtualMesh:
    """Runs a job's nodes to completion in virtual time. `observe(mesh, node, report)` is called with each of a
    node's progress reports (the place to write the metrics log), `on_switch(mesh, node, switch)` when a node
    switches to a new topology. `metrics` gets the nodes' Prometheus series, for a caller that reads them; with
    None, no series are kept."""

    def __init__(self, nodes: list[Node], job: str, simulation: SimulationSpec, metrics: Metrics | None,
                 observe: Observer | None = None, on_switch: SwitchObserver | None = None):
        self.job = job
        self.on_switch = on_switch
        self.simulation = simulation
        self.network = simulation.network
        self.metrics = metrics
        self.observe = observe
        self.rng = np.random.default_rng(simulation.seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None], bool]] = []  # (time, sequence, action, background)
        self._work = 0  # queued events that are not background: the run ends when none is left
        self._cancelled: set[int] = set()  # queued events that will not happen (`cancel`)
        self._started = False  # every node's first step is queued (the first run)
        self._sequence = itertools.count()
        self._link_free_at: dict[tuple[int, int], float] = {}
        # Each edge's byte counters, looked up once: a labelled lookup costs more than a small model's message.
        self._edge_counters: dict[tuple[int, int], tuple[Counter, Counter]] = {}
        # Each partition's group of every rank it names, once: asked per message, it cost O(nodes) each time.
        self._sides = [{rank: index for index, group in enumerate(partition.groups) for rank in group}
                       for partition in simulation.partitions]
        self.liars: dict[int, ByzantineSpec] = {rank: group for group in simulation.byzantine for rank in group.ranks}
        # The latest honest message tensors of each kind, by sender: what the liars forge against.
        self._honest: dict[Kind, dict[int, Mapping[str, torch.Tensor]]] = {}
        self._attack_generator = torch.Generator().manual_seed(simulation.seed)
        speeds = simulation.speeds or [1.0] * len(nodes)
        with rare_full_collections():
            self.nodes = [
                SimNode(
                    node=n, name=self.name_of(n.rank), visible=n.algorithm.snapshot(),
                    driver=NodeDriver(n, job=job, name=self.name_of(n.rank), clock=self.clock,
                                      metrics=Unrecorded() if metrics is None
                                      else metrics.node(job, self.name_of(n.rank)),
                                      name_of=self.name_of, report_every_s=self._report_every_s(n)),
                    step_time_s=max(simulation.step_time_s / speeds[n.rank] * n.spec.slowdown.get(n.rank, 1.0),
                                    n.spec.min_step_s),
                )
                for n in nodes
            ]
        self.collective: SimulatedQuorum | None = None
        if nodes and type(nodes[0].algorithm).family is Family.COLLECTIVE:
            failure = nodes[0].spec.failure
            self.collective = SimulatedQuorum(self, QuorumOptions(
                step_timeout_s=failure.step_timeout_s, join_s=failure.join_s,
                min_members=nodes[0].spec.quorum_minimum, wait_s=failure.lost_grace_s + failure.step_timeout_s))
        self.server: SimulatedServer | None = None
        if nodes and type(nodes[0].algorithm).family is Family.SERVER:
            self.server = SimulatedServer(self, build_server(nodes[0].spec, nodes[0].batches.dataset.info))
            if not torch.equal(self.server.half.w, nodes[0].algorithm.w.cpu()):
                raise RuntimeError("the server's initial model differs from the workers'")
            for sim in self.nodes:
                sim.link = SimulatedLink(self.server, sim)

    @staticmethod
    def _report_every_s(node: Node) -> float | None:
        """A node of a robust job reports as an agent does, each REPORT_INTERVAL_S (virtual), for the coordinator's
        suspicion; otherwise at its evaluations only: at 10,000 nodes the reports are much of the run's cost."""
        return REPORT_INTERVAL_S if node.spec.algorithm.robust is not None else None

    @staticmethod
    def name_of(rank: int) -> str:
        return f"rank{rank}"

    def clock(self) -> float:
        return self.now

    # -- the event loop ------------------------------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], None]) -> int:
        """Do `action` at `time`; the run lasts until then. Returns the event's number, for `cancel`."""
        event = next(self._sequence)
        heapq.heappush(self._queue, (time, event, action, False))
        self._work += 1
        return event

    def cancel(self, event: int) -> None:
        """The queued event `event` (`at`'s number) will not happen, nor keep the run and its clock going until its
        time: a watchdog whose round completed."""
        self._cancelled.add(event)
        self._work -= 1

    def in_background(self, time: float, action: Callable[[], None]) -> None:
        """Do `action` at `time` if the run lasts until then: an observer's periodic look (the coordinator's
        monitor) that keeps the run going no longer than the nodes' own work."""
        heapq.heappush(self._queue, (time, next(self._sequence), action, True))

    def halt(self) -> None:
        """Nothing more happens: the run ends now (the job ended, as the coordinator decided)."""
        self._queue.clear()
        self._cancelled.clear()
        self._work = 0

    def run(self, until: float = math.inf, on_event: Callable[[VirtualMesh], None] | None = None) -> None:
        with rare_full_collections():
            if not self._started:
                self._started = True
                for sim in self.nodes:
                    self.at(0.0, lambda sim=sim: self._start(sim))
            while self._work and self._queue[0][0] <= until:
                time, event, action, background = heapq.heappop(self._queue)
                if event in self._cancelled:
                    self._cancelled.remove(event)
                    continue
                self.now = time
                self._work -= not background
                action()
                if on_event is not None:
                    on_event(self)

    @property
    def finished(self) -> bool:
        return all(sim.done for sim in self.nodes)

    # -- availability --------------------------------------------------------------------------------------------

    def down_until(self, rank: int, time: float) -> float | None:
        """The end of the fault that holds `rank` down at `time`, if any."""
        for fault in self.simulation.faults:
            if fault.node == rank and fault.down_from <= time < fault.down_until:
                return fault.down_until
        return None

    def reachable(self, src: int, dst: int, time: float) -> bool:
        if self.down_until(dst, time) is not None or self.down_until(src, time) is not None:
            return False
        for partition, side in zip(self.simulation.partitions, self._sides, strict=True):
            if partition.start <= time < partition.end and src in side and dst in side and side[src] != side[dst]:
                return False
        return True

    # -- a node's work: what its driver decides ------------------------------------------------------------------

    def _start(self, sim: SimNode) -> None:
        if sim.done or sim.computing:
            return
        back = self.down_until(sim.rank, self.now)
        if back is not None:
            self.at(back, lambda: self._start(sim))
            return
        decision = sim.driver.next()
        if self.on_switch is not None and len(sim.driver.switches) > sim.switches_seen:
            for switch in sim.driver.switches[sim.switches_seen:]:
                self.on_switch(self, sim, switch)
            sim.switches_seen = len(sim.driver.switches)
        self._transmit(sim, decision.sends)
        if self.observe is not None:
            for report in decision.reports:
                self.observe(self, sim, report)
        sim.waiting = decision.action is Action.WAIT
        if decision.action is Action.DONE:
            sim.visible = sim.node.algorithm.snapshot()
        if decision.action is not Action.STEP:
            return
        samples = sim.driver.samples
        sim.driver.step()
        duration = sim.step_time_s
        if self.simulation.jitter > 0:
            duration *= float(self.rng.lognormal(0.0, self.simulation.jitter))
        sim.round.compute += duration
        sim.round.steps += 1
        sim.round.samples += sim.driver.samples - samples
        sim.computing = True
        self.at(self.now + duration, lambda: self._complete(sim, duration))

    def _complete(self, sim: SimNode, duration: float) -> None:
        sim.computing = False
        sends = sim.driver.stepped(duration)
        sim.visible = sim.node.algorithm.snapshot()
        self._transmit(sim, sends)
        self._start(sim)

    def arrive(self, sim: SimNode, item: Arrival) -> None:
        """Hand `item` to the node's driver, schedule the retries it asks for, and wake the node if it waits."""
        retry_at = sim.driver.arrived(item)
        if retry_at is not None:
            self.at(retry_at, lambda: self._transmit(sim, sim.driver.due_retries()))
        if sim.waiting and not sim.computing:
            self._start(sim)

    # -- liars ---------------------------------------------------------------------------------------------------

    def sent_by(self, sender: int, receiver: int | None, kind: Kind,
                tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """What `sender`'s message of `kind` to `receiver` holds on the wire: `tensors`, or a liar's forgery of them."""
        honest = self._honest.setdefault(kind, {})
        group = self.liars.get(sender)
        if group is None:
            honest[sender] = tensors
            return tensors
        others = [t for rank, t in honest.items() if rank not in self.liars]
        return forge(group.attack, tensors, others, None if receiver is None else honest.get(receiver),
                     group.strength, self._attack_generator)

    def forged(self, message: Message) -> Message:
        if not self.liars:
            return message
        return replace(message, tensors=self.sent_by(message.sender, message.receiver, message.kind, message.tensors))

    # -- the network ---------------------------------------------------------------------------------------------

    def _arrival(self, link: tuple[int, int], size: int) -> float:
        """When `size` bytes sent now on `link` arrive (a link carries one message at a time)."""
        start = max(self.now, self._link_free_at.get(link, 0.0))
        finish = start + self.network.message_cost_s + size / self.network.bandwidth_bytes_per_s
        self._link_free_at[link] = finish
        return finish + self.network.latency_s

    def _transmit(self, sim: SimNode, transmissions: list[Transmission] | tuple[Transmission, ...]) -> None:
        for t in transmissions:
            route = t.send.route
            if route in (Route.ALLREDUCE, Route.ALLGATHER):
                assert self.collective is not None, f"{sim.name} sent to the all-reduce, but this job has none"
                self.collective.contribute(sim, t)
            elif route == Route.SERVER:
                assert sim.link is not None, f"{sim.name} sent to the parameter server, but this job has none"
                sim.link.call(t.send.message, t.call_id, t.step_s, lambda answer, t=t: self._answered(sim, t, answer))
            else:
                self._to_peer(sim, t)

    def _answered(self, sim: SimNode, t: Transmission, answer: object) -> None:
        if isinstance(answer, SendFailed):
            self.arrive(sim, Failure(t, answer.reason, answer.transient))
        else:
            self.arrive(sim, Reply(t, answer))

    def _to_peer(self, sim: SimNode, t: Transmission) -> None:
        src, dst = sim.rank, t.send.peer
        if not self.reachable(src, dst, self.now):
            self._give_up(sim, t, "unavailable", self.now)
            return
        if self.network.loss > 0 and self.rng.random() < self.network.loss:
            self._give_up(sim, t, "deadline_exceeded", self.now + self.network.timeout_s)
            return
        message = t.send.message
        size = REQUEST_BYTES if message is None else message.payload_bytes
        self.count(sim, self.nodes[dst], size)
        self.at(self._arrival((src, dst), size), lambda: self._deliver(sim, t))

    def _give_up(self, sim: SimNode, t: Transmission, reason: str, when: float) -> None:
        self.at(when, lambda: self.arrive(sim, Failure(t, reason)))

    def _deliver(self, sender: SimNode, t: Transmission) -> None:
        receiver = self.nodes[t.send.peer]
        if not self.reachable(sender.rank, receiver.rank, self.now):
            # The receiver went down (or was cut off) while the message travelled: the sender's call fails.
            self._give_up(sender, t, "unavailable", self.now)
            return
        message = t.send.message
        assert message is None or isinstance(message, Message)
        if message is not None:
            message = self.forged(message)
        if t.send.route == Route.PUSH:
            self.arrive(receiver, message)
            self.arrive(sender, Reply(t, None))
            return
        # An exchange or a pull: the peer answers from the snapshot of its last completed step.
        reply = receiver.visible.message_for(sender.rank, t.send.kind)
        if reply is None:
            self._give_up(sender, t, "failed_precondition", self.now)
            return
        reply = self.forged(reply)
        self.count(receiver, sender, reply.payload_bytes)
        arrival = self._arrival((receiver.rank, sender.rank), reply.payload_bytes)
        self.at(arrival, lambda: self._exchange_done(sender, t, reply))
        if message is not None:
            self.arrive(receiver, message)

    def _exchange_done(self, sender: SimNode, t: Transmission, reply: Message) -> None:
        if self.down_until(sender.rank, self.now) is not None:
            # The initiator went down meanwhile: the reply is lost with it, and the call failed.
            self.arrive(sender, Failure(t, "unavailable"))
            return
        self.arrive(sender, Reply(t, reply))

    def count(self, src: SimNode, dst: SimNode, size: int) -> None:
        src.driver.traffic.add_sent(dst.rank, size)
        dst.driver.traffic.add_received(src.rank, size)
        if self.metrics is None:
            return
        counters = self._edge_counters.get((src.rank, dst.rank))
        if counters is None:
            labels = (self.job, src.name, dst.name)
            counters = self._edge_counters[src.rank, dst.rank] = (
                self.metrics.edge_bytes_sent.labels(*labels), self.metrics.edge_bytes_received.labels(*labels))
        for counter in counters:
            counter.inc(size)


class SimulatedServer:
    """The parameter server of a simulated job: the server half the coordinator would host, behind one network
    interface of the mesh."""

    INGRESS = (SERVER_RANK, 0)  # keys of its interface in the mesh's link table
    EGRESS = (SERVER_RANK, 1)

    def __init__(self, mesh: VirtualMesh, half: ServerHalf):
        self.mesh = mesh
        self.half = half
        self.bytes_up = 0
        self.bytes_down = 0
        self._waiting: dict[int, tuple[SimNode, ServerPush, Answered]] = {}  # pushed, not yet released

    def count(self, sim: SimNode, up: int = 0, down: int = 0) -> None:
        sim.driver.traffic.add_sent(SERVER_RANK, up)
        sim.driver.traffic.add_received(SERVER_RANK, down)
        sim.round.sent += up
        sim.round.received += down
        self.bytes_up += up
        self.bytes_down += down
        metrics = self.mesh.metrics
        if metrics is None:
            return
        if up:
            metrics.edge_bytes_sent.labels(self.mesh.job, sim.name, SERVER_NAME).inc(up)
            metrics.edge_bytes_received.labels(self.mesh.job, sim.name, SERVER_NAME).inc(up)
        if down:
            metrics.edge_bytes_sent.labels(self.mesh.job, SERVER_NAME, sim.name).inc(down)
            metrics.edge_bytes_received.labels(self.mesh.job, SERVER_NAME, sim.name).inc(down)

    def small_trip(self) -> float:
        """When a request without tensors sent now arrives (no queueing)."""
        network = self.mesh.network
        return self.mesh.now + REQUEST_BYTES / network.bandwidth_bytes_per_s + network.latency_s

    def push(self, sim: SimNode, push: ServerPush, call_id: str, answered: Answered) -> None:
        mesh = self.mesh
        # The server lives in host memory, as the coordinator's does: a push from a GPU worker arrives there as it
        # would off the wire (and its answers reach the worker in host memory, as the agent's link decodes them).
        tensors = {name: tensor.cpu() for name, tensor in push.tensors.items()}
        push = replace(push, tensors=mesh.sent_by(sim.rank, None, push.kind, tensors) if mesh.liars else tensors)
        liar = mesh.liars.get(sim.rank)
        copies = liar.pushes if liar is not None else 1
        for copy in range(copies):
            self.count(sim, up=push.payload_bytes)
            arrival = mesh._arrival(self.INGRESS, push.payload_bytes)
            claimed = replace(push, clock=push.clock * copies + copy) if copies > 1 else push  # the module's text
            if copy < copies - 1:  # applied, not answered
                mesh.at(arrival, lambda claimed=claimed, copy=copy: self._applied(sim, claimed, f"{call_id}/{copy}"))
        sim.round.network += arrival - mesh.now
        mesh.at(arrival, lambda: self._apply(sim, claimed, call_id, answered))

    def _applied(self, sim: SimNode, push: ServerPush, call_id: str) -> list[int]:
        """The server's half applies `push`; the ranks it releases."""
        result = self.half.push(sim.rank, push, call_id, self.mesh.now)
        self.half.drain_events()
        metrics = self.mesh.metrics
        if metrics is not None:
            if result.clipped:
                metrics.ps_updates_clipped.labels(self.mesh.job).inc()
            for worker in result.flagged:
                metrics.robust_clipped.labels(self.mesh.job, self.mesh.name_of(worker), SERVER_NAME).inc()
        return result.release

    def _apply(self, sim: SimNode, push: ServerPush, call_id: str, answered: Answered) -> None:
        release = self._applied(sim, push, call_id)
        self._waiting[sim.rank] = (sim, push, answered)
        for rank in release:
            worker, released, reply = self._waiting.pop(rank)
            self.send_model(worker, ServerPull(released.version, released.pull_delta), reply)

    def send_model(self, sim: SimNode, pull: ServerPull, answered: Answered) -> None:
        """The model (in full, or the delta since the pushed version), through the server's egress."""
        mesh = self.mesh
        model = self.half.pull(sim.rank, pull.since_version, pull.delta, mesh.now)
        self.half.drain_events()
        self.count(sim, down=model.payload_bytes)
        arrival = mesh._arrival(self.EGRESS, model.payload_bytes)
        sim.round.network += arrival - mesh.now
        mesh.at(arrival, lambda: self._deliver_model(sim, model, answered))

    def _deliver_model(self, sim: SimNode, model: ServerModel, answered: Answered) -> None:
        metrics = sim.round.end(self.mesh.now)
        if metrics is not None:
            sim.rounds.append(metrics)
        answered(model)

    def report(self, sim: SimNode, report: StepReport, step_s: float, answered: Answered) -> None:
        self.count(sim, up=REQUEST_BYTES)
        self.mesh.at(self.small_trip(), lambda: self._decide(sim, report, step_s, answered))

    def _decide(self, sim: SimNode, report: StepReport, step_s: float, answered: Answered) -> None:
        decision = self.half.report(sim.rank, report.version, report.round_step, step_s, self.mesh.now)
        answer = ReadyAnswer(decision.ready, decision.steps_before_asking, self.half.version)
        self.count(sim, down=REQUEST_BYTES)
        self.mesh.at(self.small_trip(), lambda: answered(answer))


class SimulatedLink(ServerLink):
    """One worker's ServerLink to the simulated server."""

    def __init__(self, server: SimulatedServer, sim: SimNode):
        self.server = server
        self.sim = sim

    def push(self, push: ServerPush, call_id: str, answered: Answered) -> None:
        self.server.push(self.sim, push, call_id, answered)

    def pull(self, pull: ServerPull, answered: Answered) -> None:
        self.server.count(self.sim, up=REQUEST_BYTES)
        mesh = self.server.mesh
        mesh.at(mesh.now + mesh.network.latency_s, lambda: self.server.send_model(self.sim, pull, answered))

    def report(self, report: StepReport, step_s: float, answered: Answered) -> None:
        self.server.report(self.sim, report, step_s, answered)
