"""The node agent daemon: register with the coordinator, watch the assignment, train, serve peers, checkpoint.

Threads: gRPC server threads serve peers (they only read the published snapshot and enqueue messages); one
watch thread follows the assignment stream; one heartbeat thread; one training thread per job (the only
thread that calls into the algorithm); a small pool performs outgoing exchanges and calls to the parameter
server (the coordinator) and enqueues their replies.

Slow devices: each local step is stretched by the product of the agent's `--slowdown` (the machine) and the
job's `slowdown` of this rank (the experiment): after the step the agent sleeps (factor - 1) times the step's
compute time, and the step counts as compute for that whole time (metrics, ESync step reports).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from nodeagent import __version__
from nodeagent._proto import coordinator_pb2, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from nodeagent.algorithms.base import ALLREDUCE_RANK, Failure, Neighbor, Route, Send
from nodeagent.algorithms.ps import PSWorker, StepReport
from nodeagent.jobspec import JobSpec
from nodeagent.mesh.grpc import GRPC_OPTIONS, PeerClient, PeerServicer, ServingState, failure_reason
from nodeagent.mesh.ps import SERVER_NODE, ServerClient, new_push_id
from nodeagent.metrics import Metrics
from nodeagent.training.job import Node, build_node
from nodeagent.wire.errors import WireError
from nodeagent.wire.message import Encoding, Message

log = logging.getLogger("nodeagent")

REPORT_INTERVAL_S = 1.0
NEIGHBOUR_WAIT_S = 60.0
RECONNECT_DELAY_S = 1.0
# Failures of a call to the parameter server that a retry may cure (the coordinator restarts, a round is slow).
TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str = "127.0.0.1:7070"
    listen: str = "0.0.0.0:7100"
    advertise: str | None = None
    metrics_listen: str | None = "0.0.0.0:9401"
    state_dir: Path = Path("/var/lib/peertrain/agent")
    data_dir: str | None = None
    device: str = "cpu"
    name: str = field(default_factory=socket.gethostname)
    slowdown: float = 1.0
    lane_port: int = 0  # TCP port of the tensor lanes beside the peer service (0: any free port)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class Collective:
    """torch.distributed (gloo) for all-reduce jobs, joined through the coordinator's rendezvous store."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        if port == 0:
            raise RuntimeError("the assignment names no rendezvous for this all-reduce job")
        timeout = timedelta(seconds=max(timeout_s, 30.0))
        store = dist.TCPStore(host, port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.world_size = world_size

    def mean(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
        dist.all_reduce(flat)
        flat /= self.world_size
        out, offset = {}, 0
        for name, tensor in tensors.items():
            out[name] = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
            offset += tensor.numel()
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _Progress:
    """What the training thread reports to the coordinator."""

    started: float
    reported: float = 0.0
    loss: float = math.nan
    accuracy: float = math.nan
    test_loss: float = math.nan
    compute_s: float = 0.0
    wait_s: float = 0.0


class JobRunner(threading.Thread):
    """Trains one job's node; the only thread that touches the algorithm."""

    def __init__(self, agent: Agent, assignment: coordinator_pb2.Assignment):
        super().__init__(name=f"train-{assignment.job_id}", daemon=True)
        self.agent = agent
        self.job_id = assignment.job_id
        self.rank = assignment.rank
        self.spec = JobSpec.from_json(assignment.job_spec_json)
        self.stop_event = threading.Event()
        self.inbox: queue.Queue[Message | Failure] = queue.Queue()
        self.addresses: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.update(assignment)
        self.neighbors = tuple(
            Neighbor(rank=n.rank, sign=n.sign, phase=n.phase, weight=n.weight, peer_phase=n.peer_phase)
            for n in assignment.neighbors
        )
        self.self_weight = assignment.self_weight
        self.peer_schedule = tuple(tuple(peers.ranks) for peers in assignment.peer_schedule)
        self.rendezvous_port = assignment.rendezvous_port
        self.collective: Collective | None = None
        self.in_flight: set[int] = set()
        self.in_flight_lock = threading.Lock()
        self.pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"exchange-{self.job_id}")
        self.clients: dict[str, PeerClient] = {}
        self.serving: ServingState | None = None
        self.server_client: ServerClient | None = None
        self._worker: PSWorker | None = None  # network threads read only its immutable configuration
        self.slowdown = agent.config.slowdown * self.spec.slowdown.get(self.rank, 1.0)
        self.failures = 0
        self.exchanges = 0

    def update(self, assignment: coordinator_pb2.Assignment) -> None:
        """New addresses or liveness of neighbours; applied between steps (dicts are replaced whole)."""
        self.addresses = {n.rank: n.address for n in assignment.neighbors}
        self.names = {n.rank: n.node_id for n in assignment.neighbors} | {self.rank: self.agent.node_id}

    @property
    def checkpoint_path(self) -> Path:
        return self.agent.config.state_dir / "checkpoints" / f"{self.job_id}-rank{self.rank}.pt"

    def save_checkpoint(self, node: Node) -> None:
        path = self.checkpoint_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(node.algorithm.state_dict(), tmp)
        os.replace(tmp, path)

    def restore_checkpoint(self, node: Node) -> None:
        if not self.checkpoint_path.exists():
            return
        state = torch.load(self.checkpoint_path, weights_only=True)
        try:
            node.algorithm.load_state_dict(state)
        except (KeyError, ValueError) as error:
            log.warning("checkpoint %s does not fit (%s); starting afresh", self.checkpoint_path, error)
            return
        log.info("resumed job %s at step %d from %s", self.job_id, node.algorithm.clock, self.checkpoint_path)

    def run(self) -> None:
        try:
            self._train()
        except Exception:
            log.exception("job %s failed on this node", self.job_id)
        finally:
            self.agent.set_serving(None)
            self.pool.shutdown(wait=False, cancel_futures=True)
            if self.collective is not None:
                self.collective.close()
            for client in self.clients.values():
                client.close()

    def _train(self) -> None:
        spec = self.spec
        node = build_node(
            spec, self.rank, self.neighbors, self.self_weight, self.agent.config.data_dir, self.peer_schedule
        )
        self.restore_checkpoint(node)
        algorithm = node.algorithm
        metrics = self.agent.metrics
        labels = (self.job_id, self.agent.node_id)
        self.serving = ServingState(
            job_id=self.job_id,
            node_id=self.agent.node_id,
            rank=self.rank,
            algorithm_name=spec.algorithm.name,
            names=self.names,
            expected=algorithm.expected,
            snapshot=algorithm.snapshot,
            inbox=self.inbox,
            encoding=Encoding.from_name(spec.wire.encoding),
            chunk_bytes=spec.wire.chunk_bytes,
            max_message_bytes=spec.wire.max_message_bytes,
        )
        self.agent.set_serving(self.serving)
        if isinstance(algorithm, PSWorker):
            assert self.agent.stub is not None
            self._worker = algorithm
            self.server_client = ServerClient(
                self.agent.stub, self.job_id, self.agent.node_id, self.rank, spec.nodes, metrics,
                encoding=Encoding.from_name(spec.wire.encoding), chunk_bytes=spec.wire.chunk_bytes,
                max_message_bytes=spec.wire.max_message_bytes,
            )
        log.info(
            "job %s: rank %d of %d, %s on %d samples, neighbours %s",
            self.job_id, self.rank, spec.nodes, spec.algorithm.name, node.shard_size, sorted(self.addresses),
        )
        self._wait_for_neighbours()
        progress = _Progress(started=time.monotonic())
        evaluated_at = -1
        while not self.stop_event.is_set():
            if evaluated_at == -1 and algorithm.clock == 0:
                # The curve starts at the shared initial model, before anything received is mixed in.
                evaluated_at = 0
                self._evaluate(node, progress, labels)
                self._report(0, progress, False)
            waited = time.perf_counter()
            self._drain(algorithm)
            while not algorithm.ready() and not self.stop_event.is_set():
                self._drain(algorithm, block=True)
            waited = time.perf_counter() - waited
            progress.wait_s += waited
            metrics.wait_seconds.labels(*labels).inc(waited)
            # A step is complete once the algorithm is ready again (synchronous modes finish it on receipt).
            final = algorithm.clock >= spec.steps
            if (algorithm.clock % spec.eval_every == 0 or final) and algorithm.clock != evaluated_at:
                evaluated_at = algorithm.clock
                self._evaluate(node, progress, labels)
                self.save_checkpoint(node)
                self._report(algorithm.clock, progress, final)
            elif time.monotonic() - progress.reported >= REPORT_INTERVAL_S:
                self._report(algorithm.clock, progress, final)
            if final:
                break
            inputs, targets = node.batches.next()
            began = time.perf_counter()
            progress.loss = algorithm.step(inputs, targets)
            elapsed = time.perf_counter() - began
            if self.slowdown > 1:
                time.sleep(elapsed * (self.slowdown - 1))
                elapsed = time.perf_counter() - began
            progress.compute_s += elapsed
            metrics.step_seconds.labels(*labels).observe(elapsed)
            metrics.local_steps.labels(*labels).inc()
            metrics.training_loss.labels(*labels).set(progress.loss)
            asked = time.perf_counter()
            for send in algorithm.sends():
                self._dispatch(send, elapsed)
            asked = time.perf_counter() - asked  # an ESync step report waits for its answer here
            progress.wait_s += asked
            metrics.wait_seconds.labels(*labels).inc(asked)
        log.info("job %s: finished at step %d, test accuracy %.4f", self.job_id, algorithm.clock, progress.accuracy)
        # Keep serving until the coordinator ends the job: slower neighbours may still exchange with us.
        while not self.stop_event.wait(0.2):
            self._drain(algorithm)

    def _wait_for_neighbours(self) -> None:
        """Start together: wait until every neighbour serves this job (bounded), so that no node runs ahead
        mixing with neighbours that have not started. A neighbour that does not come keeps its copy stale."""
        deadline = time.monotonic() + NEIGHBOUR_WAIT_S
        waiting = dict(self.addresses)
        while waiting and not self.stop_event.is_set() and time.monotonic() < deadline:
            for rank, address in list(waiting.items()):
                try:
                    description = self._client(address).stub.Describe(peer_pb2.DescribeRequest(), timeout=2)
                except grpc.RpcError:
                    continue
                if description.job_id == self.job_id:
                    del waiting[rank]
            if waiting:
                self.stop_event.wait(0.1)
        if waiting:
            log.warning("job %s: starting without neighbours %s, which do not serve it yet", self.job_id,
                        sorted(waiting))

    def _evaluate(self, node: Node, progress: _Progress, labels: tuple[str, str]) -> None:
        result = node.evaluate()
        progress.accuracy, progress.test_loss = result.accuracy, result.loss
        self.agent.metrics.test_accuracy.labels(*labels).set(result.accuracy)
        self.agent.metrics.test_loss.labels(*labels).set(result.loss)

    def _report(self, clock: int, progress: _Progress, finished: bool) -> None:
        now = time.monotonic()
        progress.reported = now
        self.agent.report(
            coordinator_pb2.MetricsReport(
                node_id=self.agent.node_id, job_id=self.job_id, rank=self.rank, step=clock, loss=progress.loss,
                test_accuracy=progress.accuracy, test_loss=progress.test_loss, elapsed_s=now - progress.started,
                finished=finished, bytes_sent=self._traffic("sent"), bytes_received=self._traffic("received"),
                compute_s=progress.compute_s, wait_s=progress.wait_s, exchanges=self.exchanges,
                exchange_failures=self.failures,
            )
        )

    def _traffic(self, direction: str) -> int:
        registry = self.agent.metrics.registry
        # This job's traffic with the parameter server is counted by its client (the edge metrics add up all jobs).
        client = self.server_client
        total = 0.0 if client is None else client.bytes_sent if direction == "sent" else client.bytes_received
        me = self.agent.node_id
        for peer in self.names.values():
            if peer == me:
                continue
            src, dst = (me, peer) if direction == "sent" else (peer, me)
            total += registry.get_sample_value(f"peertrain_edge_bytes_{direction}_total", {"src": src, "dst": dst}) or 0
        return int(total)

    def _drain(self, algorithm, block: bool = False) -> None:
        try:
            message = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(message, Failure):
                algorithm.failed(message.send, message.reason)
            else:
                algorithm.receive(message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
        if algorithm.sends_after_receive:
            for send in algorithm.sends():
                self._dispatch(send)

    def _client(self, address: str) -> PeerClient:
        client = self.clients.get(address)
        if client is None:
            client = self.clients[address] = PeerClient(address)
        return client

    def _dispatch(self, send: Send, step_s: float = math.nan) -> None:
        if send.route == Route.ALLREDUCE:
            self._allreduce(send)
            return
        if send.route == Route.SERVER:
            if isinstance(send.message, StepReport):
                # The worker can do nothing until the answer comes, and the call is small: make it from this
                # thread, sparing two thread hand-offs per local step.
                self._server_call(Send(send.route, send.peer, send.kind,
                                       dataclasses.replace(send.message, duration_s=step_s)))
                return
            self.pool.submit(self._server_call, send)
            return
        dst = self.names.get(send.peer, f"rank{send.peer}")
        address = self.addresses.get(send.peer)
        if address is None:
            raise RuntimeError(f"{send.route} to rank {send.peer}: not a neighbour of rank {self.rank}, no address")
        if send.route == Route.PUSH:
            assert send.message is not None
            self.pool.submit(self._push, send.message, address, dst)
            return
        # Flow control: one exchange or pull per edge in flight; a due one on a busy edge is skipped.
        with self.in_flight_lock:
            if send.peer in self.in_flight:
                self.agent.metrics.exchange_failures.labels(self.agent.node_id, dst, "in_flight").inc()
                self.inbox.put(Failure(send, "in_flight"))
                return
            self.in_flight.add(send.peer)
        self.pool.submit(self._exchange, send, address, dst)

    def _allreduce(self, send: Send) -> None:
        """The mean of the message's tensors over all ranks, computed with torch.distributed (gloo)."""
        assert send.message is not None
        if self.collective is None:
            host, _ = split_address(self.agent.config.coordinator)
            self.collective = Collective(
                host, self.rendezvous_port, self.rank, self.spec.nodes, self.spec.wire.exchange_timeout_s
            )
        started = time.perf_counter()
        mean = self.collective.mean(send.message.tensors)
        self.agent.metrics.exchange_seconds.labels(self.agent.node_id, "allreduce").observe(
            time.perf_counter() - started
        )
        self.inbox.put(
            Message(send.kind, ALLREDUCE_RANK, self.rank, mean, clock=send.message.clock, loss=send.message.loss)
        )

    def _failed(self, dst: str, reason: str) -> None:
        self.failures += 1
        self.agent.metrics.exchange_failures.labels(self.agent.node_id, dst, reason).inc()

    def _push(self, message: Message, address: str, dst: str) -> None:
        """Deliver a push; synchronous rounds depend on it, so a failed delivery is retried until the job ends."""
        assert self.serving is not None
        while not self.stop_event.is_set():
            try:
                self._client(address).push(self.serving, message, self.spec.wire.exchange_timeout_s,
                                           self.agent.metrics)
                self.exchanges += 1
                return
            except grpc.RpcError as error:
                self._failed(dst, failure_reason(error))
                log.debug("push to %s failed: %s; retrying", dst, error)
                self.stop_event.wait(RECONNECT_DELAY_S)
                address = self.addresses.get(message.receiver, address)

    def _server_call(self, send: Send) -> None:
        """A push (then the pull of the model), a pull, or an ESync step report to the parameter server. Transient
        failures are retried (a push with the same id, so that it is applied once) until the job ends."""
        client = self.server_client
        assert client is not None
        timeout = self.spec.wire.exchange_timeout_s
        message = send.message
        push_id = new_push_id()
        pushed = message is None or isinstance(message, StepReport)
        while not self.stop_event.is_set():
            try:
                if isinstance(message, StepReport):
                    self.inbox.put(client.report(message, timeout))
                    return
                if not pushed:
                    assert message is not None
                    reply = client.push(message, push_id, timeout)
                    pushed = True
                    if reply.rejected:
                        log.info("job %s: push rejected (%s); pulling the model", self.job_id, reply.rejected)
                since = message.model_version if message is not None else 0
                worker = self._worker
                assert worker is not None
                delta = bool(getattr(worker, "pull_delta", False)) and message is not None
                self.inbox.put(client.pull(worker, since, delta, timeout))
                self.exchanges += 1
                return
            except grpc.RpcError as error:
                reason = failure_reason(error)
                self._failed(SERVER_NODE, reason)
                if error.code() not in TRANSIENT_CODES:
                    log.warning("job %s: the parameter server refused a call: %s", self.job_id, error.details())
                    self.inbox.put(Failure(send, reason))
                    return
                log.debug("call to the parameter server failed (%s); retrying", reason)
                self.stop_event.wait(RECONNECT_DELAY_S if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED else 0)
            except WireError as error:
                self._failed(SERVER_NODE, "rejected")
                log.warning("job %s: answer of the parameter server rejected: %s", self.job_id, error)
                self.inbox.put(Failure(send, "rejected"))
                return

    def _exchange(self, send: Send, address: str, dst: str) -> None:
        """An exchange or a pull; the answer, or the failure, goes to the training thread through the inbox."""
        assert self.serving is not None
        timeout = self.spec.wire.exchange_timeout_s
        try:
            client = self._client(address)
            if send.route == Route.PULL:
                reply = client.pull(self.serving, send.peer, send.kind, timeout, self.agent.metrics)
            else:
                assert send.message is not None
                reply = client.exchange(self.serving, send.message, timeout, self.agent.metrics)
            self.inbox.put(reply)
            self.exchanges += 1
        except grpc.RpcError as error:
            self._failed(dst, failure_reason(error))
            self.inbox.put(Failure(send, failure_reason(error)))
            log.debug("%s with %s failed: %s", send.route, dst, error)
        except WireError as error:
            self._failed(dst, "rejected")
            self.inbox.put(Failure(send, "rejected"))
            log.warning("answer from %s rejected: %s", dst, error)
        finally:
            with self.in_flight_lock:
                self.in_flight.discard(send.peer)


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.metrics = Metrics()
        self.stopping = threading.Event()
        self.node_id = ""
        self._serving: ServingState | None = None
        self._runner: JobRunner | None = None
        self._runner_lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._servicer: PeerServicer | None = None
        self._channel: grpc.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self.peer_address = ""
        self.metrics_address = ""
        self._threads: list[threading.Thread] = []

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub | None:
        return self._stub

    # -- serving -------------------------------------------------------------------------------------------------

    def set_serving(self, state: ServingState | None) -> None:
        self._serving = state

    def serving(self) -> ServingState | None:
        return self._serving

    def start(self) -> None:
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        id_file = config.state_dir / "node_id"
        self.node_id = id_file.read_text().strip() if id_file.exists() else ""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer"), options=GRPC_OPTIONS
        )
        host, port = split_address(config.listen)
        # Payload bytes of exchanges travel on lanes beside gRPC, on the same host as the peer service.
        self._servicer = PeerServicer(self.serving, self.metrics, __version__, lane_host=host,
                                      lane_port=config.lane_port)
        peer_pb2_grpc.add_PeerServicer_to_server(self._servicer, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {config.listen}")
        self._server.start()
        self.peer_address = config.advertise or f"{self._advertised_host(host)}:{bound}"
        if config.metrics_listen:
            metrics_host, metrics_port = split_address(config.metrics_listen)
            metrics_bound = self.metrics.serve_http(metrics_host, metrics_port)
            self.metrics_address = f"{self._advertised_host(metrics_host)}:{metrics_bound}"
        log.warning("peer links are not encrypted (insecure mode): run only on a trusted network")
        self._channel = grpc.insecure_channel(config.coordinator, options=GRPC_OPTIONS)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._register()
        self.metrics.agent_info.labels(self.node_id, config.device).set(1)
        for target, name in ((self._watch_loop, "watch"), (self._heartbeat_loop, "heartbeat")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("agent %s serving peers on %s, metrics on %s", self.node_id, self.peer_address, self.metrics_address)

    @staticmethod
    def _advertised_host(host: str) -> str:
        return socket.gethostname() if host in ("0.0.0.0", "::", "") else host

    def _register(self) -> None:
        assert self._stub is not None
        while not self.stopping.is_set():
            try:
                reply = self._stub.Register(
                    coordinator_pb2.RegisterRequest(
                        node_id=self.node_id, peer_address=self.peer_address, metrics_address=self.metrics_address,
                        name=self.config.name, device=self.config.device, version=__version__,
                    ),
                    timeout=5,
                )
            except grpc.RpcError as error:
                log.warning("coordinator %s unreachable (%s); retrying", self.config.coordinator, failure_reason(error))
                self.stopping.wait(RECONNECT_DELAY_S)
                continue
            if reply.node_id != self.node_id:
                self.node_id = reply.node_id
                (self.config.state_dir / "node_id").write_text(self.node_id + "\n")
            self.heartbeat_interval = reply.heartbeat_interval_s or 2.0
            return

    def _heartbeat_loop(self) -> None:
        assert self._stub is not None
        while not self.stopping.wait(self.heartbeat_interval):
            try:
                reply = self._stub.Heartbeat(coordinator_pb2.HeartbeatRequest(node_id=self.node_id), timeout=5)
                if not reply.known:
                    log.warning("the coordinator forgot this node; registering again")
                    self._register()
            except grpc.RpcError as error:
                log.debug("heartbeat failed: %s", failure_reason(error))

    def _watch_loop(self) -> None:
        assert self._stub is not None
        while not self.stopping.is_set():
            try:
                for assignment in self._stub.WatchAssignment(
                    coordinator_pb2.WatchAssignmentRequest(node_id=self.node_id)
                ):
                    self._apply(assignment)
                    if self.stopping.is_set():
                        return
            except grpc.RpcError as error:
                if self.stopping.is_set():
                    return
                log.warning("assignment stream lost (%s); reconnecting", failure_reason(error))
                if failure_reason(error) == "not_found":
                    self._register()
            self.stopping.wait(RECONNECT_DELAY_S)

    def _apply(self, assignment: coordinator_pb2.Assignment) -> None:
        with self._runner_lock:
            runner = self._runner
            running = assignment.state == coordinator_pb2.JOB_RUNNING
            if runner is not None and (not running or runner.job_id != assignment.job_id):
                log.info("job %s ended here (%s)", runner.job_id, coordinator_pb2.JobState.Name(assignment.state))
                runner.stop_event.set()
                runner.join(timeout=30)
                self._runner = runner = None
            if not running:
                return
            if runner is None:
                self._runner = JobRunner(self, assignment)
                self._runner.start()
            else:
                runner.update(assignment)

    def report(self, report: coordinator_pb2.MetricsReport) -> None:
        assert self._stub is not None
        try:
            self._stub.ReportMetrics(report, timeout=5)
        except grpc.RpcError as error:
            log.debug("metrics report failed: %s", failure_reason(error))

    def stop(self) -> None:
        """Stop training, stop serving; idempotent. Checkpoints are already on disk."""
        self.stopping.set()
        with self._runner_lock:
            if self._runner is not None:
                self._runner.stop_event.set()
                self._runner.join(timeout=30)
                self._runner = None
        if self._server is not None:
            self._server.stop(grace=2).wait()
        if self._servicer is not None:
            self._servicer.close()
        if self._channel is not None:
            self._channel.close()
