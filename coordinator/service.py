"""The coordinator's gRPC servicer: registration, heartbeats, assignments, metrics reports, operator calls, and
the parameter server of the centralised algorithms (coordinator.ps_service)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import secrets
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pydantic import ValidationError

from coordinator.ca import DEFAULT_TOKEN_TTL_S, CAError, ClusterCA
from coordinator.control.plane import (
    ControlPlane,
    Effect,
    JobEnded,
    JobEvent,
    Quarantined,
    QuarantineRefused,
    TopologyRefused,
)
from coordinator.control.records import Job, MemberRow, NodeRow
from coordinator.control.sqlite import SqliteState
from coordinator.control.state import ControlState
from coordinator.control.states import ACTIVE_JOB_STATES, JobState, MemberState
from coordinator.jobs import (
    validate_job,
)
from coordinator.model_store import ModelStore
from coordinator.ps_service import PSService
from coordinator.rendezvous import Rendezvous, RendezvousError, request_problem
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from nodeagent.algorithms import Family, lookup
from nodeagent.compat import skew_problem
from nodeagent.defaults import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    KEEP_JOBS,
    KEEP_RUNS,
    MAX_MODEL_MEMORY_MIB,
    RATE_WINDOW_S,
)
from nodeagent.jobspec import (
    MAX_NODES,
    JobSpec,
    JobSpecError,
    TopologySpec,
    format_validation_error,
    parse_job_yaml,
)
from nodeagent.metrics import Metrics
from nodeagent.rpc import (
    MAX_DEVICE_MEMORY_BYTES,
    MAX_FIELD_CHARS,
    address_problem,
    field_problem,
    name_key,
    node_id_problem,
    plain_text,
)
from nodeagent.runtime import events
from nodeagent.runtime.driver import IN_FLIGHT
from nodeagent.runtime.events import Event, EventLog
from nodeagent.runtime.messages import data_from_proto, event_to_proto, from_report, to_node_progress
from nodeagent.runtime.progress import EdgeCounters, Progress, RunLog
from nodeagent.runtime.readiness import data_problem
from nodeagent.security import pki
from nodeagent.security.authz import Authorizer, rules_for
from nodeagent.security.pki import CertificateError, Role
from nodeagent.security.tls import Transport, caller
from nodeagent.training.model_memory import MIB

log = logging.getLogger("coordinator")

# How long Register waits for the old address of a node id to answer (see answers_as).
PROBE_TIMEOUT_S = 1.0

JOB_STATES = {state: pb.JobState.Value(f"JOB_{state.value}") for state in JobState}
WATCH_POLL_S = 1.0
MAX_FAILURE_CHARS = 2000  # of a node's failure reason, as stored and shown
CERTIFICATE_CHECK_S = 600.0  # how often the coordinator looks at its own certificate's expiry
MAX_WATCHES_PER_NODE = 2  # an agent holds one; a second covers a reconnect racing the old stream's end
# Every agent holds a thread with its assignment stream, and synchronous parameter-server pushes wait for their
# round on one: the server's pool is sized for a few hundred agents.
SERVER_THREADS = 512
# Calls one identity may have outstanding at once, of every kind: an agent holds a dozen at most (its watch, a ready
# report or a rendezvous long poll, parameter-server pushes in flight, its beats and reports); the server's threads
# are many times more, so no one identity starves the others.
MAX_CALLS_PER_IDENTITY = 32
DEFAULT_JOB_LIST = 100
MAX_JOB_LIST = 10_000
MAX_JOB_REFERENCE_CHARS = 128  # a job's id or name, as a person types it
UNUSABLE_TOKEN = "the join token is unknown, used or expired (`coordinator token create` makes one)"
AMBIGUOUS_SHOWN = 5  # the jobs an ambiguous id prefix begins, named in the refusal
RATE_SAMPLES = 64  # a rank's reports kept for it (about one a second)
ENDED_JOBS_EDGES_KEPT = 16  # the ended jobs whose last edges `coordinator edges` shows (in memory only)
MAX_TOPOLOGY_OPTIONS_CHARS = 65_536  # of a change's options as JSON (an edge list of a few thousand edges)
MAX_EVENTS_PER_REPORT = 64
# Each node may add EVENT_BURST events at once and EVENT_RATE_PER_S on average: a node that logs in a loop fills
# neither the disk nor `coordinator logs`; what it sends beyond is dropped and counted.
EVENT_BURST = 200
EVENT_RATE_PER_S = 2.0
# What a node's report may hold of its edges (per-edge debugging): a node has at most MAX_NODES - 1 neighbours,
# plus the parameter server or the all-reduce; what it waits for is a line of the log.
MAX_REPORTED_EDGES = MAX_NODES + 1
MAX_WAITING_CHARS = 500
# Failure reasons are a small known set (gRPC status codes, and the driver's and transports' own); anything else
# an agent sends is counted as OTHER_REASON, so that a report cannot grow the set.
KNOWN_FAILURE_REASONS = frozenset({code.name.lower() for code in grpc.StatusCode} |
                                  {"rejected", "not_neighbor", "error", IN_FLIGHT})
OTHER_REASON = "other"
MAX_MISSING_DATA_CHARS = 2000  # a node's word on the data it does not have
MAX_READY_WAIT_S = 10.0  # the longest a JobReady answer is held for the release (a long poll)
# A node's times are its own clock's durations since it started the job, after the coordinator started it: a report
# may exceed the coordinator's count by this much (clocks run at slightly different rates; reports take time).
REPORT_CLOCK_SLACK_S = 60.0

_NODE = frozenset({Role.NODE})
_OPERATOR = frozenset({Role.OPERATOR})
# Who may call what on the coordinator. A node acts only as itself (the handlers check the node id fields).
COORDINATOR_RULES = rules_for("peertrain.v1.Coordinator", {
    **dict.fromkeys(("Register", "Heartbeat", "WatchAssignment", "ReportMetrics", "ReportFailure", "Deregister",
                     "ReportEvents", "JobReady", "PsPush", "PsPull", "PsReport", "Rendezvous", "UploadModel"), _NODE),
    **dict.fromkeys(("SubmitJob", "StopJob", "DeleteJob", "ListNodes", "JobStatus", "ListJobs", "JobEvents",
                     "RemoveNode", "DrainNode",
                     "CreateJoinToken", "RevokeCertificate", "ListCertificates", "ChangeTopology", "ExportModel",
                     "Quarantine"),
                   _OPERATOR),
    "RenewCertificate": _NODE | _OPERATOR,
})


@dataclass
class CoordinatorConfig:
    state_dir: Path
    runs_dir: Path | None = None
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    ps_fsync: bool = False  # also fsync the parameter server's state before answering (survives a machine crash)
    keep_runs: int = KEEP_RUNS  # run directories of this many ended jobs are kept, the newest (0: all)
    keep_jobs: int = KEEP_JOBS  # records of this many ended jobs are kept, the latest ended (0: all)
    max_model_memory_mib: int = MAX_MODEL_MEMORY_MIB  # a job's model with its optimizer state, refused beyond

    @property
    def run_root(self) -> Path:
        return self.runs_dir or self.state_dir / "runs"


@dataclass
class _Changes:
    """A counter that grows on every change that may alter some assignment, and a condition to wait on it."""

    version: int = field(default_factory=lambda: int(time.time() * 1000))
    condition: threading.Condition = field(default_factory=threading.Condition)

    def bump(self) -> None:
        with self.condition:
            self.version += 1
            self.condition.notify_all()

    def wait_past(self, version: int, timeout: float) -> int:
        with self.condition:
            self.condition.wait_for(lambda: self.version != version, timeout=timeout)
            return self.version


def registration_problem(request: pb.RegisterRequest) -> str | None:
    """What is wrong with a registration, naming the field (None: nothing). An empty node_id asks for a new one."""
    problems = {
        "node_id": node_id_problem(request.node_id) if request.node_id else None,
        "name": field_problem(request.name),
        "peer_address": address_problem(request.peer_address),
        "metrics_address": address_problem(request.metrics_address) if request.metrics_address else None,
        "device": field_problem(request.device),
        "version": field_problem(request.version),
        "device_name": field_problem(request.device_name),
        "device_memory_bytes": (f"must be at most {MAX_DEVICE_MEMORY_BYTES} (1 PiB)"
                                if request.device_memory_bytes > MAX_DEVICE_MEMORY_BYTES else None),
    }
    return next((f"{field}: {problem}" for field, problem in problems.items() if problem), None)


def answers_as(transport: Transport, address: str, node_id: str) -> bool:
    """Whether the agent at `address` still answers as `node_id`: then a registration of that id from another address
    is a second agent, not a restart. No answer in time, or another id, means the old process is gone."""
    with transport.channel(address, server_name=node_id) as channel:
        try:
            description = peer_pb2_grpc.PeerStub(channel).Describe(peer_pb2.DescribeRequest(),
                                                                     timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return description.node_id == node_id


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """With a CA the service runs under mutual TLS (`transport` holds the coordinator's certificate): callers are
    who their certificates say. Without one (insecure) the node id fields are taken at their word."""

    def __init__(self, config: CoordinatorConfig, metrics: Metrics, ca: ClusterCA | None = None,
                 transport: Transport | None = None):
        self.config = config
        self.metrics = metrics
        self._running_shown: set[str] = set()  # the jobs peertrain_coordinator_job_running shows
        self.ca = ca
        self.transport = transport or Transport.insecure()
        self._watches: dict[str, int] = {}
        self._watches_lock = threading.Lock()
        self.store = SqliteState(config.state_dir / "coordinator.db")
        self.changes = _Changes()
        self.stopping = threading.Event()
        self.rendezvous = Rendezvous()
        self._run_logs: dict[str, RunLog] = {}
        self._event_logs: dict[str, EventLog] = {}
        self._event_allowance: dict[str, tuple[float, float]] = {}  # node -> (events it may add, when counted)
        self._events_lock = threading.Lock()
        # Per running job and rank, the node's last edges and what it waits for (JobStatus shows them): live
        # debugging figures, refreshed every second, kept in memory only and dropped when the job ends.
        self._live_edges: dict[str, dict[int, Progress]] = {}
        self._live_edges_lock = threading.Lock()  # a report racing its job's end leaves nothing behind
        # (time, step) of each running rank's recent reports, for `status`'s recent rate (in memory: a restarted
        # coordinator knows the rates again after a few reports).
        self._recent_steps: dict[str, dict[int, deque[tuple[float, int]]]] = {}
        self._ended_edges: OrderedDict[str, dict[int, Progress]] = OrderedDict()  # the newest ended jobs' last too
        # The rules (coordinator.control.plane) see one event at a time: their effects are applied before the next.
        self.plane = ControlPlane(self.store, time.time, config.heartbeat_timeout_s)
        self._plane_lock = threading.Lock()
        self.ps = PSService(self.store, metrics, fsync=config.ps_fsync)
        self.models = ModelStore(self.store)
        self._monitor = threading.Thread(target=self._monitor_loop, name="liveness", daemon=True)

    def start(self) -> None:
        if self.ca is not None:
            self._warn_of_names_refused_now(self.ca)
        self._monitor.start()

    @staticmethod
    def _warn_of_names_refused_now(ca: ClusterCA) -> None:
        """Certificates an earlier version issued under a name the naming rules refuse now (`agent-0.`, one that
        passes for another) work until they are revoked: the operator is told which."""
        now = time.time()
        for cert in ca.certificates():
            if cert.role != Role.COORDINATOR and not cert.revoked_unix and cert.not_after_unix > now and \
                    (problem := pki.name_problem(cert.name)):
                log.warning("the %s certificate %s of %r has a name that %s now: revoke it (`coordinator cert revoke "
                            "--name NAME`)", cert.role, cert.serial, cert.name, problem)

    def authorizer(self) -> Authorizer | None:
        """The interceptor that admits calls by certificate role, MAX_CALLS_PER_IDENTITY at once for each identity
        (None when insecure)."""
        if self.ca is None:
            return None
        return Authorizer(COORDINATOR_RULES, self.ca.is_revoked, MAX_CALLS_PER_IDENTITY)

    def _as_node(self, context: grpc.ServicerContext, claimed: str) -> str:
        """The node id this call acts as: its certificate's (a claimed id must agree), or, when insecure, the id
        the caller gives."""
        identity = caller(context) if self.ca is not None else None
        if identity is None:
            return claimed
        if claimed and claimed != identity.name:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"node {identity.name} cannot act as node {claimed[:64]!r}")
        return identity.name

    def stop(self) -> None:
        self.stopping.set()
        self.changes.bump()
        self.ps.close_all()
        self.rendezvous.close_all()
        self._monitor.join(timeout=5)
        self.store.close()

    # -- background ----------------------------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        renewal_checked = time.monotonic()
        while not self.stopping.wait(1.0):
            if self.ca is not None and self.transport.tls_dir is not None and \
                    time.monotonic() - renewal_checked >= CERTIFICATE_CHECK_S:
                # The coordinator's own certificate is renewed at two thirds of its life, as agents renew theirs;
                # the server presents the new one to new connections.
                renewal_checked = time.monotonic()
                self.ca.coordinator_credentials(self.transport.tls_dir)
            self._control(self.plane.tick)
            self._take_server_counts()
            self._update_gauges()

    def _take_server_counts(self) -> None:
        """Hand the control plane what each parameter server's robust rule found of its workers (suspicion)."""
        for job_id, counts in self.ps.robust_counts().items():
            job = self.store.job(job_id)
            if job is not None and job.spec.algorithm.robust is not None and counts:
                self._control(self.plane.server_reported, job, counts)

    def _update_gauges(self) -> None:
        nodes = self.store.nodes()
        up = sum(n.up for n in nodes)
        self.metrics.coordinator_nodes.labels("up").set(up)
        self.metrics.coordinator_nodes.labels("down").set(len(nodes) - up)
        counts = self.store.job_counts()  # counted, not read: ended jobs cost the monitor nothing
        for state in JOB_STATES:
            self.metrics.coordinator_jobs.labels(state.lower()).set(counts.get(state, 0))
        running = {job.job_id for job in self.store.jobs((JobState.RUNNING,))}
        for job_id in self._running_shown - running:
            self.metrics.coordinator_job_running.remove(job_id)
        for job_id in running:
            self.metrics.coordinator_job_running.labels(job_id).set(1)
        self._running_shown = running
        for job in self.store.jobs((JobState.RUNNING,)):
            with self._plane_lock:  # the plane's figures change under its lock
                flagged, quarantined = self.plane.flagged(job.job_id), self.plane.quarantined(job.job_id)
            if job.spec.algorithm.robust is None and not quarantined:
                continue
            for member in self.store.members(job.job_id):
                labels = (job.job_id, member.node_id)
                with self._plane_lock:
                    suspicion = self.plane.suspicion_of(job, member.rank)
                if not math.isnan(suspicion):
                    self.metrics.coordinator_member_suspicion.labels(*labels).set(suspicion)
                self.metrics.coordinator_member_suspected.labels(*labels).set(member.rank in flagged)
                self.metrics.coordinator_member_quarantined.labels(*labels).set(member.rank in quarantined)

    # -- the rules' effects ---------------------------------------------------------------------------------------

    def _control(self, event: Callable[..., list[Effect]], *args: object) -> None:
        """Hand an event to the control plane and apply its effects."""
        with self._plane_lock:
            self._apply(event(*args))

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, JobEnded):
                self.rendezvous.end(effect.job.job_id)
                self.ps.close(effect.job.job_id)
                self.models.forget(effect.job.job_id)
                self._retire_ended_jobs()
                self.metrics.forget_job(effect.job.job_id)
                with self._live_edges_lock:
                    last = self._live_edges.pop(effect.job.job_id, None)
                    self._recent_steps.pop(effect.job.job_id, None)
                    if last:  # `coordinator edges` of an ended job: its last known edges, for the newest few
                        self._ended_edges[effect.job.job_id] = last
                        while len(self._ended_edges) > ENDED_JOBS_EDGES_KEPT:
                            self._ended_edges.popitem(last=False)
            elif isinstance(effect, JobEvent):
                self._event(effect.job, effect.kind, effect.message, effect.level)
            elif isinstance(effect, Quarantined):
                self.ps.quarantine(effect.job.job_id, effect.rank, not effect.released)
            else:
                self.changes.bump()

    def _retire_ended_jobs(self) -> None:
        """As a job ends: the run directories beyond --keep-runs go, and the records of ended jobs beyond
        --keep-jobs (with whatever is left of their run directories)."""
        for job_id, run_dir in retire_run_dirs(self.store, self.config.run_root, self.config.keep_runs):
            self._forget_logs(job_id)
            log.info("job %s: run directory %s removed (--keep-runs %d)", job_id, run_dir, self.config.keep_runs)
        if self.config.keep_jobs:
            for job_id in self.store.ended_job_ids()[self.config.keep_jobs:]:
                if self._delete_job(job_id) is not None:
                    log.info("job %s: record deleted (--keep-jobs %d)", job_id, self.config.keep_jobs)

    def _forget_logs(self, job_id: str) -> None:
        self._run_logs.pop(job_id, None)
        with self._events_lock:
            self._event_logs.pop(job_id, None)

    def _delete_job(self, job_id: str) -> str | None:
        """Forget an ended job: its record and results, and its run directory where it lies under the run root
        (events, metrics, trained models). None when the job is unknown or still active; else the run directory
        removed ('' if none was)."""
        job = self.store.job(job_id)
        if job is None or not self.store.delete_job(job_id):
            return None
        self._forget_logs(job_id)
        self.models.forget(job_id)
        run_dir = Path(job.run_dir).resolve()
        if run_dir.parent == self.config.run_root.resolve() and run_dir.is_dir():
            shutil.rmtree(run_dir, ignore_errors=True)
            return str(run_dir)
        return ""

    # -- assignments ---------------------------------------------------------------------------------------------

    def assignment_for(self, node_id: str) -> pb.Assignment:
        revoked = self.ca.live_revocations() if self.ca is not None else []
        membership = self.store.running_membership(node_id)
        if membership is None:
            return pb.Assignment(version=self.changes.version, state=pb.JOB_STATE_UNSPECIFIED,
                                 revoked_serials=revoked)
        job, rank = membership
        spec = job.running_spec
        rows = {m.rank: m for m in self.store.members(job.job_id)}
        plan = self.plane.plan(job, list(rows.values()), rank)
        members = {m.rank: m.node_id for m in rows.values()}
        neighbors = []
        for neighbor in plan.neighbors:
            peer = self.store.node(members[neighbor.rank])
            neighbors.append(
                pb.Neighbor(
                    rank=neighbor.rank, node_id=peer.node_id if peer else "",
                    address=peer.peer_address if peer else "", sign=neighbor.sign, phase=neighbor.phase,
                    weight=neighbor.weight, up=bool(peer and peer.up), peer_phase=neighbor.peer_phase,
                )
            )
        # An elastic job's nodes are built for its most members (its data split into that many shards).
        spec_json = spec.sized().to_json() if spec.elastic else job.spec.to_json()
        return pb.Assignment(
            version=self.changes.version, job_id=job.job_id, state=pb.JOB_RUNNING, job_spec_json=spec_json,
            rank=rank, world_size=job.world_size, neighbors=neighbors, self_weight=plan.self_weight,
            run_dir=job.run_dir, peer_schedule=[pb.PeerSet(ranks=peers) for peers in plan.peer_schedule],
            rejoin=rows[rank].progress.time > 0, revoked_serials=revoked,
            topology_version=job.topology_version, switch_step=job.switch_step, topology_kind=spec.topology.kind,
            joined_at_step=rows[rank].joined_step,
        )

    # -- agent calls ---------------------------------------------------------------------------------------------

    def Register(self, request, context):
        problem = registration_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        node_id = self._as_node(context, request.node_id)
        name = request.name or request.peer_address
        if skew := skew_problem(f"agent {node_id or name}", request.version):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, skew)
        known = self.store.node(node_id) if node_id else None
        if (known is not None and known.up and known.peer_address != request.peer_address
                and answers_as(self.transport, known.peer_address, known.node_id)):
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"node {known.node_id} is up at {known.peer_address} and answers there; two agents share its node id "
                "(a copied state directory?)",
            )
        # Another live node's address or name is its own while it answers there; one that does not is gone.
        for other in self.store.nodes():
            if other.node_id == node_id or not other.up or not (
                    other.peer_address == request.peer_address or name_key(name) in (name_key(other.name),
                                                                                    name_key(other.node_id))):
                continue
            if answers_as(self.transport, other.peer_address, other.node_id):
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"node {other.node_id} ({other.name}) is up at {other.peer_address} and answers there: "
                              "its address and name are not another node's to take")
            if self.store.mark_down(other.node_id):
                log.info("%s is down: it does not answer at %s, which %s registers with", other.node_id,
                         other.peer_address, node_id or "a new node")
        node_id = self.store.register_node(
            node_id, name, request.peer_address, request.metrics_address, request.device or "cpu", request.version,
            request.device_name, request.device_memory_bytes,
        )
        log.info("registered %s (%s) at %s", node_id, request.name, request.peer_address)
        self._control(self.plane.nodes_changed)
        return pb.RegisterReply(node_id=node_id, heartbeat_interval_s=self.config.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        self.metrics.coordinator_heartbeats.inc()
        node_id = self._as_node(context, request.node_id)
        known, came_back = self.store.touch_node(node_id)
        if came_back:
            log.info("%s is up again", node_id)
            self._control(self.plane.nodes_changed)
        return pb.HeartbeatReply(known=known, assignment_version=self.changes.version)

    def WatchAssignment(self, request, context):
        node_id = self._as_node(context, request.node_id)
        if self.store.node(node_id) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {node_id[:64]!r}; register first")
        # Each stream holds a server thread for its life: a node may hold only a few.
        with self._watches_lock:
            if self._watches.get(node_id, 0) >= MAX_WATCHES_PER_NODE:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"node {node_id} already watches its assignment {MAX_WATCHES_PER_NODE} times")
            self._watches[node_id] = self._watches.get(node_id, 0) + 1
        try:
            yield from self._watch(node_id, context)
        finally:
            with self._watches_lock:
                self._watches[node_id] -= 1
                if not self._watches[node_id]:
                    del self._watches[node_id]

    def _watch(self, node_id: str, context) -> Iterator[pb.Assignment]:
        """The node's assignment now, then each time it changes. It is computed again only after a change that may
        alter it (the changes' version moved); the wait ends every WATCH_POLL_S to see whether the stream ended."""
        last_sent: bytes | None = None
        computed: int | None = None
        while context.is_active() and not self.stopping.is_set():
            version = self.changes.version
            if version != computed:
                computed = version
                assignment = self.assignment_for(node_id)
                unversioned = pb.Assignment()
                unversioned.CopyFrom(assignment)
                unversioned.version = 0
                content = unversioned.SerializeToString(deterministic=True)
                if content != last_sent:
                    last_sent = content
                    yield assignment
            self.changes.wait_past(version, WATCH_POLL_S)

    def ReportMetrics(self, request, context):
        request.node_id = self._as_node(context, request.node_id)
        now = time.time()
        progress = bounded_report(from_report(request, time=now))
        job = self.store.job(request.job_id[:MAX_JOB_REFERENCE_CHARS])
        if job is None or not any(m.rank == progress.rank and m.node_id == progress.node
                                  for m in self.store.members(job.job_id)):
            return pb.MetricsReply(job_active=False)  # not this node's rank: nothing is recorded
        if problem := report_problem(progress, job.spec, job.started_unix, now):
            field, why = problem
            self.metrics.coordinator_refused_reports.labels(request.node_id, field).inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"report of rank {request.rank} of job {job.job_id}: "
                          f"{field}: {why}")
        recorded = self.store.record_progress(progress)
        if recorded is None:
            return pb.MetricsReply(job_active=False)
        run_log = self._run_logs.get(job.job_id)
        if run_log is None:
            run_log = self._run_logs[job.job_id] = RunLog(job.run_dir)
        run_log.append(recorded)  # with the traffic of the member's whole part in the job
        live = {edge.peer for edge in progress.edges}  # the node's edges now, for per-edge debugging
        with self._live_edges_lock:
            if self.store.job(job.job_id).state == JobState.RUNNING:
                self._live_edges.setdefault(job.job_id, {})[progress.rank] = dataclasses.replace(
                    recorded, edges=tuple(edge for edge in recorded.edges if edge.peer in live))
                samples = self._recent_steps.setdefault(job.job_id, {}).setdefault(
                    progress.rank, deque(maxlen=RATE_SAMPLES))
                samples.append((now, progress.step))
        self._control(self.plane.progress_reported, job, progress)
        if request.finished:
            self._control(self.plane.reported, job)
        return pb.MetricsReply(job_active=self.store.job(job.job_id).state == JobState.RUNNING)

    def ReportFailure(self, request, context):
        reason = plain_text(request.reason[:MAX_FAILURE_CHARS]).strip() or "no reason given"
        request.node_id = self._as_node(context, request.node_id)
        with self._plane_lock:
            held, effects = self.plane.failed(request.job_id, request.rank, request.node_id, reason)
            self._apply(effects)
        job = self.store.job(request.job_id)
        if not held or job is None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node {request.node_id[:64]!r} does not hold rank "
                          f"{request.rank} of job {request.job_id[:64]!r}")
        assert job is not None
        return pb.NodeFailureReply(job_state=JOB_STATES[job.state])

    def JobReady(self, request, context):
        node_id = self._as_node(context, request.node_id)
        data = data_from_proto(request.data)
        missing = plain_text(request.missing_data[:MAX_MISSING_DATA_CHARS])
        problem = (None if missing else data_problem(data)) or (
            f"job_id: at most {MAX_JOB_REFERENCE_CHARS} characters" if len(request.job_id) > MAX_JOB_REFERENCE_CHARS
            else None) or (
            f"wait_s: {request.wait_s} is not in 0..{MAX_READY_WAIT_S:g}"
            if not 0 <= request.wait_s <= MAX_READY_WAIT_S else None)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        job = self.store.job(request.job_id)
        if job is None or not any(m.rank == request.rank and m.node_id == node_id
                                  for m in self.store.members(job.job_id)):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node {node_id[:64]!r} does not hold rank "
                          f"{request.rank} of job {request.job_id!r}")
        assert job is not None
        if missing:
            with self._plane_lock:
                _, effects = self.plane.data_missing(job.job_id, request.rank, node_id, missing)
                self._apply(effects)
            return self._ready_reply(job.job_id, released=False)
        with self._plane_lock:
            outcome, effects = self.plane.ready(job, request.rank, node_id, data)
            self._apply(effects)
        if not outcome.running or outcome.released:
            return self._ready_reply(job.job_id, released=outcome.released)
        # Held until the last rank is ready or the job ends (both bump the changes), or until wait_s.
        deadline = time.monotonic() + request.wait_s
        version = self.changes.version
        while context.is_active() and not self.stopping.is_set() and time.monotonic() < deadline:
            current = self.store.job(job.job_id)
            assert current is not None
            if current.state != JobState.RUNNING or current.released_unix:
                break
            version = self.changes.wait_past(version, deadline - time.monotonic())
        return self._ready_reply(job.job_id, released=False)

    def Rendezvous(self, request, context):
        """One operation on the job's rendezvous store (coordinator.rendezvous), for a node that holds a rank of
        the running all-reduce job: nothing of a job is readable or writable by any other caller."""
        node_id = self._as_node(context, request.node_id)
        if problem := request_problem(request):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        membership = self.store.running_membership(node_id)
        job = membership[0] if membership is not None and membership[0].job_id == request.job_id else None
        spec = job.spec if job is not None else None
        if spec is None or lookup(spec.algorithm.name).family is not Family.COLLECTIVE:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node {node_id[:64]!r} holds no rank of the running "
                          f"all-reduce job {request.job_id[:MAX_JOB_REFERENCE_CHARS]!r}")
        assert spec is not None
        store, made = self.rendezvous.store(request.job_id, spec.max_nodes)
        if made and self.store.job(request.job_id).state != JobState.RUNNING:  # it ended meanwhile: the store goes too
            self.rendezvous.end(request.job_id)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {request.job_id} is not running")
        try:
            return store.answer(request)
        except RendezvousError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))

    def _ready_reply(self, job_id: str, released: bool) -> pb.JobReadyReply:
        """The answer to a ready report: released (start), waiting (for the ranks named) or ended (the reason)."""
        job = self.store.job(job_id)
        assert job is not None
        if job.state != JobState.RUNNING:
            return pb.JobReadyReply(job_state=JOB_STATES[job.state], reason=job.reason)
        released = released or bool(job.released_unix)
        return pb.JobReadyReply(job_state=pb.JOB_RUNNING, released=released,
                                waiting_for="" if released else self.plane.not_ready(job))

    def Deregister(self, request, context):
        node_id = self._as_node(context, request.node_id)
        if self.store.mark_down(node_id):
            log.info("%s left", node_id)
            self.changes.bump()
        return pb.DeregisterReply()

    def ReportEvents(self, request, context):
        node_id = self._as_node(context, request.node_id)
        if len(request.events) > MAX_EVENTS_PER_REPORT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(request.events)} events in one report; at most {MAX_EVENTS_PER_REPORT}")
        for event in request.events:
            if event.kind not in events.NODE_KINDS or event.level not in events.LEVELS:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"event kind {event.kind[:32]!r} or level {event.level[:32]!r} is not one a node may "
                              f"report (kinds {', '.join(events.NODE_KINDS)}; levels {', '.join(events.LEVELS)})")
        job = self.store.job(request.job_id[:MAX_JOB_REFERENCE_CHARS])
        ranks = [m.rank for m in self.store.members(job.job_id) if m.node_id == node_id] if job is not None else []
        if not ranks:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"node {node_id} holds no rank of job {request.job_id[:MAX_JOB_REFERENCE_CHARS]!r}")
        assert job is not None
        kept = self._admit_events(node_id, len(request.events))
        now = time.time()
        for event in request.events[:kept]:
            self._record(job, Event(now, job.job_id, event.kind, events.bounded(event.message), event.level,
                                    ranks[0], node_id, max(-1, event.step)))
        return pb.EventReportReply(dropped=len(request.events) - kept)

    def _admit_events(self, node_id: str, count: int) -> int:
        """How many of `count` events of a node are kept under its rate limit."""
        with self._events_lock:
            now = time.monotonic()
            allowance, counted = self._event_allowance.get(node_id, (float(EVENT_BURST), now))
            allowance = min(float(EVENT_BURST), allowance + (now - counted) * EVENT_RATE_PER_S)
            kept = min(count, int(allowance))
            self._event_allowance[node_id] = (allowance - kept, now)
            return kept

    def _event(self, job: Job, kind: str, message: str, level: str = "INFO") -> None:
        """One of the coordinator's own events of a job."""
        self._record(job, Event(time.time(), job.job_id, kind, events.bounded(message), level))

    def _record(self, job: Job, event: Event) -> None:
        with self._events_lock:
            event_log = self._event_logs.get(job.job_id)
            if event_log is None:
                event_log = self._event_logs[job.job_id] = EventLog(job.run_dir)
        try:
            event_log.append(event)
        except OSError as error:  # a full or missing run directory loses the event, not the call
            log.warning("job %s: could not record an event in %s: %s", job.job_id, job.run_dir, error)

    # -- parameter server (coordinator.ps_service) ----------------------------------------------------------------

    def PsPush(self, request_iterator, context):
        return self.ps.push(request_iterator, context)

    def PsPull(self, request, context):
        yield from self.ps.pull(request, context)

    def PsReport(self, request, context):
        return self.ps.report(request, context)

    # -- trained models (coordinator.model_store) -------------------------------------------------------------------

    def UploadModel(self, request_iterator, context):
        return self.models.upload(request_iterator, context)

    def ExportModel(self, request, context):
        job = self._named_job(request.job_id, context, newest_by_default=True)
        yield from self.models.export(request, context, job)

    # -- certificates --------------------------------------------------------------------------------------------

    def _require_ca(self, context) -> ClusterCA:
        if self.ca is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this coordinator runs without a CA (--insecure)")
        return self.ca

    def RenewCertificate(self, request, context):
        """A new certificate for the caller's identity, in the last third of its certificate's life and once per
        certificate (ClusterCA.renew); a node's old certificate is revoked as the new one is issued."""
        ca = self._require_ca(context)
        identity = caller(context)
        assert identity is not None  # admitted by the authorizer
        try:
            public_key, _requested = pki.read_signing_request(request.csr_pem)
        except CertificateError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            cert = ca.renew(identity, public_key)
        except CAError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        renewed = pki.identity_of(cert)
        log.info("renewed the certificate of %s: serial %s replaces %s", identity, renewed.serial, identity.serial)
        self.changes.bump()  # agents learn the superseded serial with their next assignment
        return pb.CertificateReply(certificate_pem=pki.certificate_pem(cert), name=renewed.name,
                                   serial=renewed.serial)

    def CreateJoinToken(self, request, context):
        ca = self._require_ca(context)
        try:
            token, expires = ca.create_token(request.ttl_s or DEFAULT_TOKEN_TTL_S)
        except CAError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        log.info("%s created a join token valid until %s", caller(context), time.ctime(expires))
        return pb.CreateJoinTokenReply(token=token, expires_unix=expires, ca_fingerprint=ca.fingerprint)

    def RevokeCertificate(self, request, context):
        ca = self._require_ca(context)
        if bool(request.serial) == bool(request.name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a serial or a name, not both")
        try:
            serials = ca.revoke(serial=request.serial, name=request.name)
        except CAError as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        log.warning("%s revoked %s", caller(context), ", ".join(serials) or "nothing new")
        # A node whose certificate is revoked is down at once: its calls are refused from now on.
        revoked_nodes = [cert.name for cert in ca.certificates() if cert.serial in serials and cert.role == Role.NODE]
        for name in revoked_nodes:
            if self.store.mark_down(name):
                log.warning("%s is down: its certificate is revoked", name)
        # Its last contributions are dropped from its job (ControlPlane.revoked).
        self._control(self.plane.revoked, revoked_nodes)
        self.changes.bump()  # agents learn the revocation with their next assignment
        return pb.RevokeCertificateReply(serials=serials)

    def ListCertificates(self, request, context):
        """The certificates that have not expired (revoked or not): what can still be presented."""
        ca = self._require_ca(context)
        now = time.time()
        return pb.ListCertificatesReply(certificates=[
            pb.CertificateInfo(serial=c.serial, role=c.role, name=c.name, issued_unix=c.issued_unix,
                               not_after_unix=c.not_after_unix, revoked_unix=c.revoked_unix)
            for c in ca.certificates() if c.not_after_unix > now
        ])

    # -- operator calls ------------------------------------------------------------------------------------------

    def SubmitJob(self, request, context):
        try:
            spec = parse_job_yaml(request.spec_yaml)
            validate_job(spec, self.config.max_model_memory_mib * MIB)
        except JobSpecError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec: {error}")
        warning = self.plane.wait_reason(spec.min_nodes, self.store.nodes(), spec)
        job_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        run_dir = self.config.run_root / job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "job.yaml").write_text(request.spec_yaml)
        (run_dir / "job.json").write_text(spec.model_dump_json(indent=2))
        self.store.add_job(job_id, spec, request.spec_yaml, str(run_dir))
        nodes = f"{spec.min_nodes}..{spec.max_nodes} nodes (elastic)" if spec.elastic else f"{spec.nodes} nodes"
        log.info("job %s submitted: %s on %s", job_id, spec.algorithm.name, nodes)
        job = self.store.job(job_id)
        assert job is not None
        operator = caller(context) if self.ca is not None else None
        self._event(job, events.SUBMITTED, f"{spec.algorithm.name} on {nodes}, {spec.steps} steps"
                    + (f", by operator {operator.name}" if operator is not None else ""))
        self._control(self.plane.submitted)
        job = self.store.job(job_id)
        assert job is not None
        return pb.SubmitJobReply(job_id=job_id, state=JOB_STATES[job.state], run_dir=str(run_dir),
                                 warning=warning and f"the job cannot start now: it {warning}")

    def DeleteJob(self, request, context):
        reference = request.job_id[:MAX_JOB_REFERENCE_CHARS]
        job = self._named_job(request.job_id, context)
        if job.state in ACTIVE_JOB_STATES:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job.job_id} is {job.state.value.lower()}: stop it first (`coordinator stop "
                          f"{job.job_id}`), then delete it")
        with self._plane_lock:  # not while the rules act on jobs
            run_dir = self._delete_job(job.job_id)
        if run_dir is None:  # deleted meanwhile
            context.abort(grpc.StatusCode.NOT_FOUND, _no_job(reference))
        operator = caller(context) if self.ca is not None else None
        log.info("job %s deleted%s", job.job_id, f" by operator {operator.name}" if operator is not None else "")
        return pb.DeleteJobReply(job_id=job.job_id, run_dir=run_dir or "")

    def StopJob(self, request, context):
        job = self._named_job(request.job_id, context)
        self._control(self.plane.stopped, job)
        return pb.StopJobReply(state=JOB_STATES[self.store.job(job.job_id).state], job_id=job.job_id)

    def ChangeTopology(self, request, context):
        job = self._named_job(request.job_id, context)
        try:
            self.plane.check_topology_change(job)
        except TopologyRefused as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        topology_spec = self._requested_topology(request, context)
        try:
            with self._plane_lock:
                changed, effects = self.plane.topology_requested(job, topology_spec)
                self._apply(effects)
        except JobSpecError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid topology for job {job.job_id}: {error}")
        except TopologyRefused as error:
            code = grpc.StatusCode.ABORTED if error.kind == "aborted" else grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, str(error))
        return pb.ChangeTopologyReply(job_id=job.job_id, topology_version=changed.version,
                                      switch_step=changed.switch_step, previous_kind=changed.previous_kind)

    def Quarantine(self, request, context):
        job = self.store.find_job(request.job_id[:MAX_JOB_REFERENCE_CHARS])
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, _no_job(request.job_id))
        members = self.store.members(job.job_id)
        named = request.node[:MAX_JOB_REFERENCE_CHARS]
        member = next((m for m in members if m.node_id == named or named == str(m.rank)), None)
        if member is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {job.job_id} has no member {named!r} (a node id or a rank)")
        who = caller(context)
        by = f"by an operator ({who.name})" if who is not None else "by an operator"
        try:
            with self._plane_lock:
                if request.release:
                    effects = self.plane.release(job, member.rank)
                else:
                    effects = self.plane.quarantine(job, member.rank, by)
                self._apply(effects)
        except QuarantineRefused as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        outcome = next((e.message for e in effects if isinstance(e, JobEvent)), "")
        return pb.QuarantineReply(job_id=job.job_id, rank=member.rank, node_id=member.node_id, outcome=outcome)

    @staticmethod
    def _requested_topology(request: pb.ChangeTopologyRequest, context) -> TopologySpec:
        """The topology a ChangeTopology asks for, as a job file's `topology`; INVALID_ARGUMENT naming the field."""
        if len(request.options_json) > MAX_TOPOLOGY_OPTIONS_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"topology.options: {len(request.options_json)} "
                          f"characters of JSON; at most {MAX_TOPOLOGY_OPTIONS_CHARS}")
        try:
            options = json.loads(request.options_json or "{}")
        except (json.JSONDecodeError, RecursionError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"topology.options: not JSON: {str(error)[:200]}")
        if not isinstance(options, dict):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "topology.options: must be a JSON object")
        try:
            return TopologySpec(kind=request.kind, seed=request.seed, options=options)
        except ValidationError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, format_validation_error(error, "topology"))

    def ListNodes(self, request, context):
        return pb.ListNodesReply(nodes=[self._node_info(n) for n in self.store.nodes()])

    def _node_info(self, node: NodeRow) -> pb.NodeInfo:
        membership = self.store.running_membership(node.node_id)
        job_id, rank = (membership[0].job_id, membership[1]) if membership else ("", 0)
        return pb.NodeInfo(
            node_id=node.node_id, name=node.name, peer_address=node.peer_address,
            metrics_address=node.metrics_address, up=node.up, last_seen_unix=node.last_seen_unix, job_id=job_id,
            rank=rank, device=node.device, draining=node.draining, device_name=node.device_name,
            device_memory_bytes=node.device_memory_bytes,
        )

    def RemoveNode(self, request, context):
        node = self.store.node(request.node_id)
        if node is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id[:64]!r}")
        info = self._node_info(node)
        if info.job_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {node.node_id} runs rank {info.rank} of job {info.job_id}: stop the job or drain "
                          "the node first")
        if node.up:
            # Its agent would register again at its next heartbeat: removing it would not last.
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {node.node_id} is up (its agent at {node.peer_address} runs): stop its agent first "
                          f"(`coordinator nodes drain {node.node_id}` moves its work away), then remove it")
        self.store.remove_node(node.node_id)
        log.info("%s removed by an operator", node.node_id)
        self.changes.bump()
        return info

    def DrainNode(self, request, context):
        if not self.store.set_draining(request.node_id, request.drain):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id[:64]!r}")
        log.info("%s %s by an operator", request.node_id, "drained" if request.drain else "back in service")
        if request.drain:
            self._control(self.plane.drained, request.node_id)
        else:
            self._control(self.plane.nodes_changed)
        node = self.store.node(request.node_id)
        assert node is not None
        return self._node_info(node)

    def JobStatus(self, request, context):
        job = self._named_job(request.job_id, context, newest_by_default=True)
        nodes = {n.node_id: n for n in self.store.nodes()}
        now = time.time()
        with self._live_edges_lock:
            recent = {rank: recent_rate(samples, now)
                      for rank, samples in self._recent_steps.get(job.job_id, {}).items()}
        members = [self._node_progress(job, m, nodes.get(m.node_id))
                   for m in self.store.members(job.job_id, with_left=True)]
        for member in members:
            rate = recent.get(member.rank)
            if rate is not None and not member.finished and member.state in ("up", "down"):
                member.recent_steps_per_s = rate
        server_version = self.ps.version_of(job.job_id)
        return pb.JobStatusReply(
            job_id=job.job_id, name=job.name, state=JOB_STATES[job.state], world_size=job.world_size,
            run_dir=job.run_dir, created_unix=job.created_unix, spec_yaml=job.spec_yaml, reason=job.reason,
            started_unix=job.started_unix, ended_unix=job.ended_unix, **_elastic_range(job), task=job.spec.task,
            nodes=members, server_version=server_version,
        )

    def _node_progress(self, job: Job, member: MemberRow, node: NodeRow | None) -> pb.NodeProgress:
        with self._plane_lock:  # the plane's figures change under its lock
            quarantined = member.rank in self.plane.quarantined(job.job_id)
            suspected = member.rank in self.plane.flagged(job.job_id)
            suspicion = self.plane.suspicion_of(job, member.rank) if job.state == JobState.RUNNING else math.nan
        state = "quarantined" if quarantined and member.state not in (MemberState.LEFT, MemberState.FAILED) else \
            self._member_state(member, node)
        shown = to_node_progress(self._with_edges(member.progress), state, member.failure)
        shown.suspicion, shown.quarantined, shown.suspected = suspicion, quarantined, suspected
        return shown

    def _with_edges(self, progress: Progress) -> Progress:
        """The stored progress of a node with its edges from its last report, when it had them: a running job's, or
        one of the newest ended jobs' (ENDED_JOBS_EDGES_KEPT)."""
        with self._live_edges_lock:
            live = (self._live_edges.get(progress.job) or self._ended_edges.get(progress.job) or {}).get(progress.rank)
        if live is None or live.node != progress.node:
            return progress
        return dataclasses.replace(progress, edges=live.edges, waiting_for=live.waiting_for)

    def _named_job(self, reference: str, context, newest_by_default: bool = False) -> Job:
        """The job a person names (an id, a name, a unique id prefix; nothing: the newest job, where a command has
        that default); else the call ends NOT_FOUND, or INVALID_ARGUMENT listing the jobs an ambiguous prefix
        begins."""
        reference = reference[:MAX_JOB_REFERENCE_CHARS]
        if not reference and newest_by_default:
            job = self.store.latest_job()
            if job is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "no jobs yet")
            return job
        job = self.store.find_job(reference) if reference else None
        if job is not None:
            return job
        matches = self.store.job_ids_starting(reference, AMBIGUOUS_SHOWN + 1) if reference else []
        if len(matches) > 1:
            more = ", ..." if len(matches) > AMBIGUOUS_SHOWN else ""
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{reference!r} begins several jobs' ids: {', '.join(matches[:AMBIGUOUS_SHOWN])}{more}; give "
                          "more of the id")
        context.abort(grpc.StatusCode.NOT_FOUND, _no_job(reference))

    def ListJobs(self, request, context):
        limit = min(request.limit or DEFAULT_JOB_LIST, MAX_JOB_LIST)
        return pb.ListJobsReply(jobs=[
            pb.JobInfo(job_id=job.job_id, name=job.name, state=JOB_STATES[job.state], world_size=job.world_size,
                       created_unix=job.created_unix, started_unix=job.started_unix, ended_unix=job.ended_unix,
                       reason=job.reason, **_elastic_range(job))
            for job in self.store.all_jobs(limit)
        ])

    def JobEvents(self, request, context):
        job = self._named_job(request.job_id, context)
        if request.min_level and request.min_level not in events.LEVELS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"min_level {request.min_level[:32]!r} is not one of "
                          f"{', '.join(events.LEVELS)}")
        found, next_offset = events.read_events(job.run_dir, request.offset, events.READ_BYTES)
        rank = request.rank if request.HasField("rank") else None
        shown = [event_to_proto(e) for e in found
                 if (rank is None or e.rank in (-1, rank)) and events.level_at_least(e.level, request.min_level)]
        return pb.JobEventsReply(job_id=job.job_id, events=shown, next_offset=next_offset,
                                 state=JOB_STATES[job.state])

    @staticmethod
    def _member_state(member: MemberRow, node: NodeRow | None) -> str:
        """A member's state as `coordinator status` shows it: left, failed or finished, else whether its node is
        up."""
        if member.state in (MemberState.LEFT, MemberState.FAILED, MemberState.FINISHED):
            return member.state.lower()
        return "up" if node is not None and node.up else "down"


