"""AdaComp against ASGD (docs/results.md): worker-to-server bytes for the same number of applied updates,
and the test accuracy of the server's model, on Fashion-MNIST with the cnn model.

Every run is the simulator (coordinator simulate: the same worker and server halves as real agents and the
coordinator) with 8 equally fast workers, batch 10 and the same step size; each worker pushes `--steps` updates,
so every run applies the same number of updates (the server's version counts them; AdaComp could reject pushes
older than its window, and the table shows the count). Bytes are the pushes' and pulls' payloads (the tensors'
bytes on the wire, as the agents' edge counters count them). "test acc" is the mean test accuracy (10,000 images) of
the server's model at ten points of the last 20% of the updates (one model is a noisy measure at batch 10), "final"
the last model's. Runs:
- ASGD: dense fp32 gradients, full model pulls;
- AdaComp as in the paper: rate 0.01, fp32 values (with the compact varint index encoding), no residual;
- AdaComp as configured for the target: rate 0.01, int8 values, residual accumulation (error feedback), and
  delta pulls (the entries changed since the worker's version) to show the downstream saving too.
Target: upstream bytes at least 150x below ASGD, accuracy at most 1 point below ASGD's.

    .venv/bin/python benchmarks/adacomp.py            # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from coordinator.simulate import build_nodes
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.ps.server import initial_parameters
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.data import load_dataset
from nodeagent.training.loop import evaluate

VARIANTS = {
    "ASGD": ("asgd", {}),
    "AdaComp (paper: fp32 values)": ("adacomp", {"rate": 0.01, "codec": "fp32"}),
    "AdaComp (int8, residual, delta pulls)": (
        "adacomp", {"rate": 0.01, "codec": "int8", "residual": True, "pull": "delta"}),
}


@dataclass(frozen=True)
class Outcome:
    label: str
    applied: int
    upstream: int
    downstream: int
    accuracy: float  # mean over the last 20% of the updates
    last: float  # the final model's
    virtual_s: float
    wall_s: float


def job(args: argparse.Namespace, algorithm: str, options: dict) -> JobSpec:
    return parse_job_spec({
        "name": f"adacomp-bench-{algorithm}", "nodes": args.workers, "steps": args.steps, "eval_every": 10**9,
        "seed": args.seed,
        "algorithm": {"name": algorithm, "lr": args.lr, "options": options},
        "model": {"name": "cnn"},
        "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": args.batch_size, "test_limit": 100},
        "simulation": {"step_time_s": 0.01},
    })


def run(args: argparse.Namespace, label: str) -> Outcome:
    torch.set_num_threads(1)
    algorithm, options = VARIANTS[label]
    spec = job(args, algorithm, options)
    started = time.monotonic()
    mesh = VirtualMesh(build_nodes(spec, args.data_dir), spec.name, spec.simulation, Metrics())
    server = mesh.server
    assert server is not None
    evaluator = initial_parameters(spec)
    test = load_dataset("fashion-mnist", args.data_dir, "test")
    total = args.workers * args.steps
    # One model at the end is a noisy measure with batch 10: average the test accuracy of the server's model at
    # ten points of the last 20% of the updates.
    marks = [round(total * (0.8 + 0.02 * i)) for i in range(1, 11)]
    accuracies: list[float] = []

    def sample(_mesh: VirtualMesh) -> None:
        if len(accuracies) < len(marks) and server.half.version >= marks[len(accuracies)]:
            evaluator.vector.copy_(server.half.w)
            accuracies.append(evaluate(evaluator.model, test).accuracy)

    mesh.run(on_event=sample)
    return Outcome(label, server.half.version, mesh.server.bytes_up, mesh.server.bytes_down,
                   sum(accuracies) / len(accuracies), accuracies[-1], mesh.now, time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=750, help="pushes per worker (default %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    print(f"{args.workers} workers, cnn on Fashion-MNIST, batch {args.batch_size}, lr {args.lr}, {args.steps} pushes "
          f"per worker ({args.workers * args.steps} updates), simulator; {args.jobs} runs at a time", flush=True)
    started = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(run, [args] * len(VARIANTS), VARIANTS))
    base = outcomes[0]
    print()
    print(f"{'run':<40} {'applied':>7} {'upstream MB':>12} {'vs ASGD':>8} {'B/push':>8} {'downstream MB':>14} "
          f"{'test acc':>8} {'final':>7} {'wall s':>7}")
    for o in outcomes:
        print(f"{o.label:<40} {o.applied:>7} {o.upstream / 1e6:>12.2f} {base.upstream / o.upstream:>7.1f}x "
              f"{o.upstream / o.applied:>8.0f} {o.downstream / 1e6:>14.2f} {o.accuracy:>8.4f} {o.last:>7.4f} "
              f"{o.wall_s:>7.0f}")
    best = outcomes[-1]
    ratio = base.upstream / best.upstream
    change = (best.accuracy - base.accuracy) * 100
    ok = ratio >= 150 and change >= -1.0 and best.applied == base.applied
    print(f"\ntarget: upstream >= 150x below ASGD at <= 1 point lost, same applied updates: {ratio:.1f}x, "
          f"accuracy {change:+.2f} points against ASGD, {best.applied} vs {base.applied} updates -> "
          f"{'MET' if ok else 'NOT MET'}")
    print(f"total wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
