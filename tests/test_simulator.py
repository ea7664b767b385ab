"""The virtual-clock simulator: faults, determinism, the network and device model, the metrics log."""

import math

import pytest
import torch

from coordinator.simulate import simulate
from nodeagent.jobspec import JobSpecError, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.events import read_events
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.unit


def spec(fashion_mnist_dir, **overrides):
    base = {
        "name": "sim", "nodes": 8, "steps": 60, "eval_every": 30,
        "algorithm": {"name": "dsgd", "lr": 0.02, "interval": 4},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 50, "test_limit": 500},
        "topology": {"kind": "ring", "seed": 1},
        "simulation": {"step_time_s": 0.01},
    }
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return parse_job_spec(base)


def failures(metrics: Metrics, dst: str, reason: str) -> float:
    return sum(
        sample.value
        for family in metrics.registry.collect() if family.name == "peertrain_exchange_failures"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["dst"] == dst and sample.labels["reason"] == reason
    )


def test_16_nodes_with_a_node_down_for_a_period(fashion_mnist_dir, tmp_path):
    job = spec(
        fashion_mnist_dir, nodes=16, steps=160, eval_every=80,
        data={"split": "class-window"}, topology={"kind": "multiplex-ring"},
        simulation={"step_time_s": 0.01, "faults": [{"node": 5, "down_from": 0.5, "down_until": 1.0}]},
    )
    metrics = Metrics()
    trace = []

    def sample(mesh):
        victim = mesh.nodes[5]
        trace.append((mesh.now, victim.node.algorithm.clock, victim.driver.progress().bytes_sent))

    result = simulate(job, tmp_path / "run", metrics=metrics, on_progress=sample)
    assert result.mesh.finished
    assert all(sim.node.algorithm.clock == 160 for sim in result.mesh.nodes)
    inside = [(clock, sent) for now, clock, sent in trace if 0.5 <= now < 1.0]
    assert inside and len(set(inside)) == 1, "the down node stepped or sent while down"
    before = max(clock for now, clock, _ in trace if now < 0.5)
    after = max(clock for now, clock, _ in trace if now < 1.2)
    assert before >= 40 and after > inside[0][0]
    # Its neighbours (distance 1 and 2 on the multiplex ring) kept trying and counted the refusals.
    assert failures(metrics, "rank5", "unavailable") > 0
    assert failures(metrics, "rank12", "unavailable") == 0
    # Everyone else finished at about the same virtual time; the victim is late by about its down time.
    finish = [sim.driver.compute_s for sim in result.mesh.nodes]
    assert math.isclose(finish[5], finish[0], rel_tol=1e-9)
    records = read_run_log(tmp_path / "run")
    assert {r.rank for r in records} == set(range(16))
    final = [r for r in records if r.finished]
    assert len(final) == 16 and all(r.step == 160 for r in final)
    assert max(r.time for r in final if r.rank == 5) > max(r.time for r in final if r.rank == 0) + 0.3
    assert sum(r.test_accuracy for r in final) / 16 > 0.5


def test_same_seed_same_result_other_seed_other_timing(fashion_mnist_dir):
    job = spec(fashion_mnist_dir, simulation={"step_time_s": 0.01, "jitter": 0.3, "seed": 1})
    first, second = simulate(job).mesh, simulate(job).mesh
    assert first.now == second.now
    for a, b in zip(first.nodes, second.nodes, strict=True):
        assert torch.equal(a.node.algorithm.w, b.node.algorithm.w)
    other = simulate(spec(fashion_mnist_dir, simulation={"step_time_s": 0.01, "jitter": 0.3, "seed": 2})).mesh
    assert other.now != first.now


def test_slow_links_cost_virtual_time_in_synchronous_rounds(fashion_mnist_dir):
    cost = 0.002  # each message's fixed cost
    fast = spec(fashion_mnist_dir, algorithm={"mode": "sync"},
                simulation={"network": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0, "message_cost_s": cost}})
    slow = spec(fashion_mnist_dir, algorithm={"mode": "sync"},
                simulation={"network": {"bandwidth_bytes_per_s": 1e6, "latency_s": 0.0, "message_cost_s": cost}})
    fast_mesh, slow_mesh = simulate(fast).mesh, simulate(slow).mesh
    message_bytes = fast_mesh.nodes[0].node.algorithm.w.numel() * 4
    # Each round: compute, then two messages over links of their own: one message's time per round.
    assert fast_mesh.now == pytest.approx(60 * (0.01 + cost + message_bytes / 1e9), rel=1e-6)
    assert slow_mesh.now == pytest.approx(60 * (0.01 + cost + message_bytes / 1e6), rel=1e-6)
    # Same mathematics, whatever the network: synchronous rounds do not depend on timing.
    for a, b in zip(fast_mesh.nodes, slow_mesh.nodes, strict=True):
        assert torch.equal(a.node.algorithm.w, b.node.algorithm.w)