class EnrollmentService(coordinator_pb2_grpc.EnrollmentServicer):
    """The enrollment port: a one-time join token and a signing request buy a node certificate whose name is the
    node id the request asks for, if no valid certificate holds it."""

    def __init__(self, ca: ClusterCA):
        self.ca = ca

    def Enroll(self, request, context):
        try:
            public_key, name = pki.read_signing_request(request.csr_pem)
        except CertificateError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if problem := pki.name_problem(name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node id {name[:64]!r}: {problem}")
        # Checked first, spent last: a refusal leaves the token for the next try. Only the holder of a live token
        # learns that a name is taken (what it could learn by enrolling under it).
        token = request.token[:256]
        if not self.ca.token_live(token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNUSABLE_TOKEN)
        if name in self.ca.names_in_use():
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"node id {name} holds a valid certificate; revoke it first (`coordinator cert revoke "
                          f"--name {name}`) or enroll under another --name (the join token is still good)")
        if not self.ca.use_token(token):  # spent meanwhile by another enrollment
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNUSABLE_TOKEN)
        try:
            cert = self.ca.issue(public_key, Role.NODE, name)
        except CertificateError as error:  # the name went to another role meanwhile
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        identity = pki.identity_of(cert)
        log.info("enrolled node %s (certificate %s)", name, identity.serial)
        return pb.CertificateReply(certificate_pem=pki.certificate_pem(cert), name=name, serial=identity.serial)


