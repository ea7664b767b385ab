"""Building many simulated nodes: one dataset, one split and one initial model per job, each node its own state."""

import copy
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import coordinator.cli as cli
import coordinator.simulate as simulate_module
import nodeagent.training.job as job_module
import nodeagent.training.tasks as tasks_module
from coordinator.jobs import plan_node, validate_job
from coordinator.simulate import build_nodes
from nodeagent.jobspec import parse_job_spec
from nodeagent.training.job import build_node, copy_model
from nodeagent.training.loop import evaluate
from nodeagent.training.models import cnn, logistic, mlp

pytestmark = pytest.mark.unit


def spec(fashion_mnist_dir, nodes=12, **model):
    return parse_job_spec({
        "name": "scale", "nodes": nodes, "steps": 4, "eval_every": 4,
        "algorithm": {"name": "dsgd", "lr": 0.05, "interval": 2},
        "model": model or {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 8, "train_limit": 1200,
                 "test_limit": 100},
        "topology": {"kind": "ring", "seed": 1},
    })


def counted(monkeypatch, name: str, module=tasks_module) -> list[int]:
    """Counts the calls of `name` (a function of the data layer) where `module` (the task's, or job.py) calls it."""
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("nodes", [3, 40])
def test_a_job_splits_its_data_and_builds_its_model_once_however_many_nodes(fashion_mnist_dir, monkeypatch, nodes):
    splits, loads = (counted(monkeypatch, name) for name in ("split_indices", "load_dataset"))
    models = counted(monkeypatch, "initial_model", job_module)
    built = build_nodes(spec(fashion_mnist_dir, nodes))
    assert len(built) == nodes
    assert (len(splits), len(models), len(loads)) == (1, 1, 2)  # loads: the training and the test set


def test_every_node_indexes_the_same_dataset_tensors(fashion_mnist_dir):
    nodes = build_nodes(spec(fashion_mnist_dir))
    train = {node.batches.dataset.samples.ctypes.data for node in nodes}
    test = {node.test_set.samples.ctypes.data for node in nodes}
    assert len(train) == 1 and len(test) == 1
    assert sum(node.shard_size for node in nodes) == 1200  # the shards are disjoint index sets into it


def test_every_node_starts_from_the_same_parameters_in_tensors_of_its_own(fashion_mnist_dir):
    nodes = build_nodes(spec(fashion_mnist_dir))
    first = nodes[0].algorithm.w.clone()
    assert all(torch.equal(node.algorithm.w, first) for node in nodes)
    storages = {p.untyped_storage().data_ptr() for node in nodes for p in node.algorithm.model.parameters()}
    assert len(storages) == len(nodes)  # a node's parameters are views of its own flat vector, no one else's
    # Training one node leaves the others where they started.
    inputs, targets = nodes[0].batches.next()
    nodes[0].algorithm.step(inputs, targets)
    assert not torch.equal(nodes[0].algorithm.w, first)
    assert all(torch.equal(node.algorithm.w, first) for node in nodes[1:])


def test_an_agents_node_is_the_simulators_node_and_leaves_the_same_random_state(fashion_mnist_dir):
    """An agent builds its one node with build_node; the simulator builds all from one JobData. Same parameters, same
    batches, and torch's global generator (dropout) left where a single node's build leaves it."""
    job = spec(fashion_mnist_dir, nodes=5, name="resnet-gn", options={"depth": 18, "width": 4})
    simulated = build_nodes(job)
    after_all = torch.get_rng_state()
    plan = plan_node(job, validate_job(job), 3)
    alone = build_node(job, 3, plan.neighbors, plan.self_weight, peer_schedule=plan.peer_schedule)
    assert torch.equal(torch.get_rng_state(), after_all)
    assert torch.equal(alone.algorithm.w, simulated[3].algorithm.w)
    for _ in range(3):
        (a_inputs, a_targets), (s_inputs, s_targets) = alone.batches.next(), simulated[3].batches.next()
        assert torch.equal(a_inputs, s_inputs) and torch.equal(a_targets, s_targets)


