"""ESync against SSGD, ASGD and DC-ASGD on heterogeneous workers (docs/results.md, "ESync against SSGD, ASGD and
DC-ASGD").

Simulator (coordinator simulate: the worker and server halves that real agents and the coordinator run): 6 workers
of relative speeds 100, 100, 100, 100, 1, 1 on an iid split of Fashion-MNIST, mlp model, batch 64, the same step
size for every algorithm (ESync's local lr), global_lr 1 and epsilon 0.5 s (the paper's defaults). A fast step
takes 0.03 s of virtual time and a slow one 3 s (a GPU against a CPU, about 100x). The parameter server has one
network interface that carries one model in `--transfer-steps` fast steps (default 5: ResNet-18's 47 MB takes
0.37 s over 1 Gbit/s and 0.04 s over 10 Gbit/s against a GPU step of a few tens of ms), plus 0.5 ms latency.
Sequential SGD is one fast device on all the data. The accuracy is the server's global model's on the 10,000 test
images, every 0.5 virtual seconds while it changes; "final" is the mean over the last 10% of the time budget.
The computing time ratio of a device is 1 - (aggregation + wait) / elapsed over all its rounds (from
nodeagent.ps.RoundMetrics: one round per model it receives).
Targets: ESync's time to 0.8 at least 7x shorter than SSGD's and shorter than ASGD's and DC-ASGD's; its final
accuracy within 0.5 points of sequential SGD; every device's computing time ratio at least 0.35.

Real agents (--agents, on by default): 6 agent processes and a coordinator on loopback, the two last agents
slowed down by `--slowdown` (the job's `slowdown`: each step sleeps in proportion to its compute), time to
`--agent-target` accuracy of rank 0 (a fast worker evaluating the model it pulled) for each algorithm, capped at
`--agent-cap` seconds, and each agent's compute time over its elapsed time.

The simulator's runs give the paper's five figures (PNG, in `--figures`, default benchmarks/figures/esync): test
accuracy against virtual time on the iid split (1) and, with --non-iid, on the by-class split (2; it runs every
algorithm again, about doubling the simulator's time), each beside sequential SGD dotted; data throughput (3),
traffic load at the server (4) and computing time ratio per device (5).

    .venv/bin/python benchmarks/esync.py          # about 8 minutes on 2 cores (simulator 4, agents 4)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from coordinator.report import Series, bar_figure, line_figure
from coordinator.simulate import build_nodes, reference_spec
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.ps.esync import RoundMetrics
from nodeagent.ps.server import initial_parameters
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.data import load_dataset
from nodeagent.training.loop import evaluate

SPEEDS = [100.0, 100.0, 100.0, 100.0, 1.0, 1.0]
SLOW_STEP_S = 3.0
GRID_S = 0.5
RUNS = {
    "sequential SGD": ("sequential", {}),
    "ESync": ("esync", {"epsilon": 0.5, "global_lr": 1.0}),
    "SSGD": ("ssgd", {}),
    "ASGD": ("asgd", {}),
    "DC-ASGD": ("dc-asgd", {}),
    "DC-ASGD-a": ("dc-asgd", {"adaptive": True}),
}


@dataclass
class Outcome:
    label: str
    curve: list[tuple[float, float]] = field(default_factory=list)
    reached: float = math.nan
    final: float = math.nan
    ratios: list[float] = field(default_factory=list)
    local_steps: list[float] = field(default_factory=list)  # per device, per round
    throughput: float = math.nan  # samples/s, all devices
    traffic: float = math.nan  # bytes/s, all devices, both directions
    wall_s: float = 0.0


def job(args: argparse.Namespace, algorithm: str, options: dict, split: str) -> JobSpec:
    raw = {
        "name": f"esync-bench-{algorithm}", "nodes": len(SPEEDS), "steps": 10**8, "eval_every": 10**8,
        "seed": args.seed,
        "algorithm": {"name": algorithm, "lr": args.lr, "options": options},
        "model": {"name": args.model},
        "data": {"data_dir": args.data_dir, "split": split, "batch_size": args.batch_size, "test_limit": 100},
        "simulation": {"step_time_s": SLOW_STEP_S, "speeds": SPEEDS},
    }
    model_bytes = initial_parameters(parse_job_spec(raw)).numel * 4
    fast_step = SLOW_STEP_S / max(SPEEDS)
    network = {"bandwidth_bytes_per_s": model_bytes / (args.transfer_steps * fast_step), "latency_s": 0.0005}
    return parse_job_spec({**raw, "simulation": {**raw["simulation"], "network": network}})


def simulate_run(args: argparse.Namespace, label: str, split: str) -> Outcome:
    torch.set_num_threads(1)
    started = time.monotonic()
    algorithm, options = RUNS[label]
    spec = job(args, "asgd" if algorithm == "sequential" else algorithm, options, split)
    if algorithm == "sequential":
        spec = reference_spec(spec)
        spec = spec.model_copy(update={"simulation": spec.simulation.model_copy(update={"speeds": [max(SPEEDS)]})})
    nodes = build_nodes(spec, args.data_dir)
    mesh = VirtualMesh(nodes, spec.name, spec.simulation, Metrics())
    evaluator = initial_parameters(spec)
    test = load_dataset("fashion-mnist", args.data_dir, "test")
    outcome = Outcome(label)
    seen = -1
    now = 0.0
    limit = args.budget if algorithm != "ssgd" else args.budget * 20  # SSGD runs on until it reaches the target
    while now < limit and (now < args.budget or math.isnan(outcome.reached)):
        # Fine steps until the target is reached, then 100 points over the budget for the final accuracy.
        now += GRID_S if math.isnan(outcome.reached) else max(GRID_S, args.budget / 100)
        mesh.run(until=now)
        version = nodes[0].algorithm.clock if mesh.server is None else mesh.server.half.version
        if version == seen:
            outcome.curve.append((now, outcome.curve[-1][1]))
            continue
        seen = version
        evaluator.vector.copy_(nodes[0].algorithm.w if mesh.server is None else mesh.server.half.w)
        accuracy = evaluate(evaluator.model, test).accuracy
        outcome.curve.append((now, accuracy))
        if math.isnan(outcome.reached) and accuracy >= args.target:
            outcome.reached = now
    tail = [a for t, a in outcome.curve if 0.9 * args.budget <= t <= args.budget] or [outcome.curve[-1][1]]
    outcome.final = sum(tail) / len(tail)
    if mesh.server is not None:
        totals = [RoundMetrics.total(sim.rounds) for sim in mesh.nodes]
        outcome.ratios = [t.computing_time_ratio for t in totals]
        outcome.local_steps = [t.steps / len(sim.rounds) for t, sim in zip(totals, mesh.nodes, strict=True)]
        outcome.throughput = sum(t.samples for t in totals) / mesh.now
        outcome.traffic = sum(t.bytes_sent + t.bytes_received for t in totals) / mesh.now
    outcome.wall_s = time.monotonic() - started
    return outcome


def fmt(value: float, pattern: str = "{:.1f}") -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def simulate_all(args: argparse.Namespace, split: str, labels: list[str]) -> dict[str, Outcome]:
    with ProcessPoolExecutor(args.jobs) as pool:
        return {o.label: o for o in pool.map(simulate_run, [args] * len(labels), labels, [split] * len(labels))}


def print_outcomes(title: str, outcomes: dict[str, Outcome], sequential: Outcome, target: float) -> None:
    esync = outcomes["ESync"]
    print(f"\n{title}")
    print(f"{'algorithm':<15} {'to ' + str(target) + ' (s)':>11} {'/ ESync':>8} "
          f"{'final acc':>9} {'vs seq':>7} {'samples/s':>9} {'MB/s':>7}  {'local steps per round':<30} "
          "computing time ratio per device")
    for o in outcomes.values():
        print(f"{o.label:<15} {fmt(o.reached):>11} {fmt(o.reached / esync.reached, '{:.1f}x'):>8} "
              f"{o.final:>9.4f} {(o.final - sequential.final) * 100:>+7.2f} {fmt(o.throughput, '{:.0f}'):>9} "
              f"{fmt(o.traffic / 1e6, '{:.2f}'):>7}  {' '.join(f'{s:.0f}' for s in o.local_steps):<30} "
              f"{' '.join(f'{r:.2f}' for r in o.ratios)}")


def simulator(args: argparse.Namespace) -> bool:
    print(f"simulator: speeds {[int(s) for s in SPEEDS]}, {args.model}, batch {args.batch_size}, lr {args.lr}, "
          f"one model through the server's interface in {args.transfer_steps} fast steps, budget {args.budget:.0f} "
          f"virtual s, target {args.target}; {args.jobs} runs at a time", flush=True)
    outcomes = simulate_all(args, "iid", list(RUNS))
    sequential, esync = outcomes["sequential SGD"], outcomes["ESync"]
    print_outcomes("iid split", outcomes, sequential, args.target)
    non_iid = None
    if args.non_iid:  # sequential SGD sees all the data either way: its iid run is the baseline
        non_iid = simulate_all(args, "by-class", [label for label in RUNS if label != "sequential SGD"])
        print_outcomes("non-iid (by-class) split", non_iid, sequential, args.target)
    checks = {
        "ESync >= 7x faster than SSGD to the target": outcomes["SSGD"].reached >= 7 * esync.reached,
        "ESync faster than ASGD": outcomes["ASGD"].reached > esync.reached,
        "ESync faster than DC-ASGD (both variants)": min(outcomes["DC-ASGD"].reached,
                                                         outcomes["DC-ASGD-a"].reached) > esync.reached,
        "ESync final within 0.5 points of sequential SGD": abs(esync.final - sequential.final) <= 0.005,
        "every device's computing time ratio >= 0.35 with ESync": min(esync.ratios) >= 0.35,
    }
    for check, ok in checks.items():
        print(f"target: {check}: {'MET' if ok else 'NOT MET'}")
    print(f"wall time per run: {', '.join(f'{o.label} {o.wall_s:.0f} s' for o in outcomes.values())}", flush=True)
    write_figures(args.figures, args.budget, outcomes, non_iid)
    return all(checks.values())


def write_figures(directory: Path, budget: float, iid: dict[str, Outcome], non_iid: dict[str, Outcome] | None) -> None:
    """The ESync paper's five figures (the second only with --non-iid), through coordinator.report's plotting; the
    curves over the time budget (SSGD runs on beyond it to reach the target)."""

    def curve(outcome: Outcome) -> tuple[list[float], list[float]]:
        shown = [(t, a) for t, a in outcome.curve if t <= budget]
        return [t for t, _ in shown], [a for _, a in shown]

    directory.mkdir(parents=True, exist_ok=True)
    sequential = iid["sequential SGD"]
    servers = [o for o in iid.values() if o is not sequential]  # the parameter-server algorithms
    paths = []
    for number, (split, outcomes) in enumerate((("iid", iid), ("non-iid (by-class)", non_iid)), start=1):
        if outcomes is None:
            continue
        series = [Series(o.label, *curve(o), color=i)
                  for i, o in enumerate(outcomes.values(), start=1) if o is not sequential]
        series.append(Series("sequential SGD (one device)", *curve(sequential), color=0, style=":"))
        paths.append(line_figure(
            directory / f"fig{number}_accuracy_{split.split()[0]}.png",
            f"Test accuracy of the global model, {split} split, 6 devices",
            "virtual time (s)", "test accuracy", series))
    labels = [o.label for o in servers]
    paths.append(bar_figure(directory / "fig3_throughput.png", "Data throughput (iid)", "algorithm",
                            "samples per virtual second, all devices", labels,
                            {"throughput": [o.throughput for o in servers]}))
    paths.append(bar_figure(directory / "fig4_traffic.png", "Traffic load at the parameter server (iid)", "algorithm",
                            "MB per virtual second, up and down", labels,
                            {"traffic": [o.traffic / 1e6 for o in servers]}))
    devices = [f"{rank} (speed {speed:g})" for rank, speed in enumerate(SPEEDS)]
    paths.append(bar_figure(directory / "fig5_computing_time_ratio.png", "Computing time ratio per device (iid)",
                            "device", "1 - (aggregation + wait) / elapsed", devices,
                            {o.label: o.ratios for o in servers}))
    print(f"figures: {', '.join(str(path) for path in paths)}")


def local_steps(cluster, job_id: str, status) -> list[float]:
    """peertrain_local_steps_total of the job on each rank's agent (its Prometheus endpoint)."""
    import urllib.request

    address = {n.node_id: n.metrics_address for n in cluster.nodes()}
    steps = []
    for member in sorted(status.nodes, key=lambda n: n.rank):
        text = urllib.request.urlopen(f"http://{address[member.node_id]}/metrics", timeout=5).read().decode()
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("peertrain_local_steps_total{") and f'job_id="{job_id}"' in line]
        steps.append(sum(found))
    return steps


