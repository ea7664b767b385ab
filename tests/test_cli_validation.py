"""A job the algorithm cannot run is refused by every command that takes a job file, naming the field, before any
coordinator is contacted or any data is read; and by the coordinator itself, which then holds no job."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from coordinator.cli import main as coordinator_main
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"  # nothing listens there

REFUSED = {
    "unknown option": ({"name": "dsgd", "options": {"bogus": 1}}, "algorithm.options.bogus"),
    "momentum of ECL": ({"name": "pdmm-isvr", "momentum": 0.9}, "algorithm.momentum"),
    "mode gossip lacks": ({"name": "gossip", "mode": "sync"}, "algorithm.mode"),
    "option out of range": ({"name": "osgp", "options": {"synch_freq": -1}}, "algorithm.options.synch_freq"),
    # Refused by the algorithm's check of the graph, not by its options alone.
    "unbounded eta": ({"name": "admm-isvr", "interval": 1, "options": {"eta": "optimal"}}, "algorithm.options.eta"),
}


def job_file(directory: Path, algorithm: dict[str, Any]) -> Path:
    path = directory / "job.yaml"
    # A data directory that does not exist: a command that got past validation would fail on it, not refuse.
    job = {"name": "cli", "nodes": 4, "steps": 5, "algorithm": algorithm, "topology": {"kind": "ring"},
           "data": {"data_dir": str(directory / "no-data")}}
    path.write_text(yaml.safe_dump(job))
    return path


def argv(command: str, path: Path, runs: Path) -> list[str]:
    if command == "submit":
        return ["submit", str(path), "--coordinator", NOWHERE, "--insecure"]
    if command == "simulate":
        return ["simulate", str(path), "--runs", str(runs)]
    return ["inspect", str(path)]


@pytest.mark.parametrize("command", ["submit", "inspect", "simulate"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_job_the_algorithm_refuses_is_refused_by_the_command_naming_the_field(tmp_path, capsys, command, case):
    algorithm, field = REFUSED[case]
    path = job_file(tmp_path, algorithm)
    with pytest.raises(SystemExit) as refusal:
        coordinator_main(argv(command, path, tmp_path / "runs"))
    message = refusal.value.code
    assert isinstance(message, str) and message.startswith(f"coordinator: {path}: {field}:"), message
    assert capsys.readouterr().out == ""  # refused before doing anything
    assert not (tmp_path / "runs").exists()


def test_an_accepted_job_gets_past_validation_to_the_coordinator(tmp_path, capsys):
    """The control of the refusals above: without the error, submit goes on and finds no coordinator."""
    path = job_file(tmp_path, {"name": "dsgd"})
    assert coordinator_main(["submit", str(path), "--coordinator", NOWHERE, "--insecure"]) == 1
    assert "nothing listens there" in capsys.readouterr().err


def test_the_coordinator_refuses_the_job_naming_the_field_and_keeps_no_job(coordinator_stub, tmp_path):
    algorithm, field = REFUSED["option out of range"]
    spec_yaml = job_file(tmp_path, algorithm).read_text()
    with pytest.raises(grpc.RpcError) as refusal:
        coordinator_stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec_yaml), timeout=5)
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}:" in refusal.value.details()
    with pytest.raises(grpc.RpcError) as no_job:
        coordinator_stub.JobStatus(pb.JobStatusRequest(job_id=""), timeout=5)
    assert no_job.value.code() == grpc.StatusCode.NOT_FOUND


MODEL_REFUSED = {
    "resnet-cifar depth": ({"name": "resnet-cifar", "options": {"depth": 33}}, {"dataset": "cifar10"},
                           "depth must be 6n + 2"),
    "resnet-gn groups": ({"name": "resnet-gn", "options": {"width": 12, "group_channels": 5}}, {},
                         "cannot be cut into"),
    "gpt context": ({"name": "gpt", "options": {"context_length": 16}},
                    {"dataset": "text", "options": {"sequence_length": 32}}, "context_length must be"),
}


@pytest.mark.parametrize("command", ["validate", "submit"])
@pytest.mark.parametrize("case", list(MODEL_REFUSED))
def test_a_model_option_the_model_refuses_is_refused_at_validate_and_submit_naming_the_field(tmp_path, command,
                                                                                            case):
    """Not at the agents once the job starts: the model is built on the meta device with the data's nominal
    shape (a text job's sequence_length)."""
    model, data, reason = copy.deepcopy(MODEL_REFUSED[case])
    path = tmp_path / "job.yaml"
    task = {"task": "language-model"} if data.get("dataset") == "text" else {}
    path.write_text(yaml.safe_dump({"name": "m", "nodes": 2, "steps": 5, "model": model, "data": data, **task}))
    extra = ["--coordinator", NOWHERE, "--insecure"] if command == "submit" else []
    with pytest.raises(SystemExit) as refusal:
        coordinator_main([command, str(path), *extra])
    message = refusal.value.code
    assert isinstance(message, str) and message.startswith(f"coordinator: {path}: model.options: "), message
    assert reason in message
    # The control: the same model with options that fit is valid (the gpt's context as long as the data's).
    model["options"] = {"context_length": 32} if model["name"] == "gpt" else {}
    path.write_text(yaml.safe_dump({"name": "m", "nodes": 2, "steps": 5, "model": model, "data": data, **task}))
    assert coordinator_main(["validate", str(path)]) == 0
