"""Benchmark: peertrain on one GPU against the bare training step, and the same jobs on the machine's CPUs.

    python benchmarks/gpu.py [--models cnn resnet20] [--sections bare agents cpu staging] [--data-dir DIR]

Prints "no CUDA device" and exits 0 where torch sees none. Otherwise measures, in one run, on cuda:0, for the cnn
(batch 64) and ResNet-20 (`resnet-cifar`, depth 20, batch 128) on Fashion-MNIST (28x28 grey images, not CIFAR's
32x32 colour: the data on this disk):
- bare: the bare training step (forward, backward, SGD step on batches already on the device; one
  synchronisation at the end), alone and as 4 processes sharing the GPU (each loop's steps/s);
- agents: real agents (processes on loopback, mutual TLS) with `--device cuda`: one agent alone (a 1-node
  PDMM-ISVR job: no neighbours), and 4 agents sharing the GPU with asynchronous PDMM-ISVR (K = 8 local steps per
  exchange), synchronous DSGD and DiLoCo (H = 50);
- cpu: the same 4-agent jobs with `--device cpu` (each agent a quarter of the cores), shorter: their steps/s, and
  their accuracy against the GPU job's at the same step (from the run log);
- staging: a 44 MB and a 400 MB Push between two processes through the peer service with lanes, a CUDA tensor
  to a receiver that delivers on CUDA (pinned staging both ways) against a CPU tensor to a CPU receiver.
An agent's steps/s is read from its progress reports between its first and its last (evaluations excluded).
Targets (docs/results.md, "On a GPU"): one agent alone >= 0.9x the bare step; 4 agents with PDMM-ISVR >= 0.7x four
bare loops sharing the GPU, and >= 0.5x the bare step (issue 23: a round's fixed cost); every GPU job >= 3x its
CPU twin on ResNet-20, accuracy within 1 point; staging Push >= 0.9x the CPU Push. It asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import yaml

from nodeagent.jobspec import DEFAULT_DATA_DIR

MODELS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (model spec, batch size)
    "cnn": ({"name": "cnn"}, 64),
    "resnet20": ({"name": "resnet-cifar", "options": {"depth": 20}}, 128),
}
# Steps of each GPU job and of its CPU twin, sized for seconds of work each; the GPU job is evaluated at the twin's
# last step too, where their accuracies are compared. The 1-node job takes the PDMM-ISVR job's steps.
STEPS: dict[tuple[str, str], tuple[int, int]] = {
    ("cnn", "pdmm-isvr"): (2000, 400), ("cnn", "dsgd-sync"): (300, 150), ("cnn", "diloco"): (1000, 200),
    ("resnet20", "pdmm-isvr"): (400, 100), ("resnet20", "dsgd-sync"): (150, 50), ("resnet20", "diloco"): (400, 100),
}
JOBS: dict[str, dict[str, Any]] = {
    "pdmm-isvr": {"name": "pdmm-isvr", "lr": 0.02, "interval": 8},
    "dsgd-sync": {"name": "dsgd", "mode": "sync", "lr": 0.02},
    "diloco": {"name": "diloco", "lr": 1e-3, "options": {"inner_steps": 50}},
}
AGENTS = 4
BARE_STEPS = 500
JOB_TIMEOUT_S = 600.0
STAGING_SIZES_MB = (44, 400)
STAGING_REPEATS = 5


# -- the bare step ------------------------------------------------------------------------------------------------


def bare_loop(model_name: str, data_dir: str, steps: int, device: str) -> float:
    """Seconds per step of the plain loop a user writes: the model and an SGD optimizer, batches already on the
    device, forward, backward, step; timed over `steps` after a warm-up."""
    from nodeagent.jobspec import ModelSpec
    from nodeagent.training.data import load_dataset
    from nodeagent.training.models import build_model

    spec, batch = MODELS[model_name]
    train = load_dataset("fashion-mnist", data_dir, "train", 50 * batch)
    images = train.normalised.to(device)
    labels = train.labels.to(device)
    batches = [(images[i : i + batch], labels[i : i + batch]) for i in range(0, 50 * batch, batch)]
    torch.manual_seed(0)
    model = build_model(ModelSpec(**spec), train.input_shape, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    for index in range(50):  # warm: cuDNN's choices made, the clocks up
        step(index)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for index in range(steps):
        step(index)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def shared_bare_loop(conn: Connection, model_name: str, data_dir: str, steps: int, barrier: Any) -> None:
    torch.set_num_threads(1)
    bare_loop(model_name, data_dir, 5, "cuda")  # built and warm before the loops start together
    barrier.wait()
    conn.send(bare_loop(model_name, data_dir, steps, "cuda"))


def bare_loops_sharing(model_name: str, data_dir: str, count: int) -> float:
    """Steps/s of each of `count` bare loops (processes) sharing the GPU, the mean over the loops."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(count)
    pipes = [context.Pipe() for _ in range(count)]
    processes = [context.Process(target=shared_bare_loop, args=(child, model_name, data_dir, BARE_STEPS, barrier))
                 for _, child in pipes]
    for process in processes:
        process.start()
    seconds = [parent.recv() for parent, _ in pipes]
    for process in processes:
        process.join()
    return statistics.mean(1 / s for s in seconds)


