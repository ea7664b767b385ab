"""The parameter server inside the coordinator: the server half of every running centralised job (SSGD, ASGD,
DC-ASGD, AdaComp, ESync), served over the PsPush, PsPull and PsReport calls of coordinator.proto.

One `PSJob` per job holds the algorithm's server half (nodeagent.ps.server) behind one lock: pushes from many
workers are applied one at a time, in the order they take the lock, each exactly once (a push is named by the
"peertrain-push-id" metadata, and a retry of a worker's last push is recognised and not applied again).

Durability: every applied update is written to the job's run directory before it is acknowledged: the server state
(model, version, the rule's state, the push ids) to `ps-state.pt` after each push; ESync's step reports, which come
a few times per round from each worker and touch only the round's small table, to `ps-round.pt`. Each file is
written whole and renamed over the old one, so a coordinator that is killed and restarted finds the state as of the
last acknowledged call (add `fsync` to survive a crash of the machine too). The rule's per-worker tables that no
applied update depends on (DC-ASGD's backups and mean squares: `ServerHalf.volatile`) go to `ps-tables.pt` at most
every TABLES_EVERY_S seconds and when the job closes: after a crash a backup may be older than the model its worker
pulled, and that worker's next push is rejected (it pulls again), which costs one step and loses nothing.
`ps-log.jsonl` records the applied order: one line per push (rank, push id, the version it was computed on, the
version after it, delay, rejection), per pull that sets a backup and per ESync round.

Synchronous rules answer a push when the round completes: the call waits (bounded by the caller's deadline; the
worker retries with the same id, which waits for the same round).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from coordinator.control.state import ControlState
from coordinator.control.states import JobState
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, wire_pb2
from nodeagent.algorithms import Family, build_server, lookup
from nodeagent.jobspec import JobSpec
from nodeagent.metrics import Metrics
from nodeagent.ps.esync import Decision
from nodeagent.ps.messages import (
    PUSH_ID_HEADER,
    SERVER_NAME,
    ServerModel,
    ServerPush,
    model_message,
    push_of,
    server_wire_rank,
)
from nodeagent.ps.rules import ProtocolError, PushResult
from nodeagent.ps.server import ServerHalf
from nodeagent.rpc import add_servicer, grpc_code
from nodeagent.runtime.readiness import data_from_json
from nodeagent.security.tls import caller
from nodeagent.training.data import DatasetInfo
from nodeagent.training.models import ModelError
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.errors import Reason, Status, WireError
from nodeagent.wire.frames import counted
from nodeagent.wire.message import Encoding, Kind

log = logging.getLogger("coordinator.ps")

STATE_FILE = "ps-state.pt"
ROUND_FILE = "ps-round.pt"
TABLES_FILE = "ps-tables.pt"
TABLES_EVERY_S = 2.0
LOG_FILE = "ps-log.jsonl"
WAIT_SLICE_S = 0.5  # a waiting push checks this often whether its caller is still there



def add_coordinator_servicer(servicer: object, server: grpc.Server) -> None:
    """Register the coordinator's servicer with the frames of PsPush as bytes, which the decoder reads within its
    limits (a manifest frame is refused above nodeagent.wire.frames.MAX_CONTROL_FRAME_BYTES before protobuf parses
    it); the pushes and the trained models (UploadModel) are the tensor streams a worker sends the coordinator."""
    add_servicer(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer, server,
                 raw_requests=("PsPush", "UploadModel"))


def status_of(failure: WireError | ProtocolError | JobClosed) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a refused push, pull or report is answered with."""
    if isinstance(failure, WireError):
        return grpc_code(failure.status), str(failure)
    if isinstance(failure, JobClosed):
        return grpc.StatusCode.FAILED_PRECONDITION, str(failure)
    return grpc.StatusCode.INVALID_ARGUMENT, str(failure)

class JobClosed(Exception):
    """The job ended while a call waited."""


def atomic_write(path: Path, state: Any, fsync: bool) -> None:
    buffer = io.BytesIO()
    # The legacy format is one buffer, several times faster to write than the zip format for our small states.
    torch.save(state, buffer, _use_new_zipfile_serialization=False)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(buffer.getbuffer())
        if fsync:
            out.flush()
            os.fsync(out.fileno())
    os.replace(tmp, path)


