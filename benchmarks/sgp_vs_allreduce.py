"""SGP against AllReduce SGD (docs/results.md): 32 simulated nodes on a 1 Gbit/s network model, iid Fashion-MNIST,
the cnn model. Prints the virtual time per epoch and the final test accuracy of SGP and Overlap SGP on the
dynamic directed exponential graph, and of AllReduce SGD (exact averaging at the cost of a ring all-reduce:
2 (n - 1) / n of the model through each link and 2 (n - 1) latencies per step).

Target: SGP needs at least 2x less virtual time per epoch than AllReduce SGD and ends within 1.2 points of
its accuracy. Local compute is charged `--step-time` virtual seconds per step on every node.

    .venv/bin/python benchmarks/sgp_vs_allreduce.py [--epochs 2] [--step-time 0.01] [--latency 0.0001]
"""

from __future__ import annotations

import argparse
import os
import time

from coordinator.simulate import simulate
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobSpec, parse_job_spec

NODES = 32
BANDWIDTH = 125e6  # 1 Gbit/s in bytes per second
TARGET_SPEEDUP = 2.0
TARGET_GAP = 1.2


def spec_for(algorithm: str, topology: str, args: argparse.Namespace) -> JobSpec:
    samples_per_node = 60000 // NODES
    steps = max(1, args.epochs * samples_per_node // args.batch_size)
    return parse_job_spec({
        "name": f"sgp-bench-{algorithm}", "nodes": NODES, "steps": steps, "eval_every": steps, "seed": 0,
        "algorithm": {"name": algorithm, "lr": args.lr, "momentum": 0.9, "nesterov": True, "interval": 1,
                      "mode": "sync"},
        "model": {"name": args.model},
        "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": args.batch_size, "test_limit": 2000},
        "topology": {"kind": topology, "seed": 1},
        "simulation": {"step_time_s": args.step_time,
                       "network": {"bandwidth_bytes_per_s": BANDWIDTH, "latency_s": args.latency}},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--step-time", type=float, default=0.01, help="virtual compute time of one step (s)")
    parser.add_argument("--latency", type=float, default=0.0001, help="one-way link latency (s)")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    runs = [("allreduce", "ring"), ("sgp", "dynamic-exponential"), ("osgp", "dynamic-exponential")]
    results = {}
    for algorithm, topology in runs:
        spec = spec_for(algorithm, topology, args)
        started = time.monotonic()
        result = simulate(spec)
        per_epoch = result.mesh.now / args.epochs
        results[algorithm] = (per_epoch, 100 * result.mean_accuracy)
        print(f"{algorithm:<10} {topology:<20} {spec.steps} steps: virtual {per_epoch:7.2f} s/epoch, "
              f"accuracy {100 * result.mean_accuracy:.2f}  (wall {time.monotonic() - started:.0f} s)", flush=True)
    reference_time, reference_accuracy = results["allreduce"]
    print(f"\n{NODES} nodes, {args.model}, 1 Gbit/s, latency {args.latency * 1e3:.2f} ms, compute "
          f"{args.step_time * 1e3:.0f} ms/step, {args.epochs} epochs")
    print(f"{'algorithm':<10} {'s/epoch':>9} {'speed-up':>9} {'accuracy':>9} {'gap':>6}")
    for algorithm, (per_epoch, accuracy) in results.items():
        speedup = reference_time / per_epoch
        gap = reference_accuracy - accuracy
        verdict = ""
        if algorithm != "allreduce":
            met = speedup >= TARGET_SPEEDUP and gap <= TARGET_GAP
            verdict = f"  target (>= {TARGET_SPEEDUP}x, <= {TARGET_GAP} points): {'met' if met else 'NOT met'}"
        print(f"{algorithm:<10} {per_epoch:9.2f} {speedup:8.2f}x {accuracy:9.2f} {gap:6.2f}{verdict}")


if __name__ == "__main__":
    main()
