"""Benchmark: what a training round costs, peertrain's agents against the loops a user writes by hand.

    python benchmarks/rounds.py [--models logistic cnn resnet20] [--sections loops agents exchange]
                                [--security insecure tls] [--seconds 12] [--nodes 4] [--repeat 1] [--data-dir DIR]

Measures, in one run, on this machine's CPUs (4 processes a side unless `--nodes`, torch 1 thread each,
Fashion-MNIST, batch 64 for logistic and the cnn, 32 for ResNet-20 (`resnet-cifar`, depth 20, on 28x28 grey
images), iid shards):
- loops: the hand-written torch.distributed gloo loops of each family: D-PSGD on a ring (each step: forward,
  backward, `isend` the parameters to both ring neighbours and `irecv` theirs, average the three, SGD step) and
  all-reduce SGD (each step: forward, backward, `all_reduce` of the flattened gradient, SGD step). Steps/s per
  process, timed after a warm-up for `--seconds`.
- agents: peertrain on as many real agents (processes on loopback: `--insecure`, and mutual TLS) with sync DSGD,
  SGP, all-reduce SGD, AD-PSGD and PDMM-ISVR (one exchange per step, like the loops); steps/s per node from the
  nodes' progress reports between their first and last (evaluations excluded), and where an agent's round goes
  from the driver's own accounting (compute, waiting for neighbours, the rest: sending, receiving and bookkeeping
  in the runner thread).
- exchange: the fixed cost of one exchange between two processes through the peer service (`PeerClient.exchange`,
  the agent's own client and servicer): the time of an exchange of a 1-element tensor, and the slope (bytes/s) from
  an exchange of 1 MB; insecure and under mutual TLS. Then what a message costs a round of agents (2 agents in
  synchronous DSGD rounds, each round's wait for the other's copy): the exchange's time plus the hand-offs between
  an agent's threads at both ends, the simulator's `simulation.network.message_cost_s` for this machine. And a
  step of gloo's ring: a gloo all-reduce of one element among `--nodes` processes over its 2 (n - 1) steps.
- with agents and exchange measured: the same jobs (logistic and the cnn) in the simulator, its step time the
  agents' own time per step (compute and the rest of the runner's work: all but waiting), its network a message as
  a round pays it and the exchange's slope, and for the all-reduce family a latency per ring step of gloo's (the
  ring's steps are gloo's, in C++ on the agents; the simulator charges `latency_s` per step); steps/s against the
  agents' (target: within 20%). The simulator gives every node a machine of its own: where the agents outnumber
  the cores (4 on 2), their waiting holds the time they wait for a core, which it does not model (`--nodes 2`
  there).
With `--repeat N` the loops and the agents run N times, and the comparisons are of the medians, each with the range
of the N runs' own ratios (a run's loops against the same run's agents): on a shared machine one run's rates move by
10 to 20%. Every other run goes in the reverse order (the agents before the loops, the last security first): a
machine whose speed drifts through a run otherwise favours whatever runs first (TLS, always after insecure, came out
at 0.73x of the loop where pairs of runs in alternating order put it within 4% of insecure).
Targets (issue 23): peertrain's sync DSGD and all-reduce SGD >= 1.0x the hand-written loop of their family on every
model insecure, >= 0.9x with mutual TLS; the fixed cost of an exchange under 1 ms on loopback. It asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

from nodeagent.jobspec import DEFAULT_DATA_DIR

MODELS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (model spec, batch size)
    "logistic": ({"name": "logistic"}, 64),
    "cnn": ({"name": "cnn"}, 64),
    "resnet20": ({"name": "resnet-cifar", "options": {"depth": 20}}, 32),
}
# Each job's algorithm section: one exchange (or push, or all-reduce) per step, as in the hand-written loops.
JOBS: dict[str, dict[str, Any]] = {
    "dsgd-sync": {"name": "dsgd", "mode": "sync", "lr": 0.05},
    "sgp": {"name": "sgp", "lr": 0.05},
    "allreduce": {"name": "allreduce", "lr": 0.05},
    "ad-psgd": {"name": "ad-psgd", "lr": 0.05},
    "pdmm-isvr": {"name": "pdmm-isvr", "lr": 0.05, "interval": 1},
}
FAMILY = {"dsgd-sync": "d-psgd", "sgp": "d-psgd", "ad-psgd": "d-psgd", "pdmm-isvr": "d-psgd",
          "allreduce": "allreduce"}
TARGETED = ("dsgd-sync", "allreduce")  # the jobs with a target against their family's loop
NODES = 4  # processes a side, unless --nodes
WARMUP_STEPS = 5
JOB_TIMEOUT_S = 600.0
EXCHANGE_REPEATS = 200
# Steps of the 2-agent job that measures a message's cost in a round: about 6 s at 650 steps/s, several progress
# reports (1,000 steps gave one or two, and 1.44 ms where the agents' own rounds of the run waited 1.05 ms).
PAID_STEPS = 4000
# The simulator computes every step for real, in one process: ResNet-20's would take as long as the agents' run.
SIMULATED_MODELS = ("logistic", "cnn")


# -- the hand-written loops -----------------------------------------------------------------------------------------


def hand_written(conn: Connection, rank: int, nodes: int, port: int, family: str, model_name: str, data_dir: str,
                 seconds: float) -> None:
    """One process of the loop a user writes with torch.distributed gloo; sends back its steps/s."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from nodeagent.jobspec import ModelSpec
    from nodeagent.training.data import load_dataset
    from nodeagent.training.models import build_model

    torch.set_num_threads(1)
    spec, batch = MODELS[model_name]
    train = load_dataset("fashion-mnist", data_dir, "train", 40 * batch * nodes)
    images, labels = train.normalised, train.labels
    shard = range(rank * 40 * batch, (rank + 1) * 40 * batch, batch)
    batches = [(images[i : i + batch], labels[i : i + batch]) for i in shard]
    torch.manual_seed(0)
    model = build_model(ModelSpec(**spec), train.input_shape, 10)
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes,
                            timeout=timedelta(seconds=120))
    neighbours = sorted({(rank - 1) % nodes, (rank + 1) % nodes})  # one on a ring of 2

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if family == "allreduce":
            grads = torch.cat([p.grad.reshape(-1) for p in parameters])
            dist.all_reduce(grads)
            grads /= nodes
            offset = 0
            for p in parameters:
                p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
            return
        flat = torch.cat([p.detach().reshape(-1) for p in parameters])
        received = [torch.empty_like(flat) for _ in neighbours]
        requests = [dist.isend(flat, peer) for peer in neighbours] + \
            [dist.irecv(copy, peer) for copy, peer in zip(received, neighbours, strict=True)]
        for request in requests:
            request.wait()
        mixed = sum(received, flat) / (len(received) + 1)
        offset = 0
        with torch.no_grad():
            for p in parameters:
                p.copy_(mixed[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()

    for index in range(WARMUP_STEPS):
        step(index)
    dist.barrier()
    started = time.perf_counter()
    steps = 0
    # Every rank runs the same number of steps (a rank that stopped early would leave its neighbours waiting):
    # rank 0 decides when the time is up and tells the others in the all-reduce of a flag every 10 steps.
    while True:
        for _ in range(10):
            step(WARMUP_STEPS + steps)
            steps += 1
        flag = torch.tensor([1.0 if time.perf_counter() - started >= seconds else 0.0])
        dist.broadcast(flag, 0)
        if flag.item():
            break
    elapsed = time.perf_counter() - started
    dist.destroy_process_group()
    conn.send(steps / elapsed)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(target: Callable[..., None], nodes: int, args: tuple, timeout_s: float, what: str) -> list[Any]:
    """Run `target(conn, rank, nodes, port, *args)` in `nodes` spawned processes that meet at one port; what each
    sends back, by rank."""
    context = mp.get_context("spawn")
    port = free_port()
    pipes, processes = [], []
    for rank in range(nodes):
        parent, child = context.Pipe()
        process = context.Process(target=target, args=(child, rank, nodes, port, *args))
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        results = []
        for parent in pipes:
            if not parent.poll(timeout_s):
                raise RuntimeError(f"{what} did not finish")
            results.append(parent.recv())
        return results
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def loop_rate(family: str, model_name: str, data_dir: str, seconds: float, nodes: int) -> float:
    """Steps/s per process of the hand-written loop of `family`, the mean over its `nodes` processes."""
    return statistics.mean(run_ranks(hand_written, nodes, (family, model_name, data_dir, seconds), seconds + 300,
                                     f"the hand-written {family} loop on {model_name}"))


def gloo_all_reduce(conn: Connection, rank: int, nodes: int, port: int) -> None:
    """One process of a gloo all-reduce of one element, EXCHANGE_REPEATS times; sends back the median seconds."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes,
                            timeout=timedelta(seconds=120))
    value = torch.zeros(1)
    for _ in range(20):
        dist.all_reduce(value)
    seconds = []
    for _ in range(EXCHANGE_REPEATS):
        started = time.perf_counter()
        dist.all_reduce(value)
        seconds.append(time.perf_counter() - started)
    dist.destroy_process_group()
    conn.send(statistics.median(seconds))


def ring_step_cost(nodes: int) -> float:
    """Seconds a step of gloo's ring costs on this machine: a gloo all-reduce of one element among `nodes`
    processes (the median, the mean over the processes), over the 2 (nodes - 1) steps of a ring all-reduce."""
    return statistics.mean(run_ranks(gloo_all_reduce, nodes, (), 120, "the gloo all-reduce")) / (2 * (nodes - 1))


# -- the agents -----------------------------------------------------------------------------------------------------


@dataclass
class JobFigures:
    steps_per_s: float  # per node, the mean over the nodes
    compute_share: float  # of the nodes' elapsed time, from the driver's accounting
    wait_share: float
    steps: int
    accuracy: float  # the nodes' mean final test accuracy

    @property
    def step_s(self) -> float:
        """A node's own time per step: its compute and the rest of the runner thread's work (sending, receiving,
        bookkeeping), everything but waiting. The simulator charges the latter nowhere else: taking compute alone,
        it ran asynchronous AD-PSGD on logistic 1.56 times as fast as the agents (2-core machine; 1.11 times with
        the rest)."""
        return (1 - self.wait_share) / self.steps_per_s


def job_spec(model_name: str, job: str, steps: int, data_dir: str, nodes: int = NODES) -> dict:
    spec, batch = MODELS[model_name]
    return {
        "name": f"rounds-{model_name}-{job}", "nodes": nodes, "steps": steps, "eval_every": steps, "seed": 1,
        "algorithm": JOBS[job], "model": spec,
        "data": {"data_dir": data_dir, "split": "iid", "batch_size": batch, "test_limit": 500},
        "topology": {"kind": "ring", "seed": 1},
    }


def run_job(cluster: Any, spec: dict) -> JobFigures:
    """Submit `spec` and follow it to its end. Steps/s from each node's reports between its first and its last;
    the shares of compute and waiting over the same span."""
    from nodeagent._proto import coordinator_pb2 as pb

    seen: dict[int, list[pb.NodeProgress]] = {}

    def record(status: pb.JobStatusReply) -> None:
        for node in status.nodes:
            reports = seen.setdefault(node.rank, [])
            if 0 < node.step < spec["steps"] and (not reports or reports[-1].step != node.step):
                copy = pb.NodeProgress()
                copy.CopyFrom(node)
                reports.append(copy)

    status = cluster.wait(cluster.submit(yaml.safe_dump(spec)), JOB_TIMEOUT_S, on_progress=record)
    if status.state != pb.JOB_FINISHED:
        raise RuntimeError(f"{spec['name']}: {pb.JobState.Name(status.state)} {status.reason}")
    rates, computes, waits = [], [], []
    for node in status.nodes:
        reports = seen.get(node.rank, [])
        if len(reports) < 2 or reports[-1].elapsed_s <= reports[0].elapsed_s:
            # Too short for two reports in between: the whole run, its two evaluations included.
            first, last = pb.NodeProgress(), node
        else:
            first, last = reports[0], reports[-1]
        span = last.elapsed_s - first.elapsed_s
        rates.append((last.step - first.step) / span)
        computes.append((last.compute_s - first.compute_s) / span)
        waits.append((last.wait_s - first.wait_s) / span)
    return JobFigures(statistics.mean(rates), statistics.mean(computes), statistics.mean(waits), spec["steps"],
                      statistics.mean(node.test_accuracy for node in status.nodes))


def agents(models: list[str], jobs: list[str], data_dir: str, root: Path, tls: bool, seconds: float,
           loops: dict[tuple[str, str], float], default_steps: int, nodes: int) -> dict[tuple[str, str], JobFigures]:
    from coordinator.cluster import LocalCluster

    figures: dict[tuple[str, str], JobFigures] = {}
    security = "tls" if tls else "insecure"
    with LocalCluster(root=root / security, agents=nodes, data_dir=data_dir, tls=tls, log_level="WARNING") as cluster:
        for model_name in models:
            for job in jobs:
                # As many steps as the hand-written loop of its family makes in `seconds` (without the loops
                # measured, `steps`), at least 30.
                by_hand = loops.get((FAMILY[job], model_name))
                steps = max(30, int(by_hand * seconds) if by_hand is not None else default_steps)
                result = figures[model_name, job] = run_job(cluster, job_spec(model_name, job, steps, data_dir, nodes))
                print(f"  {security} {model_name} {job}: {result.steps_per_s:.1f} steps/s per node (compute "
                      f"{result.compute_share:.0%}, waiting {result.wait_share:.0%}, the rest "
                      f"{1 - result.compute_share - result.wait_share:.0%})", flush=True)
    return figures


# -- the fixed cost of an exchange ----------------------------------------------------------------------------------


def exchange_costs(tls: bool) -> tuple[float, float]:
    """Seconds of an exchange of a 1-element tensor (the median), and the slope in bytes/s from one of 1 MB."""
    sys.path.insert(0, str(Path(__file__).parent))
    import wire

    context = mp.get_context("spawn")
    results = []
    for numel in (1, 1 << 18):
        config = wire.Config(sizes=(numel,), repeats=EXCHANGE_REPEATS if numel == 1 else 30, warmup=10,
                             chunk_bytes=1 << 20, step_model="cnn", step_batch=64, steps=0, step_algorithm="auto",
                             skip_steps=True, link_gbit=10.0)
        method = ("exchange-tls", "raw") if tls else ("exchange", "raw")
        size = wire.measure_size(context, config, numel, [method])
        results.append(statistics.median(size.seconds[method]))
    fixed, large = results
    return fixed, (4 * (1 << 18) - 4) / max(1e-9, large - fixed)


def paid_message_cost(data_dir: str, root: Path, tls: bool, steps: int) -> float:
    """Seconds a message costs a round of agents: 2 agents in synchronous DSGD rounds on logistic regression, each
    round's wait for the other's copy (the mean over both). In lockstep both finish their own work at about the same
    time and push, so the wait is one message's way from the sender's runner to the receiver's: the hand-off to a
    sending thread, the call, the receiving thread's checks and the runner's wake-up, where the exchange above is
    timed from the client's own thread. Its bytes (31 KB) are a small part of it."""
    from coordinator.cluster import LocalCluster

    security = "tls" if tls else "insecure"
    with LocalCluster(root=root / f"paid-{security}", agents=2, data_dir=data_dir, tls=tls,
                      log_level="WARNING") as cluster:
        figures = run_job(cluster, job_spec("logistic", "dsgd-sync", steps, data_dir, nodes=2))
    return figures.wait_share / figures.steps_per_s


# -- the simulator's model of the same jobs ---------------------------------------------------------------------------


def simulated_rate(model_name: str, job: str, figures: JobFigures, data_dir: str, nodes: int, message_cost_s: float,
                   bytes_per_s: float, ring_step_s: float) -> float:
    """Steps/s per node of the same job in the simulator, its step time the agents' own per step
    (`JobFigures.step_s`), its network a message's cost as a round pays it and the slope of an exchange; the latency
    of a link, loopback's, is in a message's cost, and for the all-reduce family a step of gloo's ring
    (`ring_step_cost`), which the simulator charges per ring step."""
    from coordinator.simulate import simulate
    from nodeagent.jobspec import parse_job_spec

    spec = job_spec(model_name, job, figures.steps, data_dir, nodes)
    latency = ring_step_s if FAMILY[job] == "allreduce" else 0.0
    spec["simulation"] = {"step_time_s": figures.step_s, "network": {
        "latency_s": latency, "message_cost_s": message_cost_s, "bandwidth_bytes_per_s": bytes_per_s}}
    return figures.steps / simulate(parse_job_spec(spec)).mesh.now


# -- the report -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sections", nargs="+", default=["loops", "agents", "exchange"],
                        choices=["loops", "agents", "exchange"])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--security", nargs="+", default=["insecure", "tls"], choices=["insecure", "tls"])
    parser.add_argument("--seconds", type=float, default=12.0,
                        help="how long each hand-written loop runs; each job is sized to about as long (default 12)")
    parser.add_argument("--steps", type=int, default=300,
                        help="steps of each job when the loops are not measured in the same run (default 300)")
    parser.add_argument("--nodes", type=int, default=NODES,
                        help=f"processes a side, the loops' and the agents' (default {NODES}; where the machine has "
                        "fewer cores, the agents wait for a core, which the simulator does not model)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the loops and the agents this many times, one after the other, and compare the "
                        "medians, with the range of the runs' own ratios (default 1)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes: at least 2 (a ring)")
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    loop_runs: dict[tuple[str, str], list[float]] = {}
    figure_runs: dict[tuple[str, str, str], list[JobFigures]] = {}
    loops: dict[tuple[str, str], float] = {}
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"run {run + 1} of {args.repeat}:", flush=True)
        reverse = run % 2 == 1  # against a drifting machine (the module's text)
        for section in sorted(set(args.sections) - {"exchange"}, reverse=not reverse):  # loops, agents
            if section == "loops":
                print(f"hand-written torch.distributed gloo loops, {args.nodes} processes:", flush=True)
                for model_name in args.models:
                    for family in sorted({FAMILY[job] for job in args.jobs}):
                        rate = loop_rate(family, model_name, args.data_dir, args.seconds, args.nodes)
                        loop_runs.setdefault((family, model_name), []).append(rate)
                        print(f"  {model_name} {family}: {rate:.1f} steps/s per process", flush=True)
                loops = {key: statistics.median(rates) for key, rates in loop_runs.items()}
            else:
                print(f"peertrain, {args.nodes} agents:", flush=True)
                with tempfile.TemporaryDirectory(prefix="rounds-bench-") as root:
                    for security in reversed(args.security) if reverse else args.security:
                        measured = agents(args.models, args.jobs, args.data_dir, Path(root), security == "tls",
                                          args.seconds, loops, args.steps, args.nodes)
                        for (model_name, job), result in measured.items():
                            figure_runs.setdefault((security, model_name, job), []).append(result)
    # Each job's run of the median rate (the lower one of an even count): its shares and accuracy go with it.
    figures = {key: sorted(runs, key=lambda figure: figure.steps_per_s)[(len(runs) - 1) // 2]
               for key, runs in figure_runs.items()}
    costs: dict[str, tuple[float, float]] = {}  # per security: a message's cost as a round pays it, the slope
    ring_step = 0.0
    if "exchange" in args.sections:
        ring_step = ring_step_cost(args.nodes)
        print(f"a step of gloo's ring on this machine (an all-reduce of one element among {args.nodes} processes, "
              f"over its {2 * (args.nodes - 1)} steps): {ring_step * 1e3:.2f} ms, the simulator's "
              "simulation.network.latency_s of the all-reduce family here", flush=True)
        print("the fixed cost of one exchange (two processes, the peer service), and of a message as a round of 2 "
              "agents pays it (synchronous DSGD, logistic: the wait for the other's copy):", flush=True)
        with tempfile.TemporaryDirectory(prefix="rounds-bench-") as root:
            for security in args.security:
                fixed, slope = exchange_costs(security == "tls")
                paid = paid_message_cost(args.data_dir, Path(root), security == "tls", PAID_STEPS)
                costs[security] = paid, slope
                verdict = "met" if fixed < 1e-3 else "missed"
                print(f"  {security}: {fixed * 1e3:.2f} ms for 1 element ({verdict}: < 1 ms), slope "
                      f"{slope / 1e9:.2f} GB/s; a message in a round {paid * 1e3:.2f} ms (the simulator's "
                      f"simulation.network.message_cost_s for this machine)", flush=True)
    if loops and figures:
        medians = " (medians of the runs; the range of each run's own ratio)" if args.repeat > 1 else ""
        print(f"against the hand-written loop of the family (steps/s per node{medians}):")
        print(f"  {'model':<9} {'job':<10} {'security':<9} {'peertrain':>10} {'by hand':>9} {'ratio':>6}  target")
        for (security, model_name, job), result in figures.items():
            by_hand = loops.get((FAMILY[job], model_name))
            if by_hand is None:
                continue
            ratio = result.steps_per_s / by_hand
            goal = (1.0 if security == "insecure" else 0.9) if job in TARGETED else None
            verdict = "" if goal is None else f"{'met' if ratio >= goal else 'missed'} (>= {goal:.1f}x)"
            spread = ""
            if args.repeat > 1:
                ratios = [figure.steps_per_s / loop for figure, loop in
                          zip(figure_runs[security, model_name, job], loop_runs[FAMILY[job], model_name], strict=True)]
                spread = f" ({min(ratios):.2f}x to {max(ratios):.2f}x)"
            print(f"  {model_name:<9} {job:<10} {security:<9} {result.steps_per_s:>10.1f} {by_hand:>9.1f} "
                  f"{ratio:>5.2f}x{spread}  {verdict}")
    if costs and figures:
        print("the simulator's model of the same jobs (its step time the agents' own per step, all but waiting; its "
              "network a message as a round pays it, and the exchange's slope):")
        print(f"  {'model':<9} {'job':<10} {'security':<9} {'agents':>8} {'simulated':>10} {'ratio':>6}  target")
        for (security, model_name, job), result in figures.items():
            if security not in costs or model_name not in SIMULATED_MODELS:
                continue
            simulated = simulated_rate(model_name, job, result, args.data_dir, args.nodes, *costs[security],
                                       ring_step)
            ratio = simulated / result.steps_per_s
            verdict = "met" if abs(ratio - 1) <= 0.2 else "missed"
            print(f"  {model_name:<9} {job:<10} {security:<9} {result.steps_per_s:>8.1f} {simulated:>10.1f} "
                  f"{ratio:>5.2f}x  {verdict} (within 20%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
