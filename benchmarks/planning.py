"""Planning at the coordinator: what the largest jobs it accepts cost, and how fast it refuses larger ones.

For each job: the coordinator's work from the submitted YAML text to every node's plan, as SubmitJob and the
assignments do it: parse_job_yaml, validate_job (which builds the graph), build_topology again (the service
builds its own copy), and plan_node for every rank. The jobs: 4096 nodes (the target), the largest of their kind
within the bounds (coordinator.topology.MAX_EDGES and MAX_PERIOD_SENDS), and jobs beyond them (nodeagent.jobspec.
MAX_NODES too), which must be refused at once. Wall and CPU seconds are the best of --repeats runs (CPU time shows
the work when other processes share the machine); peak memory is traced in a separate run.
Target: planning a 4096-node job at the coordinator in under 2 s, memory bounded.

    .venv/bin/python benchmarks/planning.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import tracemalloc
from typing import Any

import yaml

from coordinator.jobs import plan_node, validate_job
from coordinator.topology import MAX_EDGES, build_topology
from nodeagent.jobspec import MAX_JOB_BYTES, MAX_NODES, JobSpecError, parse_job_yaml

TARGET_S = 2.0
NODES = 4096  # the target's job size


def job(nodes: int, kind: str, algorithm: str = "dsgd", **options: Any) -> str:
    return yaml.safe_dump({"name": "plan", "nodes": nodes, "algorithm": {"name": algorithm},
                           "topology": {"kind": kind, "options": options}})


def random_edges(nodes: int, count: int) -> str:
    """An edge file's text: a ring (so that the graph is connected) and random chords, `count` lines."""
    rng = random.Random(0)
    lines = [f"{rank} {(rank + 1) % nodes}" for rank in range(nodes)]
    lines += [f"{rng.randrange(nodes)} {rng.randrange(nodes)}" for _ in range(count - nodes)]
    return "\n".join(line for line in lines if line.split()[0] != line.split()[1]) + "\n"


def largest_edge_list() -> str:
    """The most edges an inline edge list can carry within a job's MAX_JOB_BYTES."""
    count = MAX_EDGES
    while True:
        text = yaml.safe_dump({"name": "plan", "nodes": NODES, "topology": {
            "kind": "edge-list", "options": {"edges": random_edges(NODES, count)}}})
        if len(text.encode()) <= MAX_JOB_BYTES:
            return text
        count -= 4096


def alias_bomb() -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{new}: &{new} [{', '.join([f'*{old}'] * 9)}]" for old, new in zip("abcdefgh", "bcdefghi", strict=True)]
    return "\n".join(lines) + "\n"


ACCEPTED = {
    "ring, 4096 nodes": job(NODES, "ring"),
    "exponential, 4096 nodes (dsgd)": job(NODES, "exponential"),
    "exponential, 4096 nodes (pdmm-isvr)": job(NODES, "exponential", "pdmm-isvr"),
    "torus, 4096 nodes": job(NODES, "torus"),
    "random-regular degree 2, 4096 nodes": job(NODES, "random-regular", degree=2),
    "random-regular degree 32, 4096 nodes": job(NODES, "random-regular", degree=32),
    "dynamic-exponential, 4096 nodes (sgp)": job(NODES, "dynamic-exponential", "sgp"),
    "dynamic-exponential k=2, 4096 nodes (sgp)": job(NODES, "dynamic-exponential", "sgp", peers_per_iteration=2),
    "complete, 362 nodes": job(362, "complete"),
    "edge-list inline, 4096 nodes": largest_edge_list(),
}
REFUSED = {
    "complete, 4096 nodes": job(NODES, "complete"),
    "random-regular degree 4095, 4096 nodes": job(NODES, "random-regular", degree=4095),
    "bipartite-linear, 4096 nodes": job(NODES, "bipartite-linear", "ad-psgd"),
    f"{MAX_NODES + 1} nodes": job(MAX_NODES + 1, "ring"),
    "alias bomb": alias_bomb(),
    "nesting 100,000 deep": "a: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "1 MiB + 1 byte": "#" * MAX_JOB_BYTES + "\n",
}


def plan_everything(text: str) -> tuple[int, int, int]:
    """What the coordinator does with a submitted job up to every node's plan; (edges, neighbour entries, sends in
    one period of the peer schedules)."""
    spec = parse_job_yaml(text)
    validate_job(spec)
    topology = build_topology(spec.topology, spec.nodes)
    entries = sends = 0
    for rank in range(spec.nodes):
        plan = plan_node(spec, topology, rank)
        entries += len(plan.neighbors)
        sends += sum(len(peers) for peers in plan.peer_schedule)
    return len(topology.edges), entries, sends


def timed(text: str, repeats: int) -> tuple[float, float]:
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        with contextlib.suppress(JobSpecError):  # a refusal is timed too
            plan_everything(text)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def peak_mb(text: str) -> float:
    tracemalloc.start()
    with contextlib.suppress(JobSpecError):
        plan_everything(text)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'accepted job':<44} {'YAML':>9} {'edges':>7} {'entries':>8} {'sends':>8} {'wall s':>7} {'CPU s':>6} "
          f"{'peak MB':>8}")
    worst = 0.0
    for name, text in ACCEPTED.items():
        edges, entries, sends = plan_everything(text)
        wall, cpu = timed(text, args.repeats)
        worst = max(worst, wall)
        print(f"{name:<44} {len(text.encode()):>9} {edges:>7} {entries:>8} {sends:>8} {wall:>7.2f} {cpu:>6.2f} "
              f"{peak_mb(text):>8.1f}")
    print(f"\n{'refused job':<44} {'YAML':>9} {'wall s':>7} {'CPU s':>6} {'peak MB':>8}  reason")
    for name, text in REFUSED.items():
        try:
            plan_everything(text)
            reason = "ACCEPTED (should be refused)"
        except JobSpecError as error:
            reason = str(error)[:60]
        wall, cpu = timed(text, args.repeats)
        worst = max(worst, wall)
        print(f"{name:<44} {len(text.encode()):>9} {wall:>7.3f} {cpu:>6.3f} {peak_mb(text):>8.1f}  {reason}")
    print(f"\nslowest: {worst:.2f} s wall (target < {TARGET_S} s: {'met' if worst < TARGET_S else 'not met'})")


if __name__ == "__main__":
    main()
