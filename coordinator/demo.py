"""`coordinator demo`: a local cluster trains one job on the real data and prints the result."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import yaml

from coordinator.cli import format_status
from coordinator.cluster import ClusterError, LocalCluster, mean_accuracy
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import JobSpecError, parse_job_spec
from nodeagent.training.data import DataError, load_dataset


def demo_job(args: argparse.Namespace) -> dict:
    return {
        "name": "demo",
        "nodes": args.agents,
        "steps": args.steps,
        "eval_every": max(1, args.steps // 6),
        "seed": 0,
        "algorithm": {"name": args.algorithm, "mode": "async", "lr": args.lr, "interval": 8},
        "model": {"name": args.model},
        "data": {"dataset": "fashion-mnist", "data_dir": str(Path(args.data_dir).resolve()), "split": args.split,
                 "batch_size": 100},
        "topology": {"kind": args.topology, "seed": 1},
    }


class Progress:
    """One status line, rewritten in place on a terminal and printed every few seconds otherwise."""

    def __init__(self, steps: int):
        self.steps = steps
        self.started = time.monotonic()
        self.last_print = 0.0
        self.tty = sys.stdout.isatty()

    def __call__(self, status: pb.JobStatusReply) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_print < 5 and status.state == pb.JOB_RUNNING:
            return
        self.last_print = now
        steps = [n.step for n in status.nodes] or [0]
        state = pb.JobState.Name(status.state).removeprefix("JOB_").lower()
        accuracy = mean_accuracy(status)
        line = (
            f"[{now - self.started:5.0f} s] {state:<8} steps {min(steps)}..{max(steps)} of {self.steps}"
            f"  mean test accuracy {'-' if math.isnan(accuracy) else f'{accuracy:.4f}'}"
        )
        print(f"\r{line}   " if self.tty else line, end="" if self.tty else "\n", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    try:
        load_dataset("fashion-mnist", args.data_dir, "test", limit=1)
        spec = parse_job_spec(demo_job(args))
    except DataError as error:
        print(f"coordinator demo: {error}", file=sys.stderr)
        return 1
    except JobSpecError as error:
        print(f"coordinator demo: {error}", file=sys.stderr)
        return 1
    root = (args.runs / f"demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    print(
        f"peertrain demo: {spec.nodes} agents on loopback train {spec.algorithm.name} ({spec.model.name}) on the "
        f"{spec.data.split} split of Fashion-MNIST over a {spec.topology.kind} topology, {spec.steps} steps each.\n"
        f"Run directory: {root}"
    )
    cluster = LocalCluster(root=root, agents=spec.nodes, data_dir=str(Path(args.data_dir).resolve()))
    try:
        cluster.start()
        print(f"coordinator at {cluster.address}; {spec.nodes} agents registered")
        job_id = cluster.submit(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        status = cluster.wait(job_id, args.timeout, Progress(spec.steps))
        print()
    except ClusterError as error:
        print(f"\ncoordinator demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the cluster", file=sys.stderr)
        return 130
    finally:
        cluster.stop()
    print(format_status(status))
    print(f"metrics log: {status.run_dir}/metrics.jsonl; process logs: {root}/logs")
    return 0 if status.state == pb.JOB_FINISHED else 1
