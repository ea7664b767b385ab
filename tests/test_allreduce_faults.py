"""An all-reduce job on 8 agent processes survives lost members and a coordinator restart: one member killed and
restarted a few seconds later, three times, while the others go on as a quorum of 7; the job finishes, every
rank at the job's last step with bit-identical parameters (their checkpoints), each step committed once; and the
coordinator killed and started again mid-job, while a member is down, does not end it."""

from __future__ import annotations

import time

import pytest
import torch
import yaml
from clusters import final_checkpoint

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.cluster

AGENTS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fashion_mnist_dir):
    with LocalCluster(root=tmp_path_factory.mktemp("faults"), agents=AGENTS, data_dir=str(fashion_mnist_dir),
                      heartbeat_timeout_s=5.0) as running:
        yield running


def allreduce_job(steps: int, name: str) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": AGENTS, "steps": steps, "eval_every": steps, "seed": 4,
        "algorithm": {"name": "allreduce", "lr": 0.05, "momentum": 0.9},
        "model": {"name": "logistic"},
        "data": {"split": "iid", "batch_size": 32, "test_limit": 500},
        "failure": {"step_timeout_s": 5.0, "join_s": 1.0},
        "checkpoint": {"keep": True},  # read after the job ended (final_parameters)
    })


def wait_until(cluster: LocalCluster, job_id: str, condition, timeout_s: float) -> pb.JobStatusReply:
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status(job_id)
        if condition(status):
            return status
        assert status.state == pb.JOB_RUNNING, status.reason
        assert time.monotonic() < deadline, f"steps {[n.step for n in status.nodes]}"
        time.sleep(0.2)


def agent_index(cluster: LocalCluster, status: pb.JobStatusReply, rank: int) -> int:
    node_id = next(n.node_id for n in status.nodes if n.rank == rank)
    return int(next(n.name for n in cluster.nodes() if n.node_id == node_id).split("-")[1])


def final_parameters(cluster: LocalCluster, status: pb.JobStatusReply) -> dict[int, dict]:
    """Each rank's last checkpoint (written at the job's final evaluation), from its agent's state directory."""
    return {node.rank: final_checkpoint(cluster.state_dir(agent_index(cluster, status, node.rank)), status.job_id,
                                        node.rank)
            for node in status.nodes}


def assert_replicas_identical(cluster: LocalCluster, status: pb.JobStatusReply, steps: int) -> None:
    assert status.state == pb.JOB_FINISHED, status.reason
    assert [n.step for n in status.nodes] == [steps] * AGENTS
    states = final_parameters(cluster, status)
    for rank, state in states.items():
        assert state["clock"] == steps, rank
        assert torch.equal(state["w"], states[0]["w"]), f"rank {rank} differs from rank 0"


def quorum_events(cluster: LocalCluster, job_id: str) -> list[pb.JobEvent]:
    events = cluster.stub().JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=10).events
    return [e for e in events if e.kind == "quorum"]


def test_a_member_killed_and_restarted_three_times_costs_the_job_nothing_but_time(cluster):
    steps = 3000
    job_id = cluster.submit(allreduce_job(steps, "kills"))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 100, 120)
    killed = []
    for victim_rank in (2, 5, 2):
        victim = agent_index(cluster, status, victim_rank)
        cluster.kill(f"agent-{victim}")
        at = max(n.step for n in cluster.status(job_id).nodes)
        # The others go on without it, as a quorum of 7.
        wait_until(cluster, job_id,
                   lambda s, a=at, r=victim_rank: min(n.step for n in s.nodes if n.rank != r) > a + 50, 60)
        cluster.start_agent(victim)
        # It comes back at the others' step, with their state, not at its checkpoint's.
        status = wait_until(cluster, job_id, lambda s, a=at, r=victim_rank: s.nodes[r].step > a + 50, 120)
        killed.append(at)
    status = cluster.wait(job_id, 300)
    assert max(killed) < steps, "the job ended before the third kill: make it longer"
    assert_replicas_identical(cluster, status, steps)
    events = quorum_events(cluster, job_id)
    aborted = [e for e in events if "aborted" in e.message]
    assert aborted, [e.message for e in events]
    took_up = [e for e in events if "took up the state of rank" in e.message]
    assert {e.rank for e in took_up} >= {2, 5}, [e.message for e in took_up]
    assert all(e.rank in (2, 5) or "from its checkpoint" not in e.message for e in took_up)


def test_a_coordinator_restart_mid_job_does_not_end_the_all_reduce(cluster):
    steps = 2000
    job_id = cluster.submit(allreduce_job(steps, "coordinator-restart"))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 100, 120)
    # A member lost before the restart and back after it: the others run on in a quorum of the old store, and the
    # quorum with it again forms through the new, empty one.
    victim = agent_index(cluster, status, 3)
    cluster.kill(f"agent-{victim}")
    at = max(n.step for n in cluster.status(job_id).nodes)
    wait_until(cluster, job_id, lambda s: min(n.step for n in s.nodes if n.rank != 3) > at + 50, 60)
    cluster.kill("coordinator")
    time.sleep(2.0)
    cluster.restart_coordinator()
    status = wait_until(cluster, job_id, lambda s: s.state == pb.JOB_RUNNING and
                        min(n.step for n in s.nodes if n.rank != 3) > at + 100, 120)
    cluster.start_agent(victim)
    wait_until(cluster, job_id, lambda s: s.nodes[3].step > at + 150, 120)
    status = cluster.wait(job_id, 300)
    assert_replicas_identical(cluster, status, steps)
