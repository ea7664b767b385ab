"""The trained models at the coordinator (coordinator.model_store) and their export (coordinator.export), in process:
a rank's model is taken only from the node that holds the rank, only if it fits the job's model; the export is a
rank's model or the job's consensus, and a file is written only from a stream that fits the job's model."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from coordinator.control.memory import MemoryState
from coordinator.control.states import JobState
from coordinator.export import ExportError, receive_model
from coordinator.model_store import ModelStore, model_path
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import parse_job_spec
from nodeagent.runtime.progress import Progress
from nodeagent.runtime.readiness import data_to_json
from nodeagent.training.data import DatasetInfo
from nodeagent.training.modelfile import load_model_file, write_model_file
from nodeagent.training.models import initial_model
from nodeagent.wire.encoder import encode
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit

INFO = DatasetInfo(input_shape=(1, 28, 28), num_classes=10, train_samples=600, test_samples=100)
NODES = ["node-a", "node-b", "node-c"]
ACCURACIES = [0.5, 0.625, 0.875]  # each rank's final evaluation, as it reported it


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """An insecure call's context: no certificate; abort raises."""

    def auth_context(self) -> dict:
        return {}

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def running_job(tmp_path: Path, algorithm: str = "dsgd", model: str = "logistic") -> tuple[MemoryState, str]:
    store = MemoryState()
    spec = parse_job_spec({"name": "models", "nodes": 3, "algorithm": {"name": algorithm},
                           "model": {"name": model}, "topology": {"kind": "complete"}})
    store.add_job("job-1", spec, "", str(tmp_path / "run"))
    store.start_job("job-1", NODES)
    for rank, node in enumerate(NODES):
        store.mark_ready("job-1", rank, node, data_to_json(INFO))
        store.record_progress(Progress("job-1", rank, node, step=7, test_accuracy=ACCURACIES[rank], finished=True))
    return store, "job-1"


def model_of(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: torch.randn_like(p) for name, p in initial_model(
        parse_job_spec({"model": {"name": "logistic"}}), INFO).named_parameters()}


def upload(models: ModelStore, rank: int, tensors: dict[str, torch.Tensor], node: str | None = None,
           step: int = 7) -> pb.UploadModelReply:
    message = Message(kind=Kind.PARAMS, sender=rank, receiver=3, tensors=tensors, clock=step)
    frames = encode(message, job_id="job-1", sender_id=node or NODES[rank], chunk_bytes=4096)
    return models.upload((frame.SerializeToString() for frame in frames), Context())


def exported(models: ModelStore, store: MemoryState, rank: int | None = None) -> list[pb.ModelExport]:
    request = pb.ExportModelRequest(job_id="job-1")
    if rank is not None:
        request.rank = rank
    return list(models.export(request, Context(), store.job("job-1")))


def test_each_rank_model_is_kept_and_the_consensus_is_their_mean(tmp_path):
    store, job_id = running_job(tmp_path)
    models = ModelStore(store)
    sent = {rank: model_of(rank) for rank in range(3)}
    for rank, tensors in sent.items():
        assert upload(models, rank, tensors).bytes_received == 7850 * 4  # the payload counted
    store.end_job(job_id, JobState.FINISHED)
    state_dict, manifest = receive_model(exported(models, store, rank=1))
    assert list(state_dict) == ["1.weight", "1.bias"]
    assert all(torch.equal(state_dict[name], sent[1][name]) for name in state_dict)
    assert manifest["source"] == "rank 1" and manifest["step"] == 7 and manifest["ranks"] == [1]
    assert manifest["metric"] == {"name": "test_accuracy", "value": 0.625, "of": "rank 1's final evaluation"}
    mean, manifest = receive_model(exported(models, store))
    assert manifest["source"] == "the mean of the models of ranks 0..2"
    assert manifest["metric"]["value"] == pytest.approx(2 / 3)
    for name, tensor in mean.items():
        assert torch.allclose(tensor, torch.stack([sent[rank][name] for rank in range(3)]).mean(dim=0))
    write_model_file(tmp_path / "out" / "model.pt", mean, manifest)
    loaded, read = load_model_file(tmp_path / "out" / "model.pt")
    assert read == manifest and all(torch.equal(loaded[name], mean[name]) for name in mean)


def test_a_model_that_does_not_fit_the_jobs_model_is_refused_and_nothing_is_kept(tmp_path):
    store, _ = running_job(tmp_path)
    models = ModelStore(store)
    wrong = {"1.weight": torch.zeros(10, 783), "1.bias": torch.zeros(10)}
    with pytest.raises(Aborted) as refused:
        upload(models, 0, wrong)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor '1.weight': expected shape [10, 784], got [10, 783]" in refused.value.details
    renamed = {"weight": torch.zeros(10, 784), "1.bias": torch.zeros(10)}
    with pytest.raises(Aborted, match=r"expected tensor '1\.weight', got 'weight'"):
        upload(models, 0, renamed)
    assert not model_path(tmp_path / "run", 0).exists()


def test_only_the_node_holding_the_rank_sends_its_model(tmp_path):
    store, _ = running_job(tmp_path)
    models = ModelStore(store)
    with pytest.raises(Aborted) as refused:
        upload(models, 0, model_of(0), node="node-b")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not model_path(tmp_path / "run", 0).exists()


def test_the_consensus_needs_every_ranks_model(tmp_path):
    store, job_id = running_job(tmp_path)
    models = ModelStore(store)
    upload(models, 0, model_of(0))
    store.end_job(job_id, JobState.STOPPED)
    with pytest.raises(Aborted) as refused:
        exported(models, store)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no model of ranks 1, 2" in refused.value.details and "--rank N" in refused.value.details
    assert receive_model(exported(models, store, rank=0))[1]["source"] == "rank 0"


def test_an_export_whose_stream_does_not_fit_the_described_model_is_refused(tmp_path):
    store, _ = running_job(tmp_path)
    models = ModelStore(store)
    for rank in range(3):
        upload(models, rank, model_of(rank))
    replies = exported(models, store, rank=0)
    spec = parse_job_spec({"name": "models", "nodes": 3, "model": {"name": "mlp"}})
    replies[0].model.spec_json = spec.to_json()  # the description now names another model than the stream holds
    with pytest.raises(ExportError, match="does not fit job job-1's model mlp"):
        receive_model(replies)