def recent_rate(samples: deque[tuple[float, int]], now: float) -> float | None:
    """A rank's steps per second over its reports of the last RATE_WINDOW_S, the report just before the window
    included: 0 for a rank whose step stood still (stalled) or that reported nothing in the window (silent); None
    before two reports."""
    if len(samples) < 2:
        return None
    start = next((i for i, (at, _) in enumerate(samples) if at >= now - RATE_WINDOW_S), len(samples))
    first = samples[max(0, start - 1)]
    last = samples[-1]
    if start == len(samples):  # no report in the window: it did not move that anyone saw
        return 0.0
    return max(0.0, (last[1] - first[1]) / (last[0] - first[0])) if last[0] > first[0] else None


def retire_run_dirs(store: ControlState, run_root: Path, keep: int) -> list[tuple[str, Path]]:
    """Delete the run directories (metrics, events, trained models, parameter-server state) of the ended jobs beyond
    the newest `keep` (0: keep all); the jobs stay listed. Only directories directly under `run_root` are touched.
    Returns the jobs and directories removed."""
    if not keep:
        return []
    ended = sorted(store.jobs((JobState.FINISHED, JobState.STOPPED, JobState.FAILED)),
                   key=lambda job: job.ended_unix, reverse=True)
    root = run_root.resolve()
    removed = []
    for job in ended[keep:]:
        run_dir = Path(job.run_dir).resolve()
        if run_dir.parent == root and run_dir.is_dir():
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append((job.job_id, run_dir))
    return removed


