"""Benchmark: a 4 + 4 partition of 8 agents for 20 s during an asynchronous job, against the same job unpartitioned
(issue 15; docs/results.md, "Partitions and chaos").

    .venv/bin/python benchmarks/partition.py                      # ECL-ISVR (pdmm-isvr) and gossip
    .venv/bin/python benchmarks/partition.py --row '{name: diloco, steps: 4000, algorithm: {name: ...}}'

One cluster of 8 agent processes in a private network (coordinator/chaos.py: each agent in a network namespace of its
own, `python -m coordinator.chaos run`), Fashion-MNIST, logistic model, class-window split, ring, seed 1. Each row
runs its job twice, one after the other: whole, then cut into agents 0-3 and 4-7 from `--partition-at` seconds after
every rank took its first step, for `--partition-for` seconds, then healed. A row is a YAML mapping laid over the base
job (its name, steps, algorithm section, topology, ...): any algorithm is one more row. Prints each row's final mean
accuracy over the nodes both ways and the difference (target: within 1 point), the wall time of each run, and the
exchanges across the cut that failed while it lasted. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from nodeagent.jobspec import DEFAULT_DATA_DIR
from nodeagent.runtime.progress import read_run_log

GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
TARGET_POINTS = 1.0
ROWS = (
    {"name": "ecl-isvr", "steps": 12000,
     "algorithm": {"name": "pdmm-isvr", "mode": "async", "lr": 0.02, "interval": 4}},
    {"name": "gossip", "steps": 4000, "algorithm": {"name": "gossip", "lr": 0.02}},
)


def base_job(data_dir: str) -> dict:
    return {
        "nodes": 8, "seed": 1, "model": {"name": "logistic"},
        # A call stalled by the partition gives up after 5 s (30 s by default: longer than the cut).
        "wire": {"exchange_timeout_s": 5},
        "data": {"data_dir": data_dir, "split": "class-window", "batch_size": 50},
        "topology": {"kind": "ring", "seed": 1},
    }


def cross_failures(run: dict) -> int:
    """Failed calls on the edges across the cut, reported between the cut and the heal."""
    actions = {a["action"]: a["unix"] for a in run["actions"]}
    agent_of = {n["node_id"]: n["agent"] for n in run["nodes"]}
    failures = {}
    for at in (actions.get("partition", 0.0), actions.get("heal", 0.0)):
        last = {r.rank: r for r in read_run_log(run["run_dir"]) if r.time <= at}
        failures[at] = sum(e.failures for r in last.values() for e in r.edges
                           if (agent_of[r.node] in GROUPS[0]) != (agent_of[e.peer] in GROUPS[0]))
    values = list(failures.values())
    return values[-1] - values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--row", action="append", type=yaml.safe_load,
                        help="a YAML mapping laid over the base job: name, steps, algorithm, ... (repeat; default: "
                        "ECL-ISVR 12000 steps and gossip 4000 steps)")
    parser.add_argument("--partition-at", type=float, default=5.0, help="seconds after the first steps (default 5)")
    parser.add_argument("--partition-for", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument("--root", type=Path, help="keep the cluster's directory (runs, logs) here")
    args = parser.parse_args(argv)
    rows = args.row or list(ROWS)
    fault = (f"partition {','.join(map(str, GROUPS[0]))}/{','.join(map(str, GROUPS[1]))} "
             f"at {args.partition_at:g} for {args.partition_for:g}")
    runs = []
    for row in rows:
        job = base_job(args.data_dir) | row
        job["eval_every"] = job["steps"]
        runs.append({"job": job | {"name": f"{row['name']}-whole"}, "timeout_s": 1800})
        runs.append({"job": job | {"name": f"{row['name']}-cut"}, "timeout_s": 1800, "faults": [fault]})
    with tempfile.TemporaryDirectory(prefix="partition-") as scratch:
        plan, out = Path(scratch) / "plan.yaml", Path(scratch) / "result.json"
        plan.write_text(yaml.safe_dump({"agents": 8, "data_dir": args.data_dir, "runs": runs}))
        print(f"8 agents, each in its own network namespace; {fault} s, then healed", flush=True)
        subprocess.run([sys.executable, "-m", "coordinator.chaos", "run", str(plan), "--out", str(out),
                        *(["--root", str(args.root)] if args.root else [])], check=True)
        results = json.loads(out.read_text())["runs"]
        print(f"\n{'row':<12} {'steps':>6} {'whole %':>8} {'cut %':>8} {'diff':>6} {'<= 1?':>5} {'whole s':>8} "
              f"{'cut s':>6} {'failed across':>14}")
        for index, row in enumerate(rows):
            whole, cut = results[2 * index], results[2 * index + 1]
            healed_in_time = [a["detail"] for a in cut["actions"]] == ["", ""]
            diff = 100 * (cut["mean_accuracy"] - whole["mean_accuracy"])
            met = "yes" if abs(diff) <= TARGET_POINTS else "NO"
            line = (f"{row['name']:<12} {row['steps']:>6} {100 * whole['mean_accuracy']:>8.2f} "
                    f"{100 * cut['mean_accuracy']:>8.2f} {diff:>+6.2f} {met:>5} {whole['wall_s']:>8.0f} "
                    f"{cut['wall_s']:>6.0f} {cross_failures(cut):>14}")
            if not (healed_in_time and cut["state"] == whole["state"] == "JOB_FINISHED"):
                actions = ", ".join(f"{a['action']} {a['detail']}".strip() for a in cut["actions"])
                line += f"  (whole {whole['state']}, cut {cut['state']}: {actions})"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
