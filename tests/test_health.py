"""The standard gRPC health service (grpc.health.v1) of both daemons, which Kubernetes' native gRPC probes ask
(deploy/k8s): NOT_SERVING while a daemon starts, SERVING once it is ready, on a plaintext port of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nodeagent.agent.daemon import Agent, AgentConfig

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(address: str) -> int:
    """What a kubelet's `grpc:` probe sees: a plaintext Check of the service "" (the daemon as a whole)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status


def test_the_coordinator_serves_health_once_it_serves(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--insecure", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
         "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        assert health_status(json.loads(ready.read_text())["health"]) == SERVING
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode == 0


def test_an_agent_is_not_serving_until_it_registers(coordinator_address: str, tmp_path: Path) -> None:
    # No coordinator at this address: the agent retries registering, and its health says NOT_SERVING meanwhile.
    waiting = Agent(AgentConfig(coordinator="127.0.0.1:1", listen="127.0.0.1:0", metrics_listen=None,
                                health_listen="127.0.0.1:0", state_dir=tmp_path / "waiting", name="waiting"))
    starting = threading.Thread(target=waiting.start, daemon=True)
    starting.start()
    try:
        deadline = time.monotonic() + 10
        while not waiting.health_address:
            assert time.monotonic() < deadline, "the agent serves no health port"
            time.sleep(0.02)
        assert health_status(waiting.health_address) == NOT_SERVING
    finally:
        waiting.stop()
        starting.join(timeout=10)

    agent = Agent(AgentConfig(coordinator=coordinator_address, listen="127.0.0.1:0", metrics_listen=None,
                              health_listen="127.0.0.1:0", state_dir=tmp_path / "agent", name="healthy"))
    try:
        assert agent.start()
        assert health_status(agent.health_address) == SERVING
    finally:
        agent.stop()
    with pytest.raises(grpc.RpcError) as stopped:  # stopped: nothing answers, and the probe fails
        health_status(agent.health_address)
    assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE
