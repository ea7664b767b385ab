"""`--set PATH=VALUE` on the commands that take a job file: the value replaces what the file says at that dotted
path, read as YAML and checked by the one job schema; a path that names no field, or a value of the wrong type, is
refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coordinator.cli import main as coordinator_main
from coordinator.jobschema import commented_job
from nodeagent.jobspec import JobSpecError, apply_overrides, load_job_file, parse_override

pytestmark = pytest.mark.unit


def job_file(directory: Path, job: dict | None = None) -> Path:
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job or {"name": "base", "nodes": 4, "steps": 20, "algorithm": {"lr": 0.02}}))
    return path


def test_values_are_read_as_yaml_and_typed_by_the_schema(tmp_path):
    overrides = [parse_override(text) for text in (
        "algorithm.lr=0.05", "nodes=6", "start.barrier=false", "topology.kind=complete", "algorithm.mode=sync",
        "data.split_options={width: 3}", "data.split=class-window")]
    spec = load_job_file(job_file(tmp_path), overrides).spec
    assert spec.algorithm.lr == 0.05 and spec.nodes == 6 and spec.start.barrier is False
    assert spec.topology.kind == "complete" and spec.algorithm.mode == "sync"
    assert spec.data.split == "class-window" and spec.data.split_options == {"width": 3}
    assert spec.steps == 20 and spec.name == "base"  # what no override names stays as the file says


def test_the_last_override_of_a_path_wins_and_missing_sections_are_created():
    data: dict = {"nodes": 4}
    apply_overrides(data, [parse_override("simulation.network.latency_s=0.01"), parse_override("nodes=8"),
                           parse_override("nodes=16")])
    assert data == {"nodes": 16, "simulation": {"network": {"latency_s": 0.01}}}


def test_the_overridden_job_is_what_submit_sends(tmp_path):
    job = load_job_file(job_file(tmp_path), [parse_override("algorithm.lr=0.5")])
    assert yaml.safe_load(job.text)["algorithm"]["lr"] == 0.5


@pytest.mark.parametrize(("text", "named"), [
    ("algorithm.lrr=1", "algorithm has no field 'lrr'"),
    ("nodez=3", "the job has no field 'nodez'"),
    ("steps.every=3", "steps is a value, not a section"),
    ("model..name=x", "is no dotted path"),
    ("algorithm.lr", "write PATH=VALUE"),
    ("nodes=[1, 2", "is no YAML value"),
])
def test_a_path_that_names_no_field_is_refused_naming_it(text, named):
    with pytest.raises(JobSpecError, match="--set") as refusal:
        parse_override(text)
    assert named in str(refusal.value)


@pytest.mark.parametrize(("text", "field"), [
    ("algorithm.lr=fast", "algorithm.lr"),
    ("nodes=0", "nodes"),
    ("algorithm.momentum=1.5", "algorithm.momentum"),
    ("start.barrier=maybe", "start.barrier"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(tmp_path, text, field):
    with pytest.raises(JobSpecError) as refusal:
        load_job_file(job_file(tmp_path), [parse_override(text)])
    assert str(refusal.value).startswith(f"{field}"), str(refusal.value)
    assert f"--set {text}" in str(refusal.value)


def test_a_section_the_file_holds_as_a_value_is_not_entered(tmp_path):
    with pytest.raises(JobSpecError, match="the job's nodes is 4, not a mapping"):
        load_job_file(job_file(tmp_path), [parse_override("nodes.min=2")])


def test_init_writes_the_overridden_values_and_checks_them():
    text = commented_job("gossip", [parse_override("nodes=16"), parse_override("algorithm.options.factor=0.25")])
    written = yaml.safe_load(text)
    assert written["nodes"] == 16 and written["algorithm"]["options"]["factor"] == 0.25
    with pytest.raises(JobSpecError, match=r"algorithm\.options\.bogus"):
        commented_job("dsgd", [parse_override("algorithm.options.bogus=1")])
    with pytest.raises(JobSpecError, match=r"algorithm\.momentum"):
        commented_job("dsgd", [parse_override("algorithm.momentum=-1")])


def test_the_command_line_refuses_a_wrong_field_before_anything_runs(tmp_path, capsys):
    path = job_file(tmp_path)
    with pytest.raises(SystemExit) as refusal:
        coordinator_main(["validate", str(path), "--set", "algorithm.lr=0.1", "--set", "algorithm.lrr=0.1"])
    named, fields = refusal.value.code.split("; its fields: ")
    assert named == "coordinator: --set algorithm.lrr: algorithm has no field 'lrr'"
    assert fields.split(", ")[:3] == ["name", "mode", "lr"]  # the section's fields, in the schema's order
    assert coordinator_main(["validate", str(path), "--set", "nodes=6", "--set", "steps=30"]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: valid: base, 6 nodes, dsgd on ring, 30 steps"