# -- agents ---------------------------------------------------------------------------------------------------------


@dataclass
class JobFigures:
    steps_per_s: float  # per node, the mean over the nodes
    accuracy: float  # the nodes' mean test accuracy at `at_step`
    at_step: int
    final_accuracy: float  # at the job's last step


def job_spec(model_name: str, job: str, nodes: int, steps: int, data_dir: str, eval_every: int) -> dict:
    spec, batch = MODELS[model_name]
    return {
        "name": f"gpu-{model_name}-{job}", "nodes": nodes, "steps": steps, "eval_every": eval_every, "seed": 1,
        "algorithm": JOBS[job], "model": spec,
        "data": {"data_dir": data_dir, "split": "iid", "batch_size": batch, "test_limit": 2000},
        "topology": {"kind": "ring", "seed": 1},
    }


def run_job(cluster: Any, spec: dict, accuracy_at: int) -> JobFigures:
    """Submit `spec`, follow it to its end; steps/s from each node's reports between its first and its last."""
    from nodeagent._proto import coordinator_pb2 as pb
    from nodeagent.runtime.progress import read_run_log

    reports: dict[int, list[tuple[float, int]]] = {}

    def record(status: pb.JobStatusReply) -> None:
        for node in status.nodes:
            seen = reports.setdefault(node.rank, [])
            if 0 < node.step < spec["steps"] and (not seen or seen[-1][1] != node.step):
                seen.append((node.updated_unix, node.step))

    status = cluster.wait(cluster.submit(yaml.safe_dump(spec)), JOB_TIMEOUT_S, on_progress=record)
    if status.state != pb.JOB_FINISHED:
        raise RuntimeError(f"{spec['name']}: {pb.JobState.Name(status.state)} {status.reason}")
    rates = []
    for node in status.nodes:
        seen = reports.get(node.rank, [])
        if len(seen) >= 2 and seen[-1][0] > seen[0][0]:
            rates.append((seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0]))
        else:  # too short for two reports in between: the whole run, evaluations included
            rates.append(node.step / node.elapsed_s)
    at = [r.test_accuracy for r in read_run_log(Path(status.run_dir)) if r.step == accuracy_at and r.test_accuracy
          == r.test_accuracy]
    return JobFigures(statistics.mean(rates), statistics.mean(at) if at else float("nan"), accuracy_at,
                      statistics.mean(node.test_accuracy for node in status.nodes))