def agents(args: argparse.Namespace) -> None:
    from coordinator.cluster import LocalCluster
    from nodeagent._proto import coordinator_pb2 as pb
    from nodeagent.runtime.progress import read_run_log

    slow = {4: args.slowdown, 5: args.slowdown}
    # Evaluate about as often in time: ESync after every round, SSGD every 2 rounds, the asynchronous ones every
    # 10 pushes of the fast evaluating worker.
    plan = {
        "ESync": ("esync", {"epsilon": args.agent_epsilon}, 1),
        "ASGD": ("asgd", {}, 10),
        "DC-ASGD": ("dc-asgd", {}, 10),
        "SSGD": ("ssgd", {}, 2),
    }
    print(f"\nreal agents: 6 agent processes and a coordinator on loopback, ranks 4 and 5 slowed down "
          f"{args.slowdown:g}x, {args.model}, time to {args.agent_target} of rank 0, at most {args.agent_cap:.0f} s "
          f"each", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="esync-agents-") as root, \
            LocalCluster(root=Path(root), agents=6, data_dir=args.data_dir, log_level="WARNING") as cluster:
        for label, (algorithm, options, eval_every) in plan.items():
            spec = {
                "name": f"esync-agents-{algorithm}", "nodes": 6, "steps": 10**8, "eval_every": eval_every,
                "seed": args.seed, "slowdown": slow,
                "algorithm": {"name": algorithm, "lr": args.lr, "options": options},
                "model": {"name": args.model},
                "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": args.batch_size,
                         "test_limit": 2000},
            }
            job_id = cluster.submit(yaml.safe_dump(spec))
            started = time.monotonic()
            while time.monotonic() - started < args.agent_cap + 10:
                status = cluster.status(job_id)
                first = status.nodes[0] if status.nodes else None
                if first is not None and first.test_accuracy >= args.agent_target:
                    break
                time.sleep(0.5)
            local = local_steps(cluster, job_id, status)
            cluster.stub().StopJob(pb.StopJobRequest(job_id=job_id), timeout=10)
            records = read_run_log(status.run_dir)
            hits = [r.elapsed_s for r in records if r.rank == 0 and r.test_accuracy >= args.agent_target]
            reached = min(hits) if hits else math.nan
            last = {}
            for record in records:
                last[record.rank] = record
            ratios = [last[r].compute_s / last[r].elapsed_s if r in last and last[r].elapsed_s > 0 else math.nan
                      for r in range(6)]
            best = max((r.test_accuracy for r in records if r.rank == 0 and not math.isnan(r.test_accuracy)), default=0)
            rounds = [last[r].step if r in last else 0 for r in range(6)]
            per_round = [local[r] / max(1, rounds[r]) for r in range(6)]
            rows.append((label, reached, best, ratios, rounds, per_round))
            time.sleep(1.0)
    esync = rows[0][1]
    print(f"{'algorithm':<10} {'to ' + str(args.agent_target) + ' (s)':>11} {'/ ESync':>8} {'best acc':>8}  "
          f"{'clock per rank (pushes; rounds)':<32} {'local steps per clock':<28} compute / elapsed per rank")
    for label, reached, best, ratios, steps, per_round in rows:
        shown = fmt(reached) if not math.isnan(reached) else f">{args.agent_cap:.0f}"
        print(f"{label:<10} {shown:>11} {fmt(reached / esync, '{:.1f}x'):>8} {best:>8.4f}  "
              f"{' '.join(str(s) for s in steps):<32} {' '.join(f'{s:.1f}' for s in per_round):<28} "
              f"{' '.join(fmt(r, '{:.2f}') for r in ratios)}")
    order = [label for label, reached, *_ in sorted(rows, key=lambda row: (math.isnan(row[1]), row[1]))]
    print(f"ordering on agents (fastest first): {' < '.join(order)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--budget", type=float, default=1000.0, help="virtual seconds per run (default %(default)s)")
    parser.add_argument("--transfer-steps", type=float, default=5.0,
                        help="fast steps one model takes through the server's interface (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations in parallel")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    parser.add_argument("--non-iid", action="store_true",
                        help="also run every algorithm on the by-class split (the paper's figure 2; doubles the "
                        "simulator's time)")
    parser.add_argument("--figures", type=Path, default=Path(__file__).parent / "figures" / "esync",
                        help="directory of the paper's figures (default %(default)s)")
    parser.add_argument("--no-agents", dest="agents", action="store_false", help="skip the real-agent run")
    parser.add_argument("--no-simulator", dest="simulator", action="store_false", help="skip the simulation")
    parser.add_argument("--slowdown", type=float, default=100.0, help="slow-down factor of the slow agents")
    parser.add_argument("--agent-target", type=float, default=0.8)
    parser.add_argument("--agent-cap", type=float, default=60.0, help="seconds per algorithm on agents")
    parser.add_argument("--agent-epsilon", type=float, default=0.02, help="ESync's epsilon on agents (seconds)")
    args = parser.parse_args()
    started = time.monotonic()
    if args.simulator:
        simulator(args)
    if args.agents:
        agents(args)
    print(f"total wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
