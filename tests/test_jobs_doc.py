"""The job file described from its schema: `coordinator schema`, `init`, `validate`, docs/jobs.md, and --help.

The venv has no JSON Schema validator (jsonschema is not a dependency), so `conforms` below checks a document
against the keywords the job schema uses; the tests that use it also show it refusing what the schema refuses.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator import cli as coordinator_cli
from coordinator.jobs import validate_job
from coordinator.jobschema import INTRODUCTION, REGENERATE, job_schema, markdown_reference
from coordinator.topology import DYNAMIC_KINDS, KINDS, kind_options
from nodeagent import cli as nodeagent_cli
from nodeagent.algorithms import REGISTRY
from nodeagent.jobspec import AlgorithmSpec, JobSpec, JobSpecError, load_job_file, parse_job_spec, parse_job_yaml
from nodeagent.training.models import MODELS
from nodeagent.training.splits import SPLIT_OPTIONS
from nodeagent.training.tasks import DATASET_OPTIONS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_JOBS = sorted((ROOT / "deploy" / "jobs").glob("*.yaml"))


def conforms(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema`, for the keywords of the job schema (draft 2020-12)."""
    if "$ref" in schema:
        return conforms(value, root["$defs"][schema["$ref"].removeprefix("#/$defs/")], root)
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in types and not isinstance(value, types[kind]):
        return False
    if kind in ("integer", "number"):
        numeric = (int,) if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            return False
    checks = [
        "enum" not in schema or value in schema["enum"],
        "const" not in schema or value == schema["const"],
        "minimum" not in schema or value >= schema["minimum"],
        "exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"],
        "maximum" not in schema or value <= schema["maximum"],
        "exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"],
        "maxLength" not in schema or len(value) <= schema["maxLength"],
        "minLength" not in schema or len(value) >= schema["minLength"],
        "pattern" not in schema or re.search(schema["pattern"], value) is not None,
        "anyOf" not in schema or any(conforms(value, option, root) for option in schema["anyOf"]),
        "oneOf" not in schema or sum(conforms(value, option, root) for option in schema["oneOf"]) == 1,
        all(conforms(value, part, root) for part in schema.get("allOf", ())),
    ]
    if "if" in schema and conforms(value, schema["if"], root):
        checks.append(conforms(value, schema.get("then", {}), root))
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        checks.append(all(key in value for key in schema.get("required", ())))
        for key, item in value.items():
            if key in properties:
                checks.append(conforms(item, properties[key], root))
            elif extra is False:
                checks.append(False)
            elif isinstance(extra, dict):
                checks.append(conforms(item, extra, root))
    if isinstance(value, list) and "items" in schema:
        checks.extend(conforms(item, schema["items"], root) for item in value)
    return all(checks)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return job_schema()


def _branch(schema: dict[str, Any], section: str, field: str, name: str) -> dict[str, Any]:
    # A section may hold two choices (data: dataset and split), each with its branches.
    branches = [b["then"] for b in schema["$defs"][section]["allOf"]
                if b["if"]["properties"].get(field, {}).get("const") == name]
    assert len(branches) == 1, f"{section}.{field} = {name}: {len(branches)} branches"
    return branches[0]


def _option_names(schema: dict[str, Any], then: dict[str, Any], field: str) -> set[str]:
    options = then["properties"][field]
    if "$ref" in options:
        options = schema["$defs"][options["$ref"].removeprefix("#/$defs/")]
    return set(options["properties"])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_schema_has_every_algorithm_with_its_options_and_modes(schema: dict[str, Any], name: str) -> None:
    cls = REGISTRY[name]
    then = _branch(schema, "AlgorithmSpec", "name", name)
    expected = {field.alias or key for key, field in cls.Options.model_fields.items()}
    assert _option_names(schema, then, "options") == expected
    assert then["properties"]["mode"]["enum"] == [*cls.modes, None]
    assert cls.__doc__, f"{name} needs a one-line docstring: the reference shows it"
    for option in cls.Options.model_json_schema(by_alias=True)["properties"].values():
        assert option.get("description"), f"an option of {name} has no description"


