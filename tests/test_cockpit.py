"""The operator's cockpit on a real cluster (4 agent processes on loopback, mutual TLS), driven through the command
line as an operator drives it: `submit --follow` shows progress and exits with the job's outcome, `jobs` lists it
by name, `logs` shows its events; a failed job's follow exits non-zero with the node's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.system


def job_file(directory: Path, data_dir: Path | str, name: str, steps: int = 200, **extra) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "nodes": 4, "steps": steps, "eval_every": 50, "seed": 3,
        "algorithm": {"name": "dsgd", "lr": 0.05},
        "data": {"data_dir": str(data_dir), "split": "iid", "batch_size": 50, "train_limit": 4000,
                 "test_limit": 500},
        "topology": {"kind": "ring", "seed": 1}, **extra,
    }))
    return path


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def cli(cluster: LocalCluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`coordinator ARGS` as an operator runs it, with the cluster's operator credentials, not on a terminal."""
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=operator_env(cluster), timeout=timeout)


def operator_env(cluster: LocalCluster) -> dict[str, str]:
    return {**os.environ, "PEERTRAIN_COORDINATOR": cluster.address, "PEERTRAIN_TLS_DIR": str(cluster.operator_tls),
            "PEERTRAIN_CONFIG": os.devnull}


def test_submit_follow_shows_progress_and_exits_with_the_outcome(cluster, tmp_path, fashion_mnist_dir):
    done = cli(cluster, "submit", "--follow", str(job_file(tmp_path, fashion_mnist_dir, "followed")))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    job_id = lines[0]
    assert job_id.startswith("followed-")
    # Progress lines (not a terminal: plain lines), then the events, then the per-node table.
    assert any(f"{job_id}: step" in line and "/200" in line for line in lines), done.stdout
    assert any("[finished] rank 2 finished at step 200" in line for line in lines), done.stdout
    assert f"job {job_id} (followed): finished" in done.stdout
    assert "mean test accuracy over 4 nodes" in done.stdout

    listed = cli(cluster, "jobs", "--json")
    jobs = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {"job_id": job_id, "name": "followed", "state": "FINISHED"}.items() <= jobs[0].items()

    # `logs` by the job's name: the coordinator's events and every node's, in order.
    logs = cli(cluster, "logs", "followed", "--json")
    assert logs.returncode == 0, logs.stderr
    events = [json.loads(line) for line in logs.stdout.splitlines()]
    kinds = [(e["kind"], e["rank"]) for e in events]
    assert kinds[0] == ("submitted", -1) and kinds[1] == ("started", -1) and kinds[-1] == ("finished", -1)
    for rank in range(4):
        assert ("started", rank) in kinds and ("finished", rank) in kinds
    assert {e["node"] for e in events if e["rank"] >= 0} == {n.node_id for n in cluster.status(job_id).nodes}
    one = cli(cluster, "logs", job_id[:-2], "--rank", "1")
    assert "rank 1 (" in one.stdout and "[submitted]" in one.stdout
    # Each line is the coordinator's or rank 1's (a message may name another rank: rank 1 waited for rank 2).
    sources = [line.split(maxsplit=3)[3] for line in one.stdout.splitlines()]
    assert all(source.startswith(("coordinator ", "rank 1 (")) for source in sources), one.stdout


def test_follow_of_a_failed_job_exits_non_zero_with_the_reason(cluster, tmp_path, fashion_mnist_dir):
    missing = tmp_path / "no-data-here"
    done = cli(cluster, "submit", "--follow", str(job_file(tmp_path, missing, "doomed")))
    assert done.returncode == 1, done.stdout
    assert "failed" in done.stdout and "no-data-here" in done.stdout
    logs = cli(cluster, "logs", "doomed", "--level", "ERROR")
    lines = logs.stdout.splitlines()
    assert lines and all(" ERROR " in line for line in lines)
    assert any("[failed]" in line and "no data for dataset fashion-mnist (no-data-here)" in line for line in lines), \
        logs.stdout


def test_follow_of_a_stopped_job_exits_3(cluster, tmp_path, fashion_mnist_dir):
    job_id = cluster.submit(job_file(tmp_path, fashion_mnist_dir, "stopped", steps=100_000).read_text())
    follower = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "follow", job_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=operator_env(cluster))
    try:
        wait_for(lambda: min((n.step for n in cluster.status(job_id).nodes), default=0) > 0, 60)
        stopped = cli(cluster, "stop", "stopped")
        assert stopped.returncode == 0 and f"{job_id}: stopped" in stopped.stdout
        out, _ = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 3, out
    assert "[stopped]" in out
    assert cluster.status(job_id).state == pb.JOB_STOPPED
