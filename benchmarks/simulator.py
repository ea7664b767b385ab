"""Simulator scaling: building and stepping thousands of logistic nodes, against bare local steps of the same shape.

The bare step is what one node would do alone: fetch a minibatch of its shard, forward, backward, SGD update
(torch.optim), on the shard a simulated node of the same job holds (60,000 / N samples) with the same batch size,
so that a node of 10,000 (6 samples, batches of 6) is compared with a bare step on 6 samples. The simulated step
is the whole simulator's work per node step: the algorithm (DSGD, asynchronous), its messages, the event queue,
the network model and the evaluations (at the start one for all nodes, which start from the same model; at the
end each node's own, on 500 test samples).

Without --nodes: the scaling table, each size in a fresh process (so that sizes do not share caches or
allocations), DSGD on a ring, 10 steps per node. Per size: the time to build the nodes (the dataset's loading
included), the memory per node (the process's resident memory after building and running, less before, over N;
the dataset is loaded before and counted once, apart), node steps per second, and their ratio to the bare step.
Targets: 10,000 nodes built in under 10 s; at least 0.5x the bare step rate at every size (issue 14: 256, 1,000
and 10,000 nodes); memory linear in N (bytes per node at the largest size at most 1.5x the smallest figure).
The machine may be shared: times are given as wall and CPU seconds of the process, and the targets are judged on
CPU seconds, which other processes inflate less.

With --nodes N: that one size in this process (DSGD on a multiplex ring, 40 steps per node by default).

    .venv/bin/python benchmarks/simulator.py [--sizes 256 1024 4096 10000] [--steps 10]
    .venv/bin/python benchmarks/simulator.py --nodes 256 [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from coordinator.simulate import build_nodes
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.simulator import VirtualMesh
from nodeagent.training.data import load_dataset
from nodeagent.training.loop import BatchStream
from nodeagent.training.models import build_model
from nodeagent.training.splits import split_indices

TARGET_RATIO = 0.5
TARGET_BUILD_S = 10.0
TARGET_BUILD_NODES = 10_000
LINEAR_SLACK = 1.5  # bytes per node at the largest size, at most this times the smallest figure
SIZES = (256, 1024, 4096, 10_000)
BARE_STEPS = 2000


@dataclass
class Measurement:
    nodes: int
    steps: int
    shard: int  # samples of rank 0's shard, the shape of the bare step
    bare_cpu_rate: float  # bare local steps per CPU second
    bare_wall_rate: float
    build_wall_s: float  # loading the dataset and building every node
    build_cpu_s: float
    run_wall_s: float
    run_cpu_s: float
    dataset_bytes: int  # resident memory the dataset took (loaded once, shared by every node)
    bytes_per_node: float  # resident memory of building and running, over the nodes
    virtual_s: float

    @property
    def cpu_rate(self) -> float:
        return self.nodes * self.steps / self.run_cpu_s

    @property
    def wall_rate(self) -> float:
        return self.nodes * self.steps / self.run_wall_s

    @property
    def ratio(self) -> float:
        return self.cpu_rate / self.bare_cpu_rate


def job(nodes: int, steps: int, topology: str, data_dir: str) -> JobSpec:
    return parse_job_spec({
        "name": "simbench", "nodes": nodes, "steps": steps, "eval_every": steps,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 8},
        "model": {"name": "logistic"},
        "data": {"data_dir": data_dir, "split": "iid", "batch_size": 100, "test_limit": 500},
        "topology": {"kind": topology, "seed": 1},
        "simulation": {"step_time_s": 0.01, "jitter": 0.1},
    })


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bare_rates(spec: JobSpec, shard: np.ndarray, steps: int) -> tuple[float, float]:
    """Local SGD steps per CPU second and per wall second of one node on `shard`, nothing else."""
    train = load_dataset(spec.data.dataset, spec.data.data_dir, "train")
    batches = BatchStream(train, shard, spec.data.batch_size, seed=0)
    torch.manual_seed(0)
    model = build_model(spec.model, train.info.input_shape, train.info.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.algorithm.lr)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        inputs, targets = batches.next()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(50):  # warm-up
        step()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.process_time() - cpu), steps / (time.perf_counter() - wall)


def measure(nodes: int, steps: int, topology: str, data_dir: str) -> Measurement:
    """Build and run one job of `nodes` nodes in this process."""
    torch.set_num_threads(1)  # as coordinator.simulate does: one process steps every node in turn
    spec = job(nodes, steps, topology, data_dir)
    before_data = resident_bytes()
    cpu, wall = time.process_time(), time.perf_counter()
    train = load_dataset(spec.data.dataset, data_dir, "train")
    load_dataset(spec.data.dataset, data_dir, "test", spec.data.test_limit)
    load_cpu, load_wall = time.process_time() - cpu, time.perf_counter() - wall
    shard = split_indices(train.labels.numpy(), nodes, spec.data.split, spec.seed)[0]
    bare_cpu, bare_wall = bare_rates(spec, shard, BARE_STEPS)
    before = resident_bytes()
    cpu, wall = time.process_time(), time.perf_counter()
    built = build_nodes(spec)  # the dataset is cached: its loading is counted above
    build_cpu, build_wall = time.process_time() - cpu + load_cpu, time.perf_counter() - wall + load_wall
    mesh = VirtualMesh(built, spec.name, spec.simulation, Metrics())
    cpu, wall = time.process_time(), time.perf_counter()
    mesh.run()
    run_cpu, run_wall = time.process_time() - cpu, time.perf_counter() - wall
    assert mesh.finished
    return Measurement(nodes, steps, len(shard), bare_cpu, bare_wall, build_wall, build_cpu, run_wall, run_cpu,
                       before - before_data, (resident_bytes() - before) / nodes, mesh.now)


def in_fresh_process(nodes: int, steps: int, data_dir: str) -> Measurement:
    command = [sys.executable, __file__, "--nodes", str(nodes), "--steps", str(steps), "--topology", "ring",
               "--data-dir", data_dir, "--json"]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return Measurement(**json.loads(output.splitlines()[-1]))


def verdict(met: bool) -> str:
    return "met" if met else "not met"


def print_table(rows: list[Measurement]) -> None:
    print(f"DSGD on a ring, logistic model, {rows[0].steps} steps per node, batch 100; each size in a fresh process")
    print(f"{'nodes':>6} {'shard':>5} {'build s':>13} {'bytes/node':>10} {'node steps/s':>13} {'bare steps/s':>13} "
          f"{'ratio':>5}")
    print(f"{'':>6} {'':>5} {'wall (cpu)':>13} {'':>10} {'cpu (wall)':>13} {'cpu (wall)':>13} {'cpu':>5}")
    for row in rows:
        print(f"{row.nodes:>6} {row.shard:>5} {row.build_wall_s:>6.2f} ({row.build_cpu_s:>5.2f}) "
              f"{row.bytes_per_node:>10.0f} {row.cpu_rate:>6.0f} ({row.wall_rate:>5.0f}) "
              f"{row.bare_cpu_rate:>6.0f} ({row.bare_wall_rate:>5.0f}) {row.ratio:>5.2f}")
    print(f"the dataset, loaded once per process: {rows[0].dataset_bytes / 1e6:.0f} MB (not in bytes/node)")
    largest = max(rows, key=lambda row: row.nodes)
    if largest.nodes >= TARGET_BUILD_NODES:
        print(f"target: {TARGET_BUILD_NODES} nodes built in under {TARGET_BUILD_S:.0f} s: {largest.build_cpu_s:.2f} s "
              f"CPU, {largest.build_wall_s:.2f} s wall ({verdict(largest.build_cpu_s < TARGET_BUILD_S)})")
    for row in rows:
        print(f"target: step rate at {row.nodes} nodes at least {TARGET_RATIO}x the bare step: {row.ratio:.3f} "
              f"({verdict(row.ratio >= TARGET_RATIO)})")
    smallest = min(row.bytes_per_node for row in rows)
    print(f"target: memory linear in N: {', '.join(f'{row.bytes_per_node:.0f}' for row in rows)} bytes per node; "
          f"at {largest.nodes} nodes {largest.bytes_per_node / smallest:.2f}x the smallest figure "
          f"(at most {LINEAR_SLACK}x: {verdict(largest.bytes_per_node <= LINEAR_SLACK * smallest)})")


def print_one(row: Measurement) -> None:
    print(f"bare local step (logistic, {row.shard}-sample shard, batch 100): {row.bare_cpu_rate:9.0f} steps per CPU s "
          f"({row.bare_wall_rate:.0f} per wall s)")
    print(f"simulator, {row.nodes} nodes x {row.steps} steps (DSGD): {row.cpu_rate:9.0f} node steps per CPU s "
          f"({row.wall_rate:.0f} per wall s; {row.run_wall_s:.2f} s; building the nodes took {row.build_wall_s:.2f} s "
          f"more)")
    print(f"memory: {row.bytes_per_node:.0f} bytes per node, besides the dataset's {row.dataset_bytes / 1e6:.0f} MB")
    print(f"ratio simulator / bare: {row.ratio:.2f} (target >= {TARGET_RATIO}: {verdict(row.ratio >= TARGET_RATIO)}); "
          f"virtual time {row.virtual_s:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, help="one size, in this process (default: the scaling table)")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="the table's sizes")
    parser.add_argument("--steps", type=int, help="local steps per node (default: 10 in the table, 40 with --nodes)")
    parser.add_argument("--topology", default="multiplex-ring", help="with --nodes (the table runs rings)")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    parser.add_argument("--json", action="store_true", help="with --nodes: print the measurement as JSON")
    args = parser.parse_args()
    if args.nodes is not None:
        row = measure(args.nodes, args.steps or 40, args.topology, args.data_dir)
        if args.json:
            print(json.dumps(asdict(row)))
        else:
            print_one(row)
        return
    rows = []
    for nodes in args.sizes:
        rows.append(in_fresh_process(nodes, args.steps or 10, args.data_dir))
        print(f"... {nodes} nodes done", file=sys.stderr, flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