def test_the_initial_model_is_evaluated_once_for_all_nodes_as_each_would_be(fashion_mnist_dir, monkeypatch):
    nodes = build_nodes(spec(fashion_mnist_dir, nodes=20))
    expected = evaluate(nodes[7].algorithm.model, nodes[7].test_set)
    evaluations = counted(monkeypatch, "evaluate")
    assert all(node.evaluate() == expected for node in nodes)
    assert len(evaluations) == 1
    # Once a node has trained, it is evaluated on its own parameters.
    inputs, targets = nodes[0].batches.next()
    nodes[0].algorithm.step(inputs, targets)
    trained = nodes[0].evaluate()
    assert len(evaluations) == 2 and trained == evaluate(nodes[0].algorithm.model, nodes[0].test_set) != expected


def test_copy_model_copies_as_deepcopy_does_into_tensors_of_its_own():
    tied = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    hooked = nn.Linear(3, 2)
    hooked.register_forward_hook(lambda module, inputs, output: output * 2)  # not plain: deepcopy takes it
    for model in (logistic(), mlp(), cnn(), nn.BatchNorm1d(4), tied, hooked):
        copied = copy_model(model, torch.device("cpu"))
        reference = copy.deepcopy(model)
        assert type(copied) is type(model) and repr(copied) == repr(reference)
        ours, theirs, original = copied.state_dict(), reference.state_dict(), model.state_dict()
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            assert torch.equal(tensor, theirs[name]) and tensor.dtype == theirs[name].dtype
            assert tensor.data_ptr() != original[name].data_ptr()  # its own storage
        assert [p.requires_grad for p in copied.parameters()] == [p.requires_grad for p in model.parameters()]
    tied_copy = copy_model(tied, torch.device("cpu"))
    assert tied_copy[2].weight is tied_copy[0].weight  # tied weights stay tied, as deepcopy keeps them
    assert len(copy_model(hooked, torch.device("cpu"))._forward_hooks) == 1


def simulated_calls(job_file, nodes: int, runs, capsys) -> Counter:
    """Calls made by `coordinator simulate JOB --set nodes=N`, by call site: Python functions by their code, and
    functions of C called from the project's code by name and caller."""
    counts: Counter = Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call":
            counts[code.co_filename, code.co_firstlineno, code.co_name] += 1
        elif event == "c_call" and PROJECT in code.co_filename:
            counts[code.co_filename, code.co_name, getattr(arg, "__qualname__", "?")] += 1

    sys.setprofile(profile)
    try:
        assert cli.main(["simulate", str(job_file), "--set", f"nodes={nodes}", "--runs", str(runs)]) == 0
    finally:
        sys.setprofile(None)
    assert f"finished, {nodes} nodes" in capsys.readouterr().out
    return counts


PROJECT = str(Path(cli.__file__).resolve().parents[1])


def test_the_simulate_command_does_work_linear_in_the_nodes(fashion_mnist_dir, tmp_path, monkeypatch, capsys):
    """Issue 25: `coordinator simulate` of 10,000 nodes spent minutes in work that grew faster than the nodes. Counted,
    not timed: at 4 times the nodes no call site of the command's path (the job's reading, the nodes' building, the
    coordinator's rules in virtual time, the progress view, the logs, the final table) runs more than 4 times as
    often, give or take one call per node (a walk over the ring's n - 1 other ranks), where work of n^2 would run 16
    times as often."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({
        "name": "linear", "nodes": 4, "steps": 3, "eval_every": 3,
        "algorithm": {"name": "dsgd", "lr": 0.05, "interval": 1},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 4, "train_limit": 640,
                 "test_limit": 20},
        "topology": {"kind": "ring", "seed": 0},
    }))
    # The progress view updates once: its updates are paced by wall time, which a count must not depend on.
    paced = simulate_module.SimulationProgress
    monkeypatch.setattr(simulate_module, "SimulationProgress",
                        lambda view, task: paced(view, task, every_s=math.inf))
    small = simulated_calls(job_file, 4, tmp_path / "runs", capsys)
    large = simulated_calls(job_file, 16, tmp_path / "runs", capsys)
    node_steps = large[next(site for site in large if site[-1] == "step" and site[0].endswith("driver.py"))]
    assert node_steps == 16 * 3  # the count sees the nodes' work
    grown = {site: (small[site], calls) for site, calls in large.items() if calls > 4 * small[site] + 16}
    assert not grown, f"call sites that grew faster than the nodes (4 -> 16 nodes): {grown}"
