"""Benchmark: a 4 + 4 partition of 8 agents for 20 s during a job, against the same job unpartitioned (issue 15;
docs/results.md, "Partitions and chaos").

    .venv/bin/python benchmarks/partition.py             # ECL-ISVR (pdmm-isvr), gossip and DiLoCo, 2 pairs each
    .venv/bin/python benchmarks/partition.py --row '{name: sgp, steps: 4000, algorithm: {name: sgp, ...}}'

One cluster of 8 agent processes in a private network (coordinator/chaos.py: each agent in a network namespace of its
own, `python -m coordinator.chaos run`), Fashion-MNIST, logistic model, class-window split, ring, seed 1. Each row
runs its job in pairs (`--repeats`, interleaved with the other rows'): whole, then cut into agents 0-3 and 4-7 from
`--partition-at` seconds after every rank took its first step, for `--partition-for` seconds, then healed. A row is a
YAML mapping laid over the base job (its name, steps, algorithm section, topology, ...): any algorithm is one more
row. Prints each row's final mean accuracy over the nodes both ways (each run's, and their mean) and the difference
of the means (target: within 1 point; two whole runs alike differ too, asynchronous as they are: their spread says
how much), the mean wall time of the runs, and the calls across the cut that failed while it lasted (on peer edges: an
all-reduce has none). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    {"name": "ecl-isvr", "steps": 16000,
     "algorithm": {"name": "pdmm-isvr", "mode": "async", "lr": 0.02, "interval": 4}},
    {"name": "gossip", "steps": 4000, "algorithm": {"name": "gossip", "lr": 0.02}},
    # Synchronous: the all-reduce step across the cut is aborted after 5 s, and no half (4 of 8) has a quorum.
    {"name": "diloco", "steps": 4000, "algorithm": {"name": "diloco", "lr": 0.002, "options": {"inner_steps": 100}},
     "failure": {"step_timeout_s": 5}},
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
        failures[at] = sum(e.failures for r in last.values() for e in r.edges if e.peer in agent_of
                           and (agent_of[r.node] in GROUPS[0]) != (agent_of[e.peer] in GROUPS[0]))
    values = list(failures.values())
    return values[-1] - values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="Fashion-MNIST (default %(default)s)")
    parser.add_argument("--row", action="append", type=yaml.safe_load,
                        help="a YAML mapping laid over the base job: name, steps, algorithm, ... (repeat; default: "
                        "ECL-ISVR 16000 steps and gossip 4000 steps)")
    parser.add_argument("--partition-at", type=float, default=5.0, help="seconds after the first steps (default 5)")
    parser.add_argument("--partition-for", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="pairs of runs (whole, cut) per row, interleaved with the other rows' (default 2)")
    parser.add_argument("--root", type=Path, help="keep the cluster's directory (runs, logs) here")
    args = parser.parse_args(argv)
    rows = args.row or list(ROWS)
    fault = (f"partition {','.join(map(str, GROUPS[0]))}/{','.join(map(str, GROUPS[1]))} "
             f"at {args.partition_at:g} for {args.partition_for:g}")
    runs = []
    for repeat in range(args.repeats):
        for row in rows:
            job = base_job(args.data_dir) | row
            job["eval_every"] = job["steps"]
            runs.append({"job": job | {"name": f"{row['name']}-whole-{repeat}"}, "timeout_s": 1800})
            runs.append({"job": job | {"name": f"{row['name']}-cut-{repeat}"}, "timeout_s": 1800, "faults": [fault]})
    with tempfile.TemporaryDirectory(prefix="partition-") as scratch:
        plan, out = Path(scratch) / "plan.yaml", Path(scratch) / "result.json"
        plan.write_text(yaml.safe_dump({"agents": 8, "data_dir": args.data_dir, "runs": runs}))
        print(f"8 agents, each in its own network namespace; {fault} s, then healed; {args.repeats} pairs of runs "
              "per row", flush=True)
        subprocess.run([sys.executable, "-m", "coordinator.chaos", "run", str(plan), "--out", str(out),
                        *(["--root", str(args.root)] if args.root else [])], check=True)
        results = json.loads(out.read_text())["runs"]
        print(f"\n{'row':<12} {'steps':>6} {'whole %':>18} {'cut %':>18} {'diff':>6} {'<= 1?':>5} {'whole s':>8} "
              f"{'cut s':>6} {'failed across':>14}")
        for index, row in enumerate(rows):
            pairs = [(results[2 * (r * len(rows) + index)], results[2 * (r * len(rows) + index) + 1])
                     for r in range(args.repeats)]
            wholes = [100 * whole["mean_accuracy"] for whole, _ in pairs]
            cuts = [100 * cut["mean_accuracy"] for _, cut in pairs]
            diff = statistics.mean(cuts) - statistics.mean(wholes)
            met = "yes" if abs(diff) <= TARGET_POINTS else "NO"
            print(f"{row['name']:<12} {row['steps']:>6} {spread(wholes):>18} {spread(cuts):>18} {diff:>+6.2f} "
                  f"{met:>5} {statistics.mean(w['wall_s'] for w, _ in pairs):>8.0f} "
                  f"{statistics.mean(c['wall_s'] for _, c in pairs):>6.0f} "
                  f"{sum(cross_failures(cut) for _, cut in pairs) / len(pairs):>14.0f}")
            for whole, cut in pairs:
                if [a["detail"] for a in cut["actions"]] != ["", ""] or {whole["state"], cut["state"]} != {
                        "JOB_FINISHED"}:
                    actions = ", ".join(f"{a['action']} {a['detail']}".strip() for a in cut["actions"])
                    print(f"  ! {whole['job_id']} {whole['state']}, {cut['job_id']} {cut['state']}: {actions}")
    print("\nwhole %, cut %: the mean over the repeats of the final mean accuracy over the 8 nodes, and in brackets "
          "each run's; diff: cut less whole; failed across: calls on the cut's edges that failed during the "
          "partition, per run")
    return 0


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ({' '.join(f'{v:.1f}' for v in values)})"

if __name__ == "__main__":
    sys.exit(main())
