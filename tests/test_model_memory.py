"""A bound on the memory of a job's model (issue 27, item 6): a small spec asking for a huge model is refused at
`validate` and at submit with both figures, and an agent refuses it before allocating anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import nodeagent.training.job as job_module
from coordinator.cli import main as coordinator_main
from coordinator.jobs import validate_job
from nodeagent.jobspec import JobSpecError, parse_job_spec
from nodeagent.training.job import JobData
from nodeagent.training.model_memory import MIB, ModelTooLarge, check_model_memory, model_memory_bytes
from nodeagent.training.models import build_model
from tests.datafiles import learnable, write_npy

pytestmark = pytest.mark.unit

HUGE_MLP = {"name": "mlp", "options": {"hidden": [100_000, 100_000]}}  # a 150-byte spec, 10 billion parameters


def spec(model: dict, dataset: str = "fashion-mnist", momentum: float = 0.0, data_dir: str = "/data/x") -> dict:
    return {"name": "big", "nodes": 2, "steps": 10, "topology": {"kind": "ring"}, "model": model,
            "algorithm": {"name": "dsgd", "momentum": momentum}, "data": {"dataset": dataset, "data_dir": data_dir}}


def test_the_count_is_parameters_gradients_and_momentum_as_built_on_the_cpu() -> None:
    job = parse_job_spec(spec({"name": "mlp", "options": {"hidden": [64]}}, momentum=0.9))
    model = build_model(job.model, (1, 28, 28), 10)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == 784 * 64 + 64 + 64 * 10 + 10
    assert model_memory_bytes(model, job) == 3 * 4 * parameters
    assert check_model_memory(job, (1, 28, 28), 10, 1 * MIB) == 3 * 4 * parameters  # built on the meta device


def test_validate_and_submit_refuse_a_huge_model_with_the_figures() -> None:
    with pytest.raises(ModelTooLarge) as refused:
        validate_job(parse_job_spec(spec(HUGE_MLP)))
    assert str(refused.value) == ("model: mlp needs 76,901 MiB for 10,079,600,010 parameters (with gradients); the "
                                  "coordinator allows 2,048 MiB (--max-model-memory)")
    validate_job(parse_job_spec(spec({"name": "resnet-cifar", "options": {"depth": 32}}, "cifar10")))  # fits
    with pytest.raises(ModelTooLarge, match=r"needs 7 MiB for 855,770 parameters .* allows 1 MiB"):
        validate_job(parse_job_spec(spec({"name": "resnet-cifar", "options": {"depth": 56}}, "cifar10")),
                     max_model_bytes=1 * MIB)


def test_an_elastic_job_is_checked_too_and_a_bad_option_names_the_field() -> None:
    elastic = {**spec(HUGE_MLP), "nodes": {"min": 2, "max": 4}, "algorithm": {"name": "gossip"}}
    with pytest.raises(ModelTooLarge):
        validate_job(parse_job_spec(elastic))
    with pytest.raises(JobSpecError, match=r"^model\.options: .*depth"):
        validate_job(parse_job_spec(spec({"name": "resnet-cifar", "options": {"depth": 33}}, "cifar10")))


def test_coordinator_validate_refuses_it_before_any_agent_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(spec(HUGE_MLP)))
    with pytest.raises(SystemExit) as refused:
        coordinator_main(["validate", str(path)])
    assert "needs 76,901 MiB" in str(refused.value.code) and "allows 2,048 MiB" in str(refused.value.code)


def test_an_agent_refuses_a_model_over_its_bound_before_building_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The data's shape is in its files (npy): only the agent can count; it does before the model is built."""
    train, test = learnable(64, (1, 8, 8), 3, seed=1), learnable(16, (1, 8, 8), 3, seed=2)
    write_npy(tmp_path / "npy", train, test)
    job = parse_job_spec(spec({"name": "mlp", "options": {"hidden": [4096, 4096]}}, "npy",
                              data_dir=str(tmp_path / "npy")))
    validate_job(job)  # the coordinator cannot know the shape
    built = []
    monkeypatch.setattr(job_module, "initial_model", lambda *args: built.append(args))
    with pytest.raises(ModelTooLarge, match=r"needs 130 MiB for 17,059,843 parameters .*; this node allows "
                                            r"64 MiB"):
        JobData.prepare(job, max_model_bytes=64 * MIB)
    assert built == []
    assert torch.get_default_device().type == "cpu"  # the meta device was only a context
