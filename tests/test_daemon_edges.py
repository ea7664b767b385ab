"""Daemons that refuse to share: a second agent or coordinator on a used port or a held state directory exits
naming it while the first keeps working; the coordinator refuses a node id that is live at another address, and
fields out of bounds; the agent's retries back off and log a summary rather than a line per try."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from nodeagent import __version__
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from nodeagent.rpc import Backoff

pytestmark = pytest.mark.system

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
        "--torch-threads", "1", "--insecure",  # the ports and state directories are the point here, not TLS
    ]


def coordinator_args(state_dir: Path, listen: int, metrics: int) -> list[str]:
    return ["--listen", f"127.0.0.1:{listen}", "--metrics-listen", f"127.0.0.1:{metrics}",
            "--state-dir", str(state_dir), "--insecure"]


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
            description = peer_pb2_grpc.PeerStub(channel).Describe(peer_pb2.DescribeRequest(), timeout=5)
        assert description.node_id == node.node_id


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

@pytest.mark.parametrize("port", ["peer", "lanes", "metrics"])
def test_a_second_agent_on_a_used_port_exits_naming_the_address(running, tmp_path, port):
    ports = {"peer": free_port(), "lanes": free_port(), "metrics": free_port()}
    ports[port] = {"peer": running.peer, "lanes": running.lanes, "metrics": running.agent_metrics}[port]
    result = run_to_exit(command("nodeagent.cli", *agent_args(running.coordinator, tmp_path / "second", "second",
                                                              ports["peer"], ports["lanes"], ports["metrics"])))
    assert_refused_in_one_line(result, f"nodeagent: cannot listen on 127.0.0.1:{ports[port]}: address in use")
    running.assert_still_working()
    assert "second" not in {n.name for n in running.stub().ListNodes(pb.ListNodesRequest(), timeout=5).nodes}


@pytest.mark.parametrize("port", ["grpc", "metrics"])
def test_a_second_coordinator_on_a_used_port_exits_naming_the_address(running, tmp_path, port):
    used = int(running.coordinator.rpartition(":")[2]) if port == "grpc" else running.coordinator_metrics
    listen, metrics = (used, free_port()) if port == "grpc" else (free_port(), used)
    result = run_to_exit(command("coordinator.cli", *coordinator_args(tmp_path / "second", listen, metrics)))
    assert_refused_in_one_line(result, f"coordinator: cannot listen on 127.0.0.1:{used}: address in use")
    running.assert_still_working()


def test_a_second_agent_on_a_held_state_dir_exits_naming_it(running):
    pid = running.processes[1].pid
    result = run_to_exit(command("nodeagent.cli", *agent_args(running.coordinator, running.agent_state, "second",
                                                              free_port(), free_port(), free_port())))
    assert_refused_in_one_line(
        result, f"nodeagent: state directory {running.agent_state} is in use by another process (pid {pid})"
    )
    running.assert_still_working()


def test_a_second_coordinator_on_a_held_state_dir_exits_naming_it(running):
    pid = running.processes[0].pid
    result = run_to_exit(command("coordinator.cli", *coordinator_args(running.coordinator_state, free_port(),
                                                                      free_port())))
    assert_refused_in_one_line(
        result, f"coordinator: state directory {running.coordinator_state} is in use by another process (pid {pid})"
    )
    running.assert_still_working()


def test_an_agent_with_the_node_id_of_a_live_agent_is_refused(running, tmp_path):
    """A state directory copied from a running agent (a cloned disk): the copy may not take the node over."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(running.agent_state / "node_id", copy / "node_id")
    node = running.node()
    result = run_to_exit(command("nodeagent.cli", *agent_args(running.coordinator, copy, "copy", free_port(),
                                                              free_port(), free_port())))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"nodeagent: coordinator {running.coordinator} refused this node: node {node.node_id} is up at "
        f"127.0.0.1:{running.peer} and answers there; two agents share its node id (a copied state directory?)"
    )
    running.assert_still_working()
    assert running.node().name == "first"


# -- Register ------------------------------------------------------------------------------------------------------

class FakePeer(peer_pb2_grpc.PeerServicer):
    """An agent's peer service as the coordinator's probe sees it: Describe names a node."""

    def __init__(self, node_id: str):
        self.node_id = node_id

    def Describe(self, request, context):
        return peer_pb2.NodeDescription(node_id=self.node_id)


@pytest.fixture
def fake_peer() -> Iterator[tuple[FakePeer, grpc.Server, str]]:
    peer = FakePeer("")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    peer_pb2_grpc.add_PeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield peer, server, f"127.0.0.1:{port}"
    server.stop(grace=None)


def register(stub, peer_address: str, node_id: str = "", **fields: str | int) -> str:
    request = pb.RegisterRequest(**{"name": "n", "device": "cpu", "version": __version__, **fields}, node_id=node_id,
                                 peer_address=peer_address)
    return stub.Register(request, timeout=10).node_id


def peer_address_of(stub, node_id: str) -> str:
    return next(n.peer_address for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes if n.node_id == node_id)