def bounded_report(progress: Progress) -> Progress:
    """A node's report as the coordinator keeps, logs and shows it: at most MAX_REPORTED_EDGES edges, names and
    texts cut and plain (no terminal escapes, no control characters), failure reasons from the known set, and no
    number that is not one (an age that is not a finite, non-negative number is unknown: NaN)."""
    return dataclasses.replace(
        progress, waiting_for=plain_text(progress.waiting_for[:MAX_WAITING_CHARS]),
        edges=tuple(_bounded_edge(edge) for edge in progress.edges[:MAX_REPORTED_EDGES]),
    )


def report_problem(progress: Progress, spec: JobSpec, started_unix: float, now: float) -> tuple[str, str] | None:
    """What no run of the job can report, as the field and why (None: nothing): a step past the job's end, local
    steps past it (but ESync's, which are many per step), a loss that is not a non-negative number, an accuracy
    outside 0..1 or a perplexity below 1 (NaN: not measured yet), a time longer than the job has run. Checked
    before anything is stored."""
    ran_s = max(0.0, now - started_unix) + REPORT_CLOCK_SLACK_S
    local_steps_bounded = lookup(spec.algorithm.name).family is not Family.SERVER
    problems = {
        "step": not 0 <= progress.step <= spec.steps,
        "local_steps": local_steps_bounded and progress.local_steps > spec.steps,
        "loss": not (math.isnan(progress.loss) or 0 <= progress.loss < math.inf),
        "test_loss": not (math.isnan(progress.test_loss) or 0 <= progress.test_loss < math.inf),
        "test_accuracy": not (math.isnan(progress.test_accuracy) or 0 <= progress.test_accuracy <= 1),
        "test_perplexity": not (math.isnan(progress.test_perplexity) or progress.test_perplexity >= 1),
        "elapsed_s": not 0 <= progress.elapsed_s <= ran_s,
        "compute_s": not 0 <= progress.compute_s <= ran_s,
        "wait_s": not 0 <= progress.wait_s <= ran_s,
    }
    wrong = next((field for field, refused in problems.items() if refused), None)
    if wrong is None:
        return None
    value = getattr(progress, wrong)
    if isinstance(value, float):
        return wrong, f"{value:.6g} is not a value a run of this job can have"
    return wrong, f"{value} is not a value a run of this job can have (it has {spec.steps} steps)"


