"""Streaming DiLoCo's overlap on agents (issue 24): do the inner steps go on while a fragment is all-reduced?

Starts a local cluster (a coordinator and `--agents` agents, processes on loopback, mutual TLS, gloo), warms the
agents with one short job, then runs the same seeded DiLoCo job (logistic, Fashion-MNIST, inner AdamW) three ways: -
no sync but the last: H = the job's steps (the step time without any all-reduce); - streaming, F fragments, no
overlap (tau = 0): each fragment's step waits for its all-reduce; - streaming, F fragments, each sync overlapped
with tau inner steps. It reports per node the wall time per step (the job's elapsed time over its steps), and the
time the node waited (the driver's wait: from the end of a step until the node was ready again), mean over the
nodes, median over `--repeats` runs of each job taken in turn. With the overlap the all-reduce runs on its own
thread while the node steps: its wait should be near zero. The target is on the steps taken while a fragment is
all-reduced: their wall time within 20% of a step without a sync. They are not timed one by one; their mean is
estimated from the job's time less its other steps at the first run's rate:
    during = (steps x per_step - (steps - s) x reference) / s,
s the steps taken during a sync (syncs x tau; without an overlap, the syncs themselves: one step each waits).

    .venv/bin/python benchmarks/overlap.py [--agents 4] [--steps 400] [--inner-steps 40] [--fragments 4] [--overlap 4]
                                           [--model logistic] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import yaml

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import DEFAULT_DATA_DIR

TARGET = 1.2


def job_yaml(args: argparse.Namespace, name: str, inner_steps: int, fragments: int, overlap: int) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": args.agents, "steps": args.steps, "eval_every": args.steps, "seed": 4,
        "algorithm": {"name": "diloco", "lr": 1e-3, "options": {
            "inner_steps": inner_steps, "fragments": fragments, "overlap_steps": overlap}},
        "model": {"name": args.model},
        "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": 32, "test_limit": 500},
    })


def run(cluster: LocalCluster, spec: str, timeout_s: float) -> tuple[float, float]:
    """The job's mean wall time per step and mean wait per node, in seconds."""
    status = cluster.wait(cluster.submit(spec), timeout_s=timeout_s)
    if status.state != pb.JOB_FINISHED:
        raise RuntimeError(f"the job ended {pb.JobState.Name(status.state)}")
    nodes = status.nodes
    per_step = sum(node.elapsed_s / node.step for node in nodes) / len(nodes)
    waited = sum(node.wait_s for node in nodes) / len(nodes)
    return per_step, waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=4)
    parser.add_argument("--model", default="logistic")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each job, in turn; the median is reported")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    runs = [
        ("no sync but the last", args.steps, 1, 0),
        (f"F={args.fragments}, no overlap", args.inner_steps, args.fragments, 0),
        (f"F={args.fragments}, overlap {args.overlap}", args.inner_steps, args.fragments, args.overlap),
    ]
    with tempfile.TemporaryDirectory() as root, LocalCluster(root=Path(root), agents=args.agents,
                                                             data_dir=args.data_dir) as cluster:
        run(cluster, job_yaml(args, "warm", args.steps, 1, 0), args.timeout)  # the agents load their data
        timings: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in runs}
        for repeat in range(args.repeats):  # in turn, so that the machine's drift falls on every run alike
            for index, (label, h, f, tau) in enumerate(runs):
                timings[label].append(run(cluster, job_yaml(args, f"run{repeat}-{index}", h, f, tau), args.timeout))
        results = [(label, statistics.median(t[0] for t in timings[label]),
                    statistics.median(t[1] for t in timings[label])) for label, *_ in runs]
    reference = results[0][1]
    syncs = args.steps // args.inner_steps * args.fragments
    print(f"{args.agents} agents, {args.model}, {args.steps} steps, H = {args.inner_steps}, {syncs} fragment syncs")
    print(f"{'run':<24} {'ms/step':>8} {'vs no sync':>10} {'wait s/node':>11} {'ms/step during a sync':>22}")
    during = 0.0
    for (label, per_step, waited), (_, _, _, tau) in zip(results, runs, strict=True):
        print(f"{label:<24} {1000 * per_step:8.2f} {per_step / reference:9.2f}x {waited:11.2f}", end="")
        if label == runs[0][0]:
            print()
            continue
        taken = min(args.steps, syncs * max(tau, 1))
        during = (args.steps * per_step - (args.steps - taken) * reference) / taken
        print(f" {1000 * during:12.2f} ({during / reference:.2f}x)")
    print(f"steps during a sync, overlapped, within {TARGET - 1:.0%} of a step without one: "
          f"{'met' if during / reference <= TARGET else 'NOT met'} ({during / reference:.2f}x, estimated)")


if __name__ == "__main__":
    main()