def test_a_node_id_live_at_another_address_is_refused_and_accepted_once_the_old_process_is_gone(
    coordinator_stub, fake_peer
):
    peer, server, old_address = fake_peer
    node_id = register(coordinator_stub, old_address)
    peer.node_id = node_id
    new_address = f"127.0.0.1:{free_port()}"
    with pytest.raises(grpc.RpcError) as refusal:
        register(coordinator_stub, new_address, node_id=node_id)
    assert refusal.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"is up at {old_address} and answers there" in refusal.value.details()
    assert peer_address_of(coordinator_stub, node_id) == old_address
    # The same address again is the same agent registering again (the coordinator forgot it, say).
    assert register(coordinator_stub, old_address, node_id=node_id) == node_id

    server.stop(grace=None).wait()  # the old process died: a restart on a new port is accepted
    assert register(coordinator_stub, new_address, node_id=node_id) == node_id
    assert peer_address_of(coordinator_stub, node_id) == new_address


def test_an_old_address_that_answers_as_another_node_does_not_block_a_restart(coordinator_stub, fake_peer):
    peer, _server, old_address = fake_peer
    node_id = register(coordinator_stub, old_address)
    peer.node_id = "someone-else"  # the port went to another agent after this one died
    new_address = f"127.0.0.1:{free_port()}"
    assert register(coordinator_stub, new_address, node_id=node_id) == node_id
    assert peer_address_of(coordinator_stub, node_id) == new_address


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("node_id", "has space"),
        ("node_id", "n" * 65),
        ("node_id", "semi;colon"),
        ("name", "tab\there"),
        ("name", "n" * 65),
        ("name", "bell\x07"),
        ("peer_address", ""),
        ("peer_address", "no-port"),
        ("peer_address", "127.0.0.1:99999"),
        ("peer_address", ":7100"),
        ("peer_address", "h" * 250 + ".com:7100"),
        ("metrics_address", "127.0.0.1:http"),
        ("device", "d" * 65),
        ("version", "v" * 65),
        ("device_name", "n" * 65),
        ("device_name", "NVIDIA\nH100"),
        ("device_memory_bytes", 2**50 + 1),
        ("device_memory_bytes", 2**64 - 1),  # past SQLite's INTEGER
    ],
)
def test_register_refuses_a_field_out_of_bounds_naming_it(coordinator_stub, field, value):
    fields = {"node_id": "", "name": "n", "peer_address": "127.0.0.1:7100", "metrics_address": "127.0.0.1:9401",
              "device": "cpu", "version": "0.1.0", field: value}
    with pytest.raises(grpc.RpcError) as refusal:
        coordinator_stub.Register(pb.RegisterRequest(**fields), timeout=5)
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal.value.details().startswith(f"{field}: ")
    assert not coordinator_stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes


def test_register_accepts_fields_at_their_bounds(coordinator_stub):
    """The control of the refusals above: the longest values allowed, an empty node id (a new node)."""
    new_id = register(coordinator_stub, "h" * 245 + ".com:7100", name="n" * 64, device="d" * 64,
                      version=(__version__ + "+" + "x" * 64)[:64],
                      metrics_address="[::1]:9401", device_name="n" * 64, device_memory_bytes=2**50)
    assert new_id
    assert register(coordinator_stub, "127.0.0.1:7100", node_id="A-z_0.9" + "x" * 57) == "A-z_0.9" + "x" * 57


# -- back-off ------------------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_from_1_s_to_at_most_30_s_and_starts_over_after_a_success():
    backoff = Backoff("registration", logging.getLogger("test"), clock=FakeClock())
    assert [backoff.failed("unavailable") for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    backoff.succeeded()
    assert [backoff.failed("unavailable") for _ in range(3)] == [1, 2, 4]


def test_backoff_logs_the_first_failure_then_a_summary_a_minute_and_the_recovery(caplog):
    clock = FakeClock()
    backoff = Backoff("registration with coordinator 127.0.0.1:7070", logging.getLogger("test.backoff"), clock=clock)
    caplog.set_level(logging.INFO, logger="test.backoff")
    for _ in range(12):  # tries at 0, 1, 3, 7, 15, 31, 61, 91, 121, 151, 181, 211 s
        clock.now += backoff.failed("unavailable")
    backoff.succeeded()
    assert [record.getMessage() for record in caplog.records] == [
        "registration with coordinator 127.0.0.1:7070 failed (unavailable); retrying with back-off",
        "registration with coordinator 127.0.0.1:7070 still failing after 7 tries over 61 s (unavailable)",
        "registration with coordinator 127.0.0.1:7070 still failing after 9 tries over 121 s (unavailable)",
        "registration with coordinator 127.0.0.1:7070 still failing after 11 tries over 181 s (unavailable)",
        "registration with coordinator 127.0.0.1:7070 succeeded again after 12 failed tries over 241 s",
    ]


def test_an_agent_stopped_while_it_cannot_register_exits_0_and_logs_the_failure_once(tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command("nodeagent.cli", *agent_args(nowhere, tmp_path / "agent", "lonely", 0, 0, 0)),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while f"registration with coordinator {nowhere} failed" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        time.sleep(4.0)  # tries at 0, 1 and 3 s: the old loop logged a line for each, once a second
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "Exception in thread" not in text, text
    assert text.count(nowhere) == 1, text
    assert text.count("shutting down") == 1, text
    assert os.path.isdir(tmp_path / "agent")
