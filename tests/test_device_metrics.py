"""What an agent tells of its device: its name and memory at registration (`coordinator nodes` shows them), and the
device gauges of its /metrics (memory as torch's allocator counts it, utilisation from NVML), read at each scrape.
The CUDA side is faked here (tests/fakecuda.py: torch.cuda's memory counters and device properties, a pynvml module),
so that it runs on machines without a GPU; a CPU agent is the real thing."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from fakecuda import CARD, GiB, fake_cuda, fake_pynvml, without_pynvml
from prometheus_client.parser import text_string_to_metric_families

from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.agent.daemon import Agent, AgentConfig
from nodeagent.metrics import DEVICE_GAUGES, Metrics

pytestmark = pytest.mark.integration


def device_samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    """The peertrain_device_* samples of a /metrics text: name -> (labels, value); one series each."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("peertrain_device_"):
                assert sample.name not in samples, f"{sample.name}: more than one series"
                samples[sample.name] = (sample.labels, sample.value)
    return samples


def scrape(metrics: Metrics) -> dict[str, tuple[dict[str, str], float]]:
    from prometheus_client import generate_latest

    return device_samples(generate_latest(metrics.registry).decode())


@pytest.fixture
def cuda_1(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """An H100 as cuda:1 (fakecuda.fake_cuda); its memory counters."""
    return fake_cuda(monkeypatch, index=1)


def test_a_cpu_agent_exports_no_device_gauges() -> None:
    metrics = Metrics()
    metrics.watch_device("n0", "cpu")
    assert scrape(metrics) == {}


def test_a_cuda_agent_exports_its_devices_memory_read_at_each_scrape(cuda_1, monkeypatch) -> None:
    without_pynvml(monkeypatch)
    metrics = Metrics()
    metrics.watch_device("n0", "cuda:1")
    labels = {"node": "n0", "device": "cuda:1"}
    assert scrape(metrics) == {
        "peertrain_device_memory_allocated_bytes": (labels, 3 * GiB),
        "peertrain_device_memory_reserved_bytes": (labels, 4 * GiB),
        "peertrain_device_memory_peak_bytes": (labels, 6 * GiB),
    }
    cuda_1["allocated"] = 5 * GiB
    assert scrape(metrics)["peertrain_device_memory_allocated_bytes"] == (labels, 5 * GiB)


def test_a_cuda_agent_with_nvml_exports_its_devices_utilisation_and_leaves_it_out_while_nvml_fails(
        cuda_1, monkeypatch) -> None:
    pynvml = fake_pynvml(monkeypatch, utilization_percent=37)
    metrics = Metrics()
    metrics.watch_device("n0", "cuda:1")
    samples = scrape(metrics)
    assert set(samples) == set(DEVICE_GAUGES)
    assert samples["peertrain_device_utilization_ratio"] == ({"node": "n0", "device": "cuda:1"}, 0.37)
    pynvml.lost = True
    samples = scrape(metrics)
    assert set(samples) == set(DEVICE_GAUGES) - {"peertrain_device_utilization_ratio"}


def test_nvml_that_does_not_know_the_device_gives_no_utilisation(cuda_1, monkeypatch) -> None:
    fake_pynvml(monkeypatch, utilization_percent=37, uuid="GPU-another-card")
    metrics = Metrics()
    metrics.watch_device("n0", "cuda:1")
    assert "peertrain_device_utilization_ratio" not in scrape(metrics)
    assert "peertrain_device_memory_allocated_bytes" in scrape(metrics)


# -- an agent in this process, registered with a coordinator in this process --------------------------------------


@pytest.fixture
def coordinator_address(tmp_path: Path) -> Iterator[tuple[str, coordinator_pb2_grpc.CoordinatorStub]]:
    service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path / "coordinator"), Metrics())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_coordinator_servicer(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield f"127.0.0.1:{port}", coordinator_pb2_grpc.CoordinatorStub(channel)
    server.stop(grace=None)
    service.stop()


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_an_agent_registers_its_device_and_serves_its_gauges(coordinator_address, tmp_path, monkeypatch, device
                                                             ) -> None:
    if device.startswith("cuda"):
        fake_cuda(monkeypatch, index=1)
        fake_pynvml(monkeypatch, utilization_percent=80)
    address, stub = coordinator_address
    agent = Agent(AgentConfig(coordinator=address, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
                              state_dir=tmp_path / "agent", device=device, name="gpu-host-gpu1"))
    try:
        assert agent.start()
        [node] = stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes
        with urllib.request.urlopen(f"http://{agent.metrics_address}/metrics", timeout=5) as reply:
            samples = device_samples(reply.read().decode())
    finally:
        agent.stop()
    if device == "cpu":
        assert (node.device, node.device_name, node.device_memory_bytes) == ("cpu", "cpu", 0)
        assert samples == {}
    else:
        assert (node.device, node.device_name, node.device_memory_bytes) == ("cuda:1", CARD.name, CARD.total_memory)
        labels = {"node": node.node_id, "device": "cuda:1"}
        assert samples == {
            "peertrain_device_memory_allocated_bytes": (labels, 3 * GiB),
            "peertrain_device_memory_reserved_bytes": (labels, 4 * GiB),
            "peertrain_device_memory_peak_bytes": (labels, 6 * GiB),
            "peertrain_device_utilization_ratio": (labels, 0.8),
        }
