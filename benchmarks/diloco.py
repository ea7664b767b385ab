"""DiLoCo against AllReduce SGD (docs/results.md, issue 15): bytes sent per worker and final test accuracy.

8 workers, Fashion-MNIST, the cnn model, batch 32, the iid and class-window splits, every run `--steps` local steps
per worker in the simulator (the same algorithm code and byte counting as agents). Runs:
- AllReduce SGD (lr 0.02, Nesterov momentum 0.9, as benchmarks/sgp_vs_allreduce.py), a ring all-reduce per step;
- DiLoCo over the all-reduce, H = 50, 100, 500 (inner AdamW at lr 1e-3, outer Nesterov SGD lr 0.7 momentum 0.9);
- DiLoCo through the parameter server (diloco-ps, the coordinator as outer optimizer), H = 100, in full precision
  and with int8 pseudo-gradients (error feedback); the pull of the new global parameters is in full precision;
- decentralised DiLoCo (diloco-gossip), H = 100, push-sum on the one-peer exponential graph, log2 8 = 3 rounds per
  outer step (the exact average), no collective;
- streaming DiLoCo, H = 100, 4 fragments, each sync overlapped with 5 inner steps, int8 pseudo-gradients with
  error feedback (all-gathered: at 8 workers as many bytes as a float32 ring all-reduce, see the module's text).
Bytes are each worker's payload bytes sent (the simulator counts a ring all-reduce's 2 (n - 1) / n of the payload,
an all-gather's n - 1 payloads, and each push). Accuracy is the mean over the workers of their final model's on
--test-limit test images.

Targets: DiLoCo within 1 point of AllReduce SGD's accuracy with at least 100x fewer bytes per worker; decentralised
DiLoCo within 1.5 points, with no collective.

`--gossip` runs the gossip table instead (issue 24): decentralised DiLoCo on a ring, a torus, the static exponential
graph and the one-peer exponential graph (its default rounds: one period), with 6, 8 and 12 nodes, on heterogeneous
data (the class-window split), against DiLoCo over the all-reduce with as many nodes. Each run measures the
replicas' spread after every sync, sqrt(mean_i ||theta_i - mean theta||^2) over the nodes' global parameters right
after they applied it, and reports it after the first sync, at its largest, and after the last (bounded: the last
is no larger than the largest of the first half); the target is the final accuracy within 1.5 points of DiLoCo
over the all-reduce: the replicas' mean accuracy, and beside it the accuracy of the replicas' mean model (the
consensus, which `coordinator export` writes for a peer-to-peer job).

    .venv/bin/python benchmarks/diloco.py                       # 16 simulated jobs of 500 steps (see results.md)
    .venv/bin/python benchmarks/diloco.py --quick               # 200 steps, H = 50, 100, 200: a few minutes
    .venv/bin/python benchmarks/diloco.py --agents              # also a shorter run on 8 local agents (gRPC, gloo)
    .venv/bin/python benchmarks/diloco.py --agents --no-simulator --agent-steps 100 --agent-inner-steps 50
    .venv/bin/python benchmarks/diloco.py --runs-dir DIR        # keep the run directories: coordinator report DIR/*
    .venv/bin/python benchmarks/diloco.py --only 'AllReduce SGD,DiLoCo H=100,DiLoCo PS'   # some of the runs
    .venv/bin/python benchmarks/diloco.py --gossip --gossip-steps 5000 --gossip-inner-steps 10   # 500 syncs
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from coordinator.simulate import SimulationResult, simulate
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobSpec, parse_job_spec
from nodeagent.runtime.simulator import VirtualMesh

NODES = 8
TARGET_RATIO = 100.0
TARGET_GAP = 1.0
TARGET_GAP_GOSSIP = 1.5


@dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str
    options: dict
    topology: str = "ring"


@dataclass(frozen=True)
class Outcome:
    split: str
    label: str
    bytes_per_worker: float
    accuracy: float  # percent, mean over the workers
    wall_s: float


def variants(args: argparse.Namespace) -> list[Variant]:
    runs = [Variant("AllReduce SGD", "allreduce", {})]
    runs += [Variant(f"DiLoCo H={h}", "diloco", {"inner_steps": h}) for h in args.inner_steps]
    h = args.inner_steps[min(1, len(args.inner_steps) - 1)]
    runs.append(Variant(f"DiLoCo PS H={h}", "diloco-ps", {"inner_steps": h}))
    runs.append(Variant(f"DiLoCo PS int8 H={h}", "diloco-ps", {"inner_steps": h, "precision": "int8"}))
    runs.append(Variant(f"DiLoCo gossip H={h}", "diloco-gossip", {"inner_steps": h}, "npeer-exponential"))
    runs.append(Variant(f"Streaming DiLoCo int8 H={h} F=4", "diloco", {
        "inner_steps": h, "fragments": 4, "overlap_steps": min(5, h // 4 - 1), "precision": "int8"}))
    if args.only:
        wanted = [label.strip() for label in args.only.split(",")]
        runs = [run for run in runs if any(run.label.startswith(label) for label in wanted)]
    return runs


def job(variant: Variant, split: str, args: argparse.Namespace) -> dict:
    if variant.algorithm == "allreduce":
        algorithm = {"name": "allreduce", "lr": 0.02, "momentum": 0.9, "nesterov": True}
    else:
        algorithm = {"name": variant.algorithm, "lr": args.inner_lr, "options": variant.options}
    return {
        "name": f"{split}-{variant.label}".lower().replace(" ", "-").replace("=", ""),
        "nodes": NODES, "steps": args.steps, "eval_every": args.steps // 5, "seed": 0,
        "algorithm": {**algorithm, "mode": "sync"},
        "model": {"name": args.model},
        "data": {"data_dir": args.data_dir, "split": split, "batch_size": 32, "test_limit": args.test_limit},
        "topology": {"kind": variant.topology, "seed": 1},
        "simulation": {"step_time_s": 0.01, "network": {"bandwidth_bytes_per_s": 125e6, "latency_s": 1e-4}},
    }


def simulated(split: str, variant: Variant, args: argparse.Namespace) -> Outcome:
    spec: JobSpec = parse_job_spec(job(variant, split, args))
    run_dir = Path(args.runs_dir) / spec.name if args.runs_dir else None
    started = time.monotonic()
    result = simulate(spec, run_dir)
    progress = result.progress
    sent = sum(p.bytes_sent for p in progress) / len(progress)
    outcome = Outcome(split, variant.label, sent, 100 * result.mean_accuracy, time.monotonic() - started)
    print(f"  {split:<13} {variant.label:<32} {sent / 1e6:10.2f} MB/worker  accuracy {outcome.accuracy:6.2f}  "
          f"(wall {outcome.wall_s:.0f} s)", flush=True)
    return outcome


@dataclass(frozen=True)
class GossipCase:
    topology: str
    nodes: int
    algorithm: str = "diloco-gossip"


@dataclass(frozen=True)
class GossipOutcome:
    case: GossipCase
    rounds: int  # push-sum rounds per sync (0: the all-reduce)
    bytes_per_worker: float
    accuracy: float  # the replicas' mean
    consensus_accuracy: float  # of the replicas' mean model
    spreads: tuple[float, ...]  # after each sync


class SpreadMeter:
    """The replicas' spread after each sync, sqrt(mean_i ||theta_i - mean theta||^2), from each node's global
    parameters right after it applied the sync (the nodes apply it at different virtual times): a simulation's
    `on_progress`. One fragment, no overlap: node i has applied clock // H syncs, less the one out."""

    def __init__(self, nodes: int, inner_steps: int):
        self.nodes, self.inner_steps = nodes, inner_steps
        self.applied = [0] * nodes
        self.sums: dict[int, torch.Tensor] = {}
        self.squares: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.spreads: list[float] = []

    def __call__(self, mesh: VirtualMesh) -> None:
        for sim in mesh.nodes:
            algorithm = sim.node.algorithm
            done = algorithm.clock // self.inner_steps - (algorithm.pending is not None)
            while self.applied[sim.rank] < done:
                self.applied[sim.rank] += 1
                sync = self.applied[sim.rank]
                theta = algorithm.global_w.detach().to(torch.float64)
                self.sums[sync] = self.sums.get(sync, torch.zeros_like(theta)) + theta
                self.squares[sync] = self.squares.get(sync, 0.0) + float(theta @ theta)
                self.counts[sync] = self.counts.get(sync, 0) + 1
                if self.counts[sync] == self.nodes:
                    mean = self.sums.pop(sync) / self.nodes
                    variance = self.squares.pop(sync) / self.nodes - float(mean @ mean)
                    self.spreads.append(math.sqrt(max(0.0, variance)))
                    del self.counts[sync]