@pytest.mark.parametrize("kind", KINDS + DYNAMIC_KINDS)
def test_schema_has_every_topology_kind_with_its_options(schema: dict[str, Any], kind: str) -> None:
    then = _branch(schema, "TopologySpec", "kind", kind)
    expected = set(kind_options(kind).model_fields) | ({"path"} if kind == "edge-list" else set())
    assert _option_names(schema, then, "options") == expected
    assert then["description"]


@pytest.mark.parametrize("split", sorted(SPLIT_OPTIONS))
def test_schema_has_every_split_with_its_options(schema: dict[str, Any], split: str) -> None:
    then = _branch(schema, "DataSpec", "split", split)
    assert _option_names(schema, then, "split_options") == set(SPLIT_OPTIONS[split].model_fields)
    assert then["description"]


@pytest.mark.parametrize("dataset", sorted(DATASET_OPTIONS))
def test_schema_has_every_dataset_with_its_options(schema: dict[str, Any], dataset: str) -> None:
    then = _branch(schema, "DataSpec", "dataset", dataset)
    assert _option_names(schema, then, "options") == set(DATASET_OPTIONS[dataset].model_fields)
    assert then["description"]


def test_the_reference_describes_every_model_with_its_options() -> None:
    reference = markdown_reference()
    assert "### `gpt`" in reference and "| `context_length` | `null` |" in reference
    assert all(f"### `{name}`" in reference for name in MODELS)


def test_the_reference_language_model_example_is_a_valid_job() -> None:
    example = INTRODUCTION.split("```yaml\n")[1].split("```")[0]
    spec = parse_job_yaml(example)
    assert spec.task == "language-model"
    validate_job(spec)


def test_every_field_of_a_job_is_described(schema: dict[str, Any]) -> None:
    sections = [schema, *(definition for definition in schema["$defs"].values() if "properties" in definition)]
    undescribed = [name for section in sections for name, prop in section["properties"].items()
                   if not prop.get("description")]
    assert undescribed == []


@pytest.mark.parametrize("path", SHIPPED_JOBS, ids=lambda path: path.name)
def test_shipped_job_files_conform_to_the_schema(schema: dict[str, Any], path: Path) -> None:
    assert conforms(yaml.safe_load(path.read_text()), schema, schema)


@pytest.mark.parametrize("job", [
    {"algorithm": {"name": "pdmm-isvr", "options": {"eta": "largest"}}},  # not a choice of the option
    {"algorithm": {"name": "pdmm-isvr", "options": {"momentum": 0.9}}},  # not an option of pdmm-isvr
    {"algorithm": {"name": "pdmm-isvr", "mode": "sync"}},  # a mode pdmm-isvr does not run
    {"algorithm": {"options": {"eta": "released"}}},  # the default algorithm, dsgd, takes no options
    {"algorithm": {"name": "no-such-algorithm"}},
    {"topology": {"kind": "torus", "options": {"degree": 4}}},
    {"topology": {"kind": "random-regular"}},  # degree is required
    {"topology": {"kind": "edge-list", "options": {}}},  # neither edges nor path
    {"data": {"split": "dirichlet", "split_options": {"alpha": 0}}},
    {"data": {"split_options": {"alpha": 0.5}}},  # the default split, iid, takes no options
    {"nodes": 0},
    {"wire": {"encoding": "fp8"}},
    {"unknown_section": {}},
], ids=lambda job: json.dumps(job))
def test_the_schema_refuses_what_the_coordinator_refuses(schema: dict[str, Any], job: dict[str, Any]) -> None:
    assert not conforms(job, schema, schema)
    with pytest.raises(JobSpecError):
        validate_job(parse_job_spec(job))