def agents(device: str, models: list[str], data_dir: str, root: Path, alone: bool,
           jobs: list[str]) -> dict[tuple[str, str], JobFigures]:
    from coordinator.cluster import LocalCluster

    threads = 1 if device == "cuda" else max(1, (os.cpu_count() or AGENTS) // AGENTS)
    figures: dict[tuple[str, str], JobFigures] = {}
    with LocalCluster(root=root / device, agents=AGENTS, data_dir=data_dir, device=device,
                      torch_threads=threads) as cluster:
        for model_name in models:
            if alone:
                steps = STEPS[model_name, "pdmm-isvr"][0]
                spec = job_spec(model_name, "pdmm-isvr", 1, steps, data_dir, steps)
                figures[model_name, "alone"] = run_job(cluster, spec, steps)
                print(f"  {device} {model_name} one agent alone: {figures[model_name, 'alone'].steps_per_s:.1f} "
                      "steps/s", flush=True)
            for job in jobs:
                gpu_steps, cpu_steps = STEPS[model_name, job]
                steps = gpu_steps if device == "cuda" else cpu_steps
                spec = job_spec(model_name, job, AGENTS, steps, data_dir, cpu_steps)
                figures[model_name, job] = result = run_job(cluster, spec, cpu_steps)
                print(f"  {device} {model_name} {job}: {result.steps_per_s:.1f} steps/s per agent, accuracy "
                      f"{result.accuracy:.4f} at step {cpu_steps}, {result.final_accuracy:.4f} at step {steps}",
                      flush=True)
    return figures


# -- staging --------------------------------------------------------------------------------------------------------


def staging_server(conn: Connection, numel: int) -> None:
    """Two peer servers with lanes: one delivers received tensors in host memory, one on cuda:0."""
    from concurrent import futures

    import grpc

    from nodeagent.algorithms.base import Snapshot
    from nodeagent.metrics import Metrics
    from nodeagent.rpc import GRPC_OPTIONS
    from nodeagent.runtime.peer_service import PeerServicer, ServingState, add_peer_servicer
    from nodeagent.wire.message import Encoding, TensorSpec

    torch.set_num_threads(1)
    torch.cuda.init()
    spec = TensorSpec("w", torch.float32, (numel,))

    class Discard(queue.Queue):
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            del item, block, timeout

    ports, keep = [], []
    for device in ("cpu", "cuda"):
        state = ServingState(
            job_id="bench", node_id="server", rank=1, algorithm_name="bench", names={0: "client", 1: "server"},
            expected=lambda sender, kind: [spec], snapshot=lambda: Snapshot(1, 0, 0.0, {}), inbox=Discard(),
            encoding=Encoding.RAW, chunk_bytes=1 << 20, max_message_bytes=max(1 << 30, 4 * numel), device=device,
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_OPTIONS)
        servicer = PeerServicer(lambda state=state: state, Metrics(), "bench", lane_host="127.0.0.1")
        add_peer_servicer(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        keep.append((server, servicer, state))
    conn.send(ports)
    conn.recv()  # stop
    for server, servicer, _ in keep:
        servicer.close()
        server.stop(grace=1.0)


def staging_client(conn: Connection, ports: list[int], numel: int, repeats: int) -> None:
    import grpc

    from nodeagent.algorithms.base import Snapshot
    from nodeagent.metrics import Metrics
    from nodeagent.runtime.peer_service import PeerClient, ServingState
    from nodeagent.wire.message import Encoding, Kind, Message

    torch.set_num_threads(1)
    metrics = Metrics()
    results: dict[str, list[float]] = {}
    for encoding in ("raw", "fp16"):
        state = ServingState(
            job_id="bench", node_id="client", rank=0, algorithm_name="bench", names={0: "client", 1: "server"},
            expected=lambda sender, kind: [], snapshot=lambda: Snapshot(0, 0, 0.0, {}), inbox=queue.Queue(),
            encoding=Encoding.from_name(encoding), chunk_bytes=1 << 20, max_message_bytes=max(1 << 30, 4 * numel),
        )
        host = torch.randn(numel)
        messages = {"cpu": Message(Kind.PARAMS, 0, 1, {"w": host}), "cuda": Message(Kind.PARAMS, 0, 1,
                                                                                    {"w": host.to("cuda")})}
        clients = {"cpu": PeerClient(f"127.0.0.1:{ports[0]}"), "cuda": PeerClient(f"127.0.0.1:{ports[1]}")}
        for client in clients.values():
            grpc.channel_ready_future(client.channel).result(timeout=30)
        for repeat in range(repeats + 1):  # the first of each is a warm-up
            for device in ("cpu", "cuda"):
                started = time.perf_counter()
                clients[device].push(state, messages[device], 120.0, metrics)
                if repeat:
                    results.setdefault(f"{device} {encoding}", []).append(time.perf_counter() - started)
        for client in clients.values():
            client.close()
    conn.send(results)


def staging(size_mb: int) -> dict[str, float]:
    """Median seconds of a Push of `size_mb` MB, by "device encoding"."""
    numel = size_mb * 1_000_000 // 4
    context = mp.get_context("spawn")
    server_end, server_child = context.Pipe()
    server = context.Process(target=staging_server, args=(server_child, numel))
    server.start()
    ports = server_end.recv()
    client_end, client_child = context.Pipe()
    client = context.Process(target=staging_client, args=(client_child, ports, numel, STAGING_REPEATS))
    client.start()
    results = client_end.recv()
    client.join()
    server_end.send("stop")
    server.join()
    return {what: statistics.median(seconds) for what, seconds in results.items()}


# -- the report -----------------------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return f"{value:.2f}x (target >= {target}x: {'met' if value >= target else 'MISSED'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--sections", nargs="+", choices=["bare", "agents", "cpu", "staging"],
                        default=["bare", "agents", "cpu", "staging"])
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS),
                        help="the 4-agent jobs of the agents and cpu sections (default all)")
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR") or DEFAULT_DATA_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure here (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
        return 0
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{os.cpu_count()} CPUs", flush=True)
    bare: dict[str, float] = {}
    shared: dict[str, float] = {}
    if "bare" in args.sections:
        for model_name in args.models:
            bare[model_name] = bare_loop(model_name, args.data_dir, BARE_STEPS, "cuda")
            shared[model_name] = bare_loops_sharing(model_name, args.data_dir, AGENTS)
            print(f"bare step {model_name}: {bare[model_name] * 1e3:.2f} ms ({1 / bare[model_name]:.1f} steps/s); "
                  f"{AGENTS} loops sharing the GPU: {shared[model_name]:.1f} steps/s each", flush=True)
    on_gpu: dict[tuple[str, str], JobFigures] = {}
    on_cpu: dict[tuple[str, str], JobFigures] = {}
    with tempfile.TemporaryDirectory(prefix="peertrain-gpu-") as root:
        if "agents" in args.sections:
            on_gpu = agents("cuda", args.models, args.data_dir, Path(root), alone=True, jobs=args.jobs)
        if "cpu" in args.sections:
            on_cpu = agents("cpu", args.models, args.data_dir, Path(root), alone=False, jobs=args.jobs)
    staged: dict[int, dict[str, float]] = {}
    if "staging" in args.sections:
        for size in STAGING_SIZES_MB:
            staged[size] = staging(size)
            rates = ", ".join(f"{what} {size / 1e3 / s:.2f} GB/s" for what, s in staged[size].items())
            print(f"staging Push {size} MB: {rates}", flush=True)

    print("\nsummary")
    for model_name in args.models:
        if model_name in bare and (model_name, "alone") in on_gpu:
            ratio = on_gpu[model_name, "alone"].steps_per_s * bare[model_name]
            print(f"  {model_name}: one agent alone against the bare GPU step: {verdict(ratio, 0.9)}")
        if model_name in shared and (model_name, "pdmm-isvr") in on_gpu:
            ratio = on_gpu[model_name, "pdmm-isvr"].steps_per_s / shared[model_name]
            print(f"  {model_name}: 4 agents with PDMM-ISVR against 4 bare loops sharing the GPU: "
                  f"{verdict(ratio, 0.7)}")
        if model_name in bare and (model_name, "pdmm-isvr") in on_gpu:
            ratio = on_gpu[model_name, "pdmm-isvr"].steps_per_s * bare[model_name]
            print(f"  {model_name}: 4 agents with PDMM-ISVR (K = 8) against the bare GPU step: {verdict(ratio, 0.5)}")
        for job in JOBS:
            if (model_name, job) in on_gpu and (model_name, job) in on_cpu:
                gpu, cpu = on_gpu[model_name, job], on_cpu[model_name, job]
                target = 3.0 if model_name == "resnet20" else 1.0
                ratio = gpu.steps_per_s / cpu.steps_per_s
                print(f"  {model_name} {job}: GPU against its CPU twin {verdict(ratio, target)}; accuracy at step "
                      f"{cpu.at_step}: GPU {gpu.accuracy:.4f}, CPU {cpu.accuracy:.4f} "
                      f"({abs(gpu.accuracy - cpu.accuracy) * 100:.2f} points)")
    for size, seconds in staged.items():
        for encoding in ("raw", "fp16"):
            ratio = seconds[f"cpu {encoding}"] / seconds[f"cuda {encoding}"]
            print(f"  staging Push {size} MB {encoding}: CUDA against CPU {verdict(ratio, 0.9)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
