"""Time from `submit` to the first local step, with mutual TLS against without (the trust issue's target: TLS
adds at most 1 s).

Starts a local cluster of 4 agents (processes on loopback), insecure and then with TLS, submits the same small
job several times on each, and times from the SubmitJob call until every node's `peertrain_local_steps` counter
(scraped from its /metrics every 20 ms) is past zero. Prints the median and range of each and the difference.

    .venv/bin/python benchmarks/startup.py [--runs 3] [--agents 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import yaml
from start_latency import time_to_first_step  # this directory's: the same timing as the start-latency benchmark

from coordinator.cluster import LocalCluster
from nodeagent.jobspec import DEFAULT_DATA_DIR

TARGET_EXTRA_S = 1.0


def job_yaml(agents: int, data_dir: str, index: int) -> str:
    return yaml.safe_dump({
        "name": f"startup-{index}", "nodes": agents, "steps": 200, "eval_every": 200, "seed": 0,
        "algorithm": {"name": "dsgd", "mode": "async", "lr": 0.02, "interval": 4},
        "model": {"name": "logistic"},
        "data": {"data_dir": data_dir, "split": "iid", "batch_size": 32, "train_limit": 8000, "test_limit": 500},
        "topology": {"kind": "ring"},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    for tls in (False, True):
        label = "mutual TLS" if tls else "insecure"
        with tempfile.TemporaryDirectory() as root, \
                LocalCluster(root=Path(root), agents=args.agents, data_dir=args.data_dir, tls=tls,
                             log_level="WARNING") as cluster:
            results[label] = [time_to_first_step(cluster, job_yaml(args.agents, args.data_dir, i), 120.0)
                              for i in range(args.runs)]
        times = results[label]
        print(f"{label:<11} submit -> first step on all {args.agents} nodes: median {statistics.median(times):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times)})")
    extra = statistics.median(results["mutual TLS"]) - statistics.median(results["insecure"])
    verdict = "met" if extra <= TARGET_EXTRA_S else "MISSED"
    print(f"TLS adds {extra:+.2f} s (target: at most +{TARGET_EXTRA_S:.1f} s): {verdict}")


if __name__ == "__main__":
    main()
