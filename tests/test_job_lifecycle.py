"""A job tells the truth, on 4 agent processes on loopback (the shared cluster): a job that cannot run fails with the
agent's words and frees its agents; a synchronous job survives an agent killed and restarted mid-job (a DiLoCo rank
even when it comes back after the others finished), and fails when the agent does not come back, where an
asynchronous one finishes without it."""

from __future__ import annotations

import re
import time

import pytest
import yaml
from test_cluster import scrape

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.cluster


def job(data_dir, name: str, algorithm: dict, steps: int = 300, topology: str = "ring", **extra) -> str:
    return yaml.safe_dump({
        "name": name, "nodes": 4, "steps": steps, "eval_every": 50, "seed": 2,
        "algorithm": {"lr": 0.05, **algorithm},
        "data": {"data_dir": str(data_dir), "split": "iid", "batch_size": 50, "test_limit": 1000},
        "topology": {"kind": topology, "seed": 1}, **extra,
    })


def wait_until(cluster: LocalCluster, job_id: str, condition, timeout_s: float) -> pb.JobStatusReply:
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status(job_id)
        if condition(status):
            return status
        assert time.monotonic() < deadline, f"job {job_id}: {pb.JobState.Name(status.state)}, steps " \
                                            f"{[n.step for n in status.nodes]}, reason {status.reason!r}"
        time.sleep(0.2)


def agent_of(cluster: LocalCluster, status: pb.JobStatusReply, rank: int) -> str:
    node_id = next(n.node_id for n in status.nodes if n.rank == rank)
    return next(n.name for n in cluster.nodes() if n.node_id == node_id)


def test_a_job_whose_agents_lack_its_data_fails_with_their_words_and_frees_them(cluster, tmp_path,
                                                                                 fashion_mnist_dir):
    submitted = time.monotonic()
    job_id = cluster.submit(job(tmp_path / "nowhere", "no-data", {"name": "dsgd"}))
    status = wait_until(cluster, job_id, lambda s: s.state != pb.JOB_RUNNING and s.state != pb.JOB_PENDING, 30)
    assert status.state == pb.JOB_FAILED and time.monotonic() - submitted < 30
    # At the start barrier, naming a node and the dataset, and where it looked (not a loader's traceback later).
    assert status.reason.startswith("start barrier: rank ") and "(node agent-" in status.reason, status.reason
    assert f"has no data for dataset fashion-mnist (nowhere) (looked in {tmp_path / 'nowhere'})" in status.reason
    assert "failed" in [n.state for n in status.nodes]
    # Its agents are free: the next job runs and finishes.
    following = cluster.wait(cluster.submit(job(fashion_mnist_dir, "after", {"name": "dsgd"}, steps=100)), 120)
    assert following.state == pb.JOB_FINISHED


DILOCO = {"name": "diloco", "lr": 1e-3, "options": {"inner_steps": 20, "precision": "int8"}}


def exchange_failures_with(address: str, node_id: str) -> float:
    """The failed exchanges (an edge found busy aside) that the agent serving /metrics at `address` counted with
    `node_id`."""
    return sum(value for (name, labels), value in scrape(address).items()
               if name == "peertrain_exchange_failures_total" and ("dst", node_id) in labels
               and ("reason", "in_flight") not in labels)


