"""The coordinator's gRPC servicer: registration, heartbeats, assignments, metrics reports, operator calls, and
the parameter server of the centralised algorithms (coordinator.ps_service)."""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from torch.distributed import TCPStore

from coordinator.jobs import plan_node, validate_job
from coordinator.ps_service import PSService
from coordinator.store import JobRow, NodeRow, Store
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
MAX_FAILURE_CHARS = 2000  # of a node's failure reason, as stored and shown


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
        # After a restart the agents' heartbeats need a timeout's time to come back: until then no node is marked
        # down for silence (its last heartbeat went to the coordinator that stopped).
        self._silence_counts_from = time.time() + config.heartbeat_timeout_s

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
            if time.time() >= self._silence_counts_from:
                down = self.store.mark_silent_nodes_down(self.config.heartbeat_timeout_s)
                if down:
                    log.warning("no heartbeat from %s: marked down", ", ".join(down))
                    self.changes.bump()
                self._review_running_jobs()
            self._schedule()
            self._update_gauges()

    def _review_running_jobs(self) -> None:
        """Apply each running job's failure policy to its lost nodes (silent for longer than the heartbeat timeout
        plus the job's `failure.lost_grace_s`): a synchronous job fails, since its other nodes would wait forever; an
        asynchronous job goes on without them, and finishes once every other node has."""
        nodes = {n.node_id: n for n in self.store.nodes()}
        now = time.time()
        for job in self.store.jobs(("RUNNING",)):
            spec = JobSpec.from_json(job.spec_json)
            members = self.store.members(job.job_id)
            lost = []
            for member in members:
                node = nodes.get(member.node_id)
                silent = now - node.last_seen_unix if node is not None else math.inf
                if (node is None or not node.up) and not member.progress.finished and \
                        silent > self.config.heartbeat_timeout_s + spec.failure.lost_grace_s:
                    lost.append((member, silent))
            if not lost:
                continue
            ranks = ", ".join(f"rank {m.rank} (node {m.node_id}, silent for {silent:.0f} s)" for m, silent in lost)
            if lookup(spec.algorithm.name).synchronous(spec.algorithm):
                self._end_job(job, "FAILED", f"lost {ranks}: longer than the heartbeat timeout and the job's "
                              f"failure.lost_grace_s ({spec.failure.lost_grace_s:g} s) allow a synchronous job")
            elif all(m.progress.finished or m.rank in {gone.rank for gone, _ in lost} for m in members):
                self._end_job(job, "FINISHED", f"without the lost {ranks}")

    def _update_gauges(self) -> None:
        nodes = self.store.nodes()
        up = sum(n.up for n in nodes)
        self.metrics.coordinator_nodes.labels("up").set(up)
        self.metrics.coordinator_nodes.labels("down").set(len(nodes) - up)
        for state in JOB_STATES:
            self.metrics.coordinator_jobs.labels(state.lower()).set(len(self.store.jobs((state,))))

    def _schedule(self) -> None:
        """Start pending jobs, oldest first, on idle nodes that are up and not draining (in registration order). A
        job that does not fit waits, with the reason, and does not hold back a smaller one that fits."""
        with self._schedule_lock:
            for job in self.store.jobs(("PENDING",)):
                nodes = self.store.nodes()
                idle = self._idle(nodes)
                if len(idle) < job.world_size:
                    reason = self._wait_reason(job.world_size, nodes)
                    if reason != job.reason:
                        self.store.set_pending_reason(job.job_id, reason)
                    continue
                self.store.start_job(job.job_id, idle[: job.world_size])
                log.info("job %s started on %s", job.job_id, ", ".join(idle[: job.world_size]))
                self.changes.bump()

    def _idle(self, nodes: list[NodeRow]) -> list[str]:
        busy = self.store.busy_node_ids()
        return [n.node_id for n in nodes if n.up and not n.draining and n.node_id not in busy]

    def _wait_reason(self, needed: int, nodes: list[NodeRow]) -> str:
        """What a job of `needed` nodes waits for, or "" if it can start now."""
        idle = len(self._idle(nodes))
        if idle >= needed:
            return ""
        usable = sum(n.up and not n.draining for n in nodes)
        if usable < needed:
            return (f"needs {needed} agents; {usable} {_are(usable)} up and not draining ({len(nodes)} registered): "
                    f"it starts when {needed - usable} more join")
        return (f"needs {needed} idle agents; {idle} {_are(idle)} idle now, the others run jobs: it starts when they "
                "end")

    def _end_job(self, job: JobRow, state: str, reason: str = "") -> None:
        """Finish, stop or fail an active job: its agents are freed (their assignment ends), and its rendezvous and
        parameter server close."""
        if not self.store.end_job(job.job_id, state, reason):
            return
        self._end_rendezvous(job.job_id)
        self.ps.close(job.job_id)
        self.metrics.forget_job(job.job_id)
        log.log(logging.WARNING if state == "FAILED" else logging.INFO, "job %s %s%s", job.job_id, state.lower(),
                f": {reason}" if reason else "")
        self.changes.bump()
        self._schedule()

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
        rows = self.store.members(job.job_id)
        members = {m.rank: m.node_id for m in rows}
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
            rendezvous_port=self._rendezvous_port(job, spec), rejoin=rows[rank].progress.time > 0,
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
                self._end_job(job, "FINISHED")
        return pb.MetricsReply(job_active=self.store.job(job.job_id).state == "RUNNING")

    def ReportFailure(self, request, context):
        reason = request.reason[:MAX_FAILURE_CHARS] or "no reason given"
        if not self.store.record_failure(request.job_id, request.rank, request.node_id, reason):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node {request.node_id[:64]!r} does not hold rank "
                          f"{request.rank} of job {request.job_id[:64]!r}")
        job = self.store.job(request.job_id)
        assert job is not None
        # The default policy: a node that cannot build or continue its job fails the job.
        self._end_job(job, "FAILED", f"rank {request.rank} (node {request.node_id}) failed: {reason}")
        return pb.NodeFailureReply(job_state=JOB_STATES[self.store.job(job.job_id).state])

    def Deregister(self, request, context):
        if self.store.mark_down(request.node_id):
            log.info("%s left", request.node_id)
            self.changes.bump()
        return pb.DeregisterReply()

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
        warning = self._wait_reason(spec.nodes, self.store.nodes())
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
        return pb.SubmitJobReply(job_id=job_id, state=JOB_STATES[job.state], run_dir=str(run_dir),
                                 warning=warning and f"the job cannot start now: it {warning}")

    def StopJob(self, request, context):
        job = self.store.job(request.job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")
        self._end_job(job, "STOPPED", "stopped by an operator")
        return pb.StopJobReply(state=JOB_STATES[self.store.job(job.job_id).state])

    def ListNodes(self, request, context):
        return pb.ListNodesReply(nodes=[self._node_info(n) for n in self.store.nodes()])

    def _node_info(self, node: NodeRow) -> pb.NodeInfo:
        membership = self.store.running_membership(node.node_id)
        job_id, rank = (membership[0].job_id, membership[1]) if membership else ("", 0)
        return pb.NodeInfo(
            node_id=node.node_id, name=node.name, peer_address=node.peer_address,
            metrics_address=node.metrics_address, up=node.up, last_seen_unix=node.last_seen_unix, job_id=job_id,
            rank=rank, device=node.device, draining=node.draining,
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
        self.store.remove_node(node.node_id)
        log.info("%s removed by an operator", node.node_id)
        self.changes.bump()
        return info

    def DrainNode(self, request, context):
        if not self.store.set_draining(request.node_id, request.drain):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id[:64]!r}")
        log.info("%s %s by an operator", request.node_id, "drained" if request.drain else "back in service")
        self.changes.bump()
        self._schedule()
        node = self.store.node(request.node_id)
        assert node is not None
        return self._node_info(node)

    def JobStatus(self, request, context):
        job = self.store.job(request.job_id) if request.job_id else self.store.latest_job()
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}" if request.job_id else "no jobs yet")
        nodes = {n.node_id: n for n in self.store.nodes()}
        return pb.JobStatusReply(
            job_id=job.job_id, name=job.name, state=JOB_STATES[job.state], world_size=job.world_size,
            run_dir=job.run_dir, created_unix=job.created_unix, spec_yaml=job.spec_yaml, reason=job.reason,
            started_unix=job.started_unix, ended_unix=job.ended_unix,
            nodes=[to_node_progress(m.progress, self._member_state(m, nodes.get(m.node_id)), m.failure)
                   for m in self.store.members(job.job_id)],
        )

    @staticmethod
    def _member_state(member, node: NodeRow | None) -> str:
        if member.failure:
            return "failed"
        if member.progress.finished:
            return "finished"
        return "up" if node is not None and node.up else "down"


def _are(count: int) -> str:
    return "is" if count == 1 else "are"
