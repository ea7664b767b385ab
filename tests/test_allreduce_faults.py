"""An all-reduce job on the shared cluster of 4 agent processes survives lost members and a coordinator restart, in
one job: a member killed (kill -9), the coordinator killed and started again while it is down, and the member back
(restarted from its checkpoint, it takes the others' state) while the others go on as a quorum of 3; then the
upgrade procedure of docs/operations.md ("Upgrades"): the coordinator stopped and started again, then two agents one
after the other drained, stopped and started again. The job finishes, every rank at the job's last step with
bit-identical parameters (their checkpoints), each step committed once.
(A member killed and restarted with the store up: test_collective_regroup.py on the Collective's processes, and
test_job_lifecycle.py's lost agent on agents. benchmarks/faults.py measures what three kills cost on 8 agents.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml
from clusters import final_checkpoint

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.cluster

AGENTS = 4
# The job must outlast a kill (noticed after the step timeout), an agent's restart, the coordinator's two restarts
# and two agents' drain and restart. On an idle 2-core machine the last of them came at step 200 (the agents forked
# from the fork server restart in about a second); a loaded machine stretches the restarts, during which the others
# step on. Paced at 10 steps/s (`min_step_s`), the job lasts at least 60 s on any machine while a step of 4 members
# costs about 27 ms of CPU here: a quarter of a core, where a faster pace made the job CPU-bound and slowed the tests
# beside it. The test checks that the last event came before the last step.
STEPS = 600
PACE_S = 0.1
UPGRADED = (3, 0)  # the ranks whose agents are upgraded, one after the other


def allreduce_job(data_dir: Path) -> str:
    return yaml.safe_dump({
        "name": "allreduce-faults", "nodes": AGENTS, "steps": STEPS, "eval_every": STEPS, "seed": 4,
        "algorithm": {"name": "allreduce", "lr": 0.05, "momentum": 0.9},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(data_dir), "split": "iid", "batch_size": 32, "test_limit": 500},
        "failure": {"step_timeout_s": 3.0, "join_s": 1.0}, "min_step_s": PACE_S,
        "checkpoint": {"keep": True},  # read after the job ended (final_parameters)
    })


def wait_until(cluster: LocalCluster, job_id: str, condition, what: str, timeout_s: float = 120) -> pb.JobStatusReply:
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status(job_id)
        if condition(status):
            return status
        assert status.state == pb.JOB_RUNNING, f"the job ended before {what}: {status.reason}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: steps {[n.step for n in status.nodes]}"
        time.sleep(0.2)


def agent_index(cluster: LocalCluster, status: pb.JobStatusReply, rank: int) -> int:
    node_id = next(n.node_id for n in status.nodes if n.rank == rank)
    return int(next(n.name for n in cluster.nodes() if n.node_id == node_id).split("-")[1])


def final_parameters(cluster: LocalCluster, status: pb.JobStatusReply) -> dict[int, dict]:
    """Each rank's last checkpoint (written at the job's final evaluation), from its agent's state directory."""
    return {node.rank: final_checkpoint(cluster.state_dir(agent_index(cluster, status, node.rank)), status.job_id,
                                        node.rank)
            for node in status.nodes}


def others_past(rank: int, step: int):
    return lambda s: min(n.step for n in s.nodes if n.rank != rank) > step


def test_members_killed_and_a_coordinator_restart_cost_the_all_reduce_nothing_but_time(cluster, fashion_mnist_dir):
    job_id = cluster.submit(allreduce_job(fashion_mnist_dir))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 30, "step 30")

    # A member lost before a coordinator restart and back after it: the others run on without it in a quorum of 3 of
    # the old store, and the quorum with it again forms through the new, empty one, where it takes their state (it
    # restarted from its checkpoint, steps behind them).
    victim = agent_index(cluster, status, 2)
    cluster.kill(f"agent-{victim}")
    at = max(n.step for n in cluster.status(job_id).nodes)
    wait_until(cluster, job_id, others_past(2, at + 20), "the others to go on without rank 2")
    cluster.kill("coordinator")
    time.sleep(2.0)
    cluster.restart_coordinator()
    wait_until(cluster, job_id, lambda s: s.state == pb.JOB_RUNNING and others_past(2, at + 40)(s),
               "the job to go on after the coordinator's restart")
    cluster.start_agent(victim)
    status = wait_until(cluster, job_id, lambda s: s.nodes[2].step > at + 60, "rank 2 to come back")

    # The upgrade while the job runs: the coordinator stopped (SIGTERM) and started again, then the agents one by
    # one: drained (no new job lands on it), stopped and started again; it takes its rank up again, and is put back
    # in service.
    cluster.stop_coordinator()
    cluster.restart_coordinator()
    at = max(n.step for n in cluster.status(job_id).nodes)
    status = wait_until(cluster, job_id, lambda s: min(n.step for n in s.nodes) > at + 30,
                        "the job to go on after the coordinator's upgrade")
    for rank in UPGRADED:
        victim = agent_index(cluster, status, rank)
        node_id = status.nodes[rank].node_id
        assert cluster.stub().DrainNode(pb.DrainRequest(node_id=node_id, drain=True), timeout=10).draining
        cluster.stop_agent(victim)
        cluster.start_agent(victim)
        at = max(n.step for n in cluster.status(job_id).nodes)
        status = last_event = wait_until(cluster, job_id, lambda s, r=rank, a=at: s.nodes[r].step > a + 30,
                                         f"the upgraded agent of rank {rank} to come back")
        assert not cluster.stub().DrainNode(pb.DrainRequest(node_id=node_id, drain=False), timeout=10).draining
    assert max(n.step for n in last_event.nodes) < STEPS, "the job ended before its faults: make it longer"
    print(f"the last fault's step: {max(n.step for n in last_event.nodes)} of {STEPS}")

    status = cluster.wait(job_id, 300)
    assert status.state == pb.JOB_FINISHED, status.reason
    assert [n.step for n in status.nodes] == [STEPS] * AGENTS
    states = final_parameters(cluster, status)
    for rank, state in states.items():
        assert state["clock"] == STEPS, rank
        assert torch.equal(state["w"], states[0]["w"]), f"rank {rank} differs from rank 0"
    events = cluster.stub().JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=10).events
    quorums = [e for e in events if e.kind == "quorum"]
    assert any("aborted" in e.message for e in quorums), [e.message for e in quorums]
    took_up = [e for e in quorums if "took up the state of rank" in e.message]
    assert {e.rank for e in took_up} >= {2, *UPGRADED}, [e.message for e in took_up]
