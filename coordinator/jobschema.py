"""The job file, described from its schema: the JSON Schema `coordinator schema` prints, the reference docs/jobs.md
(`coordinator schema --markdown`), and the commented job file `coordinator init` writes.

All three are derived from what a job is checked with: the pydantic models of nodeagent.jobspec, each algorithm's
typed Options (nodeagent.algorithms), the topology kinds' options (coordinator.topology.KIND_OPTIONS) and the
splits' options (nodeagent.training.splits.SPLIT_OPTIONS), descriptions and defaults included. So the reference
cannot drift from the code; tests/test_jobs_doc.py fails when docs/jobs.md is not what this module writes now.

The options of a choice (an algorithm, a topology kind, a split) depend on the choice, so the schema adds to the
section an `allOf` of `if` (the name is this one) / `then` (its options' schema, and for an algorithm the modes it
runs). A JSON-Schema-aware editor (VS Code's YAML extension, JetBrains) applies the branch that matches and
completes and checks the options with their descriptions; `oneOf` over whole sections would make a validator
report every branch that failed, and an `x-` extension would be ignored by editors. A branch for the default
choice matches when the name is left out, as the job does.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from collections.abc import Sequence
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from coordinator.topology import DYNAMIC_KINDS, KIND_MEANINGS, KINDS, EdgeListOptions, kind_options
from nodeagent.algorithms import REGISTRY
from nodeagent.jobspec import AlgorithmSpec, JobSpec, JobSpecError, Override, apply_overrides, parse_job_spec
from nodeagent.training.models import MODELS
from nodeagent.training.splits import SPLIT_MEANINGS, SPLIT_OPTIONS
from nodeagent.training.tasks import DATASET_MEANINGS, DATASET_OPTIONS

Schema = dict[str, Any]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
DOC_PATH = "docs/jobs.md"
REGENERATE = "coordinator schema --markdown > docs/jobs.md"

# The sections whose options depend on a choice: (section, field naming the choice, field of its options, the
# heading of the reference that lists the choices).
_ALGORITHMS = ("AlgorithmSpec", "name", "options", "Algorithms")
_TOPOLOGIES = ("TopologySpec", "kind", "options", "Topology kinds")
_SPLITS = ("DataSpec", "split", "split_options", "Data splits")
_DATASETS = ("DataSpec", "dataset", "options", "Datasets")
_CHOICES = (_ALGORITHMS, _TOPOLOGIES, _SPLITS, _DATASETS)

# An edge-list job file may name its edge file instead of giving the edges; the command line that loads it reads
# the file and sends its text as `edges` (nodeagent.jobspec.load_job_file).
_EDGE_FILE_OPTION: Schema = {
    "type": "string",
    "description": "the edge file, relative to the job file's directory; the command line reads it and sends its "
    "text as edges (give edges or path)",
}

INTRODUCTION = f"""\
# Job files

A job is a YAML file that `coordinator submit JOB.yaml` sends to the coordinator (`coordinator simulate JOB.yaml`
runs it on a virtual clock instead). It says how many nodes train which model on which data, with which algorithm,
over which communication graph. Every field has a default, so a job file names only what it changes; unknown
fields are refused, and an error names the field that is wrong.

- `coordinator init [ALGORITHM] --out JOB.yaml` writes a job file with every field, its default and its meaning as a
  comment, and the algorithm's own options;
- `coordinator validate JOB.yaml` checks a job file as the coordinator would (schema, algorithm, options, topology)
  without submitting it; `coordinator inspect JOB.yaml` also shows its graph and each node's data shard;
- `--set PATH=VALUE` on `submit`, `simulate`, `validate`, `inspect` and `init` changes one field without another
  file: `coordinator simulate job.yaml --set algorithm.lr=0.05 --set nodes=16`. PATH is the field's dotted path as
  in the tables below (`algorithm.options.outer_lr`, `simulation.network.latency_s`), VALUE is read as YAML (`0.05`,
  `true`, `ring`, `[1, 2]`, `{{min: 2, max: 8}}`), and the job is checked as if the file said it: a path that names
  no field, or a value of the wrong type, is refused naming the field;
