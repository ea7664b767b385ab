"""A coordinator and 4 agents as separate processes on loopback, training on the real Fashion-MNIST."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from coordinator.cluster import ClusterError, LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.cluster


def job_yaml(data_dir: str, steps: int, eval_every: int, name: str) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": 4, "steps": steps, "eval_every": eval_every,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 4},
        "model": {"name": "logistic"},
        "data": {"data_dir": data_dir, "split": "class-window", "batch_size": 50, "test_limit": 2000},
        "topology": {"kind": "ring", "seed": 3},
    })


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.replace('"', "").split(",") if p)
        samples[(name, pairs)] = float(value)
    return samples


def accuracy_by_rank(run_dir: str) -> dict[int, list[float]]:
    curves = defaultdict(list)
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["test_accuracy"] is not None and (not curves[record["rank"]] or
                                                    curves[record["rank"]][-1] != record["test_accuracy"]):
            curves[record["rank"]].append(record["test_accuracy"])
    return curves


def test_four_agents_train_and_exchange_on_every_edge(cluster, fashion_mnist_dir):
    job_id = cluster.submit(job_yaml(str(fashion_mnist_dir), steps=400, eval_every=100, name="smoke"))
    status = cluster.wait(job_id, timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    assert [n.step for n in status.nodes] == [400] * 4
    curves = accuracy_by_rank(status.run_dir)
    for rank in range(4):
        assert len(curves[rank]) >= 3, curves[rank]
        assert curves[rank][-1] > curves[rank][0] + 0.05, f"rank {rank} did not learn: {curves[rank]}"
        assert curves[rank][-1] > 0.5
    rank_of = {m.rank: m.node_id for m in status.nodes}
    last = {record.rank: record for record in read_run_log(status.run_dir)}
    for rank in rank_of:
        # The job's own traffic, per edge, in its run's log: both ring neighbours, never the node across.
        edges = {edge.peer: edge for edge in last[rank].edges}
        assert set(edges) == {rank_of[(rank - 1) % 4], rank_of[(rank + 1) % 4]}
        assert all(edge.bytes_sent > 0 and edge.bytes_received > 0 for edge in edges.values())
        assert last[rank].bytes_sent == sum(edge.bytes_sent for edge in edges.values())
        assert status.nodes[rank].bytes_sent == last[rank].bytes_sent
    # A finished job's series are gone from the agents' Prometheus endpoints (its figures stay in the log); a
    # neighbour's call still in flight at the end may bring some back until its deadline (30 s), and no longer.
    nodes = {n.node_id: n for n in cluster.nodes()}
    deadline = time.monotonic() + 40
    for node_id in rank_of.values():
        while [key for key in scrape(nodes[node_id].metrics_address) if ("job_id", job_id) in key[1]]:
            assert time.monotonic() < deadline, f"{node_id} still has series of the finished job {job_id}"
            time.sleep(0.5)


def test_agents_and_coordinator_exit_cleanly_on_sigterm(tmp_path, fashion_mnist_dir):
    cluster = LocalCluster(root=tmp_path, agents=2, data_dir=str(fashion_mnist_dir))
    cluster.start()
    try:
        for process in cluster.processes.values():
            process.send_signal(signal.SIGTERM)
        # A bound, not a speed: an agent's goodbye to a coordinator stopping beside it may wait out its call, and a
        # loaded machine took over 20 s.
        codes = {name: process.wait(timeout=90) for name, process in cluster.processes.items()}
    finally:
        cluster.stop()
    assert codes == dict.fromkeys(codes, 0), codes
    assert all("shutting down" in cluster.log_of(name) for name in codes)


def test_a_cluster_that_cannot_start_in_time_stops_what_it_started(tmp_path):
    cluster = LocalCluster(root=tmp_path, agents=2)
    with pytest.raises(ClusterError, match="did not start in time"):
        cluster.start(timeout_s=0.0)
    assert cluster.processes and all(process.poll() is not None for process in cluster.processes.values())


HOLD_A_CLUSTER = """
import sys, time
from pathlib import Path
from coordinator.cluster import LocalCluster
root = Path(sys.argv[1])
with LocalCluster(root=root, agents=1, data_dir=sys.argv[2], tls=False) as cluster:
    (root / "pids").write_text(" ".join(str(process.pid) for process in cluster.processes.values()))
    time.sleep(600)
"""


def test_a_program_holding_a_cluster_stops_its_processes_when_it_is_sent_sigterm(tmp_path, fashion_mnist_dir):
    """What `timeout` or `kill` does to a benchmark: the coordinator and agents it started end with it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_CLUSTER, str(tmp_path), str(fashion_mnist_dir)],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        deadline = time.monotonic() + 180  # a bound for a loaded machine, not a speed
        while not (tmp_path / "pids").exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the cluster did not start"
            time.sleep(0.2)
        pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=90) == 128 + signal.SIGTERM
    finally:
        holder.kill()
        holder.wait()
    assert len(pids) == 2 and not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