def test_relative_speeds_set_each_nodes_pace(fashion_mnist_dir):
    job = spec(fashion_mnist_dir, simulation={"step_time_s": 0.01, "speeds": [1, 1, 1, 0.5, 1, 1, 1, 2]})
    mesh = simulate(job).mesh
    compute = [sim.driver.compute_s for sim in mesh.nodes]
    assert compute[3] == pytest.approx(1.2) and compute[7] == pytest.approx(0.3) and compute[0] == pytest.approx(0.6)


def test_partition_and_message_loss_fail_exchanges(fashion_mnist_dir):
    metrics = Metrics()
    job = spec(fashion_mnist_dir, simulation={
        "partitions": [{"groups": [[0, 1, 2, 3], [4, 5, 6, 7]], "start": 0.0, "end": 10.0}],
    })
    simulate(job, metrics=metrics)
    # Ring edges 3-4 and 7-0 cross the cut; 1-2 does not.
    assert failures(metrics, "rank4", "unavailable") > 0 and failures(metrics, "rank0", "unavailable") > 0
    assert failures(metrics, "rank2", "unavailable") == 0
    lossy = Metrics()
    simulate(spec(fashion_mnist_dir, simulation={"network": {"loss": 0.3}}), metrics=lossy)
    assert sum(failures(lossy, f"rank{r}", "deadline_exceeded") for r in range(8)) > 0


def test_simulation_section_is_validated():
    with pytest.raises(JobSpecError, match=r"simulation\.speeds"):
        parse_job_spec({"nodes": 2, "simulation": {"speeds": [1.0]}})
    with pytest.raises(JobSpecError, match=r"simulation\.faults"):
        parse_job_spec({"nodes": 2, "simulation": {"faults": [{"node": 3, "down_from": 0, "down_until": 1}]}})


@pytest.mark.parametrize(("mode", "state"), [("sync", "FAILED"), ("async", "FINISHED")])
def test_a_node_down_for_longer_than_the_failure_policy_allows_ends_the_job_as_on_agents(fashion_mnist_dir, tmp_path,
                                                                                          mode, state):
    """The coordinator's failure policy runs on the virtual clock: a node silent for longer than the heartbeat
    timeout (15 s) and `failure.lost_grace_s` fails a synchronous job, and an asynchronous one finishes without it
    once the others have; the run ends there, and its events say why."""
    job = spec(fashion_mnist_dir, nodes=4, steps=20, eval_every=20, algorithm={"mode": mode},
               failure={"lost_grace_s": 5},
               simulation={"faults": [{"node": 2, "down_from": 0.05, "down_until": 1000}]})
    result = simulate(job, tmp_path / "run")
    assert result.job.state == state
    assert 20 < result.mesh.now < 22  # silent since its last heartbeat, at 0 s, for longer than 15 + 5 s
    assert result.mesh.nodes[2].node.algorithm.clock < 20
    kinds = [(e.kind, e.message) for e in read_events(tmp_path / "run")[0]]
    assert [kind for kind, _ in kinds].count("released") == 1  # at the start barrier, every rank ready
    if state == "FAILED":
        assert result.job.reason.startswith("lost rank 2 (node rank2, silent for 2")
        assert kinds[-1] == ("failed", result.job.reason)
    else:
        assert all(sim.node.algorithm.clock == 20 for sim in result.mesh.nodes if sim.rank != 2)
        assert kinds[-1][0] == "finished" and kinds[-1][1].startswith("without the lost rank 2 (node rank2")


def test_a_synchronous_job_that_runs_longer_than_its_start_barrier_and_failure_bounds_finishes(fashion_mnist_dir):
    """Released at virtual time 0, the job is released for the coordinator's rules too: it runs past its
    `start.timeout_s` (10 s here). And its nodes, which report at their evaluations only (30 s apart here), are seen
    to step: the rules hold a synchronous job whose highest step does not move for the heartbeat timeout and
    `failure.lost_grace_s` (15 + 5 s) as withheld."""
    job = spec(fashion_mnist_dir, nodes=4, steps=30, eval_every=30, algorithm={"mode": "sync", "interval": 1},
               start={"timeout_s": 10}, failure={"lost_grace_s": 5}, simulation={"step_time_s": 1.0})
    result = simulate(job)
    assert result.job.state == "FINISHED", result.job.reason
    assert result.mesh.now > 30
    assert all(sim.node.algorithm.clock == 30 for sim in result.mesh.nodes)


def test_a_run_keeps_prometheus_series_only_for_a_caller_that_reads_them(fashion_mnist_dir, tmp_path):
    # `coordinator simulate` keeps none (nothing serves them); the nodes must compute the same either way.
    job = spec(fashion_mnist_dir, nodes=4, steps=20, eval_every=10)
    metrics = Metrics()
    simulate(job, tmp_path / "kept", metrics=metrics)
    simulate(job, tmp_path / "none")
    steps = [sample.value for family in metrics.registry.collect() if family.name == "peertrain_local_steps"
             for sample in family.samples if sample.name.endswith("_total")]
    assert steps == [20.0] * 4
    kept, none = read_run_log(tmp_path / "kept"), read_run_log(tmp_path / "none")
    assert len(kept) >= 12 and kept == none