- `coordinator schema > job.schema.json` writes the JSON Schema of a job file, for editors that complete and check
  YAML against a schema (VS Code's YAML extension reads a first line `# yaml-language-server: $schema=job.schema.json`).

Examples: [deploy/jobs/demo.yaml](../deploy/jobs/demo.yaml) (DSGD on a ring, the container demo) and
[deploy/jobs/ecl-multiplex-ring.yaml](../deploy/jobs/ecl-multiplex-ring.yaml) (the ECL-ISVR comparison of
[results.md](results.md)). What a job may not ask of the machines (import paths, sizes) is in
[operations.md](operations.md), "What a job may ask for".

A language model is a job with `task: language-model`, the `gpt` model and `text` or `tokens` data; its nodes
report the validation loss and perplexity where a classifier's report test accuracy:

```yaml
task: language-model
model: {{name: gpt, options: {{layers: 2, heads: 4, width: 128}}}}
data:
  dataset: text
  data_dir: /srv/corpus            # UTF-8 text files (or one file); bytes are the tokens
  options: {{sequence_length: 64}}
  split: by-file                   # each node its own documents; iid: every node a share of every file
  batch_size: 16
algorithm: {{name: diloco, lr: 0.001, options: {{inner_steps: 100}}}}
```

This file is generated from the schema: `{REGENERATE}` writes it again.
"""


# ----------------------------------------------------------------------------------------------------
# The JSON Schema


def job_schema() -> Schema:
    """The JSON Schema (draft 2020-12) of a job file, with every algorithm's, topology kind's and split's options."""
    schema = JobSpec.model_json_schema()
    defs: Schema = schema["$defs"]
    _add_factory_defaults(JobSpec, schema)
    for model in _section_models():
        _add_factory_defaults(model, defs[model.__name__])
    choices = {
        _ALGORITHMS: {
            name: (cls.__doc__ or "", cls.Options, list(cls.modes)) for name, cls in sorted(REGISTRY.items())
        },
        _TOPOLOGIES: {kind: (KIND_MEANINGS[kind], kind_options(kind), None) for kind in KINDS + DYNAMIC_KINDS},
        _SPLITS: {split: (SPLIT_MEANINGS[split], SPLIT_OPTIONS[split], None) for split in SPLIT_OPTIONS},
        _DATASETS: {kind: (DATASET_MEANINGS[kind], DATASET_OPTIONS[kind], None) for kind in DATASET_OPTIONS},
    }
    for (section, field, options_field, _heading), entries in choices.items():
        target = defs[section]
        target["properties"][field]["enum"] = list(entries)
        default = target["properties"][field]["default"]
        branches = []
        for name, (meaning, options_model, modes) in entries.items():
            options_schema = _edge_list_options() if options_model is EdgeListOptions else _options_ref(
                options_model, defs)
            then: Schema = {"description": " ".join(meaning.split()), "properties": {options_field: options_schema}}
            if any(option.is_required() for option in options_model.model_fields.values()):
                then["required"] = [options_field]  # left out, the options would be {}, which lacks them
            if modes is not None:
                then["properties"]["mode"] = {"enum": [*modes, None], "default": modes[0]}
            condition: Schema = {"properties": {field: {"const": name}}}
            if name != default:  # the default's branch also applies when the field is left out
                condition["required"] = [field]
            branches.append({"if": condition, "then": then})
        target["allOf"] = target.get("allOf", []) + branches  # a section may hold two choices (data)
    _drop_titles(schema)
    return {"$schema": JSON_SCHEMA_DIALECT, "title": "peertrain job file", **schema}


def _section_models() -> list[type[BaseModel]]:
    """Every model a job is made of, below JobSpec (those of lists included)."""
    found: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in found:
            found.append(annotation)
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for argument in get_args(annotation):
            visit(argument)

    for field in JobSpec.model_fields.values():
        visit(field.annotation)
    return found


def _add_factory_defaults(model: type[BaseModel], schema: Schema) -> None:
    """pydantic leaves out the default of a field with a default factory; a list's or mapping's ([] or {}) is
    worth saying. A section's (a model) is its own fields' defaults."""
    for name, field in model.model_fields.items():
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            if not isinstance(value, BaseModel):
                schema["properties"][name]["default"] = value


def _options_ref(model: type[BaseModel], defs: Schema) -> Schema:
    """A reference to the options model's schema in `defs`, added there once."""
    if model.__name__ not in defs:
        defs[model.__name__] = model.model_json_schema()
    return {"$ref": f"#/$defs/{model.__name__}"}


def _edge_list_options() -> Schema:
    """The edge-list kind's options as a job file may write them: the edges, or the edge file that holds them."""
    schema = EdgeListOptions.model_json_schema()
    schema["properties"]["path"] = _EDGE_FILE_OPTION
    del schema["required"]
    schema["oneOf"] = [{"required": ["edges"]}, {"required": ["path"]}]
    return schema


def _drop_titles(node: Any) -> None:
    """pydantic's titles repeat the names ("Step Time S", "AlgorithmSpec"); editors show the descriptions."""
    if isinstance(node, dict):
        if isinstance(node.get("title"), str):
            del node["title"]
        for value in node.values():
            _drop_titles(value)
    elif isinstance(node, list):
        for value in node:
            _drop_titles(value)


def schema_json() -> str:
    return json.dumps(job_schema(), indent=2) + "\n"


# ----------------------------------------------------------------------------------------------------
# The reference (docs/jobs.md)


def markdown_reference() -> str:
    """docs/jobs.md: the introduction, then every field of every section, every algorithm, topology kind and split
    with its options, all read from `job_schema()`."""
    schema = job_schema()
    defs = schema["$defs"]
    lines = [INTRODUCTION, "## Fields", ""]
    _section_markdown(lines, "", "JobSpec", schema, defs)
    for section, field, options_field, heading in _CHOICES:
        lines += [f"## {heading}", ""]
        for branch in _branches(defs, section, field):
            name = branch["if"]["properties"][field]["const"]
            then = branch["then"]
            meaning = then["description"]
            lines += [f"### `{name}`", "", meaning[:1].upper() + meaning[1:].removesuffix(".") + ".", ""]
            if "mode" in then["properties"]:
                modes = [mode for mode in then["properties"]["mode"]["enum"] if mode is not None]
                lines += [f"Modes: {', '.join(f'`{mode}`' for mode in modes)} (default `{modes[0]}`).", ""]
            options = _resolve(then["properties"][options_field], defs)
            if options["properties"]:
                lines += _table("option", options, defs, "")
            else:
                lines += ["No options.", ""]
    lines += _models_markdown()
    return "\n".join(lines).rstrip("\n") + "\n"


# The factory's arguments that come from the data, never from model.options (nodeagent.training.models).
_FROM_THE_DATA = ("input_shape", "num_classes")


def _models_markdown() -> list[str]:
    """The registered models: each factory's description (its docstring) and its options (its keyword arguments,
    with their defaults)."""
    lines = ["## Models", "", "`model.options` are the keyword arguments of the model's factory; the input shape and "
             "the class count (a language model's sequence length and vocabulary) come from the data.", ""]
    for name, factory in MODELS.items():
        lines += [f"### `{name}`", "", " ".join(inspect.getdoc(factory).split()), ""]  # type: ignore[union-attr]
        options = [p for p in inspect.signature(factory).parameters.values() if p.name not in _FROM_THE_DATA]
        if options:
            lines += ["| option | default |", "|---|---|"]
            defaults = [list(p.default) if isinstance(p.default, tuple) else p.default for p in options]
            lines += [f"| `{p.name}` | `{_yaml_value(value)}` |" for p, value in zip(options, defaults, strict=True)]
            lines.append("")
        else:
            lines += ["No options.", ""]
    return lines


def _section_markdown(lines: list[str], path: str, section: str, schema: Schema, defs: Schema) -> None:
    """The table of one section's fields, then each of its subsections (a section or a list of them)."""
    lines += [f"### `{path}`" if path else "### Top level", ""]
    if path:
        lines += [schema.get("description", ""), ""]
    lines += _table("field", schema, defs, section)
    for name, prop in schema["properties"].items():
        full = f"{path}.{name}" if path else name
        if "$ref" in prop:
            _section_markdown(lines, full, _ref_name(prop), defs[_ref_name(prop)], defs)
        elif prop.get("type") == "array" and "$ref" in prop["items"]:
            _section_markdown(lines, f"{full}[]", _ref_name(prop["items"]), defs[_ref_name(prop["items"])], defs)
        # A value or a section (nodes: a number or {min, max}), or an optional section (algorithm.robust).
        for form in (*prop.get("oneOf", ()), *prop.get("anyOf", ())):
            if "$ref" in form:
                _section_markdown(lines, full, _ref_name(form), defs[_ref_name(form)], defs)


def _table(first: str, schema: Schema, defs: Schema, section: str) -> list[str]:
    rows = [f"| {first} | type | default | meaning |", "|---|---|---|---|"]
    required = schema.get("required", ())
    for name, prop in schema["properties"].items():
        rows.append(f"| `{name}` | {_type_text(prop, section, name)} | {_default_text(prop, name in required)} | "
                    f"{_escape(prop.get('description', ''))} |")
    return [*rows, ""]


def _type_text(prop: Schema, section: str = "", name: str = "") -> str:
    for choice_section, field, options_field, heading in _CHOICES:
        anchor = heading.lower().replace(" ", "-")
        if section == choice_section and name == field:
            return f"string, one of the [{heading.lower()}](#{anchor})"
        if section == choice_section and name == options_field:
            return f"mapping, see [{heading.lower()}](#{anchor})"
    if "$ref" in prop:
        return "section, below"
    if "anyOf" in prop:
        kinds = [_type_text(option) for option in prop["anyOf"] if option.get("type") != "null"]
        return " or ".join(kinds) + (" or null" if len(kinds) < len(prop["anyOf"]) else "")
    if "oneOf" in prop:
        return " or ".join(_type_text(option) for option in prop["oneOf"])
    if "enum" in prop:
        return "one of " + ", ".join(f"`{value}`" for value in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        items = prop["items"]
        return "list of sections, below" if "$ref" in items else f"list of {_type_text(items)}"
    if kind == "object":
        values = prop.get("additionalProperties", True)
        return f"mapping to {_type_text(values)}" if isinstance(values, dict) else "mapping"
    bounds = [f"{sign} {prop[key]}" for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                      ("maximum", "<="), ("exclusiveMaximum", "<")) if key in prop]
    if "maxLength" in prop:
        bounds.append(f"at most {prop['maxLength']} characters")
    if "pattern" in prop:
        bounds.append(f"matching `{prop['pattern']}`")
    return ", ".join([kind, *bounds])


def _default_text(prop: Schema, required: bool) -> str:
    if "default" in prop:
        return f"`{_yaml_value(prop['default'])}`"
    if "$ref" in prop:
        return "see below"
    return "required" if required else "-"


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _ref_name(prop: Schema) -> str:
    return prop["$ref"].removeprefix("#/$defs/")


def _resolve(prop: Schema, defs: Schema) -> Schema:
    return defs[_ref_name(prop)] if "$ref" in prop else prop


def _yaml_value(value: Any) -> str:
    """`value` as YAML writes it on one line (null, true, 0.02, [], {})."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).removesuffix("\n...\n").strip()


# ----------------------------------------------------------------------------------------------------
# The commented job file (coordinator init)


def commented_job(algorithm: str, overrides: Sequence[Override] = ()) -> str:
    """A job file for `algorithm` with every field at its default, each under a comment giving its meaning, and
    the algorithm's own options at their defaults; `overrides` (`--set PATH=VALUE`) replace defaults, checked as a
    job file's fields are. ValueError names the algorithms if it is not one; JobSpecError the override that does not
    fit."""
    from coordinator.jobs import validate_job

    if algorithm not in REGISTRY:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(REGISTRY))}")
    if any(override.path == ("algorithm", "name") for override in overrides):
        raise JobSpecError("--set algorithm.name: name the algorithm as `coordinator init ALGORITHM`")
    schema = job_schema()
    defs = schema["$defs"]
    cls = REGISTRY[algorithm]
    values = JobSpec(name=algorithm, algorithm=AlgorithmSpec(name=algorithm)).model_dump(mode="json")
    values["algorithm"]["options"] = cls.Options().model_dump(mode="json", by_alias=True)
    if overrides:
        apply_overrides(values, overrides)
        try:
            validate_job(parse_job_spec(values))
        except JobSpecError as error:
            given = ", ".join(f"--set {override}" for override in overrides)
            raise JobSpecError(f"{error} (with {given})") from None
    header = (f"A peertrain job: {algorithm}. {cls.__doc__ or ''} Written by `coordinator init` with every field "
              "at its default; docs/jobs.md explains each field, every algorithm, topology kind and split. Delete "
              "what you do not change.")
    lines = [f"# {line}" for line in textwrap.wrap(" ".join(header.split()), 116)] + [""]
    _commented_mapping(lines, schema, values, defs, "JobSpec", 0)
    return "\n".join(lines) + "\n"


def _commented_mapping(lines: list[str], schema: Schema, values: dict[str, Any], defs: Schema, section: str,
                       indent: int) -> None:
    pad = " " * indent
    for name, prop in schema["properties"].items():
        comment = " ".join(prop.get("description", "").split())
        if prop.get("type") == "array" and "$ref" in prop["items"]:
            comment += f"; each item: {', '.join(defs[_ref_name(prop['items'])]['properties'])}"
        lines += [f"{pad}# {line}" for line in textwrap.wrap(comment, 116 - indent)]
        value = values[name]
        if "$ref" in prop:
            lines.append(f"{pad}{name}:")
            _commented_mapping(lines, defs[_ref_name(prop)], value, defs, _ref_name(prop), indent + 2)
        elif section == _ALGORITHMS[0] and name == _ALGORITHMS[2] and value:
            lines.append(f"{pad}{name}:")
            options = _resolve(_branch(defs, _ALGORITHMS, values[_ALGORITHMS[1]])["properties"][name], defs)
            _commented_mapping(lines, options, value, defs, "", indent + 2)
        else:
            lines.append(f"{pad}{name}: {_yaml_value(value)}")


def _branch(defs: Schema, choice: tuple[str, str, str, str], name: str) -> Schema:
    """The `then` of the choice called `name`."""
    section, field, _options, _heading = choice
    return next(branch["then"] for branch in _branches(defs, section, field)
                if branch["if"]["properties"][field]["const"] == name)


def _branches(defs: Schema, section: str, field: str) -> list[Schema]:
    """The `if`/`then` branches of the choice that `field` of `section` makes (data holds two: dataset, split)."""
    return [branch for branch in defs[section]["allOf"] if field in branch["if"]["properties"]]