def test_a_synchronous_job_waits_for_an_agent_killed_and_restarted_which_resumes_and_rejoins(cluster,
                                                                                              fashion_mnist_dir):
    """Kill -9 mid-job: the coordinator marks the node down, its neighbours count failed exchanges with it, and once
    restarted it resumes from its last checkpoint, rejoins its neighbours' round, and the job finishes. (Each
    algorithm's rejoining is tested in process by test_rejoin; the all-reduce's on agents by test_allreduce_faults.)"""
    steps = 300
    job_id = cluster.submit(job(fashion_mnist_dir, "restart", {"name": "dsgd", "mode": "sync"}, steps=steps))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 60, 120)
    victim = agent_of(cluster, status, 2)
    victim_id = status.nodes[2].node_id
    log_before = len(cluster.log_of(victim))
    cluster.kill(victim)
    killed_at = cluster.status(job_id).nodes[2].step
    nodes = {n.node_id: n for n in cluster.nodes()}
    neighbours = [nodes[status.nodes[rank].node_id].metrics_address for rank in (1, 3)]
    deadline = time.monotonic() + 60  # the heartbeat timeout (5 s), with room for a busy machine

    def seen() -> tuple[list[float], list[str]]:
        """Each neighbour's failed exchanges with the victim, and what it says it waits for."""
        waiting = cluster.status(job_id).nodes
        return [exchange_failures_with(a, victim_id) for a in neighbours], [waiting[r].waiting_for for r in (1, 3)]

    # A neighbour whose last push reached the victim before it died waits for its step without sending again, and
    # counts no failure (seen with two busy loops beside the suite, and with both neighbours in a fresh clone's
    # suite): a neighbour counts failures with it, or both say they wait for rank 2's parameters.
    failures, waiting = seen()
    while nodes[victim_id].up or not (any(failures) or all(re.search(r"ranks \[[^]]*\b2\b", w) for w in waiting)):
        assert time.monotonic() < deadline, (nodes[victim_id].up, failures, waiting)
        time.sleep(0.2)
        nodes = {n.node_id: n for n in cluster.nodes()}
        failures, waiting = seen()
    cluster.start_agent(int(victim.split("-")[1]))
    status = cluster.wait(job_id, 180)
    assert status.state == pb.JOB_FINISHED, status.reason
    assert [n.step for n in status.nodes] == [steps] * 4
    assert all(n.test_accuracy > 0.6 for n in status.nodes), [n.test_accuracy for n in status.nodes]
    assert "rejoined" in cluster.log_of(victim)[log_before:]
    # The job's events (`coordinator logs`) say where the restarted node took up its rank: its last checkpoint.
    events = cluster.stub().JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=5).events
    resumed = [e for e in events if e.kind == "resumed" and e.rank == 2 and e.node_id == victim_id]
    assert resumed, [(e.kind, e.rank, e.message) for e in events]
    assert 50 <= resumed[-1].step <= killed_at


def test_a_diloco_rank_restarted_after_the_others_finished_takes_their_final_state(cluster, fashion_mnist_dir):
    """DiLoCo over the all-reduce: the restarted rank takes the others' final state and sends nothing again."""
    steps = 300
    job_id = cluster.submit(job(fashion_mnist_dir, "restart", DILOCO, steps=steps))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 60, 120)
    victim = agent_of(cluster, status, 2)
    log_before = len(cluster.log_of(victim))
    cluster.kill(victim)  # kill -9, mid-job: it restarts from its last checkpoint, rounds behind
    wait_until(cluster, job_id, lambda s: all(n.state == "finished" for n in s.nodes if n.rank != 2), 120)
    cluster.start_agent(int(victim.split("-")[1]))
    status = cluster.wait(job_id, 180)
    assert status.state == pb.JOB_FINISHED, status.reason
    assert [n.step for n in status.nodes] == [steps] * 4
    assert all(n.test_accuracy > 0.6 for n in status.nodes), [n.test_accuracy for n in status.nodes]
    assert "took up the state of rank" in cluster.log_of(victim)[log_before:]


@pytest.mark.parametrize(("algorithm", "failure", "outcome"),
                         [({"name": "dsgd", "mode": "sync"}, {}, pb.JOB_FAILED),
                          # All-reduce: the quorum of the 3 others (a majority) goes on without it and finishes; one
                          # that needs all 4 fails.
                          ({"name": "allreduce"}, {}, pb.JOB_FINISHED),
                          ({"name": "allreduce"}, {"min_members": 4}, pb.JOB_FAILED),
                          ({"name": "pdmm-isvr"}, {}, pb.JOB_FINISHED)],
                         ids=["sync-fails", "allreduce-finishes", "allreduce-below-quorum-fails", "async-finishes"])
def test_an_agent_that_does_not_come_back(cluster, fashion_mnist_dir, algorithm, failure, outcome):
    # Paced: unpaced, an asynchronous job's 200 steps can be over before the rank is killed (at its step 50, as a
    # progress report tells), and nothing is then lost.
    job_id = cluster.submit(job(fashion_mnist_dir, "lost", algorithm, steps=200, min_step_s=0.02,
                                failure={"lost_grace_s": 2.0, **failure}))
    status = wait_until(cluster, job_id, lambda s: min((n.step for n in s.nodes), default=0) >= 50, 120)
    victim = agent_of(cluster, status, 2)
    cluster.kill(victim)
    try:
        status = wait_until(cluster, job_id, lambda s: s.state != pb.JOB_RUNNING, 120)
        assert status.state == outcome, status.reason
        assert "rank 2" in status.reason and "lost" in status.reason, status.reason
        if outcome == pb.JOB_FINISHED:
            assert [n.step for n in status.nodes if n.rank != 2] == [200] * 3
    finally:
        cluster.start_agent(int(victim.split("-")[1]))  # back for the tests that follow
        cluster.wait_for_nodes(4, time.monotonic() + 60)
