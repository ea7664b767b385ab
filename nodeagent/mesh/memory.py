"""The memory runtime: the same algorithm objects as the gRPC agent, driven by a discrete-event loop.

Local steps run for real (real tensors, real gradients) but cost virtual time: the step time of a node is
`step_time_s / speed` (times a seeded jitter); a message on a directed link waits for the link to be free,
takes `bytes / bandwidth`, then `latency`. Lost messages make the sender time out; nodes that are down or cut
off by a partition refuse connections at once. The loop mirrors the agent's order of work exactly: drain the
inbox, wait until the algorithm is ready, evaluate when due, step, send. A peer answers an exchange from the
snapshot it published at the end of its last completed step, as the agent's servicer does.

The parameter server (Route.SERVER, the centralised algorithms) is the same server half the coordinator hosts
(nodeagent.algorithms.ps.build_server), in this process. It has one network interface: pushes queue on its
ingress and models on its egress, each at the network's bandwidth, plus the latency; step reports and their
answers (ESync) are small and cost the latency and their bytes, without queueing. The server's clock is the
virtual clock, so ESync's READY decision runs unchanged on virtual time; a report carries the step's virtual
duration. The server is always reachable (faults and partitions apply to peer links). Each worker's rounds (one
per model it receives) are measured as nodeagent.ps.RoundMetrics in `SimNode.rounds`: local steps, samples,
compute, aggregation (its push's and its model's time on the network, queueing included) and wait (the rest:
step reports, and waiting for the other workers).

Everything is deterministic for a given seed: one heap ordered by (time, sequence number) and one generator.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nodeagent.algorithms.base import ALLREDUCE_RANK, SERVER_RANK, Failure, Route, Send, Snapshot
from nodeagent.algorithms.ps import ReadyAnswer, ServerHalf, StepReport, build_server, server_class
from nodeagent.jobspec import SimulationSpec
from nodeagent.metrics import Metrics
from nodeagent.ps.esync import RoundMetrics
from nodeagent.training.job import Node
from nodeagent.wire.message import Message

# A push that cannot be delivered is retried after this long (synchronous rounds depend on every push).
PUSH_RETRY_S = 1.0
# Bytes of a request that carries no tensors (a pull): its frames' headers.
REQUEST_BYTES = 64
# Keys of the parameter server's interface in the link table.
SERVER_INGRESS = (SERVER_RANK, 0)
SERVER_EGRESS = (SERVER_RANK, 1)
SERVER_NAME = "server"


@dataclass
class SimNode:
    node: Node
    name: str
    step_time_s: float
    visible: Snapshot
    inbox: list[Message | Failure] = field(default_factory=list)
    in_flight: set[int] = field(default_factory=set)
    waiting_since: float | None = None
    computing: bool = False
    done: bool = False
    loss: float = math.nan
    accuracy: float = math.nan
    test_loss: float = math.nan
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0
    failures: int = 0
    evaluated_at: int = -1
    # The current round with the parameter server (from one model received to the next).
    round_started: float = 0.0
    round_steps: int = 0
    round_samples: int = 0
    round_compute: float = 0.0
    round_network: float = 0.0
    round_sent: int = 0
    round_received: int = 0
    rounds: list[RoundMetrics] = field(default_factory=list)


Observer = Callable[["VirtualMesh", SimNode, bool], None]


class VirtualMesh:
    """Runs a job's nodes to completion in virtual time. `observe(mesh, node, final)` is called after each
    evaluation (the place to write the metrics log)."""

    def __init__(self, nodes: list[Node], job: str, simulation: SimulationSpec, metrics: Metrics,
                 observe: Observer | None = None):
        self.job = job
        self.simulation = simulation
        self.network = simulation.network
        self.metrics = metrics
        self.observe = observe
        self.rng = np.random.default_rng(simulation.seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self._link_free_at: dict[tuple[int, int], float] = {}
        self._allreduce: dict[int, dict[int, Message]] = {}
        speeds = simulation.speeds or [1.0] * len(nodes)
        self.server: ServerHalf | None = None
        if nodes and server_class(nodes[0].spec.algorithm.name) is not None:
            self.server = build_server(nodes[0].spec)
            if not torch.equal(self.server.w, nodes[0].algorithm.w):
                raise RuntimeError("the server's initial model differs from the workers'")
        self._push_ids = itertools.count()
        self._pushed_from: dict[int, int] = {}  # rank -> the version its outstanding push was computed on
        self.server_bytes_up = 0
        self.server_bytes_down = 0
        self.nodes = [
            SimNode(
                node=n, name=f"rank{n.rank}", visible=n.algorithm.snapshot(),
                step_time_s=simulation.step_time_s / speeds[n.rank] * n.spec.slowdown.get(n.rank, 1.0),
            )
            for n in nodes
        ]

    # -- the event loop ------------------------------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (time, next(self._sequence), action))

    def run(self, until: float = math.inf, on_event: Callable[[VirtualMesh], None] | None = None) -> None:
        if not self._queue and self.now == 0.0:
            for sim in self.nodes:
                self.at(0.0, lambda sim=sim: self._start(sim))
        while self._queue and self._queue[0][0] <= until:
            self.now, _, action = heapq.heappop(self._queue)
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
        for partition in self.simulation.partitions:
            if partition.start <= time < partition.end:
                side = {rank: index for index, group in enumerate(partition.groups) for rank in group}
                if src in side and dst in side and side[src] != side[dst]:
                    return False
        return True

    # -- a node's work -------------------------------------------------------------------------------------------

    def _start(self, sim: SimNode) -> None:
        """Drain, wait until ready, evaluate when due, step; the step's effects land when it completes."""
        if sim.done or sim.computing:
            return
        back = self.down_until(sim.node.rank, self.now)
        if back is not None:
            self.at(back, lambda: self._start(sim))
            return
        algorithm = sim.node.algorithm
        for message in sim.inbox:
            if isinstance(message, Failure):
                algorithm.failed(message.send, message.reason)
            else:
                algorithm.receive(message)
        if sim.inbox and algorithm.sends_after_receive:
            for send in algorithm.sends():
                self._transmit(sim, send)
        sim.inbox.clear()
        if not algorithm.ready():
            if sim.waiting_since is None:
                sim.waiting_since = self.now
            return
        if sim.waiting_since is not None:
            sim.wait_s += self.now - sim.waiting_since
            sim.waiting_since = None
        spec = sim.node.spec
        final = algorithm.clock >= spec.steps
        if (algorithm.clock % spec.eval_every == 0 or final) and algorithm.clock != sim.evaluated_at:
            sim.evaluated_at = algorithm.clock
            result = sim.node.evaluate()
            sim.accuracy, sim.test_loss = result.accuracy, result.loss
            if self.observe is not None:
                self.observe(self, sim, final)
        if final:
            sim.done = True
            sim.visible = algorithm.snapshot()
            return
        inputs, targets = sim.node.batches.next()
        sim.loss = algorithm.step(inputs, targets)
        self.metrics.local_steps.labels(self.job, sim.name).inc()
        duration = sim.step_time_s
        if self.simulation.jitter > 0:
            duration *= float(self.rng.lognormal(0.0, self.simulation.jitter))
        sim.compute_s += duration
        sim.round_compute += duration
        sim.round_steps += 1
        sim.round_samples += len(inputs)
        sim.computing = True
        sends = [self._stamp(send, duration) for send in algorithm.sends()]
        snapshot = algorithm.snapshot()
        self.at(self.now + duration, lambda: self._complete(sim, sends, snapshot))

    def _complete(self, sim: SimNode, sends: list[Send], snapshot: Snapshot) -> None:
        sim.computing = False
        sim.visible = snapshot
        for send in sends:
            self._transmit(sim, send)
        self._start(sim)

    # -- the network ---------------------------------------------------------------------------------------------

    def _failed(self, sim: SimNode, peer: int, reason: str) -> None:
        sim.failures += 1
        self.metrics.exchange_failures.labels(sim.name, self.nodes[peer].name, reason).inc()

    def _arrival(self, src: int, dst: int, size: int) -> float:
        """When a message of `size` bytes sent now on src -> dst arrives (the link carries one at a time)."""
        start = max(self.now, self._link_free_at.get((src, dst), 0.0))
        finish = start + size / self.network.bandwidth_bytes_per_s
        self._link_free_at[(src, dst)] = finish
        return finish + self.network.latency_s

    def _transmit(self, sim: SimNode, send: Send) -> None:
        if send.route == Route.ALLREDUCE:
            self._contribute(sim, send)
            return
        if send.route == Route.SERVER:
            self._to_server(sim, send)
            return
        src, dst = sim.node.rank, send.peer
        if send.route in (Route.EXCHANGE, Route.PULL):
            if dst in sim.in_flight:
                self._failed(sim, dst, "in_flight")
                sim.inbox.append(Failure(send, "in_flight"))
                return
            sim.in_flight.add(dst)
        if not self.reachable(src, dst, self.now):
            self._give_up(sim, send, "unavailable", self.now)
            return
        if self.network.loss > 0 and self.rng.random() < self.network.loss:
            self._give_up(sim, send, "deadline_exceeded", self.now + self.network.timeout_s)
            return
        size = send.message.payload_bytes if send.message is not None else REQUEST_BYTES
        self._count(sim, self.nodes[dst], size)
        arrival = self._arrival(src, dst, size)
        self.at(arrival, lambda: self._deliver(sim, send))

    def _give_up(self, sim: SimNode, send: Send, reason: str, when: float) -> None:
        def fail() -> None:
            self._failed(sim, send.peer, reason)
            sim.in_flight.discard(send.peer)
            if send.route == Route.PUSH:
                self.at(self.now + PUSH_RETRY_S, lambda: self._transmit(sim, send))
                return
            sim.inbox.append(Failure(send, reason))
            self._wake(sim)

        self.at(when, fail)

    def _contribute(self, sim: SimNode, send: Send) -> None:
        """A rank's part of an all-reduce; once every rank's is in, all receive the mean after the time a ring
        all-reduce takes: 2 (n - 1) / n of the bytes through each link and 2 (n - 1) latencies."""
        assert send.message is not None
        clock = send.message.clock
        parts = self._allreduce.setdefault(clock, {})
        parts[sim.node.rank] = send.message
        if len(parts) < len(self.nodes):
            return
        del self._allreduce[clock]
        count = len(self.nodes)
        size = send.message.payload_bytes
        share = round(2 * (count - 1) / count * size)
        duration = share / self.network.bandwidth_bytes_per_s + 2 * (count - 1) * self.network.latency_s
        messages = [parts[rank] for rank in range(count)]
        mean = {
            name: torch.stack([m.tensors[name] for m in messages]).mean(dim=0) for name in messages[0].tensors
        }
        for rank, node in enumerate(self.nodes):
            self._count(node, self.nodes[(rank + 1) % count], share)
            result = Message(send.kind, ALLREDUCE_RANK, rank, mean, clock=clock)
            self.at(self.now + duration, lambda node=node, result=result: self._collect(node, result))

    def _collect(self, sim: SimNode, result: Message) -> None:
        sim.inbox.append(result)
        self._wake(sim)

    def _count(self, src: SimNode, dst: SimNode, size: int) -> None:
        src.bytes_sent += size
        dst.bytes_received += size
        self.metrics.edge_bytes_sent.labels(src.name, dst.name).inc(size)
        self.metrics.edge_bytes_received.labels(src.name, dst.name).inc(size)

    def _deliver(self, sender: SimNode, send: Send) -> None:
        receiver = self.nodes[send.peer]
        if not self.reachable(sender.node.rank, receiver.node.rank, self.now):
            # The receiver went down (or was cut off) while the message travelled: the sender's call fails.
            self._give_up(sender, send, "unavailable", self.now)
            return
        if send.route == Route.PUSH:
            assert send.message is not None
            receiver.inbox.append(send.message)
            sender.exchanges += 1
            self._wake(receiver)
            return
        # An exchange or a pull: the peer answers from the snapshot of its last completed step.
        reply = receiver.visible.message_for(sender.node.rank, send.kind)
        if reply is None:
            self._give_up(sender, send, "failed_precondition", self.now)
            return
        if send.message is not None:
            receiver.inbox.append(send.message)
        self._count(receiver, sender, reply.payload_bytes)
        arrival = self._arrival(receiver.node.rank, sender.node.rank, reply.payload_bytes)
        self.at(arrival, lambda: self._exchange_done(sender, receiver, reply))
        self._wake(receiver)

    def _exchange_done(self, sender: SimNode, peer: SimNode, reply: Message) -> None:
        sender.in_flight.discard(peer.node.rank)
        if self.down_until(sender.node.rank, self.now) is not None:
            return  # the initiator itself went down meanwhile: the reply is lost with it
        sender.exchanges += 1
        sender.inbox.append(reply)
        self._wake(sender)

    def _wake(self, sim: SimNode) -> None:
        if sim.waiting_since is not None and not sim.computing:
            self._start(sim)

    # -- the parameter server ------------------------------------------------------------------------------------

    @staticmethod
    def _stamp(send: Send, duration: float) -> Send:
        """A step report carries the virtual duration of the step it reports."""
        if isinstance(send.message, StepReport):
            return dataclasses.replace(send, message=dataclasses.replace(send.message, duration_s=duration))
        return send

    def _server_link(self, key: tuple[int, int], size: int) -> float:
        """When `size` bytes sent now through the server's ingress or egress arrive (one transfer at a time)."""
        start = max(self.now, self._link_free_at.get(key, 0.0))
        finish = start + size / self.network.bandwidth_bytes_per_s
        self._link_free_at[key] = finish
        return finish + self.network.latency_s

    def _count_server(self, sim: SimNode, up: int = 0, down: int = 0) -> None:
        sim.bytes_sent += up
        sim.round_sent += up
        sim.bytes_received += down
        sim.round_received += down
        self.server_bytes_up += up
        self.server_bytes_down += down
        if up:
            self.metrics.edge_bytes_sent.labels(sim.name, SERVER_NAME).inc(up)
            self.metrics.edge_bytes_received.labels(sim.name, SERVER_NAME).inc(up)
        if down:
            self.metrics.edge_bytes_sent.labels(SERVER_NAME, sim.name).inc(down)
            self.metrics.edge_bytes_received.labels(SERVER_NAME, sim.name).inc(down)

    def _to_server(self, sim: SimNode, send: Send) -> None:
        server = self.server
        if server is None:
            raise RuntimeError(f"{sim.name} sent to the parameter server, but this job has none")
        message = send.message
        rank = sim.node.rank
        if isinstance(message, StepReport):
            self._count_server(sim, up=REQUEST_BYTES)
            arrival = self.now + REQUEST_BYTES / self.network.bandwidth_bytes_per_s + self.network.latency_s
            self.at(arrival, lambda: self._server_report(sim, message))
            return
        if message is None:  # a pull of the current model
            self._count_server(sim, up=REQUEST_BYTES)
            self._pushed_from[rank] = sim.node.algorithm.version
            self.at(self.now + self.network.latency_s, lambda: self._server_answer(rank))
            return
        size = message.payload_bytes
        self._count_server(sim, up=size)
        arrival = self._server_link(SERVER_INGRESS, size)
        sim.round_network += arrival - self.now
        push_id = f"{rank}:{next(self._push_ids)}"
        self.at(arrival, lambda: self._server_push(rank, message, push_id))

    def _server_push(self, rank: int, message, push_id: str) -> None:
        assert self.server is not None
        result = self.server.push(rank, message, push_id, self.now)
        self.server.drain_events()
        self._pushed_from[rank] = message.model_version
        self.nodes[rank].exchanges += 1
        for worker in result.release:
            self._server_answer(worker)

    def _server_answer(self, rank: int) -> None:
        """Send worker `rank` the model (in full, or the delta since its push if it asks for deltas)."""
        assert self.server is not None
        sim = self.nodes[rank]
        delta = bool(getattr(sim.node.algorithm, "pull_delta", False))
        answer = self.server.pull(rank, self._pushed_from.pop(rank, 0), delta, self.now)
        self.server.drain_events()
        size = answer.payload_bytes
        self._count_server(sim, down=size)
        arrival = self._server_link(SERVER_EGRESS, size)
        sim.round_network += arrival - self.now
        self.at(arrival, lambda: self._server_deliver(sim, answer))

    def _server_deliver(self, sim: SimNode, answer) -> None:
        sim.inbox.append(answer)
        self._end_round(sim)
        self._wake(sim)

    def _server_report(self, sim: SimNode, report: StepReport) -> None:
        assert self.server is not None
        rank = sim.node.rank
        decision = self.server.report(rank, report.model_version, report.clock, report.duration_s, self.now)
        answer = ReadyAnswer(report.kind, SERVER_RANK, rank, {}, model_version=self.server.version,
                             ready=decision.ready, steps_before_asking=decision.steps_before_asking)
        self._count_server(sim, down=REQUEST_BYTES)
        arrival = self.now + REQUEST_BYTES / self.network.bandwidth_bytes_per_s + self.network.latency_s
        self.at(arrival, lambda: self._collect(sim, answer))

    def _end_round(self, sim: SimNode) -> None:
        elapsed = self.now - sim.round_started
        if elapsed > 0:
            aggregation = min(sim.round_network, elapsed)
            wait = max(0.0, elapsed - sim.round_compute - aggregation)
            sim.rounds.append(
                RoundMetrics(sim.round_steps, sim.round_samples, sim.round_compute, wait, aggregation, elapsed,
                             sim.round_sent, sim.round_received)
            )
        sim.round_started = self.now
        sim.round_steps = sim.round_samples = sim.round_sent = sim.round_received = 0
        sim.round_compute = sim.round_network = 0.0
