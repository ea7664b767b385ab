"""Every parameter-server algorithm on real agents: 4 agent processes and a coordinator (the server) on loopback.
ESync's slowed-down agent (the job's `slowdown`) does one local step per round while the others do several; a
worker of a synchronous job (ESync) killed and restarted from an older checkpoint rejoins, and the job finishes with
every round applied once. (That SSGD on agents ends with the simulator's model
is in test_equivalence.py.)"""

import json
import math
import time
from pathlib import Path

import pytest
import yaml

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.cluster

ALGORITHMS = {
    "ssgd": ({"name": "ssgd"}, 150, {}),
    "asgd": ({"name": "asgd"}, 150, {}),
    "dc-asgd": ({"name": "dc-asgd", "options": {"adaptive": True}}, 150, {}),
    "adacomp": ({"name": "adacomp", "options": {"rate": 0.05, "codec": "int8", "residual": True, "pull": "delta"}},
                150, {}),
    "esync": ({"name": "esync", "options": {"epsilon": 0.0}}, 15, {3: 200.0}),
    # DiLoCo with the coordinator as outer optimizer: 15 rounds of 10 AdamW steps, int8 pseudo-gradients.
    "diloco-ps": ({"name": "diloco-ps", "lr": 1e-3, "options": {"inner_steps": 10, "precision": "int8"}}, 150, {}),
}


def job(name: str, fashion_mnist_dir, **overrides) -> dict:
    algorithm, steps, slowdown = ALGORITHMS[name]
    return {
        "name": name, "nodes": 4, "steps": steps, "eval_every": steps // 3, "slowdown": slowdown,
        "algorithm": {"lr": 0.05, **algorithm}, "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 50, "test_limit": 1000},
        **overrides,
    }


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_trains_through_the_coordinator(cluster, fashion_mnist_dir, name):
    spec = job(name, fashion_mnist_dir)
    job_id = cluster.submit(yaml.safe_dump(spec))
    status = cluster.wait(job_id, timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    assert [n.step for n in status.nodes] == [spec["steps"]] * 4
    records = read_run_log(status.run_dir)
    first = {r.rank: r.test_accuracy for r in records if r.step == 0 and not math.isnan(r.test_accuracy)}
    for node in status.nodes:
        assert node.test_accuracy > 0.6, f"rank {node.rank} reached only {node.test_accuracy}"
        assert first[node.rank] + 0.2 < node.test_accuracy
        assert node.bytes_sent > 0 and node.bytes_received > 0
        assert not math.isnan(node.loss)
    if name == "adacomp":
        # Compressed pushes: upstream is far below a dense model per push (31,400 bytes for the logistic model).
        assert all(n.bytes_sent < spec["steps"] * 31_400 / 10 for n in status.nodes)
    if name == "esync":
        rounds = spec["steps"]
        by_rank = {n.rank: n.local_steps for n in status.nodes}
        assert by_rank[3] == rounds, by_rank  # the slowest worker: one local step per round
        assert all(by_rank[rank] >= 2 * rounds for rank in (0, 1, 2)), by_rank


def test_a_worker_killed_mid_round_rejoins_and_the_job_finishes(cluster, fashion_mnist_dir):
    """ESync, whose rounds also hold each worker's reports, on real agents; the rejoining of SSGD's and DiLoCo's
    workers, and the server's rounds across a restart, are tested in process (test_ps_algorithms, test_ps_service,
    test_diloco)."""
    name = "esync"
    spec = job(name, fashion_mnist_dir, steps=150, eval_every=20, slowdown={})
    job_id = cluster.submit(yaml.safe_dump(spec))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = cluster.status(job_id)
        if status.state == pb.JOB_RUNNING and min((n.step for n in status.nodes), default=0) >= 45:
            break
        time.sleep(0.1)
    victim = next(n for n in status.nodes if n.rank == 2)
    agent_name = next(n.name for n in cluster.nodes() if n.node_id == victim.node_id)
    cluster.kill(agent_name)
    # It resumes from its checkpoint (step 40), rounds behind: its first call is refused, and it rejoins.
    cluster.start_agent(int(agent_name.split("-")[1]))
    status = cluster.wait(job_id, timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    assert [n.step for n in status.nodes] == [spec["steps"]] * 4
    events = [json.loads(line) for line in (Path(status.run_dir) / "ps-log.jsonl").read_text().splitlines()]
    # Every round applied once: versions 1 .. rounds, one applying push each.
    applied = [e["version"] for e in events if e["event"] == "push" and e["applied"]]
    assert applied == list(range(1, spec["steps"] + 1))
