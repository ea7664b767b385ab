"""The node agent daemon: register with the coordinator, keep beating, watch the assignment, serve peers, and run
each assigned job in a runner thread (nodeagent.agent.runner).

Threads: gRPC server threads serve peers (they only read the published snapshot and enqueue messages); one
watch thread follows the assignment stream; one heartbeat thread; one events thread forwards job events and
warnings to the coordinator (nodeagent.agent.forward); one runner thread per job (the only thread
that calls into the algorithm), with a small pool for its outgoing calls.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from nodeagent import __version__
from nodeagent._proto import coordinator_pb2, coordinator_pb2_grpc
from nodeagent.agent.checkpoint import retire_checkpoints
from nodeagent.agent.enroll import EnrollmentError, enroll, needs_renewal, renew
from nodeagent.agent.forward import FORWARDED, EventForwarder
from nodeagent.agent.runner import JobRunner
from nodeagent.compat import versioned
from nodeagent.defaults import (
    AGENT_METRICS_PORT,
    AGENT_PORT,
    COORDINATOR_ADDRESS,
    ENROLL_PORT,
    HEARTBEAT_INTERVAL_S,
    KEEP_CHECKPOINTS,
    MAX_MODEL_MEMORY_MIB,
)
from nodeagent.health import HealthServer
from nodeagent.listen import check_port_free
from nodeagent.metrics import Metrics
from nodeagent.rpc import (
    GRPC_OPTIONS,
    MAX_FIELD_CHARS,
    SERVER_OPTIONS,
    Backoff,
    failure_reason,
    split_address,
    unreachable_cause,
)
from nodeagent.runtime.limits import PEER_SERVER_THREADS
from nodeagent.runtime.peer_service import PEER_RULES, PeerServicer, ServingState, add_peer_servicer, serve_promptly
from nodeagent.security.authz import Authorizer
from nodeagent.security.pki import Identity, Role, name_problem
from nodeagent.security.tls import INSECURE_WARNING, TlsDir, TlsError, Transport
from nodeagent.training.datadirs import DataDirs
from nodeagent.training.device import describe_device

log = logging.getLogger("nodeagent")

EVENTS_EVERY_S = 1.0  # how often queued events go to the coordinator

# Answers to Register that trying again will not change.
# Answers that say the same again would be refused again: no retry. PERMISSION_DENIED and UNAUTHENTICATED come from
# the coordinator's authorizer (a certificate of another role, a revoked one), never from a network fault.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)


class RegistrationRefused(Exception):
    """The coordinator refused this node (a bad field, its node id live elsewhere, its enrollment); the message
    says why."""


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str = COORDINATOR_ADDRESS
    listen: str = f"0.0.0.0:{AGENT_PORT}"
    advertise: str | None = None
    metrics_listen: str | None = f"0.0.0.0:{AGENT_METRICS_PORT}"
    state_dir: Path = Path("/var/lib/peertrain/agent")
    data_dirs: DataDirs = field(default_factory=DataDirs)  # where this machine keeps each dataset
    device: str = "cpu"  # resolved (nodeagent.training.device.resolve_device): cpu, cuda:0, ...
    name: str = field(default_factory=socket.gethostname)
    slowdown: float = 1.0
    lane_port: int = 0  # TCP port of the tensor lanes beside the peer service (0: any free port)
    health_listen: str | None = None  # the plaintext gRPC health service for probes (nodeagent.health); None: none
    tls_dir: Path | None = None  # this node's credentials (ca.crt, tls.crt, tls.key); None: insecure
    join_token: str = ""  # enroll with it when tls_dir holds no credentials yet
    ca_fingerprint: str = ""
    enroll_address: str = ""  # the coordinator's enrollment address (default: its host, ENROLL_PORT)
    allow_imports: tuple[str, ...] = ()  # modules a job's model may be imported from (nodeagent.training.models)
    max_model_memory_mib: int = MAX_MODEL_MEMORY_MIB  # a job's model with its optimizer state, refused beyond
    keep_checkpoints: int = KEEP_CHECKPOINTS  # the checkpoints of this many jobs ended here are kept (checkpoint.py)


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.metrics = Metrics()
        self.stopping = threading.Event()
        self.node_id = ""
        self.registered = False  # the coordinator accepted this process as node_id (only then may it leave as it)
        self._serving: ServingState | None = None
        self._runner: JobRunner | None = None
        self._runner_lock = threading.Lock()
        self._swept = False  # checkpoint retention applied since this process started
        self._server: grpc.Server | None = None
        self._health: HealthServer | None = None
        self.health_address = ""
        self._servicer: PeerServicer | None = None
        self._channel: grpc.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self.device = describe_device(torch.device(config.device))
        self.peer_address = ""
        self.metrics_address = ""
        self._threads: list[threading.Thread] = []
        self.transport = Transport.insecure()
        self.revoked: frozenset[str] = frozenset()  # serials the coordinator revoked: refused on every link
        self.events = EventForwarder(self._current_job)

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub | None:
        return self._stub

    # -- serving -------------------------------------------------------------------------------------------------

    def set_serving(self, state: ServingState | None) -> None:
        self._serving = state

    def serving(self) -> ServingState | None:
        return self._serving

    def start(self) -> bool:
        """Serve peers and metrics, register, then follow the assignment; False if stopped before registering.
        Raises ListenError for an address that cannot be had, RegistrationRefused if the coordinator refuses."""
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        if config.health_listen:  # NOT_SERVING until registered: a probe sees the agent start
            self._health = HealthServer(config.health_listen)
            self.health_address = f"{split_address(config.health_listen)[0]}:{self._health.port}"
        id_file = config.state_dir / "node_id"
        self.node_id = id_file.read_text().strip() if id_file.exists() else ""
        interceptors = []
        if config.tls_dir is not None:
            if not self._credentials(TlsDir(config.tls_dir)):
                return False
            self.node_id = self.transport.credentials().identity.name  # who this node is: its certificate says
            interceptors.append(Authorizer(PEER_RULES, self.is_revoked))
        self.metrics.insecure_mode.set(int(not self.transport.secure))
        serve_promptly()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=PEER_SERVER_THREADS, thread_name_prefix="peer"),
            options=SERVER_OPTIONS, maximum_concurrent_rpcs=PEER_SERVER_THREADS, interceptors=interceptors,
        )
        host, _port = split_address(config.listen)
        # Payload bytes of exchanges travel on lanes beside gRPC, on the same host as the peer service.
        self._servicer = PeerServicer(self.serving, self.metrics, __version__, node_id=lambda: self.node_id,
                                      lane_host=host, lane_port=config.lane_port, secure=self.transport.secure,
                                      revoked=self.is_revoked)
        add_peer_servicer(self._servicer, self._server)
        bound = self.transport.bind(self._server, config.listen)
        self._server.start()
        self.peer_address = config.advertise or f"{self._advertised_host(host)}:{bound}"
        if config.metrics_listen:
            metrics_host, metrics_port = split_address(config.metrics_listen)
            metrics_bound = self.metrics.serve_http(metrics_host, metrics_port)
            self.metrics_address = f"{self._advertised_host(metrics_host)}:{metrics_bound}"
        if not self.transport.secure:
            log.warning(INSECURE_WARNING)
        self._connect()
        if not self._register():
            return False
        self.metrics.agent_info.labels(self.node_id, config.name, __version__, self.peer_address, config.device).set(1)
        self.metrics.watch_device(self.node_id, config.device)
        logging.getLogger("nodeagent").addHandler(self.events)
        for target, name in ((self._watch_loop, "watch"), (self._heartbeat_loop, "heartbeat"),
                             (self._events_loop, "events")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._health is not None:
            self._health.ready()
        log.info("agent %s serving peers on %s, metrics on %s; data: %s", self.node_id, self.peer_address,
                 self.metrics_address, config.data_dirs.describe())
        return True

    def _credentials(self, tls_dir: TlsDir) -> bool:
        """Load this node's credentials, enrolling first when there are none (retrying while the coordinator
        cannot be reached); False if stopped first. Raises RegistrationRefused when it cannot be done."""
        config = self.config
        if not tls_dir.complete():
            if not (config.join_token and config.ca_fingerprint):
                raise RegistrationRefused(
                    f"no certificate in {tls_dir.path}: enroll with --join-token TOKEN --ca-fingerprint SHA256 (from "
                    "`coordinator token create`), or put one there from `coordinator cert issue --node NAME`; "
                    "--insecure runs without, for local experiments only")
            self._check_before_enrolling()
            host, _port = split_address(config.coordinator)
            address = config.enroll_address or f"{host}:{ENROLL_PORT}"
            backoff = Backoff(f"enrollment at {address}", log)
            while not self.stopping.is_set():
                try:
                    enroll(address, config.join_token, config.ca_fingerprint, config.name.lower(), tls_dir)
                    break
                except EnrollmentError as error:
                    raise RegistrationRefused(str(error)) from None
                except (OSError, grpc.RpcError) as error:
                    reason = (unreachable_cause(error) or failure_reason(error)) if isinstance(error, grpc.RpcError) \
                        else str(error)
                    self.stopping.wait(backoff.failed(reason))
            else:
                return False
        try:
            self.transport = Transport(tls_dir)
        except TlsError as error:
            raise RegistrationRefused(str(error)) from None
        holder = self.transport.credentials().identity
        if holder.role != Role.NODE:  # e.g. an operator's directory: the coordinator would refuse every call
            raise RegistrationRefused(
                f"{tls_dir.path} holds the certificate of {holder} (role {holder.role}); an agent needs a node "
                "certificate: give it its own directory (--tls-dir, env PEERTRAIN_AGENT_TLS_DIR), not the operator "
                "CLI's (PEERTRAIN_TLS_DIR)")
        return True

    def _check_before_enrolling(self) -> None:
        """What would stop this agent once enrolled, checked before the one-time token is spent: the name its
        certificate would bear, and the ports it serves on. RegistrationRefused or ListenError naming it."""
        config = self.config
        if problem := name_problem(config.name.lower()):
            raise RegistrationRefused(f"--name {config.name!r} cannot be a node's name: {problem}; the join token "
                                      "was not used")
        host, port = split_address(config.listen)
        addresses = [(host, port), (host, config.lane_port)]
        if config.metrics_listen:
            addresses.append(split_address(config.metrics_listen))
        for host, port in addresses:
            check_port_free(host, port)

    def is_revoked(self, identity: Identity) -> bool:
        return identity.serial in self.revoked

    def _connect(self) -> None:
        """(Re)make the channel to the coordinator, with the current credentials."""
        old = self._channel
        self._channel = self.transport.channel(self.config.coordinator, options=GRPC_OPTIONS)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(versioned(self._channel))
        if old is not None:
            old.close()

    def _renew_if_due(self) -> None:
        """Rotate this node's certificate once less than a third of its life is left (checked every heartbeat)."""
        if not self.transport.secure or not needs_renewal(self.transport):
            return
        assert self._stub is not None
        try:
            serial = renew(self.transport, self._stub)
        except (grpc.RpcError, EnrollmentError) as error:
            log.warning("certificate renewal failed (retried at the next heartbeat): %s",
                        error.details() if isinstance(error, grpc.RpcError) else error)
            return
        log.info("renewed this node's certificate: serial %s", serial)
        # New connections present the new certificate: the peer server reloads it by itself, the coordinator's
        # channel is given it here.
        self._connect()

    @staticmethod
    def _advertised_host(host: str) -> str:
        return socket.gethostname() if host in ("0.0.0.0", "::", "") else host

    def _register(self) -> bool:
        """Register with the coordinator, retrying with back-off while it cannot be reached; False if stopped first.
        Raises RegistrationRefused if the coordinator refuses this node."""
        assert self._stub is not None
        backoff = Backoff(f"registration with coordinator {self.config.coordinator}", log)
        while not self.stopping.is_set():
            try:
                reply = self._stub.Register(
                    coordinator_pb2.RegisterRequest(
                        node_id=self.node_id, peer_address=self.peer_address, metrics_address=self.metrics_address,
                        name=self.config.name, device=self.config.device, version=__version__,
                        # Bounded as the coordinator checks it: a long card name must not get this node refused.
                        device_name=self.device.name[:MAX_FIELD_CHARS], device_memory_bytes=self.device.memory_bytes,
                    ),
                    timeout=5,
                )
            except grpc.RpcError as error:
                if error.code() in REFUSALS:
                    raise RegistrationRefused(
                        f"coordinator {self.config.coordinator} refused this node: {error.details()}"
                    ) from None
                self.stopping.wait(backoff.failed(unreachable_cause(error) or failure_reason(error)))
                continue
            backoff.succeeded()
            if reply.node_id != self.node_id:
                self.node_id = reply.node_id
                (self.config.state_dir / "node_id").write_text(self.node_id + "\n")
            self.heartbeat_interval = reply.heartbeat_interval_s or HEARTBEAT_INTERVAL_S
            self.registered = True
            return True
        return False

    def _register_again(self) -> None:
        """Register again from a loop thread, after the coordinator forgot this node. A refusal is logged: the node
        then takes no part until it is restarted."""
        try:
            self._register()
        except RegistrationRefused as refusal:
            log.error("%s", refusal)

    def _heartbeat_loop(self) -> None:
        assert self._stub is not None
        backoff = Backoff(f"heartbeats to coordinator {self.config.coordinator}", log)
        while not self.stopping.wait(self.heartbeat_interval):
            try:
                reply = self._stub.Heartbeat(coordinator_pb2.HeartbeatRequest(node_id=self.node_id), timeout=5)
            except grpc.RpcError as error:
                if self.stopping.is_set():  # the channel closed because this agent stops
                    return
                # Logged with back-off, but beating on at the interval: the coordinator's liveness rests on it, and
                # a longer pause after an outage would have it mark this node down.
                backoff.failed(unreachable_cause(error) or failure_reason(error))
                continue
            backoff.succeeded()
            if not reply.known:
                log.warning("the coordinator forgot this node; registering again")
                self._register_again()
            self._renew_if_due()

    def _events_loop(self) -> None:
        while not self.stopping.wait(EVENTS_EVERY_S):
            self.send_events()

    def send_events(self) -> None:
        if self._stub is not None:
            self.events.send(self._stub, self.node_id)

    def event(self, job_id: str, kind: str, message: str, level: str = "INFO", step: int = -1) -> None:
        """A job event of this node, sent to the coordinator now (events are few, and their order across nodes is
        the coordinator's time of receipt), and logged here at `level`."""
        log.log(logging.getLevelName(level), "job %s: %s", job_id, message, extra={FORWARDED: True})
        self.events.add(job_id, kind, message, level, step)
        self.send_events()

    def _current_job(self) -> tuple[str, int] | None:
        runner = self._runner
        return (runner.job_id, runner.step()) if runner is not None else None

    def _watch_loop(self) -> None:
        assert self._stub is not None
        backoff = Backoff(f"assignment stream from coordinator {self.config.coordinator}", log)
        while not self.stopping.is_set():
            reason = "ended"
            try:
                for assignment in self._stub.WatchAssignment(
                    coordinator_pb2.WatchAssignmentRequest(node_id=self.node_id)
                ):
                    backoff.succeeded()
                    self._apply(assignment)
                    if self.stopping.is_set():
                        return
            except grpc.RpcError as error:
                reason = failure_reason(error)
            if self.stopping.is_set():  # the stream ended because this agent stops
                return
            if reason == "not_found":
                self._register_again()
            self.stopping.wait(backoff.failed(reason))

    def _apply(self, assignment: coordinator_pb2.Assignment) -> None:
        self.revoked = frozenset(assignment.revoked_serials)
        with self._runner_lock:
            runner = self._runner
            running = assignment.state == coordinator_pb2.JOB_RUNNING
            current = assignment.job_id if running else None
            if runner is not None and (not running or runner.job_id != assignment.job_id):
                # An agent freed by its job's end is sent an empty assignment: the job's outcome is in `status`.
                log.info("job %s ended here; this agent is free for the next job", runner.job_id)
                runner.stop_event.set()
                runner.join(timeout=30)
                self._runner = None
                if not runner.is_alive():  # else it may still write a checkpoint: the next sweep takes it
                    self._retire_checkpoints(current)
                runner = None
            elif not self._swept:  # checkpoints of jobs that ended while this agent was away
                self._retire_checkpoints(current)
            if not running:
                return
            if runner is None:
                self._runner = JobRunner(self, assignment)
                self._runner.start()
            else:
                runner.update(assignment)

    def _retire_checkpoints(self, running: str | None) -> None:
        self._swept = True
        try:
            deleted = retire_checkpoints(self.config.state_dir, self.config.keep_checkpoints, running)
        except OSError as error:
            log.warning("could not delete the checkpoints of ended jobs: %s", error)
            return
        if deleted:
            log.info("deleted %d checkpoint%s of ended jobs (--keep-checkpoints %d)", len(deleted),
                     "" if len(deleted) == 1 else "s", self.config.keep_checkpoints)

    def report(self, report: coordinator_pb2.MetricsReport) -> None:
        assert self._stub is not None
        try:
            self._stub.ReportMetrics(report, timeout=5)
        except grpc.RpcError as error:
            log.debug("metrics report failed: %s", failure_reason(error))

    def report_failure(self, job_id: str, rank: int, reason: str) -> None:
        """This node cannot build or continue its job: the coordinator applies the job's failure policy."""
        assert self._stub is not None
        try:
            self._stub.ReportFailure(
                coordinator_pb2.NodeFailure(node_id=self.node_id, job_id=job_id, rank=rank, reason=reason), timeout=5
            )
        except grpc.RpcError as error:
            log.warning("the failure of job %s could not be reported: %s", job_id, failure_reason(error))

    def stop(self) -> None:
        """Stop training, leave the cluster, stop serving; idempotent. Checkpoints are already on disk."""
        self.stopping.set()
        if self._health is not None:  # probes see NOT_SERVING (then nothing) while the agent leaves
            self._health.stop()
        with self._runner_lock:
            if self._runner is not None:
                self._runner.stop_event.set()
                self._runner.join(timeout=30)
                self._runner = None
        logging.getLogger("nodeagent").removeHandler(self.events)
        self.send_events()
        if self._stub is not None and self.registered:
            try:  # down at once, rather than after the heartbeat timeout
                self._stub.Deregister(coordinator_pb2.DeregisterRequest(node_id=self.node_id), timeout=2)
            except grpc.RpcError as error:
                log.info("could not tell the coordinator this node leaves: %s", failure_reason(error))
        if self._server is not None:
            self._server.stop(grace=2).wait()
        if self._servicer is not None:
            self._servicer.close()
        if self._channel is not None:
            self._channel.close()