def gossip_job(case: GossipCase, args: argparse.Namespace) -> dict:
    return {
        "name": f"gossip-{case.algorithm}-{case.topology}-{case.nodes}",
        "nodes": case.nodes, "steps": args.gossip_steps, "eval_every": args.gossip_steps, "seed": 0,
        "algorithm": {"name": case.algorithm, "lr": args.inner_lr, "mode": "sync",
                      "options": {"inner_steps": args.gossip_inner_steps}},
        "model": {"name": args.gossip_model},
        "data": {"data_dir": args.data_dir, "split": "class-window", "batch_size": 32, "test_limit": args.test_limit},
        "topology": {"kind": case.topology, "seed": 1},
        "simulation": {"step_time_s": 0.01, "network": {"bandwidth_bytes_per_s": 125e6, "latency_s": 1e-4}},
    }


def gossip_simulated(case: GossipCase, args: argparse.Namespace) -> GossipOutcome:
    spec: JobSpec = parse_job_spec(gossip_job(case, args))
    meter = SpreadMeter(case.nodes, args.gossip_inner_steps)
    result = simulate(spec, on_progress=meter)
    sent = sum(p.bytes_sent for p in result.progress) / len(result.progress)
    rounds = getattr(result.mesh.nodes[0].node.algorithm, "rounds", 0)
    outcome = GossipOutcome(case, rounds, sent, 100 * result.mean_accuracy, 100 * consensus_accuracy(result),
                            tuple(meter.spreads))
    print(f"  {case.algorithm:<14} {case.topology:<18} {case.nodes:>3} nodes  accuracy {outcome.accuracy:6.2f}  "
          f"consensus {outcome.consensus_accuracy:6.2f}  "
          f"spread first {outcome.spreads[0]:.4f} max {max(outcome.spreads):.4f} last {outcome.spreads[-1]:.4f}  "
          f"(wall {result.wall_s:.0f} s)", flush=True)
    return outcome


