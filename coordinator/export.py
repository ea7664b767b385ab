"""`coordinator export`: a job's trained model as one file that plain PyTorch loads, and `coordinator report --model`,
which evaluates such a file on its job's test set.

The file is nodeagent.training.modelfile's: `torch.save({"state_dict": ..., "manifest": ...})`, loadable with
`torch.load(path, weights_only=True)`. `state_dict` is the model's own (the parameters as trained, buffers as the
job's seeded model has them: the algorithms exchange and train only parameters), `manifest` a dictionary of plain
values (`manifest_of`: FORMAT, the job, its algorithm, the model's name and options, the data's description, what the
parameters are, their step and the job's metric). docs/operations.md, "Taking a trained model home", shows how to
load it.

The parameters come from the coordinator (ExportModel: coordinator.model_store), which the job's ranks sent them to
over their authenticated channels as they finished. They are read here within the job's `wire.max_message_bytes`,
checked against the model rebuilt from the job's own description (names, dtypes and shapes of every parameter, before
any payload is read; nothing that does not fit is written), and never unpickled.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import wire_pb2
from nodeagent.jobspec import JobSpec
from nodeagent.runtime.messages import data_from_proto
from nodeagent.training.data import DatasetInfo
from nodeagent.training.loop import EvalResult
from nodeagent.training.modelfile import FORMAT, load_model_file
from nodeagent.training.models import parameter_specs, seeded_model
from nodeagent.training.tasks import task_of
from nodeagent.wire.decoder import decode
from nodeagent.wire.errors import WireError
from nodeagent.wire.message import TensorSpec


class ExportError(Exception):
    """An export that cannot be had; the message says why."""


def receive_model(replies: Iterable[pb.ModelExport], allow_imports: Collection[str] = ()
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state_dict and manifest of an ExportModel stream: its description first, then one tensor stream whose
    tensors must be the parameters of the job's model (ExportError otherwise)."""
    stream = iter(replies)
    first = next(stream, None)
    if first is None or not first.HasField("model"):
        raise ExportError("the coordinator's answer does not start with the model's description")
    described = first.model
    spec = JobSpec.from_json(described.spec_json)
    if not described.HasField("data"):
        raise ExportError(f"job {described.job_id}: no rank described its data, so the model has no shape")
    info = data_from_proto(described.data)
    model = seeded_model(spec, info, allow_imports)  # its buffers as the job's nodes built them
    expected = [TensorSpec(name, dtype, shape) for name, dtype, shape in parameter_specs(model)]
    try:
        message = decode(_frames(stream), lambda _manifest: expected, spec.wire.max_message_bytes)
    except WireError as error:
        raise ExportError(f"the model does not fit job {described.job_id}'s model {spec.model.name}: {error}") \
            from None
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in message.tensors:
                parameter.copy_(message.tensors[name])
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return state_dict, manifest_of(described, spec, info)


def _frames(stream: Iterator[pb.ModelExport]) -> Iterator[wire_pb2.Frame]:
    for reply in stream:
        if not reply.HasField("frame"):
            raise ExportError("the coordinator's answer describes the model twice")
        yield reply.frame


def manifest_of(described: pb.ExportedModel, spec: JobSpec, info: DatasetInfo) -> dict[str, Any]:
    """What the file says of its model, in plain values (torch.load with weights_only reads them)."""
    return {
        "format": FORMAT,
        "job_id": described.job_id,
        "job_name": spec.name,
        "algorithm": spec.algorithm.name,
        "task": spec.task,
        "model": {"name": spec.model.name, "options": dict(spec.model.options)},
        "data": {
            "dataset": spec.data.dataset, "data_dir": spec.data.data_dir, "test_limit": spec.data.test_limit,
            "input_shape": list(info.input_shape), "num_classes": info.num_classes,
            "train_samples": info.train_samples, "test_samples": info.test_samples,
        },
        "source": described.source,
        "ranks": list(described.ranks),
        "step": described.step,
        "metric": {"name": described.metric_name, "value": described.metric_value, "of": described.metric_of},
        "seed": spec.seed,
        "job_spec": spec.to_json(),
    }


def evaluate_model_file(path: Path, data_dir: str | None = None, allow_imports: Collection[str] = ()
                        ) -> tuple[EvalResult, dict[str, Any]]:
    """An exported model evaluated on its job's test set (the job's data directory, or `data_dir`) by the job's
    task, as the job's nodes evaluate theirs."""
    state_dict, manifest = load_model_file(path)
    spec = JobSpec.from_json(manifest["job_spec"])
    task = task_of(spec)
    test = task.load(spec, data_dir or spec.data.data_dir, "test")
    model = seeded_model(spec, test.info, allow_imports)
    model.load_state_dict(state_dict)
    return task.evaluate(model, test), manifest
