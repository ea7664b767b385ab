"""`coordinator simulate` end to end: the command a user runs, at 2,000, 5,000 and 10,000 nodes.

benchmarks/simulator.py drives the simulator directly; this one runs the whole command in a fresh process per size
(`python -m coordinator.cli simulate JOB.yaml --set nodes=N`): its imports, the data and the nodes' building, the
coordinator's rules in virtual time, the progress view, the metrics and events logs, the final table. The job is
issue 25's: DSGD on a ring, logistic regression on Fashion-MNIST (iid split), 5 steps, batch 10, evaluated at the end
on 100 test samples. Per size: the wall seconds of the command, and the user and system CPU seconds of its process
(the machine may be shared: CPU seconds are inflated less by other processes than wall seconds), and the CPU seconds
per node, which a command linear in the node count keeps level. Target (issue 25): 10,000 nodes in under 60 s end
to end.

    .venv/bin/python benchmarks/simulate_command.py [--sizes 2000 5000 10000] [--timeout 600]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nodeagent.jobspec import DEFAULT_DATA_DIR

SIZES = (2_000, 5_000, 10_000)
TARGET_NODES = 10_000
TARGET_WALL_S = 60.0


def job_yaml(data_dir: str) -> str:
    return f"""name: scale
nodes: 2000
steps: 5
eval_every: 5
seed: 0
algorithm:
  name: dsgd
  lr: 0.02
model:
  name: logistic
data:
  dataset: fashion-mnist
  data_dir: {data_dir}
  split: iid
  batch_size: 10
  test_limit: 100
topology:
  kind: ring
  seed: 0
"""


@dataclass
class Run:
    nodes: int
    wall_s: float  # up to the timeout where the command ran past it
    user_s: float
    sys_s: float
    timed_out: bool

    @property
    def cpu_per_node_ms(self) -> float:
        return 1000 * (self.user_s + self.sys_s) / self.nodes


def run_command(job: Path, nodes: int, runs: Path, timeout_s: float) -> Run:
    """One `coordinator simulate` of `nodes` nodes, in a child process, stopped after `timeout_s`; its output is
    discarded (it ends with one line per node)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    timed_out = False
    try:
        subprocess.run([sys.executable, "-m", "coordinator.cli", "simulate", str(job), "--set", f"nodes={nodes}",
                        "--runs", str(runs)], check=True, stdout=subprocess.DEVNULL, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # the child is killed and waited for: its CPU time is counted
        timed_out = True
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Run(nodes, wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, timed_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one size may take")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="simulate-command-") as scratch:
        job = Path(scratch) / "scale.yaml"
        job.write_text(job_yaml(args.data_dir))
        for nodes in args.sizes:
            rows.append(run_command(job, nodes, Path(scratch) / "runs", args.timeout))
            print(f"... {nodes} nodes done", file=sys.stderr, flush=True)
    print("coordinator simulate, DSGD on a ring, logistic, 5 steps, batch 10, test_limit 100; one process per size")
    print(f"load average (1 min) before {load_before:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'nodes':>6} {'wall s':>7} {'user s':>7} {'sys s':>6} {'cpu ms/node':>11}")
    for row in rows:
        wall = f"{row.wall_s:>7.1f}" + (" (timed out)" if row.timed_out else "")
        print(f"{row.nodes:>6} {wall} {row.user_s:>7.1f} {row.sys_s:>6.1f} {row.cpu_per_node_ms:>11.2f}")
    target = [row for row in rows if row.nodes == TARGET_NODES]
    if target:
        row = target[0]
        met = row.wall_s < TARGET_WALL_S and not row.timed_out
        print(f"target: {TARGET_NODES} nodes in under {TARGET_WALL_S:.0f} s end to end: {row.wall_s:.1f} s wall, "
              f"{row.user_s + row.sys_s:.1f} s CPU ({'met' if met else 'not met'})")
    if len(rows) > 1:
        smallest, largest = min(rows, key=lambda row: row.nodes), max(rows, key=lambda row: row.nodes)
        print(f"linear in the nodes: CPU per node at {largest.nodes} nodes is "
              f"{largest.cpu_per_node_ms / smallest.cpu_per_node_ms:.2f}x that at {smallest.nodes}")


if __name__ == "__main__":
    main()
