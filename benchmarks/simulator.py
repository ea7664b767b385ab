"""Simulator overhead: node steps per second with 256 logistic nodes against bare local steps of the same model.

The bare step is what one node would do alone: fetch a minibatch, forward, backward, SGD update (torch.optim).
The simulated step is the whole simulator's work per node step: the algorithm (DSGD, asynchronous, on a
multiplex ring), its messages, the event queue, the network model and the evaluations at the start and the end.
Target: at least 0.5x the bare rate (overhead at most 2x).

    .venv/bin/python benchmarks/simulator.py [--nodes 256] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from coordinator.simulate import build_nodes
from nodeagent.jobspec import DEFAULT_DATA_DIR, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.data import load_dataset
from nodeagent.training.loop import BatchStream
from nodeagent.training.models import build_model
from nodeagent.training.splits import split_indices

TARGET_RATIO = 0.5


def bare_rate(spec, steps: int) -> float:
    """Local SGD steps per second of one node, nothing else."""
    train = load_dataset(spec.data.dataset, spec.data.data_dir, "train")
    shard = split_indices(train.labels.numpy(), spec.nodes, spec.data.split, spec.seed)[0]
    batches = BatchStream(train, shard, spec.data.batch_size, seed=0)
    torch.manual_seed(0)
    model = build_model(spec.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.algorithm.lr)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(50):  # warm-up
        inputs, targets = batches.next()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    started = time.perf_counter()
    for _ in range(steps):
        inputs, targets = batches.next()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="local steps per node")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = parse_job_spec({
        "name": "simbench", "nodes": args.nodes, "steps": args.steps, "eval_every": args.steps,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 8},
        "model": {"name": "logistic"},
        "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": 100, "test_limit": 500},
        "topology": {"kind": "multiplex-ring", "seed": 1},
        "simulation": {"step_time_s": 0.01, "jitter": 0.1},
    })
    bare = bare_rate(spec, steps=2000)
    built = time.perf_counter()
    nodes = build_nodes(spec)
    build_s = time.perf_counter() - built
    mesh = VirtualMesh(nodes, spec.name, spec.simulation, Metrics())
    started = time.perf_counter()
    mesh.run()
    run_s = time.perf_counter() - started
    assert mesh.finished
    node_steps = args.nodes * args.steps
    simulated = node_steps / run_s
    ratio = simulated / bare
    print(f"bare local step (logistic, batch 100):        {bare:9.0f} steps/s")
    print(f"simulator, {args.nodes} nodes x {args.steps} steps (DSGD):  {simulated:9.0f} node steps/s "
          f"({run_s:.2f} s; building the nodes took {build_s:.2f} s more)")
    print(f"ratio simulator / bare: {ratio:.2f} (target >= {TARGET_RATIO}: "
          f"{'met' if ratio >= TARGET_RATIO else 'not met'}); virtual time {mesh.now:.2f} s")


if __name__ == "__main__":
    main()
