"""Version skew (docs/operations.md, "Upgrades"): which agent and command-line versions a coordinator serves, and
the refusal, naming both versions, of the others, on Register and on every call that says its version."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from coordinator.cli import main
from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent import __version__
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.compat import VersionCheck, skew_problem, versioned
from nodeagent.metrics import Metrics

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("caller", "why"), [
    ("0.3.2", None), ("0.3.0", None), ("0.3.9", None),  # patch releases interoperate
    ("0.2.7", None),  # one minor version behind: agents are upgraded after the coordinator
    ("", None),  # did not say: a tool on the protocol, or a caller from before the check
    ("0.1.5", "more than one minor version behind; upgrade it to 0.3"),
    ("0.4.0", "newer than the coordinator; upgrade the coordinator first"),
    ("1.3.0", "different major versions do not work together"),
    ("three", "'three' is no MAJOR.MINOR.PATCH version"),
])
def test_the_skew_policy(caller, why):
    problem = skew_problem("agent n1", caller, "0.3.2")
    if why is None:
        assert problem is None
    else:
        assert problem is not None and why in problem
        assert f"agent n1 runs peertrain {caller!r} and the coordinator 0.3.2" in problem


@pytest.fixture
def coordinator_at(tmp_path):
    """Start a coordinator whose calls are checked as version `version` would check them; yields its address."""
    started = []

    def start(version: str) -> str:
        service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path), Metrics())
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[VersionCheck(version)])
        add_coordinator_servicer(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        service.start()
        started.append((server, service))
        return f"127.0.0.1:{port}"

    yield start
    for server, service in started:
        server.stop(grace=None)
        service.stop()


def test_a_caller_too_old_or_too_new_is_refused_on_every_call_with_both_versions(coordinator_at, capsys):
    address = coordinator_at("0.3.0")
    with grpc.insecure_channel(address) as channel:
        current = coordinator_pb2_grpc.CoordinatorStub(versioned(channel, "0.2.1"))
        assert current.ListNodes(pb.ListNodesRequest(), timeout=5).nodes == []
        too_old = coordinator_pb2_grpc.CoordinatorStub(versioned(channel, "0.1.0"))
        for call in (lambda: too_old.ListNodes(pb.ListNodesRequest(), timeout=5),
                     lambda: next(too_old.WatchAssignment(pb.WatchAssignmentRequest(node_id="n"), timeout=5))):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'0.1.0' and the coordinator 0.3.0" in refused.value.details()
        unversioned = coordinator_pb2_grpc.CoordinatorStub(channel)  # a tool on the protocol
        assert unversioned.ListNodes(pb.ListNodesRequest(), timeout=5).nodes == []
    # This command line (its own version, 0.1.x) against a coordinator two minor versions ahead.
    assert main(["nodes", "--coordinator", address, "--insecure"]) == 1
    error = capsys.readouterr().err
    assert "FAILED_PRECONDITION" in error and f"'{__version__}'" in error and "0.3.0" in error


def test_register_refuses_an_agent_of_a_version_that_cannot_work_with_the_coordinator(coordinator_at):
    address = coordinator_at(__version__)
    major, minor, _ = __version__.split(".")
    newer = f"{major}.{int(minor) + 1}.0"
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(pb.RegisterRequest(peer_address="127.0.0.1:7100", name="w0", version=newer), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == (f"agent w0 runs peertrain '{newer}' and the coordinator {__version__}: it "
                                           "is newer than the coordinator; upgrade the coordinator first "
                                           "(docs/operations.md, \"Upgrades\")")
        assert stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes == []
        assert stub.Register(pb.RegisterRequest(peer_address="127.0.0.1:7100", name="w0", version=__version__),
                             timeout=5).node_id
