"""An agent stopped with SIGSTOP in the middle of an asynchronous job, on a real cluster (4 agent processes on
loopback): `coordinator edges` names it within 10 s, its neighbours' staleness gauges for it grow, the others step on
without it; once it goes on its edges come back and the job finishes."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coordinator.cli import main as coordinator_main
from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.cluster

NAMED_WITHIN_S = 10.0
# Paced at about 29 steps/s (`min_step_s`): the stopped agent, stopped near step 50, has some 450 steps left when it
# goes on, 15 s or more, and the job lasts until then, so its edges are seen coming back while it runs; the others
# are still stepping when it goes on (it is stopped for about 8 s, at most 12.5 s by the test's own bounds: they are
# near step 450 at most). Few steps and few messages (interval 4), slowly: the job's CPU is its steps and messages.
STEPS = 500
PACE_S = 0.035
STOPPED_FOR_S = 6.0


def staleness(metrics_address: str, job_id: str, src: str, dst: str) -> float | None:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "peertrain_neighbor_staleness_steps" and sample.labels == {
                    "job_id": job_id, "src": src, "dst": dst}:
                return sample.value
    return None


def edges(cluster: LocalCluster, job: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert coordinator_main(["edges", job, "--json", "--coordinator", cluster.address,
                             "--tls-dir", str(cluster.operator_tls)]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_stopped_agent_is_named_by_edges_holds_up_nobody_and_the_job_finishes(tmp_path, fashion_mnist_dir, capsys):
    job = {
        "name": "edges", "nodes": 4, "steps": STEPS, "eval_every": STEPS, "seed": 3, "min_step_s": PACE_S,
        "algorithm": {"name": "dsgd", "lr": 0.05, "interval": 4}, "topology": {"kind": "ring"},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 20, "train_limit": 2000,
                 "test_limit": 200},
    }
    # Heartbeats go on being missed while the agent is stopped: a long timeout keeps it "up" at the coordinator,
    # so that what the test sees is the edges' own account.
    with LocalCluster(root=tmp_path / "cluster", agents=4, heartbeat_timeout_s=120.0) as cluster:
        job_id = cluster.submit(yaml.safe_dump(job))
        deadline = time.monotonic() + 120
        while True:
            status = cluster.status(job_id)
            assert status.state == pb.JOB_RUNNING and time.monotonic() < deadline, status
            if len(status.nodes) == 4 and all(n.step >= 50 and len(n.edges) == 2 for n in status.nodes):
                break
            time.sleep(0.2)
        ids = {n.rank: n.node_id for n in status.nodes}
        nodes = {n.node_id: n for n in cluster.nodes()}
        victim, neighbours = ids[2], (ids[1], ids[3])
        healthy = edges(cluster, "edges", capsys)  # by name
        assert {e["trouble"] for e in healthy["edges"]} <= {"ok", "failing", "stale"}
        assert {(e["src"], e["dst"]) for e in healthy["edges"]} == {
            (ids[r], ids[(r + d) % 4]) for r in range(4) for d in (1, 3)}
        pid = cluster.processes[nodes[victim].name].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            stopped_unix = time.time()
            before = {n: staleness(nodes[n].metrics_address, job_id, n, victim) for n in neighbours}
            while True:
                shown = edges(cluster, job_id, capsys)
                stalled = {(e["src"], e["dst"]) for e in shown["edges"] if e["trouble"] == "stalled"}
                if {(n, victim) for n in neighbours} <= stalled:
                    break
                assert time.monotonic() - stopped < NAMED_WITHIN_S, shown
                time.sleep(0.5)
            # The stalled edges come first, and the job's waits name them.
            assert {(e["src"], e["dst"]) for e in shown["edges"][:len(stalled)]} == stalled
            assert any(f"-> {victim} is stalled" in line for line in shown["waits_on"])
            time.sleep(2.0)  # the neighbours step on, async: the stopped node falls further behind
            after = {n: staleness(nodes[n].metrics_address, job_id, n, victim) for n in neighbours}
            assert all(after[n] is not None and before[n] is not None and after[n] > before[n] for n in neighbours), \
                (before, after)
            # Stopped long enough for the others' steps to be counted across it.
            time.sleep(max(0.0, stopped + STOPPED_FOR_S - time.monotonic()))
        finally:
            continued_unix = time.time()
            os.kill(pid, signal.SIGCONT)
        # Going on, the node's edges carry messages again, while the job still runs.
        deadline = time.monotonic() + 30
        while any(e["trouble"] == "stalled" for e in edges(cluster, job_id, capsys)["edges"]):
            assert time.monotonic() < deadline, "the edges stayed stalled after SIGCONT"
            time.sleep(0.5)
        assert cluster.status(job_id).state == pb.JOB_RUNNING
        status = cluster.wait(job_id, timeout_s=180)
    assert status.state == pb.JOB_FINISHED and [n.step for n in status.nodes] == [STEPS] * 4, status
    # The others stepped on while it was stopped, and it did not. From 2 s in: a report the agent sent just before it
    # stopped may be taken in late by a busy coordinator; until 0.5 s before the SIGCONT.
    steps_at: dict[str, list[int]] = {}
    for at in (stopped_unix + 2.0, continued_unix - 0.5):
        last = {r.node: r.step for r in read_run_log(status.run_dir) if r.time <= at}
        for node, step in last.items():
            steps_at.setdefault(node, []).append(step)
    assert steps_at[victim][1] == steps_at[victim][0]
    others = [node for node in steps_at if node != victim]
    assert len(others) == 3 and all(steps_at[n][1] > steps_at[n][0] + 50 for n in others), steps_at
