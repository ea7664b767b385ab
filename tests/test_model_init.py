"""A job that starts from a trained model (`model.init`): the model file a simulated job writes (`coordinator simulate
--export`) is where the next job starts, on every node and at the parameter server, and a file that is not the
job's model is refused naming the field, before it is read where it is too large."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.cli import main as coordinator_main
from coordinator.export import evaluate_model_file
from coordinator.simulate import simulate, simulated_model
from nodeagent.jobspec import JobSpec, parse_job_spec
from nodeagent.runtime.progress import read_run_log
from nodeagent.training.data import DatasetInfo
from nodeagent.training.modelfile import FORMAT, ModelFileError, load_model_file, write_model_file
from nodeagent.training.models import ModelError, initial_model, seeded_model

pytestmark = pytest.mark.unit


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    for index, words in enumerate(("to be or not to be ", "the quick brown fox ", "all is well that ends well ")):
        (directory / f"part{index}.txt").write_text(words * 30)
    return directory


def job(corpus: Path, algorithm: dict, **model) -> dict:
    return {"name": "warm", "task": "language-model", "nodes": 3, "steps": 8, "eval_every": 4, "seed": 2,
            "algorithm": algorithm,
            "model": {"name": "gpt", "options": {"layers": 1, "heads": 2, "width": 16}, **model},
            "data": {"dataset": "text", "data_dir": str(corpus), "batch_size": 4, "options": {"sequence_length": 8},
                     "test_limit": 12}}


def first_evaluations(spec: JobSpec, run_dir: Path) -> list[float]:
    """Each node's validation loss at step 0, before it trained: of the model it started from."""
    simulate(spec, run_dir)  # the simulator refuses a server whose model differs from its workers'
    return [record.test_loss for record in read_run_log(run_dir) if record.step == 0]


@pytest.mark.parametrize("algorithm", [
    {"name": "allreduce", "lr": 0.05},  # the collective family
    {"name": "dsgd", "mode": "sync", "lr": 0.05},  # peer-to-peer
    {"name": "asgd", "lr": 0.05},  # the parameter server's: its model must be the workers'
], ids=lambda a: a["name"])
def test_a_job_starts_from_the_model_a_simulated_job_wrote(corpus: Path, tmp_path: Path, algorithm: dict) -> None:
    trained = simulate(parse_job_spec(job(corpus, {"name": "dsgd", "mode": "sync", "lr": 0.3})))
    state_dict, manifest = simulated_model(trained)
    assert manifest["format"] == FORMAT and manifest["source"] == "the mean of the models of ranks 0..2"
    path = tmp_path / "trained.pt"
    write_model_file(path, state_dict, manifest)
    exported, _manifest = evaluate_model_file(path)

    started = first_evaluations(parse_job_spec(job(corpus, algorithm, init=str(path))), tmp_path / "started")
    assert started == pytest.approx([exported.loss] * 3)
    seeded = first_evaluations(parse_job_spec(job(corpus, algorithm)), tmp_path / "seeded")
    assert seeded[0] > exported.loss + 0.1, "the file's model is not the seeded one"


def test_the_exported_model_of_each_family_is_its_consensus(corpus: Path) -> None:
    server = simulate(parse_job_spec(job(corpus, {"name": "asgd", "lr": 0.05})))
    state_dict, manifest = simulated_model(server)
    assert manifest["source"] == "the parameter server" and manifest["ranks"] == []
    flat = torch.cat([state_dict[name].reshape(-1) for name, _ in seeded_model(
        server.job.spec, server.mesh.nodes[0].node.batches.dataset.info).named_parameters()])
    assert torch.equal(flat, server.mesh.server.half.w)

    collective = simulate(parse_job_spec(job(corpus, {"name": "allreduce", "lr": 0.05})))
    state_dict, manifest = simulated_model(collective)
    assert manifest["source"] == "rank 0"
    for name, parameter in collective.mesh.nodes[0].node.algorithm.model.named_parameters():
        assert torch.equal(state_dict[name], parameter.detach())


def test_simulate_export_writes_the_file_that_report_evaluates(corpus: Path, tmp_path: Path, capsys) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(json.dumps(job(corpus, {"name": "dsgd", "mode": "sync", "lr": 0.3})))  # YAML reads JSON
    out = tmp_path / "models" / "model.pt"
    assert coordinator_main(["simulate", str(job_file), "--runs", str(tmp_path / "runs"), "--export", str(out)]) == 0
    assert f"wrote {out}: the mean of the models of ranks 0..2 at step 8" in capsys.readouterr().out
    assert coordinator_main(["report", "--model", str(out)]) == 0
    assert "validation perplexity" in capsys.readouterr().out


def gpt_of(width: int) -> tuple[JobSpec, DatasetInfo]:
    spec = parse_job_spec({"task": "language-model", "model": {"name": "gpt", "options": {
        "layers": 1, "heads": 2, "width": width}}, "data": {"dataset": "text"}})
    return spec, DatasetInfo((8,), 256, 10, 10)


def written(path: Path, model: torch.nn.Module) -> Path:
    write_model_file(path, model.state_dict(), {"format": FORMAT})
    return path


def test_a_file_that_is_not_the_jobs_model_is_refused_naming_the_field(tmp_path: Path) -> None:
    spec, info = gpt_of(16)
    wider, _ = gpt_of(32)
    deeper = parse_job_spec(spec.model_dump() | {"model": {"name": "gpt", "options": {
        "layers": 2, "heads": 2, "width": 16}}})
    cases = {
        "wider": (written(tmp_path / "wider.pt", seeded_model(wider, info)), "is (256, 32), the job's (256, 16)"),
        "deeper": (written(tmp_path / "deeper.pt", seeded_model(deeper, info)), "the job's has no 'blocks.1."),
        "not a model": (tmp_path / "text.pt", "not a model file `coordinator export` wrote (UnpicklingError)"),
        "missing": (tmp_path / "none.pt", "cannot read it: No such file or directory"),
    }
    (tmp_path / "text.pt").write_text("x" * 100)
    for name, (path, message) in cases.items():
        with pytest.raises(ModelError, match=r"^model\.init ") as refused:
            initial_model(spec.model_copy(update={"model": spec.model.model_copy(update={"init": str(path)})}), info)
        assert message in str(refused.value), name


def test_a_file_without_the_manifest_too_large_or_not_finite_is_refused(tmp_path: Path) -> None:
    spec, info = gpt_of(16)
    model = seeded_model(spec, info)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "bare.pt")
    with pytest.raises(ModelFileError, match=f"no {FORMAT} manifest"):
        load_model_file(tmp_path / "bare.pt")
    large = written(tmp_path / "large.pt", model)
    with pytest.raises(ModelFileError, match="more than the job's model can fill"):
        load_model_file(large, max_bytes=large.stat().st_size - 1)
    broken = model.state_dict()
    broken[next(iter(broken))] = torch.full_like(broken[next(iter(broken))], float("inf"))
    write_model_file(tmp_path / "inf.pt", broken, {"format": FORMAT})
    with pytest.raises(ModelError, match="holds values that are not finite"):
        initial_model(spec.model_copy(update={"model": spec.model.model_copy(
            update={"init": str(tmp_path / "inf.pt")})}), info)