def consensus_accuracy(result: SimulationResult) -> float:
    """The test accuracy of the mean of the nodes' final models, evaluated on rank 0's node (the run is over: its
    model is overwritten)."""
    nodes = [sim.node for sim in result.mesh.nodes]
    mean = torch.stack([node.algorithm.w.detach() for node in nodes]).mean(dim=0)
    with torch.no_grad():
        nodes[0].algorithm.w.copy_(mean)
    return nodes[0].evaluate().accuracy


def gossip_table(outcomes: list[GossipOutcome], args: argparse.Namespace) -> None:
    syncs = args.gossip_steps // args.gossip_inner_steps
    print(f"\nGossip DiLoCo, class-window split, {args.gossip_model}, {args.gossip_steps} steps, "
          f"H = {args.gossip_inner_steps} ({syncs} syncs); spread sqrt(mean_i ||theta_i - mean theta||^2)")
    print(f"{'graph':<18} {'nodes':>5} {'rounds':>6} {'MB/worker':>10} {'spread 1st':>10} {'max':>8} {'last':>8} "
          f"{'bounded':>7} {'accuracy':>8} {'all-reduce':>10} {'gap':>6} {'consensus':>9} {'gap':>6}  target")
    for o in outcomes:
        if o.case.algorithm != "diloco-gossip":
            continue
        reference = next(r for r in outcomes if r.case.algorithm == "diloco" and r.case.nodes == o.case.nodes)
        gap = reference.accuracy - o.accuracy
        half = o.spreads[: max(1, len(o.spreads) // 2)]
        bounded = o.spreads[-1] <= max(half) * 1.001
        met = "met" if gap <= TARGET_GAP_GOSSIP else "NOT met"
        print(f"{o.case.topology:<18} {o.case.nodes:>5} {o.rounds:>6} {o.bytes_per_worker / 1e6:10.2f} "
              f"{o.spreads[0]:10.4f} {max(o.spreads):8.4f} {o.spreads[-1]:8.4f} {'yes' if bounded else 'NO':>7} "
              f"{o.accuracy:8.2f} {reference.accuracy:10.2f} {gap:6.2f} {o.consensus_accuracy:9.2f} "
              f"{reference.accuracy - o.consensus_accuracy:6.2f}  <= {TARGET_GAP_GOSSIP} points: {met}")


def gossip(args: argparse.Namespace) -> None:
    cases = [GossipCase(topology, nodes) for nodes in args.gossip_nodes for topology in args.gossip_topologies]
    cases += [GossipCase("ring", nodes, "diloco") for nodes in args.gossip_nodes]  # the reference, all-reduce
    print(f"gossip DiLoCo against DiLoCo over the all-reduce, {len(cases)} simulated jobs:", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        outcomes = list(pool.map(gossip_simulated, cases, [args] * len(cases)))
    gossip_table(outcomes, args)


def on_agents(split: str, variant: Variant, args: argparse.Namespace, cluster) -> Outcome:
    from nodeagent._proto import coordinator_pb2 as pb

    spec = job(variant, split, args)
    del spec["simulation"]
    started = time.monotonic()
    status = cluster.wait(cluster.submit(yaml.safe_dump(spec)), timeout_s=args.agent_timeout)
    if status.state != pb.JOB_FINISHED:
        raise RuntimeError(f"{spec['name']} ended {pb.JobState.Name(status.state)}")
    sent = sum(n.bytes_sent for n in status.nodes) / len(status.nodes)
    accuracy = 100 * sum(n.test_accuracy for n in status.nodes) / len(status.nodes)
    outcome = Outcome(split, variant.label, sent, accuracy, time.monotonic() - started)
    print(f"  {split:<13} {variant.label:<32} {sent / 1e6:10.2f} MB/worker  accuracy {accuracy:6.2f}  "
          f"(wall {outcome.wall_s:.0f} s, agents)", flush=True)
    return outcome


def table(title: str, outcomes: list[Outcome]) -> None:
    print(f"\n{title}")
    print(f"{'split':<13} {'run':<32} {'MB/worker':>10} {'fewer bytes':>11} {'accuracy':>9} {'gap':>6}  target")
    for split in dict.fromkeys(o.split for o in outcomes):
        rows = [o for o in outcomes if o.split == split]
        reference = next(o for o in rows if o.label == "AllReduce SGD")
        for o in rows:
            ratio = reference.bytes_per_worker / o.bytes_per_worker
            gap = reference.accuracy - o.accuracy
            verdict = ""
            if o.label.startswith("DiLoCo gossip"):
                met = gap <= TARGET_GAP_GOSSIP
                verdict = f"<= {TARGET_GAP_GOSSIP} points, no collective: {'met' if met else 'NOT met'}"
            elif "DiLoCo" in o.label:
                met = gap <= TARGET_GAP and ratio >= TARGET_RATIO
                verdict = f"<= {TARGET_GAP} point, >= {TARGET_RATIO:.0f}x: {'met' if met else 'NOT met'}"
            print(f"{split:<13} {o.label:<32} {o.bytes_per_worker / 1e6:10.2f} {ratio:10.1f}x {o.accuracy:9.2f} "
                  f"{gap:6.2f}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="local steps per worker (a multiple of every H)")
    parser.add_argument("--inner-steps", type=lambda s: [int(h) for h in s.split(",")], default=[50, 100, 500],
                        help="the H of the DiLoCo runs, comma-separated; the second is the gossip and streaming one's")
    parser.add_argument("--quick", action="store_true", help="200 steps, H = 50, 100, 200")
    parser.add_argument("--splits", default="iid,class-window")
    parser.add_argument("--only", default="", help="only the runs whose labels start with one of these "
                        "(comma-separated; keep 'AllReduce SGD', the table's reference)")
    parser.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW's lr of DiLoCo's inner steps")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--test-limit", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2, help="simulated jobs run at once (processes)")
    parser.add_argument("--runs-dir", help="keep each run's directory here (for coordinator report)")
    parser.add_argument("--agents", action="store_true", help="also run on 8 local agents (--agent-steps steps)")
    parser.add_argument("--agent-steps", type=int, default=100)
    parser.add_argument("--agent-inner-steps", type=lambda s: [int(h) for h in s.split(",")], default=[50])
    parser.add_argument("--agent-splits", default="iid")
    parser.add_argument("--agent-model", default="cnn")
    parser.add_argument("--agent-timeout", type=float, default=1800)
    parser.add_argument("--no-simulator", action="store_true", help="only the agents' runs")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    parser.add_argument("--gossip", action="store_true", help="the gossip table only (see above)")
    parser.add_argument("--gossip-nodes", type=lambda s: [int(n) for n in s.split(",")], default=[6, 8, 12])
    parser.add_argument("--gossip-topologies", type=lambda s: s.split(","),
                        default=["ring", "torus", "exponential", "npeer-exponential"])
    parser.add_argument("--gossip-steps", type=int, default=5000, help="local steps per node of the gossip runs")
    parser.add_argument("--gossip-inner-steps", type=int, default=10, help="H of the gossip runs")
    parser.add_argument("--gossip-model", default="logistic")
    args = parser.parse_args()
    if args.gossip:
        gossip(args)
        return
    if args.quick:
        args.steps, args.inner_steps = 200, [50, 100, 200]
    if "AllReduce SGD" not in [variant.label for variant in variants(args)]:
        parser.error("--only must keep 'AllReduce SGD', the table's reference")
    if not args.no_simulator:
        print(f"{NODES} workers, {args.model}, batch 32, {args.steps} steps, simulator:", flush=True)
        plan = [(split, variant) for split in args.splits.split(",") for variant in variants(args)]
        with ProcessPoolExecutor(args.workers) as pool:
            outcomes = list(pool.map(simulated, *zip(*plan, strict=True), [args] * len(plan)))
        table(f"Simulator: {NODES} workers, {args.model}, {args.steps} steps", outcomes)
    if args.agents:
        from coordinator.cluster import LocalCluster

        args.steps, args.inner_steps, args.model = args.agent_steps, args.agent_inner_steps, args.agent_model
        print(f"\n{NODES} local agents, {args.model}, {args.steps} steps:", flush=True)
        with tempfile.TemporaryDirectory() as root, LocalCluster(root=Path(root), agents=NODES,
                                                                 data_dir=args.data_dir) as cluster:
            agent_outcomes = [on_agents(split, variant, args, cluster) for split in args.agent_splits.split(",")
                              for variant in variants(args)]
        table(f"Agents: {NODES} workers, {args.model}, {args.steps} steps", agent_outcomes)


if __name__ == "__main__":
    main()
