"""Daemons that refuse to share: a second agent or coordinator on a used port or a held state directory exits
naming it while the first keeps working."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, "serve", *args]


def agent_args(coordinator: str, state_dir: Path, name: str, peer: int, lanes: int, metrics: int) -> list[str]:
    return [
        "--coordinator", coordinator, "--listen", f"127.0.0.1:{peer}", "--lane-port", str(lanes),
        "--metrics-listen", f"127.0.0.1:{metrics}", "--state-dir", str(state_dir), "--name", name, "--device", "cpu",
        "--torch-threads", "1",
    ]


def coordinator_args(state_dir: Path, listen: int, metrics: int) -> list[str]:
    return ["--listen", f"127.0.0.1:{listen}", "--metrics-listen", f"127.0.0.1:{metrics}",
            "--state-dir", str(state_dir)]


def run_to_exit(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a daemon that must refuse to start; one that starts anyway is killed at the timeout (and fails the test)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          check=False)


def assert_refused_in_one_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [expected], result.stderr


@dataclass
class Running:
    """A coordinator and one agent, started as processes with known ports."""

    root: Path
    coordinator: str
    coordinator_metrics: int
    coordinator_state: Path
    agent_state: Path
    peer: int
    lanes: int
    agent_metrics: int
    processes: list[subprocess.Popen]

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(self.coordinator))

    def node(self) -> pb.NodeInfo:
        nodes = [n for n in self.stub().ListNodes(pb.ListNodesRequest(), timeout=5).nodes if n.name == "first"]
        assert len(nodes) == 1, nodes
        return nodes[0]

    def assert_still_working(self) -> None:
        """Both daemons still serve: the coordinator lists the agent up at its address, the agent answers there."""
        for process in self.processes:
            assert process.poll() is None, f"{process.args} exited"
        node = self.node()
        assert node.up and node.peer_address == f"127.0.0.1:{self.peer}"
        with grpc.insecure_channel(node.peer_address) as channel:
            peer_pb2_grpc.PeerStub(channel).Describe(peer_pb2.DescribeRequest(), timeout=5)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("edges")
    listen, coordinator_metrics, peer, lanes, agent_metrics = (free_port() for _ in range(5))
    processes: list[subprocess.Popen] = []
    ready = root / "ready.json"
    try:
        with open(root / "coordinator.log", "wb") as log:
            processes.append(subprocess.Popen(
                command("coordinator.cli", *coordinator_args(root / "coordinator", listen, coordinator_metrics),
                        "--ready-file", str(ready)),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert processes[0].poll() is None and time.monotonic() < deadline, (root / "coordinator.log").read_text()
            time.sleep(0.1)
        address = json.loads(ready.read_text())["listen"]
        with open(root / "agent.log", "wb") as log:
            processes.append(subprocess.Popen(
                command("nodeagent.cli", *agent_args(address, root / "agent", "first", peer, lanes, agent_metrics)),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
        started = Running(root, address, coordinator_metrics, root / "coordinator", root / "agent", peer, lanes,
                          agent_metrics, processes)
        while True:
            assert processes[1].poll() is None and time.monotonic() < deadline, (root / "agent.log").read_text()
            nodes = started.stub().ListNodes(pb.ListNodesRequest(), timeout=5).nodes
            if any(n.name == "first" and n.up for n in nodes):
                break
            time.sleep(0.2)
        yield started
    finally:
        _stop(processes)


# -- a second daemon -----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("port", ["peer", "lanes", "metrics"])
def test_a_second_agent_on_a_used_port_exits_naming_the_address(running, tmp_path, port):
    ports = {"peer": free_port(), "lanes": free_port(), "metrics": free_port()}
    ports[port] = {"peer": running.peer, "lanes": running.lanes, "metrics": running.agent_metrics}[port]
    result = run_to_exit(command("nodeagent.cli", *agent_args(running.coordinator, tmp_path / "second", "second",
                                                              ports["peer"], ports["lanes"], ports["metrics"])))
    assert_refused_in_one_line(result, f"nodeagent: cannot listen on 127.0.0.1:{ports[port]}: address in use")
    running.assert_still_working()
    assert "second" not in {n.name for n in running.stub().ListNodes(pb.ListNodesRequest(), timeout=5).nodes}


@pytest.mark.slow
@pytest.mark.parametrize("port", ["grpc", "metrics"])
def test_a_second_coordinator_on_a_used_port_exits_naming_the_address(running, tmp_path, port):
    used = int(running.coordinator.rpartition(":")[2]) if port == "grpc" else running.coordinator_metrics
    listen, metrics = (used, free_port()) if port == "grpc" else (free_port(), used)
    result = run_to_exit(command("coordinator.cli", *coordinator_args(tmp_path / "second", listen, metrics)))
    assert_refused_in_one_line(result, f"coordinator: cannot listen on 127.0.0.1:{used}: address in use")
    running.assert_still_working()


@pytest.mark.slow
def test_a_second_agent_on_a_held_state_dir_exits_naming_it(running):
    pid = running.processes[1].pid
    result = run_to_exit(command("nodeagent.cli", *agent_args(running.coordinator, running.agent_state, "second",
                                                              free_port(), free_port(), free_port())))
    assert_refused_in_one_line(
        result, f"nodeagent: state directory {running.agent_state} is in use by another process (pid {pid})"
    )
    running.assert_still_working()


@pytest.mark.slow
def test_a_second_coordinator_on_a_held_state_dir_exits_naming_it(running):
    pid = running.processes[0].pid
    result = run_to_exit(command("coordinator.cli", *coordinator_args(running.coordinator_state, free_port(),
                                                                      free_port())))
    assert_refused_in_one_line(
        result, f"coordinator: state directory {running.coordinator_state} is in use by another process (pid {pid})"
    )
    running.assert_still_working()
