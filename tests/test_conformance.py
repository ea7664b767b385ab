"""What every registered algorithm owes its users, checked over the registry so that a new algorithm is covered
without editing this file: a small job trains in the simulator, every job its constructor would refuse is refused
at validation already (before any agent sees it), and a refused option names its field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from datafiles import FASHION_MNIST

from coordinator.jobs import plan_node, validate_job
from coordinator.simulate import simulate
from coordinator.topology import build_topology
from nodeagent.algorithms import REGISTRY, Algorithm, Family, NodeContext, build_server
from nodeagent.jobspec import JobSpec, JobSpecError, parse_job_spec
from nodeagent.runtime.progress import read_run_log
from nodeagent.training.models import initial_model

pytestmark = pytest.mark.unit

ALGORITHMS = sorted(REGISTRY)
# A topology each algorithm accepts: AD-PSGD's bipartite kind, SGP's time-varying one, a ring otherwise.
TOPOLOGY = {"ad-psgd": "bipartite-exponential", "sgp": "dynamic-exponential", "osgp": "dynamic-exponential"}
# A DiLoCo job ends on an outer round: one of its default 100 inner steps.
STEPS = {"diloco": 100, "diloco-gossip": 100, "diloco-ps": 100}
# Values of the wrong type or out of range for most options (a Literal option's own values are tried too).
HOSTILE_VALUES: tuple[Any, ...] = (-1, 0, 1.5, 1e9, math.inf, True, "x", None)


def job(name: str, fashion_mnist_dir: Path | None = None, **algorithm: Any) -> dict:
    """A 4-node job of `name` on a few hundred samples (the data directory matters only to jobs that run)."""
    data: dict[str, Any] = {"split": "iid", "batch_size": 20, "train_limit": 400, "test_limit": 300}
    if fashion_mnist_dir is not None:
        data["data_dir"] = str(fashion_mnist_dir)
    return {
        "name": "conformance", "nodes": 4, "steps": STEPS.get(name, 30), "eval_every": STEPS.get(name, 30), "seed": 3,
        "algorithm": {"name": name, "lr": 0.05, "interval": 4, **algorithm},
        "model": {"name": "logistic"}, "data": data,
        "topology": {"kind": TOPOLOGY.get(name, "ring")},
    }


# -- every algorithm trains -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_trains_a_small_job_in_the_simulator(name, fashion_mnist_dir, tmp_path, device):
    spec = parse_job_spec(job(name, fashion_mnist_dir))
    result = simulate(spec, run_dir=tmp_path, device=device)
    start = {r.rank: r.test_accuracy for r in read_run_log(tmp_path) if r.step == 0 and not math.isnan(r.test_accuracy)}
    assert sorted(start) == [0, 1, 2, 3], "every node is evaluated at its initial model"
    for progress in result.progress:
        assert progress.finished and progress.step == spec.steps
        assert progress.test_accuracy > start[progress.rank] + 0.2, (
            f"rank {progress.rank}: {start[progress.rank]:.3f} at step 0, {progress.test_accuracy:.3f} at the end"
        )


# -- every algorithm trains a language model ---------------------------------------------------------------------

# A few kilobytes of text in 4 files (documents), with structure a tiny model picks up in a few steps.
WORDS = ("the node sends its model to the peer", "a step of gradient descent lowers the loss",
         "every worker trains on its own documents", "the server averages what the workers push")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("text")
    for index, sentence in enumerate(WORDS):
        (directory / f"doc{index}.txt").write_text("".join(f"{sentence}, line {line}.\n" for line in range(60)))
    return directory


# The inner optimiser of the DiLoCo family is AdamW, at a step size of its own; an outer round every 10 steps.
LANGUAGE_MODEL_ALGORITHM = {
    name: {"lr": 0.003, "options": {"inner_steps": 10}} for name in ("diloco", "diloco-gossip", "diloco-ps")
}


def language_model_job(name: str, text_dir: Path) -> dict:
    """A 4-node job of `name` training a tiny GPT on the text files, iid (the asynchronous parameter server's
    stale pushes over 4 nodes of their own documents each need more than 20 steps)."""
    return {
        "name": "conformance-lm", "task": "language-model", "nodes": 4, "steps": 20, "eval_every": 20, "seed": 3,
        "algorithm": {"name": name, "lr": 0.3, "interval": 2, **LANGUAGE_MODEL_ALGORITHM.get(name, {})},
        "model": {"name": "gpt", "options": {"layers": 1, "heads": 2, "width": 32}},
        "data": {"dataset": "text", "data_dir": str(text_dir), "split": "iid", "batch_size": 8,
                 "options": {"sequence_length": 16}, "test_limit": 64},
        "topology": {"kind": TOPOLOGY.get(name, "ring")},
    }


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_trains_a_tiny_language_model_in_the_simulator(name, text_dir, tmp_path, device):
    spec = parse_job_spec(language_model_job(name, text_dir))
    validate_job(spec)
    result = simulate(spec, run_dir=tmp_path, device=device)
    records = read_run_log(tmp_path)
    start = {r.rank: r.test_loss for r in records if r.step == 0 and not math.isnan(r.test_loss)}
    assert sorted(start) == [0, 1, 2, 3], "every node is evaluated at its initial model"
    for progress in result.progress:
        assert progress.finished and progress.step == spec.steps
        assert progress.test_loss < start[progress.rank] - 1.0, (
            f"rank {progress.rank}: validation loss {start[progress.rank]:.3f} at step 0, {progress.test_loss:.3f} "
            "at the end")
        assert progress.test_perplexity == pytest.approx(math.exp(progress.test_loss))
        assert math.isnan(progress.test_accuracy), "a language model has no accuracy"


# -- every constructor refusal is a validation refusal ----------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A change to the job's algorithm section that the algorithm may refuse."""

    description: str
    algorithm: dict[str, Any]
    prefix: str  # what a refusal's message must start with: the field it names
    options: frozenset[str] = frozenset()  # the declared options it sets


