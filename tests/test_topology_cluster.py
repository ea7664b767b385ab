"""A running job's topology changed on a real cluster (a coordinator and agents as processes on loopback, with TLS,
training on Fashion-MNIST): `coordinator topology JOB --kind multiplex-ring` mid-job moves traffic onto the new
distance-2 edges, every node switches at the same step and says so, and the job finishes. (That the change does
not cost the job accuracy against the same job that kept its ring is shown in the simulator, which runs this job
deterministically: tests/test_topology_change.py.)"""

from __future__ import annotations

import time

import pytest
import yaml

from coordinator.cli import main as coordinator_main
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.events import TOPOLOGY, read_events
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.cluster

# The shared cluster's four agents: on a ring of four the distance-2 edges (0-2 and 1-3) are new edges, one per node.
AGENTS = 4
FAR_PEERS = 1  # each node's neighbours at distance 2 on a multiplex ring of AGENTS
# Paced at 20 steps/s (`min_step_s`), the job lasts at least 10 s on any machine: the switch comes some 5 s of steps
# after the request at step 20. A step costs about the same CPU at any pace, so the job's CPU is in its number of
# steps: 1200 steps at 100 steps/s cost several times as much.
STEPS = 200
PACE_S = 0.05
REQUEST_AT_STEP = 20  # about 1 s into the job


def job_yaml(data_dir, name: str) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": AGENTS, "steps": STEPS, "eval_every": STEPS, "seed": 1,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 2},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(data_dir), "split": "class-window", "batch_size": 50, "train_limit": 10000,
                 "test_limit": 2000},
        "topology": {"kind": "ring", "seed": 3}, "min_step_s": PACE_S,
    })


def distance(a: int, b: int) -> int:
    return min((a - b) % AGENTS, (b - a) % AGENTS)


def test_a_ring_changed_to_a_multiplex_ring_mid_job_moves_traffic_onto_the_new_edges(cluster, fashion_mnist_dir,
                                                                                       capsys):
    logged = {i: len(cluster.log_of(f"agent-{i}")) for i in range(AGENTS)}  # the shared cluster's earlier lines
    job_id = cluster.submit(job_yaml(fashion_mnist_dir, "changed-ring"))
    deadline = time.monotonic() + 120
    while min((n.step for n in cluster.status(job_id).nodes), default=0) < REQUEST_AT_STEP:
        assert time.monotonic() < deadline, f"the job did not reach step {REQUEST_AT_STEP}"
        time.sleep(0.2)
    address = ["--coordinator", cluster.address, "--tls-dir", str(cluster.operator_tls)]
    requested = time.time()
    assert coordinator_main(["topology", "changed-ring", "--kind", "multiplex-ring", *address]) == 0
    printed = capsys.readouterr().out
    switch_step = int(printed.split("just before step ")[1])
    assert switch_step < STEPS, printed
    changed = cluster.wait(job_id, 300)
    assert changed.state == pb.JOB_FINISHED, changed.reason
    assert [n.step for n in changed.nodes] == [STEPS] * AGENTS
    agent_logs = "".join(cluster.log_of(f"agent-{i}")[logged[i]:] for i in range(AGENTS))

    rank_of = {n.node_id: n.rank for n in changed.nodes}
    records = read_run_log(changed.run_dir)

    def far_bytes(record) -> int:
        return sum(e.bytes_sent + e.bytes_received for e in record.edges
                   if e.peer in rank_of and distance(record.rank, rank_of[e.peer]) == 2)

    # Before the change no distance-2 edge carried a byte; after it every node's distance-2 edges did. (Around the
    # switch a node still before it answers a new neighbour that has switched: the edge's first bytes may be counted
    # at a step just below the switch step, hence the time of the request rather than the step.)
    before = [r for r in records if r.time < requested]
    assert before and not any(far_bytes(r) for r in before)
    last = {r.rank: r for r in records}
    assert sorted(last) == list(range(AGENTS))
    for record in last.values():
        far = [e for e in record.edges if e.peer in rank_of and distance(record.rank, rank_of[e.peer]) == 2]
        assert len(far) == FAR_PEERS and all(e.bytes_sent > 0 and e.bytes_received > 0 for e in far), record.edges
    # Every node switched at the same step, on time, and said so; the change is in the run's events.
    assert agent_logs.count(f"at step {switch_step}: neighbours") == AGENTS
    assert "late: the job switched" not in agent_logs
    events, _ = read_events(changed.run_dir)
    assert [e.message for e in events if e.kind == TOPOLOGY] == [
        f"topology ring -> multiplex-ring (version 2) at step {switch_step}"]
