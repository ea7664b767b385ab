"""The coordinator's gRPC servicer: registration, heartbeats, assignments, metrics reports, operator calls, and
the parameter server of the centralised algorithms (coordinator.ps_service)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from torch.distributed import TCPStore

from coordinator.jobs import plan_node, validate_job
from coordinator.ps_service import PSService
from coordinator.store import ACTIVE_STATES, JobRow, Store
from coordinator.topology import Topology, build_topology
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from nodeagent.algorithms import Family, lookup
from nodeagent.jobspec import JobSpec, JobSpecError, parse_job_yaml
from nodeagent.metrics import Metrics
from nodeagent.rpc import MAX_FIELD_CHARS, address_problem, name_problem, node_id_problem
from nodeagent.runtime.progress import RunLog, from_report, to_node_progress

log = logging.getLogger("coordinator")

# How long Register waits for the old address of a node id to answer (see answers_as).
PROBE_TIMEOUT_S = 1.0

JOB_STATES = {
    name: pb.JobState.Value(f"JOB_{name}") for name in ("PENDING", "RUNNING", "FINISHED", "STOPPED", "FAILED")
}
WATCH_POLL_S = 1.0


@dataclass
class CoordinatorConfig:
    state_dir: Path
    runs_dir: Path | None = None
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 15.0
    ps_fsync: bool = False  # also fsync the parameter server's state before answering (survives a machine crash)

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
        "name": name_problem(request.name),
        "peer_address": address_problem(request.peer_address),
        "metrics_address": address_problem(request.metrics_address) if request.metrics_address else None,
        "device": _length_problem(request.device),
        "version": _length_problem(request.version),
    }
    return next((f"{field}: {problem}" for field, problem in problems.items() if problem), None)


def _length_problem(value: str) -> str | None:
    return f"must be at most {MAX_FIELD_CHARS} characters" if len(value) > MAX_FIELD_CHARS else None


def answers_as(address: str, node_id: str) -> bool:
    """Whether the agent at `address` still answers as `node_id`: then a registration of that id from another address
    is a second agent, not a restart. No answer in time, or another id, means the old process is gone."""
    with grpc.insecure_channel(address) as channel:
        try:
            description = peer_pb2_grpc.PeerStub(channel).Describe(peer_pb2.DescribeRequest(),
                                                                     timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return description.node_id == node_id


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.store = Store(config.state_dir / "coordinator.db")
        self.changes = _Changes()
        self.stopping = threading.Event()
        self._topologies: dict[str, Topology] = {}
        self._rendezvous: dict[str, TCPStore] = {}
        self._run_logs: dict[str, RunLog] = {}
        self._schedule_lock = threading.Lock()
        self.ps = PSService(self.store, metrics, fsync=config.ps_fsync)
        self._monitor = threading.Thread(target=self._monitor_loop, name="liveness", daemon=True)

    def start(self) -> None:
        self._monitor.start()

    def stop(self) -> None:
        self.stopping.set()
        self.changes.bump()
        self.ps.close_all()
        self._monitor.join(timeout=5)
        self.store.close()

    # -- background ----------------------------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self.stopping.wait(1.0):
            down = self.store.mark_silent_nodes_down(self.config.heartbeat_timeout_s)
            if down:
                log.warning("no heartbeat from %s: marked down", ", ".join(down))
                self.changes.bump()
            self._schedule()
            self._update_gauges()

    def _update_gauges(self) -> None:
        nodes = self.store.nodes()
        up = sum(n.up for n in nodes)
        self.metrics.coordinator_nodes.labels("up").set(up)
        self.metrics.coordinator_nodes.labels("down").set(len(nodes) - up)
        for state in JOB_STATES:
            self.metrics.coordinator_jobs.labels(state.lower()).set(len(self.store.jobs((state,))))

    def _schedule(self) -> None:
        """Start pending jobs, oldest first, on idle nodes that are up (in registration order)."""
        with self._schedule_lock:
            for job in self.store.jobs(("PENDING",)):
                busy = self.store.busy_node_ids()
                idle = [n.node_id for n in self.store.nodes() if n.up and n.node_id not in busy]
                if len(idle) < job.world_size:
                    return
                self.store.start_job(job.job_id, idle[: job.world_size])
                log.info("job %s started on %s", job.job_id, ", ".join(idle[: job.world_size]))
                self.changes.bump()

    # -- assignments ---------------------------------------------------------------------------------------------

    def _topology(self, job: JobRow, spec: JobSpec) -> Topology:
        topology = self._topologies.get(job.job_id)
        if topology is None:
            topology = self._topologies[job.job_id] = build_topology(spec.topology, spec.nodes)
        return topology

    def assignment_for(self, node_id: str) -> pb.Assignment:
        membership = self.store.running_membership(node_id)
        if membership is None:
            return pb.Assignment(version=self.changes.version, state=pb.JOB_STATE_UNSPECIFIED)
        job, rank = membership
        spec = JobSpec.from_json(job.spec_json)
        plan = plan_node(spec, self._topology(job, spec), rank)
        members = {m.rank: m.node_id for m in self.store.members(job.job_id)}
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
        return pb.Assignment(
            version=self.changes.version, job_id=job.job_id, state=pb.JOB_RUNNING, job_spec_json=job.spec_json,
            rank=rank, world_size=job.world_size, neighbors=neighbors, self_weight=plan.self_weight,
            run_dir=job.run_dir, peer_schedule=[pb.PeerSet(ranks=peers) for peers in plan.peer_schedule],
            rendezvous_port=self._rendezvous_port(job, spec),
        )

    def _rendezvous_port(self, job: JobRow, spec: JobSpec) -> int:
        """All-reduce jobs meet at a torch.distributed store that the coordinator hosts for the job's life."""
        if lookup(spec.algorithm.name).family is not Family.COLLECTIVE:
            return 0
        with self._schedule_lock:
            store = self._rendezvous.get(job.job_id)
            if store is None:
                store = self._rendezvous[job.job_id] = TCPStore(
                    "0.0.0.0", 0, spec.nodes + 1, is_master=True, wait_for_workers=False
                )
            return store.port

    def _end_rendezvous(self, job_id: str) -> None:
        with self._schedule_lock:
            self._rendezvous.pop(job_id, None)

    # -- agent calls ---------------------------------------------------------------------------------------------

    def Register(self, request, context):
        problem = registration_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        known = self.store.node(request.node_id) if request.node_id else None
        if (known is not None and known.up and known.peer_address != request.peer_address
                and answers_as(known.peer_address, known.node_id)):
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"node {known.node_id} is up at {known.peer_address} and answers there; two agents share its node id "
                "(a copied state directory?)",
            )
        node_id = self.store.register_node(
            request.node_id, request.name or request.peer_address, request.peer_address, request.metrics_address,
            request.device or "cpu", request.version,
        )
        log.info("registered %s (%s) at %s", node_id, request.name, request.peer_address)
        self.changes.bump()
        self._schedule()
        return pb.RegisterReply(node_id=node_id, heartbeat_interval_s=self.config.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        self.metrics.coordinator_heartbeats.inc()
        known, came_back = self.store.touch_node(request.node_id)
        if came_back:
            log.info("%s is up again", request.node_id)
            self.changes.bump()
        return pb.HeartbeatReply(known=known, assignment_version=self.changes.version)

    def WatchAssignment(self, request, context):
        if self.store.node(request.node_id) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id!r}; register first")
        last_sent: bytes | None = None
        version = self.changes.version
        while context.is_active() and not self.stopping.is_set():
            assignment = self.assignment_for(request.node_id)
            unversioned = pb.Assignment()
            unversioned.CopyFrom(assignment)
            unversioned.version = 0
            content = unversioned.SerializeToString(deterministic=True)
            if content != last_sent:
                last_sent = content
                yield assignment
            version = self.changes.wait_past(version, WATCH_POLL_S)

    def ReportMetrics(self, request, context):
        progress = from_report(request, time=time.time())
        if not self.store.record_progress(progress):
            return pb.MetricsReply(job_active=False)
        job = self.store.job(request.job_id)
        assert job is not None
        run_log = self._run_logs.get(job.job_id)
        if run_log is None:
            run_log = self._run_logs[job.job_id] = RunLog(job.run_dir)
        run_log.append(progress)
        if request.finished and job.state == "RUNNING":
            members = self.store.members(job.job_id)
            if all(m.progress.finished for m in members):
                self.store.set_job_state(job.job_id, "FINISHED")
                self._end_rendezvous(job.job_id)
                self.ps.close(job.job_id)
                log.info("job %s finished", job.job_id)
                self.changes.bump()
                self._schedule()
        return pb.MetricsReply(job_active=job.state == "RUNNING")

    # -- parameter server (coordinator.ps_service) ----------------------------------------------------------------

    def PsPush(self, request_iterator, context):
        return self.ps.push(request_iterator, context)

    def PsPull(self, request, context):
        yield from self.ps.pull(request, context)

    def PsReport(self, request, context):
        return self.ps.report(request, context)

    # -- operator calls ------------------------------------------------------------------------------------------

    def SubmitJob(self, request, context):
        try:
            spec = parse_job_yaml(request.spec_yaml)
            validate_job(spec)
        except JobSpecError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec: {error}")
        job_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        run_dir = self.config.run_root / job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "job.yaml").write_text(request.spec_yaml)
        (run_dir / "job.json").write_text(spec.model_dump_json(indent=2))
        self.store.add_job(job_id, spec.name, spec.to_json(), request.spec_yaml, spec.nodes, str(run_dir))
        log.info("job %s submitted: %s on %d nodes", job_id, spec.algorithm.name, spec.nodes)
        self._schedule()
        job = self.store.job(job_id)
        assert job is not None
        return pb.SubmitJobReply(job_id=job_id, state=JOB_STATES[job.state], run_dir=str(run_dir))

    def StopJob(self, request, context):
        job = self.store.job(request.job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")
        if job.state in ACTIVE_STATES:
            self.store.set_job_state(job.job_id, "STOPPED")
            self._end_rendezvous(job.job_id)
            self.ps.close(job.job_id)
            log.info("job %s stopped by an operator", job.job_id)
            self.changes.bump()
            self._schedule()
        return pb.StopJobReply(state=JOB_STATES[self.store.job(job.job_id).state])

    def ListNodes(self, request, context):
        busy = {}
        for job in self.store.jobs(("RUNNING",)):
            for member in self.store.members(job.job_id):
                busy[member.node_id] = (job.job_id, member.rank)
        return pb.ListNodesReply(
            nodes=[
                pb.NodeInfo(
                    node_id=n.node_id, name=n.name, peer_address=n.peer_address, metrics_address=n.metrics_address,
                    up=n.up, last_seen_unix=n.last_seen_unix, job_id=busy.get(n.node_id, ("", 0))[0],
                    rank=busy.get(n.node_id, ("", 0))[1], device=n.device,
                )
                for n in self.store.nodes()
            ]
        )

    def JobStatus(self, request, context):
        job = self.store.job(request.job_id) if request.job_id else self.store.latest_job()
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}" if request.job_id else "no jobs yet")
        return pb.JobStatusReply(
            job_id=job.job_id, name=job.name, state=JOB_STATES[job.state], world_size=job.world_size,
            run_dir=job.run_dir, created_unix=job.created_unix, spec_yaml=job.spec_yaml,
            nodes=[to_node_progress(m.progress) for m in self.store.members(job.job_id)],
        )