def test_an_edge_list_job_may_name_its_edge_file(schema: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "ring.edges").write_text("0 1\n1 2\n2 3\n3 0\n")
    job = {"nodes": 4, "topology": {"kind": "edge-list", "options": {"path": "ring.edges"}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert conforms(job, schema, schema)
    assert len(validate_job(load_job_file(tmp_path / "job.yaml").spec).edges) == 4
    assert not conforms({**job, "topology": {"kind": "edge-list", "options": {"path": "a", "edges": "0 1"}}},
                        schema, schema)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_init_writes_a_commented_job_that_validates(
    schema: dict[str, Any], tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job.yaml"
    assert coordinator_cli.main(["init", name, "--out", str(out)]) == 0
    spec = load_job_file(out).spec
    validate_job(spec)
    options = REGISTRY[name].Options().model_dump(by_alias=True)
    assert spec == JobSpec(name=name, algorithm=AlgorithmSpec(name=name, options=options))
    assert conforms(yaml.safe_load(out.read_text()), schema, schema)
    lines = out.read_text().splitlines()
    for number, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            assert lines[number - 1].lstrip().startswith("#"), f"no comment above {line!r}"
    assert coordinator_cli.main(["validate", str(out)]) == 0
    assert f"{out}: valid" in capsys.readouterr().out


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.yaml"
    out.write_text("mine\n")
    with pytest.raises(SystemExit, match="exists; give --force"):
        coordinator_cli.main(["init", "gossip", "--out", str(out)])
    assert out.read_text() == "mine\n"
    assert coordinator_cli.main(["init", "gossip", "--out", str(out), "--force"]) == 0
    assert load_job_file(out).spec.algorithm.name == "gossip"


def test_init_of_an_unknown_algorithm_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        coordinator_cli.main(["init", "sgd-plus", "--out", str(tmp_path / "job.yaml")])
    assert "unknown algorithm 'sgd-plus'" in str(refused.value)
    assert all(name in str(refused.value) for name in REGISTRY)
    assert not (tmp_path / "job.yaml").exists()


def test_validate_refuses_a_bad_job_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  name: gossip\n  options:\n    factor: 2\n")
    with pytest.raises(SystemExit, match=r"algorithm\.options\.factor"):
        coordinator_cli.main(["validate", str(SHIPPED_JOBS[0]), str(bad)])


def test_schema_command_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert coordinator_cli.main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert printed == job_schema()


def test_docs_jobs_md_is_what_the_schema_generates(capsys: pytest.CaptureFixture[str]) -> None:
    written = (ROOT / "docs" / "jobs.md").read_text()
    assert written == markdown_reference(), f"docs/jobs.md is out of date: run `{REGENERATE}`"
    assert coordinator_cli.main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == written


def test_docs_jobs_md_names_every_algorithm_kind_and_split() -> None:
    text = (ROOT / "docs" / "jobs.md").read_text()
    for name in [*REGISTRY, *KINDS, *DYNAMIC_KINDS, *SPLIT_OPTIONS]:
        assert f"### `{name}`" in text


def test_no_documentation_points_outside_the_repository() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.yaml"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "coordinator").rglob("*.py"),
             *(ROOT / "nodeagent").rglob("*.py")]
    outside = re.compile(r"TARGETS\.md|ALGORITHMS\.md|ARCHITECTURE\.md|\.\./shared|shared/design")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), start=1) if outside.search(line)]
    assert found == []


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.help != argparse.SUPPRESS:
            yield path, action


@pytest.mark.parametrize("parser", [coordinator_cli.build_parser(), nodeagent_cli.build_parser()],
                         ids=["coordinator", "nodeagent"])
def test_help_shows_every_default_and_choice(parser: argparse.ArgumentParser) -> None:
    silent = []
    for path, action in _options(parser, parser.prog):
        name = f"{path} {'/'.join(action.option_strings) or action.dest}"
        if action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in (action.help or ""):
            silent.append(f"{name}: default {action.default!r} not in its help")
        # argparse lists the choices itself ({a,b,c}) unless a metavar hides them.
        if action.choices and action.metavar and not all(str(c) in (action.help or "") for c in action.choices):
            silent.append(f"{name}: choices hidden by the metavar")
    assert silent == []