def _bounded_edge(edge: EdgeCounters) -> EdgeCounters:
    reasons: dict[str, int] = {}
    for reason, count in edge.failure_reasons.items():
        key = reason if reason in KNOWN_FAILURE_REASONS else OTHER_REASON
        reasons[key] = reasons.get(key, 0) + count
    return dataclasses.replace(
        edge, peer=plain_text(edge.peer[:MAX_FIELD_CHARS]), failure_reasons=reasons,
        last_message_age_s=_age(edge.last_message_age_s), message_interval_s=_age(edge.message_interval_s),
        in_flight_s=_age(edge.in_flight_s) if edge.in_flight_s > 0 else 0.0,
        last_failure_age_s=_age(edge.last_failure_age_s), consensus_distance=_age(edge.consensus_distance),
        staleness_steps=edge.staleness_steps if math.isfinite(edge.staleness_steps) else math.nan,
        judged=edge.judged[:MAX_NODES],
    )


def _age(value: float) -> float:
    """A duration or a norm: a finite, non-negative number, or NaN (unknown)."""
    return value if math.isfinite(value) and value >= 0 else math.nan


def _elastic_range(job: Job) -> dict[str, int]:
    """An elastic job's least and most members, as JobInfo and JobStatusReply give them (none for a fixed size)."""
    spec = job.spec
    return {"min_nodes": spec.min_nodes, "max_nodes": spec.max_nodes} if spec.elastic else {}


def _no_job(reference: str) -> str:
    return (f"no job {reference[:MAX_JOB_REFERENCE_CHARS]!r}: give a job's id, a unique prefix of it, or its name "
            "(`coordinator jobs` lists them)")