class PSJob:
    """One job's server half, its lock, and its files."""

    def __init__(self, job_id: str, spec: JobSpec, run_dir: Path, members: dict[int, str], metrics: Metrics,
                 data: DatasetInfo, fsync: bool = False, quarantined: set[int] | None = None):
        self.job_id = job_id
        self.spec = spec
        self.members = members  # rank -> node id
        self.metrics = metrics
        self.fsync = fsync
        # The model is shaped for the data the job's ranks described in their ready reports: the coordinator has none.
        self.half: ServerHalf = build_server(spec, data)
        if quarantined is not None:  # the service's set, shared: the ControlPlane's quarantine reaches the pushes
            self.half.quarantined = quarantined
        self.run_dir = run_dir
        self.state_path = run_dir / STATE_FILE
        self.round_path = run_dir / ROUND_FILE
        self.tables_path = run_dir / TABLES_FILE
        self.tables_written = 0.0
        self.condition = threading.Condition()
        self.closed = False
        self.commits = 0
        self._load()
        self._log = open(run_dir / LOG_FILE, "a")  # noqa: SIM115 (open for the job's life, closed by close())
        metrics.ps_version.labels(job_id).set(self.half.version)

    def _load(self) -> None:
        if self.state_path.exists():
            state = torch.load(self.state_path, weights_only=True)
        elif self.round_path.exists():
            state = {**self.half.state_dict(), "commits": 0}  # reports came, no push yet
        else:
            return
        self.commits = int(state.get("commits", 0))
        if self.half.volatile:
            tables = torch.load(self.tables_path, weights_only=True) if self.tables_path.exists() else {}
            fresh = self.half.state_dict()["rule"]
            for key in self.half.volatile:
                if key in fresh:
                    state["rule"][key] = tables.get(key, fresh[key])
        if self.round_path.exists():
            light = torch.load(self.round_path, weights_only=True)
            if int(light.get("commits", -1)) > self.commits and light.get("version") == state["rule"]["version"]:
                state["rule"].update(light["round"])
                self.commits = int(light["commits"])
        self.half.load_state_dict(state)
        log.info("job %s: parameter server resumed at version %d from %s", self.job_id, self.half.version,
                 self.state_path)

    # -- the calls, each under the job's lock -------------------------------------------------------------------------

    def push(self, rank: int, push: ServerPush, push_id: str, alive: Callable[[], bool]) -> PushResult:
        with self.condition:
            self._check_open()
            result = self.half.push(rank, push, push_id, time.monotonic())
            outcome = "duplicate" if result.duplicate else "rejected" if result.rejected else "repeated" if \
                result.repeated else "applied" if result.applied else "pending"
            self.metrics.ps_pushes.labels(self.job_id, outcome).inc()
            if result.clipped:
                self.metrics.ps_updates_clipped.labels(self.job_id).inc()
            for worker in result.flagged:
                member = self.members.get(worker, f"rank{worker}")
                self.metrics.robust_clipped.labels(self.job_id, member, SERVER_NAME).inc()
            if not result.duplicate:
                self._commit()
                if result.applied and not self.half.synchronous:
                    self.metrics.ps_staleness.labels(self.job_id).observe(result.delay)
                self.condition.notify_all()
            while not self.half.is_released(rank, push_id):
                self._check_open()
                if not alive():
                    raise JobClosed("the caller went away")
                self.condition.wait(WAIT_SLICE_S)
            return dataclasses.replace(result, version=self.half.version)

    def pull(self, rank: int, since_version: int, delta: bool, alive: Callable[[], bool]) -> ServerModel:
        with self.condition:
            self._check_open()
            while self.half.holds_update(rank):  # a rejoining worker that had pushed: the next round's model
                if not alive():
                    raise JobClosed("the caller went away")
                self.condition.wait(WAIT_SLICE_S)
                self._check_open()
            model = self.half.pull(rank, since_version, delta, time.monotonic())
            if self.half.pull_mutates:
                self._commit(durable=False)
            return model

    def report(self, rank: int, version: int, round_step: int, duration_s: float) -> tuple[Decision, int]:
        with self.condition:
            self._check_open()
            decision = self.half.report(rank, version, round_step, duration_s, time.monotonic())
            self.commits += 1
            atomic_write(self.round_path, {"commits": self.commits, "version": self.half.version,
                                           "round": self.half.round_state()}, self.fsync)
            return decision, self.half.version

    def _check_open(self) -> None:
        if self.closed:
            raise JobClosed(f"job {self.job_id} is not running")

    def _commit(self, durable: bool = True) -> None:
        """Make the state durable, then log what happened (called with the lock held, before any answer).
        `durable` False: only volatile tables changed (they are written when due)."""
        state = self.half.state_dict()
        tables = {key: state["rule"].pop(key) for key in self.half.volatile if key in state["rule"]}
        if durable:
            self.commits += 1
            atomic_write(self.state_path, {**state, "commits": self.commits}, self.fsync)
        if tables and time.monotonic() - self.tables_written >= TABLES_EVERY_S:
            self._write_tables(tables)
        for event in self.half.drain_events():
            self._log.write(json.dumps(event) + "\n")
        self._log.flush()
        self.metrics.ps_version.labels(self.job_id).set(self.half.version)

    def _write_tables(self, tables: dict[str, Any] | None = None) -> None:
        if tables is None:
            state = self.half.state_dict()["rule"]
            tables = {key: state[key] for key in self.half.volatile if key in state}
        atomic_write(self.tables_path, tables, self.fsync)
        self.tables_written = time.monotonic()

    def close(self) -> None:
        with self.condition:
            if self.half.volatile and not self.closed:
                self._write_tables()
            self.closed = True
            self.condition.notify_all()
            self._log.close()


