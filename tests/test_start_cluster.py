"""The start barrier on a local cluster (4 agents, processes on loopback, real Fashion-MNIST): a seeded job runs
alike twice (the same accuracy and traffic), and no rank steps before the last is ready."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.cluster

AGENTS = 4


def job_yaml(data_dir: str, name: str, steps: int, mode: str) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": AGENTS, "steps": steps, "eval_every": steps, "seed": 5,
        "algorithm": {"name": "dsgd", "mode": mode, "lr": 0.05, "interval": 1},
        "model": {"name": "logistic"},
        "data": {"data_dir": data_dir, "split": "class-window", "batch_size": 32, "test_limit": 2000},
        "topology": {"kind": "ring"},
    })


def final_accuracies(cluster: LocalCluster, spec_yaml: str) -> dict[int, float]:
    status = cluster.wait(cluster.submit(spec_yaml), timeout_s=180)
    assert status.state == pb.JOB_FINISHED, status.reason
    return {node.rank: node.test_accuracy for node in status.nodes}


def test_a_seeded_job_run_twice_gives_each_node_the_same_accuracy_and_traffic(cluster, fashion_mnist_dir):
    """Synchronous D-PSGD on a non-iid split: every node starts from the same seeded model once all are ready,
    and each round mixes the neighbours' copies of that round, so the run is a function of its seed. (The
    asynchronous mode mixes whatever copy arrived last: its accuracies still vary by about a point from run to
    run, barrier or not.) It sends every neighbour one copy per step, whatever the timing, so its traffic is the same
    each run too (an asynchronous job's varies with the exchanges that find their edge busy); before figures were
    per job, the second run showed the first one's bytes too."""
    spec = job_yaml(str(fashion_mnist_dir), "twice", 300, "sync")
    runs = []
    for _ in range(2):
        status = cluster.wait(cluster.submit(spec), timeout_s=180)
        assert status.state == pb.JOB_FINISHED, status.reason
        runs.append({node.rank: node for node in status.nodes})
    first, second = runs
    assert first.keys() == second.keys() == set(range(AGENTS))
    for rank in first:
        accuracies = (first[rank].test_accuracy, second[rank].test_accuracy)
        assert abs(accuracies[0] - accuracies[1]) <= 0.005, (rank, accuracies)
        sent = (first[rank].bytes_sent, second[rank].bytes_sent)
        assert sent[0] > 0 and abs(sent[1] - sent[0]) <= 0.05 * sent[0], (rank, sent)


def test_no_rank_steps_before_the_last_rank_is_ready(cluster, fashion_mnist_dir):
    """One agent is paused (SIGSTOP) while the job starts: the others build their nodes, report ready and wait for
    it; nothing is stepped until it has resumed, built its node and reported ready too."""
    final_accuracies(cluster, job_yaml(str(fashion_mnist_dir), "warm", 20, "async"))  # every agent's data loaded
    late = cluster.processes["agent-3"]
    os.kill(late.pid, signal.SIGSTOP)
    try:
        job_id = cluster.submit(job_yaml(str(fashion_mnist_dir), "late", 200, "async"))
        time.sleep(2.5)  # within the heartbeat timeout: the paused agent stays up
    finally:
        os.kill(late.pid, signal.SIGCONT)
    status = cluster.wait(job_id, timeout_s=120)
    assert status.state == pb.JOB_FINISHED, status.reason
    late_node = next(n.node_id for n in cluster.nodes() if n.name == "agent-3")
    events = cluster.stub().JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=5).events
    (released,) = [e for e in events if e.kind == "released"]
    waiting = [e for e in events if e.kind == "ready"]
    # Each of the other ranks said it was ready and waited for the paused agent's rank.
    assert {e.node_id for e in waiting} == {n.node_id for n in status.nodes} - {late_node}
    assert all(late_node in e.message for e in waiting)
    assert released.time_unix - max(e.time_unix for e in waiting) > 1.0  # they waited through the pause
    # No report of a step came before the release.
    reports = [json.loads(line) for line in Path(status.run_dir, "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in reports if r["step"] > 0]
    assert stepped and min(r["time"] for r in stepped) > released.time_unix
