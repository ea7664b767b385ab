"""A job's trained models at the coordinator: what its ranks send as they finish (UploadModel), and what an operator
takes home (ExportModel, `coordinator export`).

A rank sends its model once, as it finishes, before its final report: the parameters its final evaluation used, one
tensor per trainable parameter, named and shaped as the job's model's own. The coordinator checks the stream
against the job's model before it reads a byte of payload (built on the meta device for the data the ranks
described, so nothing is allocated and no user code runs; a model named by import path, which the coordinator never
imports, must match the first model a rank of the job sent), within the job's `wire.max_message_bytes`, from the
certificate of the node that holds that rank, and keeps it in the run directory: `RUN_DIR/models/rank<R>.pt`. The
agents need their checkpoints no longer once the job ended (nodeagent.agent.checkpoint: retention).

An export is a rank's model, or by default the job's consensus: the mean of its ranks' models for the peer-to-peer
family, the server's model (`ps-state.pt`) for the parameter-server family, rank 0's for the all-reduce family (whose
ranks hold the same model). It streams as the tensor frames of every other stream, after a first message describing
it (coordinator.proto, ExportModel).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from coordinator.control.records import Job, MemberRow
from coordinator.control.state import ControlState
from coordinator.control.states import JobState
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import wire_pb2
from nodeagent.algorithms import Family, lookup
from nodeagent.rpc import grpc_code
from nodeagent.runtime.messages import data_to_proto
from nodeagent.runtime.progress import task_metrics
from nodeagent.runtime.readiness import data_from_json
from nodeagent.security.tls import caller
from nodeagent.training.models import build_model, is_import_path, parameter_specs
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.errors import Reason, Status, WireError
from nodeagent.wire.frames import counted
from nodeagent.wire.message import DTYPES, Kind, Message, TensorSpec

MODELS_DIR = "models"
PS_STATE_FILE = "ps-state.pt"  # coordinator.ps_service.STATE_FILE
EXPORT_CHUNK_BYTES = 1 << 20  # frames of an export: well inside a client's default 4 MiB message limit


def model_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / MODELS_DIR / f"rank{rank}.pt"


def expected_parameters(job: Job) -> list[TensorSpec] | None:
    """The trainable parameters of the job's model, shaped for the data its ranks described: built on the meta
    device (no memory, no random draws). None for a model named by import path (the coordinator imports no user
    code) or before any rank described its data."""
    spec = job.spec
    if is_import_path(spec.model.name) or not job.data_json:
        return None
    info = data_from_json(job.data_json)
    with torch.device("meta"):
        model = build_model(spec.model, info.input_shape, info.num_classes)
    return [TensorSpec(name, dtype, shape) for name, dtype, shape in parameter_specs(model)]


class ModelStore:
    """The UploadModel and ExportModel calls of the coordinator's servicer."""

    def __init__(self, store: ControlState):
        self.store = store
        self._expected: dict[str, list[TensorSpec] | None] = {}  # job -> its model's parameters
        self._lock = threading.Lock()

    def _parameters(self, job: Job) -> list[TensorSpec] | None:
        with self._lock:
            if job.job_id not in self._expected:
                self._expected[job.job_id] = expected_parameters(job)
            return self._expected[job.job_id]

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._expected.pop(job_id, None)

    # -- UploadModel ---------------------------------------------------------------------------------------------------

    def upload(self, request_iterator, context) -> pb.UploadModelReply:
        found: dict[str, Job] = {}
        received = 0

        def count(n: int) -> None:
            nonlocal received
            received += n

        def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
            job = self._member_job(manifest, context)
            if manifest.kind != Kind.PARAMS:
                raise WireError(Reason.UNEXPECTED_KIND, "a model is sent as parameters (kind PARAMS)")
            total = sum(header.byte_length for header in manifest.tensors)
            if total > job.spec.wire.max_message_bytes:
                raise WireError(Reason.TOO_LARGE, f"a model of {total} bytes exceeds the job's wire.max_message_bytes")
            found["job"] = job
            return self._parameters(job) or self._sent_first(job, manifest)

        try:
            message = decode(counted(request_iterator, count), expect)
        except WireError as error:
            context.abort(grpc_code(error.status), f"model refused: {error}")
        job = found["job"]
        path = model_path(job.run_dir, message.sender)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"step": message.clock, "tensors": dict(message.tensors)}, tmp)
        os.replace(tmp, path)
        return pb.UploadModelReply(bytes_received=received)

    def _member_job(self, manifest: wire_pb2.Manifest, context: grpc.ServicerContext) -> Job:
        """The running job the manifest's sender holds its rank of, as the caller's certificate says."""
        identity = caller(context)
        if identity is not None and identity.name != manifest.sender_id:
            raise WireError(Reason.WRONG_IDENTITY, f"node {identity.name} cannot send as {manifest.sender_id!r}",
                            Status.PERMISSION_DENIED)
        job = self.store.job(manifest.job_id)
        if job is None or job.state != JobState.RUNNING:
            raise WireError(Reason.WRONG_JOB, f"job {manifest.job_id!r} is not running", Status.FAILED_PRECONDITION)
        members = {m.rank: m.node_id for m in self.store.members(job.job_id)}
        if members.get(manifest.sender_rank) != manifest.sender_id:
            raise WireError(Reason.NOT_MEMBER, f"node {manifest.sender_id!r} does not hold rank "
                            f"{manifest.sender_rank} of job {job.job_id}", Status.PERMISSION_DENIED)
        return job

    def _sent_first(self, job: Job, manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        """A model by import path: the parameters of the first model a rank of the job sent, or this manifest's own
        (floating tensors, within the decoder's limits) if it is the first."""
        for rank in range(job.spec.max_nodes):
            path = model_path(job.run_dir, rank)
            if path.exists():
                tensors = torch.load(path, map_location="cpu", weights_only=True)["tensors"]
                return [TensorSpec.of(name, tensor) for name, tensor in tensors.items()]
        specs = []
        for header in manifest.tensors:
            dtype = DTYPES.get(header.dtype)
            if dtype is None or not dtype.is_floating_point:
                raise WireError(Reason.BAD_MANIFEST, f"tensor {header.name!r}: parameters are floating, not "
                                f"{header.dtype!r}")
            specs.append(TensorSpec(header.name, dtype, tuple(header.shape)))
        return specs

    # -- ExportModel ---------------------------------------------------------------------------------------------------

    def export(self, request: pb.ExportModelRequest, context: grpc.ServicerContext,
               job: Job) -> Iterator[pb.ModelExport]:
        rank = request.rank if request.HasField("rank") else None
        if not Path(job.run_dir).is_dir():
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {job.job_id}: its run directory {job.run_dir} is gone "
                          "(removed after the coordinator's --keep-runs newer jobs ended)")
        try:
            described, tensors = self._exported(job, rank)
        except LookupError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {job.job_id}: {error}")
        yield pb.ModelExport(model=described)
        message = Message(kind=Kind.PARAMS, sender=rank if rank is not None else job.spec.max_nodes, receiver=0,
                          tensors=tensors, clock=described.step)
        for frame in encode(message, job_id=job.job_id, sender_id="coordinator",
                            chunk_bytes=min(EXPORT_CHUNK_BYTES, job.spec.wire.chunk_bytes)):
            yield pb.ModelExport(frame=frame)

    def _exported(self, job: Job, rank: int | None) -> tuple[pb.ExportedModel, dict[str, torch.Tensor]]:
        """The description and parameters of the model asked for; LookupError saying why there is none."""
        spec = job.spec
        family = lookup(spec.algorithm.name).family
        members = {m.rank: m for m in self.store.members(job.job_id, with_left=True)}
        metric = task_metrics(spec.task)[0]  # the task's headline figure, as its ranks reported it
        described = pb.ExportedModel(job_id=job.job_id, spec_json=spec.to_json(), metric_name=metric.field)
        if job.data_json:
            described.data.CopyFrom(data_to_proto(data_from_json(job.data_json)))
        if rank is not None:
            if rank not in members:
                raise LookupError(f"rank {rank} is not one of its ranks 0..{spec.max_nodes - 1}")
            ranks = [rank]
        elif family is Family.SERVER:
            return self._server_model(job, described, members)
        elif family is Family.COLLECTIVE:  # every rank holds the same model: rank 0's, or the first that sent one
            ranks = [r for r in sorted(members) if model_path(job.run_dir, r).exists()][:1] or [0]
        else:  # the members at the end (an elastic job's that left took no part in it)
            ranks = sorted(r for r, member in members.items() if not member.left)
        missing = [r for r in ranks if not model_path(job.run_dir, r).exists()]
        if missing:
            raise LookupError(f"no model of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: "
                              "a rank sends its model as it finishes (a stopped or failed job's unfinished ranks "
                              "send none)" + ("; `--rank N` exports one that did" if rank is None else ""))
        total: dict[str, torch.Tensor] = {}
        steps = []
        for r in ranks:
            saved = torch.load(model_path(job.run_dir, r), map_location="cpu", weights_only=True)
            steps.append(int(saved["step"]))
            for name, tensor in saved["tensors"].items():
                total[name] = total[name] + tensor if name in total else tensor.clone()
        tensors = {name: tensor / len(ranks) for name, tensor in total.items()} if len(ranks) > 1 else total
        described.ranks.extend(ranks)
        described.step = min(steps)
        described.source = f"rank {ranks[0]}" if len(ranks) == 1 else (
            f"the mean of the models of ranks {ranks[0]}..{ranks[-1]}")
        metrics = [metric.of(members[r].progress) for r in ranks]
        described.metric_value = sum(metrics) / len(metrics)
        described.metric_of = (f"rank {ranks[0]}'s final evaluation" if len(ranks) == 1 else
                               "the mean of the ranks' final evaluations (the mean model itself was not evaluated: "
                               "`coordinator report --model` evaluates it)")
        return described, tensors

    def _server_model(self, job: Job, described: pb.ExportedModel,
                      members: dict[int, MemberRow]) -> tuple[pb.ExportedModel, dict[str, torch.Tensor]]:
        state_path = Path(job.run_dir) / PS_STATE_FILE
        parameters = self._parameters(job)
        if not state_path.exists() or parameters is None:
            raise LookupError("its parameter server applied no update")
        rule = torch.load(state_path, map_location="cpu", weights_only=True)["rule"]
        flat = rule["w"]
        if flat.numel() != sum(p.numel for p in parameters):
            raise LookupError(f"the server's model has {flat.numel()} parameters, not the job's model's "
                              f"{sum(p.numel for p in parameters)}")
        tensors = {}
        offset = 0
        for parameter in parameters:
            tensors[parameter.name] = flat[offset:offset + parameter.numel].view(parameter.shape).clone()
            offset += parameter.numel
        described.step = int(rule["version"])
        described.source = "the parameter server"
        metric = task_metrics(job.spec.task)[0]
        metrics = [metric.of(m.progress) for m in members.values()]
        metrics = [m for m in metrics if not math.isnan(m)]
        described.metric_value = sum(metrics) / len(metrics) if metrics else math.nan
        described.metric_of = ("the mean of the workers' final evaluations, each of the model the server last sent "
                               "it (a synchronous rule's last round: the server's model)")
        return described, tensors
