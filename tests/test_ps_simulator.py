"""The parameter-server family in the simulator: the server half runs on the virtual clock, its interface carries
the bytes, and heterogeneous speeds shape the rounds (ESync fills the slowest worker's step, SSGD waits for it,
ASGD and DC-ASGD do not wait)."""

import pytest
import torch

from coordinator.simulate import simulate
from nodeagent.jobspec import parse_job_spec
from nodeagent.ps import RoundMetrics

pytestmark = pytest.mark.unit

SPEEDS = [20.0, 20.0, 20.0, 1.0]


def run(fashion_mnist_dir, name: str, steps: int, options=None, speeds=SPEEDS, **simulation):
    job = {
        "name": name, "nodes": len(speeds), "steps": steps, "eval_every": steps,
        "algorithm": {"name": name, "lr": 0.05, "options": options or {}}, "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "test_limit": 500},
        "simulation": {"step_time_s": 1.0, "speeds": speeds, **simulation},
    }
    return simulate(parse_job_spec(job)).mesh


def test_esync_slowest_worker_does_one_step_per_round_and_the_others_fill_its_time(fashion_mnist_dir):
    mesh = run(fashion_mnist_dir, "esync", 6, {"epsilon": 0.1})
    assert mesh.server.half.version == 6 and [sim.node.algorithm.clock for sim in mesh.nodes] == [6] * 4
    slow, fast = mesh.nodes[3], mesh.nodes[:3]
    assert [r.steps for r in slow.rounds] == [1] * 6
    for sim in fast:
        # A fast step takes 0.05 s: about (1 - epsilon) / 0.05 = 18 steps fit in the slow one's second.
        assert all(15 <= r.steps <= 21 for r in sim.rounds[1:]), [r.steps for r in sim.rounds]
        assert sim.node.algorithm.local_steps == sum(r.steps for r in sim.rounds)
    totals = [RoundMetrics.total(sim.rounds) for sim in mesh.nodes]
    assert all(t.computing_time_ratio > 0.7 for t in totals), [t.computing_time_ratio for t in totals]
    # Every worker received every global model: the runtime's evaluation sees the server's model.
    assert all(torch.equal(sim.node.algorithm.w, mesh.server.half.w) for sim in mesh.nodes)
    assert all(r.samples == 32 * r.steps for r in slow.rounds)


def test_ssgd_waits_for_the_slowest_worker_every_step(fashion_mnist_dir):
    mesh = run(fashion_mnist_dir, "ssgd", 10)
    assert mesh.server.half.version == 10 and mesh.now > 10.0  # ten slow steps of 1 s, plus the network
    fast, slow = RoundMetrics.total(mesh.nodes[0].rounds), RoundMetrics.total(mesh.nodes[3].rounds)
    assert fast.steps == slow.steps == 10
    assert fast.computing_time_ratio < 0.1 < 0.9 < slow.computing_time_ratio
    assert fast.wait_s > 9.0


@pytest.mark.parametrize("name", ["asgd", "dc-asgd"])
def test_asynchronous_workers_do_not_wait_for_the_slowest(fashion_mnist_dir, name):
    mesh = run(fashion_mnist_dir, name, 20)
    assert mesh.server.half.version == 80  # every push applied once
    finish = [sim.driver.compute_s + sim.driver.wait_s for sim in mesh.nodes]
    assert max(finish[:3]) < 2.0 < 19.0 < finish[3]  # 20 fast steps of 0.05 s against 20 slow ones of 1 s
    assert all(RoundMetrics.total(sim.rounds).computing_time_ratio > 0.9 for sim in mesh.nodes)


def test_the_servers_interface_is_shared_and_counts_both_directions(fashion_mnist_dir):
    # Four equal workers, a model of 31,400 bytes and 3.14 MB/s: each transfer takes 10 ms, one at a time.
    network = {"bandwidth_bytes_per_s": 3.14e6, "latency_s": 0.0, "message_cost_s": 0.0}
    mesh = run(fashion_mnist_dir, "ssgd", 5, speeds=[10.0] * 4, network=network)
    # Round 1: a 0.1 s step, four pushes in a row (40 ms), four models in a row (40 ms): 0.18 s. Later rounds:
    # the worker served first steps first, so the pushes no longer queue: the last one waits only for its own
    # push (10 ms) and the four models (40 ms): 0.15 s.
    assert mesh.now == pytest.approx(0.18 + 4 * 0.15)
    for sim in mesh.nodes:
        progress = sim.driver.progress()
        assert progress.bytes_sent == progress.bytes_received == 5 * 31_400
    assert mesh.server.bytes_up == mesh.server.bytes_down == 4 * 5 * 31_400


def test_adacomp_in_the_simulator_sends_far_fewer_bytes_upstream_than_asgd(fashion_mnist_dir):
    dense = run(fashion_mnist_dir, "asgd", 10, speeds=[1.0] * 4)
    sparse = run(fashion_mnist_dir, "adacomp", 10, {"codec": "int8", "pull": "delta"}, speeds=[1.0] * 4)
    assert dense.server.half.version == sparse.server.half.version == 40
    assert dense.server.bytes_up > 100 * sparse.server.bytes_up
    assert dense.server.bytes_down > 2 * sparse.server.bytes_down
