"""The agent's node loop (nodeagent.agent.runner.NodeLoop) and its dispatch, run in threads with in-process fake
transports instead of gRPC: the same job ends bit for bit as in the simulator, a push that fails is retried until
it is delivered, and a busy edge is not called twice."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import pytest
import torch

from coordinator.simulate import build_nodes, simulate
from nodeagent.agent.dispatch import Dispatch
from nodeagent.agent.runner import NodeLoop
from nodeagent.algorithms.base import SendFailed
from nodeagent.jobspec import parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime import driver as driver_module
from nodeagent.runtime.driver import NodeDriver, Report
from nodeagent.training.job import Node
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit


class LoopbackPeers:
    """Delivers a node's sends straight into its peers' inboxes; exchanges and pulls are answered from the peer's
    published snapshot, as the peer service does. `fail_pushes` pushes fail first (unavailable, transient);
    `exchange_delay_s` holds every exchange that long."""

    def __init__(self, rank: int, network: LoopbackNetwork):
        self.rank = rank
        self.network = network

    def _peer(self, rank: int) -> tuple[queue.Queue, Node]:
        return self.network.inboxes[rank], self.network.nodes[rank]

    def begin_push(self, message: Message, done) -> bool:
        return False  # every push through `push`, on the pool

    def poll(self) -> None:
        pass

    def push(self, message: Message) -> None:
        with self.network.lock:
            if self.network.fail_pushes > 0:
                self.network.fail_pushes -= 1
                raise SendFailed("unavailable", "the peer is restarting", transient=True)
        inbox, _ = self._peer(message.receiver)
        inbox.put(message)

    def exchange(self, message: Message) -> Message:
        time.sleep(self.network.exchange_delay_s)
        inbox, node = self._peer(message.receiver)
        reply = node.algorithm.snapshot().message_for(self.rank, message.kind)
        inbox.put(message)
        assert reply is not None
        return reply

    def pull(self, peer: int, kind: Kind) -> Message:
        _, node = self._peer(peer)
        reply = node.algorithm.snapshot().message_for(self.rank, kind)
        assert reply is not None
        return reply


class LoopbackNetwork:
    def __init__(self, nodes: list[Node], fail_pushes: int = 0, exchange_delay_s: float = 0.0):
        self.nodes = nodes
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in nodes]
        self.lock = threading.Lock()
        self.fail_pushes = fail_pushes
        self.exchange_delay_s = exchange_delay_s


def run_loops(spec, network: LoopbackNetwork, metrics: Metrics) -> tuple[list[NodeDriver], list[list[Report]]]:
    """Every node of the job in a NodeLoop thread of its own; returns once all are done."""
    torch.set_num_threads(1)  # as the simulator computes (and agents sharing a machine): the same float sums
    stop = threading.Event()
    drivers, reports, threads = [], [], []
    pool = futures.ThreadPoolExecutor(max_workers=4 * len(network.nodes))
    for node in network.nodes:
        rank = node.rank
        driver = NodeDriver(node, job="loop", name=f"rank{rank}", clock=time.perf_counter,
                            metrics=metrics.node("loop", f"rank{rank}"),
                            name_of=lambda peer: f"rank{peer}")
        published: list[Report] = []
        inbox = network.inboxes[rank]
        dispatch = Dispatch(inbox.put, pool, LoopbackPeers(rank, network))
        loop = NodeLoop(driver, dispatch, inbox, published.append, stop)
        threads.append(threading.Thread(target=loop.run, daemon=True))
        drivers.append(driver)
        reports.append(published)
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not all(d.done for d in drivers) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    pool.shutdown(wait=True)
    # Replies to calls still in flight when the job ended are in the inboxes now; the driver counts them as a
    # serving node's loop would have, had it not been stopped first.
    for driver, inbox in zip(drivers, network.inboxes, strict=True):
        while not inbox.empty():
            driver.arrived(inbox.get_nowait())
    assert all(d.done for d in drivers), [d.algorithm.clock for d in drivers]
    return drivers, reports


def job(fashion_mnist_dir, algorithm: dict, steps: int = 30) -> dict:
    return {
        "name": "loop", "nodes": 4, "steps": steps, "eval_every": 10, "seed": 3,
        "algorithm": {"lr": 0.05, **algorithm},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "class-window", "batch_size": 32, "train_limit": 2000,
                 "test_limit": 300},
        "topology": {"kind": "ring", "seed": 1},
    }


@pytest.mark.parametrize("failed_pushes", [0, 5])
def test_synchronous_dsgd_in_node_loops_ends_as_in_the_simulator(fashion_mnist_dir, monkeypatch, failed_pushes):
    monkeypatch.setattr(driver_module, "RETRY_FIRST_S", 0.01)
    spec = parse_job_spec(job(fashion_mnist_dir, {"name": "dsgd", "mode": "sync"}))
    network = LoopbackNetwork(build_nodes(spec), fail_pushes=failed_pushes)
    drivers, reports = run_loops(spec, network, Metrics())
    simulated = simulate(spec).mesh
    for driver, sim in zip(drivers, simulated.nodes, strict=True):
        assert driver.algorithm.clock == 30
        assert torch.equal(driver.algorithm.w, sim.node.algorithm.w), f"rank {driver.node.rank} differs"
    assert network.fail_pushes == 0  # every failure happened, and was retried until delivered
    assert sum(d.failures for d in drivers) == failed_pushes
    for published in reports:
        assert [r.progress.step for r in published if r.evaluated] == [0, 10, 20, 30]
        assert published[-1].progress.finished and published[-1].progress.test_accuracy > 0.3


def test_a_busy_edge_is_not_called_twice_and_the_job_still_finishes(fashion_mnist_dir):
    # K = 1: every step wants an exchange on every edge, and each exchange takes longer than a step.
    spec = parse_job_spec(job(fashion_mnist_dir, {"name": "pdmm-isvr", "interval": 1}, steps=20))
    network = LoopbackNetwork(build_nodes(spec), exchange_delay_s=0.02)
    metrics = Metrics()
    drivers, _ = run_loops(spec, network, metrics)
    skipped = sum(sample.value for family in metrics.registry.collect()
                  if family.name == "peertrain_exchange_failures" for sample in family.samples
                  if sample.labels.get("reason") == "in_flight" and sample.name.endswith("_total"))
    assert skipped > 0
    # On a ring the lower rank of an edge initiates its exchanges: ranks 0, 1 and 2 do, rank 3 only answers.
    assert all(d.exchanges > 0 for d in drivers[:3]) and drivers[3].exchanges == 0
    assert all(d.failures == 0 for d in drivers)  # a skip is not a failed call