class PSService:
    """The parameter-server calls of the coordinator's servicer."""

    def __init__(self, store: ControlState, metrics: Metrics, fsync: bool = False):
        self.store = store
        self.metrics = metrics
        self.fsync = fsync
        self._jobs: dict[str, PSJob] = {}
        self._quarantined: dict[str, set[int]] = {}  # by job: the workers whose pushes are ignored
        self._lock = threading.Lock()

    def quarantine(self, job_id: str, rank: int, quarantined: bool) -> None:
        """Ignore `rank`'s pushes to job `job_id` from now on (`quarantined`), or take them again."""
        with self._lock:  # the set is the job's too: a push reads it (one membership test, atomic)
            ranks = self._quarantined.setdefault(job_id, set())
            if quarantined:
                ranks.add(rank)
            else:
                ranks.discard(rank)

    def robust_counts(self) -> dict[str, dict[int, tuple[int, int]]]:
        """Per running job's server: per worker (pushes its robust rule flagged, pushes taken), cumulative."""
        with self._lock:
            jobs = list(self._jobs.values())
        counts = {}
        for job in jobs:
            with job.condition:
                counts[job.job_id] = job.half.robust_counts()
        return counts
    def job(self, job_id: str, rank: int, node_id: str, context: grpc.ServicerContext) -> PSJob:
        """The running centralised job `job_id`'s server (loaded from its run directory after a restart), for a caller
        that holds `rank` of it as `node_id`: under TLS its certificate must name that node."""
        identity = caller(context)
        if identity is not None and identity.name != node_id:
            raise WireError(Reason.NOT_MEMBER, f"node {identity.name} cannot act as node {node_id[:64]!r}",
                            Status.PERMISSION_DENIED)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.closed:
                job = self._load(job_id)
        if job.members.get(rank) != node_id:
            raise WireError(Reason.NOT_MEMBER, f"node {node_id[:64]!r} does not hold rank {rank} of job {job_id}",
                            Status.PERMISSION_DENIED)
        return job

    def _load(self, job_id: str) -> PSJob:
        row = self.store.job(job_id)
        if row is None or row.state != JobState.RUNNING:
            raise WireError(Reason.WRONG_JOB, f"job {job_id!r} is not running", Status.FAILED_PRECONDITION)
        spec = row.spec
        if lookup(spec.algorithm.name).family is not Family.SERVER:
            raise WireError(Reason.NO_SERVER, f"job {job_id!r} runs {spec.algorithm.name}, which has no parameter "
                            "server", Status.FAILED_PRECONDITION)
        members = {m.rank: m.node_id for m in self.store.members(job_id)}
        if not row.data_json:  # every worker reports ready, with its data, before its first call
            raise WireError(Reason.NOT_READY, f"job {job_id!r}: no worker has described its data yet",
                            Status.FAILED_PRECONDITION)
        try:
            job = PSJob(job_id, spec, Path(row.run_dir), members, self.metrics, data_from_json(row.data_json),
                        self.fsync, self._quarantined.setdefault(job_id, set()))
        except ModelError as error:  # model.init: a file this machine cannot read, or not the job's model
            raise WireError(Reason.NO_SERVER, f"job {job_id!r}: its parameter server cannot start: {error}",
                            Status.FAILED_PRECONDITION) from None
        self._jobs[job_id] = job
        return job

    def version_of(self, job_id: str) -> int | None:
        """The model version of a job's server while it is loaded (a running parameter-server job); else None."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None or job.closed:
            return None
        with job.condition:
            return job.half.version

    def close(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
            self._quarantined.pop(job_id, None)
        if job is not None:
            job.close()

    def close_all(self) -> None:
        for job_id in list(self._jobs):
            self.close(job_id)

    def _count(self, job: PSJob, rank: int, up: int = 0, down: int = 0) -> None:
        node = job.members.get(rank, f"rank{rank}")
        if up:
            self.metrics.ps_bytes_upstream.labels(job.job_id, node).inc(up)
            self.metrics.edge_bytes_received.labels(job.job_id, node, SERVER_NAME).inc(up)
        if down:
            self.metrics.ps_bytes_downstream.labels(job.job_id, node).inc(down)
            self.metrics.edge_bytes_sent.labels(job.job_id, SERVER_NAME, node).inc(down)

    # -- the calls ---------------------------------------------------------------------------------------------------

    def push(self, request_iterator, context) -> pb.PsPushReply:
        push_id = dict(context.invocation_metadata()).get(PUSH_ID_HEADER, "")
        if not push_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a push needs the {PUSH_ID_HEADER} metadata")
        found: dict[str, PSJob] = {}
        received = 0

        def count(n: int) -> None:
            nonlocal received
            received += n

        def expect(manifest: wire_pb2.Manifest):
            job = self.job(manifest.job_id, manifest.sender_rank, manifest.sender_id, context)
            server_rank = server_wire_rank(job.spec.nodes)
            if manifest.receiver_rank != server_rank:
                raise WireError(Reason.WRONG_RECEIVER, f"a push to the server goes to rank {server_rank}")
            total = sum(header.byte_length for header in manifest.tensors)
            if total > job.spec.wire.max_message_bytes:
                raise WireError(Reason.TOO_LARGE, f"a push of {total} bytes exceeds the job's limit")
            found["job"] = job
            shapes = [(header.name, tuple(header.shape)) for header in manifest.tensors]
            return job.half.push_specs(Kind(manifest.kind), shapes)

        try:
            message = decode(counted(request_iterator, count), expect)
        except WireError as error:
            self.metrics.stream_rejections.labels("unknown", SERVER_NAME, error.reason).inc()
            context.abort(grpc_code(error.status), str(error))
        job = found["job"]
        rank = message.sender
        self._count(job, rank, up=received)
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            result = job.push(rank, push_of(message), push_id, context.is_active)
        except WireError as refused:  # a payload the decoder cannot see into (AdaComp's), refused on decoding
            self.metrics.stream_rejections.labels("unknown", SERVER_NAME, refused.reason).inc()
            error = status_of(refused)
        except (ProtocolError, JobClosed) as failure:
            error = status_of(failure)
        if error is not None:
            context.abort(*error)
        return pb.PsPushReply(
            version=result.version, applied=not result.rejected and not result.duplicate,
            rejected=result.rejected, delay=result.delay, bytes_received=received, duplicate=result.duplicate,
        )

    def pull(self, request: pb.PsPullRequest, context) -> Iterator[wire_pb2.Frame]:
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            job = self.job(request.job_id, request.rank, request.node_id, context)
            model = job.pull(request.rank, request.since_version, request.delta, context.is_active)
        except (WireError, ProtocolError, JobClosed) as failure:
            error = status_of(failure)
        if error is not None:
            context.abort(*error)
        message = model_message(model, request.rank, job.spec.nodes)
        frames = encode(message, job_id=job.job_id, sender_id=SERVER_NAME,
                        encoding=Encoding.from_name(job.spec.wire.encoding), chunk_bytes=job.spec.wire.chunk_bytes)
        yield from counted(frames, lambda n: self._count(job, request.rank, down=n))

    def report(self, request: pb.PsReportRequest, context) -> pb.PsReportReply:
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            job = self.job(request.job_id, request.rank, request.node_id, context)
            decision, version = job.report(request.rank, request.version, request.round_step, request.duration_s)
        except (WireError, ProtocolError, JobClosed) as failure:
            error = status_of(failure)
        if error is not None:
            context.abort(*error)
        reply = pb.PsReportReply(ready=decision.ready, version=version,
                                 steps_before_asking=decision.steps_before_asking)
        self._count(job, request.rank, up=request.ByteSize(), down=reply.ByteSize())
        return reply
