"""A one-time join token is spent only on an enrollment that succeeds: the agent checks its name and its ports before
it enrolls, and the coordinator checks the token and the name before it spends the token."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from coordinator.ca import ClusterCA
from coordinator.service import EnrollmentService
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.agent.daemon import Agent, AgentConfig, RegistrationRefused
from nodeagent.agent.enroll import EnrollmentError, enroll
from nodeagent.listen import ListenError
from nodeagent.security.pki import private_key_pem
from nodeagent.security.tls import TlsDir

pytestmark = pytest.mark.integration


@dataclass
class Enrollment:
    ca: ClusterCA
    address: str


@pytest.fixture
def enrollment(tmp_path: Path) -> Iterator[Enrollment]:
    """The coordinator's enrollment port, in process, with a CA of its own."""
    ca = ClusterCA.init(tmp_path / "coordinator")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_EnrollmentServicer_to_server(EnrollmentService(ca), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(private_key_pem(ca.key),
                                                                                 ca.cert_pem)]))
    server.start()
    yield Enrollment(ca, f"127.0.0.1:{port}")
    server.stop(grace=None)


def agent_config(tmp_path: Path, enrollment: Enrollment, token: str, **fields: object) -> AgentConfig:
    settings: dict = {"coordinator": "127.0.0.1:1", "listen": "127.0.0.1:0", "metrics_listen": None,
                      "state_dir": tmp_path / "agent", "tls_dir": tmp_path / "agent-tls", "name": "worker-0",
                      "join_token": token, "ca_fingerprint": enrollment.ca.fingerprint,
                      "enroll_address": enrollment.address}
    return AgentConfig(**(settings | fields))


def start_refused(config: AgentConfig) -> BaseException:
    """What the agent's start raised (it must, at once: an agent that got past its checks would wait for the absent
    coordinator, and is stopped)."""
    agent = Agent(config)
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            agent.start()
        except (ListenError, RegistrationRefused) as error:
            outcome.append(error)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(timeout=10)
    if starting.is_alive() or not outcome:
        agent.stop()
        starting.join(timeout=10)
        pytest.fail("the agent started instead of refusing")
    return outcome[0]


def test_an_agent_that_cannot_serve_or_be_named_so_does_not_spend_its_token(tmp_path, enrollment):
    token, _ = enrollment.ca.create_token()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        # The peer service's port, the metrics', the lanes' (on the peer service's host).
        for fields in ({"listen": busy}, {"metrics_listen": busy}, {"lane_port": taken.getsockname()[1]}):
            refusal = start_refused(agent_config(tmp_path, enrollment, token, **fields))
            assert isinstance(refusal, ListenError) and str(refusal) == f"cannot listen on {busy}: address in use"
    refusal = start_refused(agent_config(tmp_path, enrollment, token, name="Worker_0!"))
    assert isinstance(refusal, RegistrationRefused)
    assert str(refusal).startswith("--name 'Worker_0!' cannot be a node's name: must be")
    assert str(refusal).endswith("; the join token was not used")
    assert not TlsDir(tmp_path / "agent-tls").complete()
    assert enrollment.ca.token_live(token)
    # The control: the token still buys a certificate, once.
    assert enroll(enrollment.address, token, enrollment.ca.fingerprint, "worker-0", TlsDir(tmp_path / "a")) == \
        "worker-0"
    assert not enrollment.ca.token_live(token)


def test_a_name_that_is_taken_is_refused_without_spending_the_token(tmp_path, enrollment):
    first, _ = enrollment.ca.create_token()
    enroll(enrollment.address, first, enrollment.ca.fingerprint, "worker-0", TlsDir(tmp_path / "first"))
    second, _ = enrollment.ca.create_token()
    with pytest.raises(EnrollmentError, match=r"worker-0 holds a valid certificate.*the join token is still good"):
        enroll(enrollment.address, second, enrollment.ca.fingerprint, "worker-0", TlsDir(tmp_path / "again"))
    assert enrollment.ca.token_live(second)
    assert enroll(enrollment.address, second, enrollment.ca.fingerprint, "worker-1", TlsDir(tmp_path / "other")) == \
        "worker-1"
    with pytest.raises(EnrollmentError, match="join token is unknown, used or expired"):  # spent now
        enroll(enrollment.address, second, enrollment.ca.fingerprint, "worker-2", TlsDir(tmp_path / "third"))
