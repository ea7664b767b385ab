"""Streaming DiLoCo's overlap on agents (issue 24): do the inner steps go on while a fragment is all-reduced?

Starts a local cluster (a coordinator and `--agents` agents, processes on loopback, mutual TLS, gloo), warms the
agents with one short job, then runs the same seeded DiLoCo job (logistic, Fashion-MNIST, inner AdamW) three ways:
- no sync but the last: H = the job's steps (the step time without any all-reduce);
- streaming, F fragments, no overlap (tau = 0): each fragment's step waits for its all-reduce;
- streaming, F fragments, each sync overlapped with tau inner steps.
It reports per node the wall time per step (the job's elapsed time over its steps), and the time the node waited
(the driver's wait: from the end of a step until the node was ready again), mean over the nodes. With the overlap
the all-reduce runs on its own thread while the node steps: its wait should be near zero and its time per step
near the first run's (target: within 20%).

    .venv/bin/python benchmarks/overlap.py [--agents 4] [--steps 400] [--inner-steps 40] [--fragments 4] [--overlap 4]
"""

from __future__ import annotations

import argparse
import os
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
        results = [(label, *run(cluster, job_yaml(args, f"run{index}", h, f, tau), args.timeout))
                   for index, (label, h, f, tau) in enumerate(runs)]
    reference = results[0][1]
    print(f"{args.agents} agents, {args.model}, {args.steps} steps, H = {args.inner_steps}")
    print(f"{'run':<24} {'ms/step':>8} {'vs no sync':>10} {'wait s/node':>11}")
    for label, per_step, waited in results:
        print(f"{label:<24} {1000 * per_step:8.2f} {per_step / reference:9.2f}x {waited:11.2f}")
    overlapped = results[-1][1] / reference
    print(f"overlapped within {TARGET - 1:.0%} of no sync: {'met' if overlapped <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
