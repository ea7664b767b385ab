"""`coordinator demo`: a local cluster trains on the real data, one job per algorithm, and prints the results
beside the single-node reference (one node trained on all the data for the same number of steps); then writes the
report that compares them (coordinator.report) into the demo's directory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from coordinator.cluster import ClusterError, LocalCluster
from coordinator.display import mean_accuracy, progress_of, show_progress, status_text
from coordinator.jobs import validate_job
from coordinator.progress_view import ProgressView
from coordinator.report import ReportError, write_report
from coordinator.simulate import reference_spec, simulate
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import JobSpecError, parse_job_spec
from nodeagent.rpc import shown
from nodeagent.training.data import DataError, describe_dataset


def demo_job(args: argparse.Namespace, algorithm: str) -> dict:
    return {
        "name": f"demo-{algorithm}",
        "nodes": args.agents,
        "steps": args.steps,
        "eval_every": max(1, args.steps // 6),
        "seed": 0,
        "algorithm": {"name": algorithm, "lr": args.lr, "l2": args.l2, "interval": 8},
        "model": {"name": args.model},
        "data": {"dataset": "fashion-mnist", "data_dir": str(Path(args.data_dir).resolve()), "split": args.split,
                 "batch_size": 100},
        "topology": {"kind": args.topology, "seed": 1},
    }


def run_demo(args: argparse.Namespace) -> int:
    algorithms = [name.strip() for name in args.algorithms.split(",") if name.strip()]
    try:
        describe_dataset("fashion-mnist", args.data_dir)
        specs = [parse_job_spec(demo_job(args, algorithm)) for algorithm in algorithms]
        for spec in specs:
            validate_job(spec)
    except (DataError, JobSpecError) as error:
        print(f"coordinator demo: {error}", file=sys.stderr)
        return 1
    first = specs[0]
    root = (args.runs / f"demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    print(
        f"peertrain demo: {first.nodes} agents on loopback train {', '.join(algorithms)} ({first.model.name}) on "
        f"the {first.data.split} split of Fashion-MNIST over a {first.topology.kind} topology, {first.steps} steps "
        f"each, one job after the other.\nRun directory: {root}"
    )
    cluster = LocalCluster(root=root, agents=first.nodes, data_dir=str(Path(args.data_dir).resolve()))
    results: list[tuple[str, pb.JobStatusReply]] = []
    try:
        cluster.start()
        print(f"coordinator at {cluster.address}; {first.nodes} agents registered; every link under mutual TLS "
              f"(cluster CA in {cluster.root / 'coordinator' / 'ca'})")
        for spec in specs:
            print(f"\n== {spec.algorithm.name}")
            job_id = cluster.submit(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
            with ProgressView(spec.algorithm.name, spec.steps, spec.nodes) as view:
                status = cluster.wait(job_id, args.timeout, lambda status: show_progress(view, status))
            print(shown(status_text(status)))
            results.append((spec.algorithm.name, status))
            if status.state != pb.JOB_FINISHED:
                return 1
    except ClusterError as error:
        print(f"\ncoordinator demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the cluster", file=sys.stderr)
        return 130
    finally:
        cluster.stop()
    reference_dir = root / "reference"
    reference = simulate(reference_spec(first), reference_dir).mean_accuracy
    print(f"\nmean test accuracy after {first.steps} steps per node ({first.data.split} split: every node sees "
          f"only part of the classes)")
    print(f"  {'reference: one node on all the data':<40} {reference:.4f}")
    for algorithm, status in results:
        nodes = progress_of(status)
        accuracies = [n.test_accuracy for n in nodes]
        sent = sum(n.bytes_sent for n in nodes) / len(nodes) / 1e6
        print(f"  {algorithm + f' on {first.nodes} agents':<40} {mean_accuracy(nodes):.4f}  "
              f"(nodes {min(accuracies):.4f}..{max(accuracies):.4f}, {sent:.1f} MB sent per node)")
    print(f"metrics logs: {root}/runs/*/metrics.jsonl; process logs: {root}/logs")
    try:
        page = write_report([Path(status.run_dir) for _, status in results] + [reference_dir], root / "report",
                            [algorithm for algorithm, _ in results] + ["reference (1 node)"])
    except ReportError as error:
        print(f"coordinator demo: no report: {error}", file=sys.stderr)
        return 1
    print(f"report: {page}")
    return 0
