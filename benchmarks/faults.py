"""Goodput of a synchronous all-reduce job that loses members (issue 15: at least 0.8x the same job without faults).

Starts a local cluster (a coordinator and `--agents` agents, processes on loopback, mutual TLS), runs one job to
warm the agents (their data is then loaded), then the same seeded all-reduce SGD job (logistic, Fashion-MNIST,
momentum 0.9) twice: without faults, and with one member killed (kill -9) every `--kill-every` seconds and started
again `--down` seconds later, `--kills` times (a different rank each time). Goodput is the job's committed steps per
second over the whole run, from the moment every rank took its first step until the job finished. After each run
the ranks' final parameters (their checkpoints) must be bit-identical, every rank at the job's last step.

    .venv/bin/python benchmarks/faults.py [--agents 8] [--steps 6000] [--kill-every 30] [--down 10] [--kills 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import yaml

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.agent.checkpoint import checkpoint_path
from nodeagent.jobspec import DEFAULT_DATA_DIR

TARGET = 0.8
POLL_S = 0.1


def job_yaml(agents: int, steps: int, data_dir: str, name: str) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": agents, "steps": steps, "eval_every": steps, "seed": 4,
        "algorithm": {"name": "allreduce", "lr": 0.05, "momentum": 0.9},
        "model": {"name": "logistic"},
        "data": {"data_dir": data_dir, "split": "iid", "batch_size": 32, "test_limit": 2000},
        "failure": {"step_timeout_s": 5.0, "join_s": 1.0},
        "checkpoint": {"keep": True},  # compared at the end: an agent deletes an ended job's checkpoints otherwise
    })


def agent_of(cluster: LocalCluster, status: pb.JobStatusReply, rank: int) -> int:
    node_id = next(n.node_id for n in status.nodes if n.rank == rank)
    return int(next(n.name for n in cluster.nodes() if n.node_id == node_id).split("-")[1])


def identical_replicas(cluster: LocalCluster, status: pb.JobStatusReply, steps: int) -> bool:
    states = [torch.load(checkpoint_path(cluster.state_dir(agent_of(cluster, status, n.rank)), status.job_id,
                                         n.rank, keep=True), weights_only=True) for n in status.nodes]
    return all(s["clock"] == steps and torch.equal(s["w"], states[0]["w"]) for s in states)


def run(cluster: LocalCluster, args: argparse.Namespace, name: str, faults: bool) -> tuple[float, int, bool]:
    """One job: its goodput (steps per second), the kills made, and whether its replicas ended bit-identical."""
    job_id = cluster.submit(job_yaml(args.agents, args.steps, args.data_dir, name))
    while True:
        status = cluster.status(job_id)
        if status.nodes and min(n.step for n in status.nodes) >= 1:
            break
        time.sleep(POLL_S)
    started = time.monotonic()
    kills: list[tuple[float, int]] = []  # (when to start it again, agent)
    killed = 0
    next_kill = started + args.kill_every
    while status.state not in (pb.JOB_FINISHED, pb.JOB_FAILED, pb.JOB_STOPPED):
        now = time.monotonic()
        if faults and killed < args.kills and now >= next_kill:
            agent = agent_of(cluster, status, (2 + 3 * killed) % args.agents)
            cluster.kill(f"agent-{agent}")
            print(f"  {now - started:6.1f} s: killed agent-{agent} at step {max(n.step for n in status.nodes)}",
                  flush=True)
            kills.append((now + args.down, agent))
            killed += 1
            next_kill += args.kill_every
        for due, agent in [k for k in kills if k[0] <= now]:
            cluster.start_agent(agent)
            print(f"  {now - started:6.1f} s: started agent-{agent} again", flush=True)
            kills.remove((due, agent))
        time.sleep(POLL_S)
        status = cluster.status(job_id)
    elapsed = time.monotonic() - started
    for _, agent in kills:  # the job ended before its restart was due
        cluster.start_agent(agent)
    if status.state != pb.JOB_FINISHED:
        raise SystemExit(f"job {name} ended {pb.JobState.Name(status.state)}: {status.reason}")
    return args.steps / elapsed, killed, identical_replicas(cluster, status, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--down", type=float, default=10.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, \
            LocalCluster(Path(root), args.agents, data_dir=args.data_dir, heartbeat_timeout_s=5.0) as cluster:
        cluster.wait(cluster.submit(job_yaml(args.agents, 200, args.data_dir, "warm")), 300)
        baseline, _, baseline_identical = run(cluster, args, "no-faults", faults=False)
        print(f"without faults: {baseline:.1f} steps/s, replicas bit-identical: {baseline_identical}", flush=True)
        goodput, kills, identical = run(cluster, args, "faults", faults=True)
        print(f"with {kills} kills (every {args.kill_every:g} s, back {args.down:g} s later): {goodput:.1f} steps/s, "
              f"replicas bit-identical: {identical}")
    ratio = goodput / baseline
    print(f"goodput ratio {ratio:.2f}x (target >= {TARGET}x): {'met' if ratio >= TARGET else 'NOT met'}; "
          f"{args.agents} agents, {args.steps} steps")
    if kills < args.kills:
        print(f"the job finished after {kills} of {args.kills} kills: give it more --steps")


if __name__ == "__main__":
    main()