def option_values(annotation: Any) -> tuple[Any, ...]:
    """The values a Literal option allows (some are refused only with other settings: eta 'optimal')."""
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def variants(cls: type[Algorithm]) -> list[Variant]:
    found = [Variant(f"mode {mode}", {"mode": mode}, "algorithm.mode") for mode in ("async", "sync")]
    found += [
        Variant("momentum 0.9", {"momentum": 0.9}, "algorithm.momentum"),
        Variant("nesterov with momentum 0.9", {"momentum": 0.9, "nesterov": True}, "algorithm."),
        Variant("interval 1", {"interval": 1}, "algorithm."),
        Variant("an unknown option", {"options": {"bogus": 1}}, "algorithm.options.bogus"),
    ]
    for name, option in cls.Options.model_fields.items():
        key = option.alias or name
        for value in (*HOSTILE_VALUES, *option_values(option.annotation)):
            found.append(Variant(f"{key}={value!r}", {"options": {key: value}}, f"algorithm.options.{key}",
                                 frozenset({key})))
            # With an exchange after every step too: refusals that depend on the interval (eta 'optimal').
            found.append(Variant(f"{key}={value!r} with interval 1", {"interval": 1, "options": {key: value}},
                                 "algorithm.", frozenset({key})))
    return found


def construct(spec: JobSpec) -> None:
    """Build every node's algorithm of `spec` as the runtimes do (planned by the coordinator's rules, the seeded
    initial model) and, for the parameter-server family, the server; no data is loaded."""
    cls = REGISTRY[spec.algorithm.name]
    info = FASHION_MNIST
    topology = build_topology(spec.topology, spec.nodes)
    for rank in range(spec.nodes):
        plan = plan_node(spec, topology, rank)
        context = NodeContext(
            rank=rank, world_size=spec.nodes, neighbors=plan.neighbors, spec=spec.algorithm,
            self_weight=plan.self_weight, seed=spec.seed, peer_schedule=plan.peer_schedule,
        )
        cls(initial_model(spec, info), context)
    if cls.family is Family.SERVER:
        build_server(spec, info)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_job_the_constructor_refuses_is_refused_at_validation(name):
    baseline = parse_job_spec(job(name))
    validate_job(baseline)
    construct(baseline)  # the harness builds an accepted job: the refusals below are the variants'
    refused: list[Variant] = []
    accepted_by_validation: list[str] = []
    misnamed: list[str] = []
    for variant in variants(REGISTRY[name]):
        spec = parse_job_spec(job(name, **variant.algorithm))
        try:
            construct(spec)
        except Exception as error:  # any error, not only ValueError: a crash on an accepted job is a late refusal
            refused.append(variant)
            try:
                validate_job(spec)
            except JobSpecError as validation:
                if not str(validation).startswith(variant.prefix):
                    misnamed.append(f"{variant.description}: {validation}")
            else:
                accepted_by_validation.append(f"{variant.description}: {type(error).__name__}: {error}")
    assert accepted_by_validation == [], "the constructor refused jobs that validate_job accepted"
    assert misnamed == [], f"refusals that do not start with the field ({name})"
    assert refused, "no variant was refused: the generation is vacuous"
    if REGISTRY[name].Options.model_fields:
        assert any(variant.options for variant in refused), "no value of any declared option was refused"


def test_eta_optimal_with_an_exchange_every_step_is_refused_by_both():
    for name in ("pdmm-isvr", "admm-isvr"):
        spec = parse_job_spec(job(name, interval=1, options={"eta": "optimal"}))
        with pytest.raises(ValueError, match="eta"):
            construct(spec)
        with pytest.raises(JobSpecError, match=r"^algorithm\.options\.eta:"):
            validate_job(spec)


# -- option errors name their field -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_unknown_option_is_refused_naming_it(name):
    spec = parse_job_spec(job(name, options={"bogus": 1}))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(spec)
    assert str(refusal.value).startswith("algorithm.options.bogus:"), str(refusal.value)
