"""The coordinator's trust boundary, tried as an attacker would: a client made from the generated proto modules and
grpc alone (the `Attacker` below imports nothing else of the project), with certificates of every kind made by
the test's CA. Each refusal is checked to leave the coordinator's state as it was."""

from __future__ import annotations

import datetime
import json
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
from datafiles import FASHION_MNIST
from hostile import channel_as

from coordinator.ca import ClusterCA
from coordinator.cli import main as cli_main
from coordinator.ps_service import add_coordinator_servicer
from coordinator.rendezvous import Rendezvous
from coordinator.service import SERVER_THREADS, CoordinatorConfig, CoordinatorService, EnrollmentService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.agent.enroll import EnrollmentError, enroll, renew
from nodeagent.metrics import Metrics
from nodeagent.runtime.messages import data_to_proto
from nodeagent.security import pki
from nodeagent.security.pki import CertificateError, Role
from nodeagent.security.tls import TlsDir, Transport

pytestmark = pytest.mark.integration

SPEC = """
name: t
nodes: 2
steps: 10
algorithm: {name: ssgd}
data: {dataset: fashion-mnist, split: iid}
"""


class Attacker:
    """A client of the coordinator built from the proto modules: any certificate, any field."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    @classmethod
    def with_pems(cls, address: str, ca_pem: bytes, cert_pem: bytes | None = None,
                  key_pem: bytes | None = None) -> Attacker:
        credentials = grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)
        return cls(grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override",
                                                                       "coordinator")]))

    @classmethod
    def with_dir(cls, address: str, directory: Path) -> Attacker:
        return cls(channel_as(address, directory, "coordinator"))

    def code(self, method: str, request, **kwargs) -> grpc.StatusCode:
        try:
            reply = getattr(self.stub, method)(request, timeout=5, **kwargs)
            if isinstance(reply, Iterator):  # a server stream: its first message, or its status
                next(reply, None)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


class SecureCoordinator:
    def __init__(self, root: Path, heartbeat_timeout_s: float = 15.0):
        self.root = root
        self.ca = ClusterCA.init(root / "state")
        tls = TlsDir(root / "state" / "tls")
        self.ca.coordinator_credentials(tls)
        self.service = CoordinatorService(CoordinatorConfig(state_dir=root / "state",
                                                            heartbeat_timeout_s=heartbeat_timeout_s), Metrics(),
                                          ca=self.ca, transport=Transport(tls))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_THREADS),
                                  interceptors=[self.service.authorizer()])
        add_coordinator_servicer(self.service, self.server)
        self.address = f"127.0.0.1:{Transport(tls).bind(self.server, '127.0.0.1:0')}"
        self.enrollment = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        coordinator_pb2_grpc.add_EnrollmentServicer_to_server(EnrollmentService(self.ca), self.enrollment)
        port = self.enrollment.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(pki.private_key_pem(self.ca.key), self.ca.cert_pem)]))
        self.enroll_address = f"127.0.0.1:{port}"
        self.server.start()
        self.enrollment.start()
        self.service.start()

    def credentials(self, role: Role, name: str, lifetime: datetime.timedelta | None = None) -> Path:
        directory = self.root / f"{role}-{name}"
        self.ca.issue_files(TlsDir(directory), role, name, lifetime)
        return directory

    def client(self, role: Role, name: str) -> Attacker:
        return Attacker.with_dir(self.address, self.credentials(role, name))

    def stop(self) -> None:
        self.server.stop(grace=None)
        self.enrollment.stop(grace=None)
        self.service.stop()


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[SecureCoordinator]:
    coordinator = SecureCoordinator(tmp_path)
    yield coordinator
    coordinator.stop()


def _register(client: Attacker, node_id: str, port: int) -> pb.RegisterReply:
    return client.stub.Register(pb.RegisterRequest(node_id=node_id, peer_address=f"127.0.0.1:{port}"), timeout=5)


def test_handshake_fails_without_a_certificate_of_the_cluster(secure, tmp_path):
    other_key, other_ca = pki.create_ca("another CA")
    stranger_key = pki.new_private_key()
    stranger = pki.issue(other_key, other_ca, stranger_key.public_key(), Role.OPERATOR, "mallory")
    expired_key = pki.new_private_key()
    expired = pki.issue(secure.ca.key, secure.ca.cert, expired_key.public_key(), Role.OPERATOR, "old",
                        lifetime=datetime.timedelta(seconds=-60))
    ca = secure.ca.cert_pem
    clients = {
        "plaintext": Attacker(grpc.insecure_channel(secure.address)),
        "no certificate": Attacker.with_pems(secure.address, ca),
        "another CA": Attacker.with_pems(secure.address, ca, pki.certificate_pem(stranger),
                                         pki.private_key_pem(stranger_key)),
        "expired": Attacker.with_pems(secure.address, ca, pki.certificate_pem(expired),
                                      pki.private_key_pem(expired_key)),
    }
    for what, client in clients.items():
        assert client.code("ListNodes", pb.ListNodesRequest()) is grpc.StatusCode.UNAVAILABLE, what
        assert client.code("SubmitJob", pb.SubmitJobRequest(spec_yaml=SPEC)) is grpc.StatusCode.UNAVAILABLE, what
        assert client.code("Rendezvous", rendezvous("x", pb.RENDEZVOUS_CHECK, "knocks")) is \
            grpc.StatusCode.UNAVAILABLE, what
    assert secure.service.store.jobs(("PENDING", "RUNNING")) == []


def test_a_node_certificate_cannot_make_operator_calls(secure):
    node = secure.client(Role.NODE, "node-a")
    _register(node, "", 7001)
    denied = {
        "SubmitJob": pb.SubmitJobRequest(spec_yaml=SPEC), "StopJob": pb.StopJobRequest(job_id="x"),
        "ListNodes": pb.ListNodesRequest(), "JobStatus": pb.JobStatusRequest(),
        "RemoveNode": pb.NodeRequest(node_id="node-a"), "DrainNode": pb.DrainRequest(node_id="node-a", drain=True),
        "CreateJoinToken": pb.CreateJoinTokenRequest(), "RevokeCertificate": pb.RevokeCertificateRequest(name="x"),
        "ListCertificates": pb.ListCertificatesRequest(), "ExportModel": pb.ExportModelRequest(job_id="x"),
    }
    for method, request in denied.items():
        assert node.code(method, request) is grpc.StatusCode.PERMISSION_DENIED, method
    assert secure.service.store.jobs(("PENDING", "RUNNING")) == []
    assert not secure.service.store.node("node-a").draining
    assert secure.ca._live_tokens() == {}


def test_an_operator_certificate_cannot_act_as_a_node(secure):
    operator = secure.client(Role.OPERATOR, "alice")
    for method, request in {
        "Register": pb.RegisterRequest(node_id="alice", peer_address="127.0.0.1:7001"),
        "Heartbeat": pb.HeartbeatRequest(node_id="alice"),
        "WatchAssignment": pb.WatchAssignmentRequest(node_id="alice"),
        "PsPull": pb.PsPullRequest(job_id="x"),
        "UploadModel": iter([wire_pb2.Frame(manifest=wire_pb2.Manifest(job_id="x"))]),
    }.items():
        assert operator.code(method, request) is grpc.StatusCode.PERMISSION_DENIED, method
    assert secure.service.store.nodes() == []


def test_a_node_acts_only_as_itself(secure):
    a, b = secure.client(Role.NODE, "node-a"), secure.client(Role.NODE, "node-b")
    assert _register(a, "", 7001).node_id == "node-a"  # the id comes from the certificate
    assert _register(b, "node-b", 7002).node_id == "node-b"
    # A man in the middle would re-point node-b's neighbours to its own address.
    assert a.code("Register", pb.RegisterRequest(node_id="node-b", peer_address="127.0.0.1:6666")) is \
        grpc.StatusCode.PERMISSION_DENIED
    assert secure.service.store.node("node-b").peer_address == "127.0.0.1:7002"
    for method, request in {
        "Heartbeat": pb.HeartbeatRequest(node_id="node-b"),
        "Deregister": pb.DeregisterRequest(node_id="node-b"),
        "WatchAssignment": pb.WatchAssignmentRequest(node_id="node-b"),
        "ReportMetrics": pb.MetricsReport(node_id="node-b", job_id="x", step=5, finished=True),
        "ReportFailure": pb.NodeFailure(node_id="node-b", job_id="x", reason="fake"),
        "JobReady": pb.JobReadyRequest(node_id="node-b", job_id="x"),
    }.items():
        assert a.code(method, request) is grpc.StatusCode.PERMISSION_DENIED, method
    assert secure.service.store.node("node-b").up


class DescribedPeer(peer_pb2_grpc.PeerServicer):
    """A node's peer port as the coordinator's probe finds it: it answers as its node."""

    def __init__(self, directory: Path, node_id: str):
        self.node_id = node_id
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        peer_pb2_grpc.add_PeerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{Transport(TlsDir(directory)).bind(self.server, '127.0.0.1:0')}"
        self.server.start()

    def Describe(self, request, context):
        return peer_pb2.NodeDescription(node_id=self.node_id)


def test_a_node_cannot_register_with_the_address_or_name_of_a_live_node(secure):
    directory = secure.credentials(Role.NODE, "agent-0")
    peer = DescribedPeer(directory, "agent-0")
    honest = Attacker.with_dir(secure.address, directory)
    honest.stub.Register(pb.RegisterRequest(peer_address=peer.address, name="agent-0"), timeout=5)
    mallory = secure.client(Role.NODE, "mallory")
    for request in (pb.RegisterRequest(peer_address=peer.address, name="mallory"),
                    pb.RegisterRequest(peer_address="127.0.0.1:7999", name="Agent-0 "),
                    pb.RegisterRequest(peer_address="127.0.0.1:7999", name="agent-0."),
                    pb.RegisterRequest(peer_address="127.0.0.1:7999", name="\uff41gent-0")):  # a full-width a
        assert mallory.code("Register", request) is grpc.StatusCode.ALREADY_EXISTS, request
    assert [(n.node_id, n.peer_address, n.up) for n in secure.service.store.nodes()] == \
        [("agent-0", peer.address, True)]
    # Once agent-0 no longer answers there it is gone: its address goes to the node that registers with it.
    peer.server.stop(grace=None).wait()
    assert mallory.stub.Register(pb.RegisterRequest(peer_address=peer.address), timeout=5).node_id == "mallory"
    assert not secure.service.store.node("agent-0").up


def test_one_nodes_flood_of_calls_that_hold_threads_leaves_the_other_nodes_up(tmp_path, caplog):
    """3000 Register calls at once from one node, each making the coordinator probe a tarpit (an address that
    accepts connections and never answers) for a second: beyond its limit they are refused at once, and an honest
    node beating all along is never marked down, with a heartbeat timeout (3 s) half what the flood would hold every
    server thread (3000 calls of 1 s on SERVER_THREADS, 512: 6 s). With 1 s, a run beside two busy loops marked the
    honest node down: the flood's 3000 TLS calls and the coordinator share this process's CPU."""
    coordinator = SecureCoordinator(tmp_path, heartbeat_timeout_s=3.0)
    tarpits = [socket.create_server(("127.0.0.1", 0), backlog=4096) for _ in range(2)]
    addresses = [f"127.0.0.1:{tarpit.getsockname()[1]}" for tarpit in tarpits]
    honest = coordinator.client(Role.NODE, "honest")
    _register(honest, "", 7001)
    beats: list[grpc.StatusCode] = []
    flooding = threading.Event()

    def beat() -> None:
        while not flooding.wait(0.1):
            beats.append(honest.code("Heartbeat", pb.HeartbeatRequest()))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        directory = coordinator.credentials(Role.NODE, "mallory")
        mallory = [Attacker(channel_as(coordinator.address, directory, "coordinator", separate=True)) for _ in range(8)]
        mallory[0].stub.Register(pb.RegisterRequest(peer_address=addresses[0]), timeout=5)
        # Each call moves mallory between the tarpits: the coordinator probes the one it is at.
        flood = [mallory[i % 8].stub.Register.future(pb.RegisterRequest(peer_address=addresses[(i + 1) % 2]),
                                                      timeout=60) for i in range(3000)]
        codes = [call.code() for call in flood]
    finally:
        flooding.set()
        beating.join()
        for tarpit in tarpits:
            tarpit.close()
        coordinator.stop()
    assert beats and set(beats) == {grpc.StatusCode.OK}
    assert "no heartbeat from honest" not in caplog.text  # never marked down meanwhile
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 2000, Counter(codes)


def test_parameter_server_calls_only_as_the_rank_the_node_holds(secure):
    a, b = secure.client(Role.NODE, "node-a"), secure.client(Role.NODE, "node-b")
    _register(a, "", 7001)
    _register(b, "", 7002)
    operator = secure.client(Role.OPERATOR, "alice")
    job_id = operator.stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC), timeout=30).job_id
    ranks = {m.node_id: m.rank for m in secure.service.store.members(job_id)}
    b_rank = ranks["node-b"]
    assert a.code("PsPull", pb.PsPullRequest(job_id=job_id, rank=b_rank, node_id="node-b")) is \
        grpc.StatusCode.PERMISSION_DENIED
    assert a.code("PsReport", pb.PsReportRequest(job_id=job_id, rank=b_rank, node_id="node-b")) is \
        grpc.StatusCode.PERMISSION_DENIED
    # A forged push: node-a's certificate, node-b's name and rank in the manifest.
    manifest = wire_pb2.Manifest(job_id=job_id, sender_id="node-b", sender_rank=b_rank, receiver_rank=2,
                                 kind=wire_pb2.KIND_GRADIENT)
    frames = iter([wire_pb2.Frame(manifest=manifest), wire_pb2.Frame(end=wire_pb2.End())])
    code = a.code("PsPush", frames, metadata=[("peertrain-push-id", "forged-1")])
    assert code is grpc.StatusCode.PERMISSION_DENIED
    # A forged trained model: node-a's certificate sending as node-b, whose rank's model `export` would take.
    manifest = wire_pb2.Manifest(job_id=job_id, sender_id="node-b", sender_rank=b_rank, kind=wire_pb2.KIND_PARAMS)
    assert a.code("UploadModel", iter([wire_pb2.Frame(manifest=manifest), wire_pb2.Frame(end=wire_pb2.End())])) is \
        grpc.StatusCode.PERMISSION_DENIED
    assert not list(Path(secure.service.store.job(job_id).run_dir).glob("models/*"))
    # The honest pull of its own rank is served, once a worker described the data the server's model is shaped for.
    assert a.code("PsPull", pb.PsPullRequest(job_id=job_id, rank=ranks["node-a"], node_id="node-a")) is \
        grpc.StatusCode.FAILED_PRECONDITION
    assert a.code("JobReady", pb.JobReadyRequest(node_id="node-a", job_id=job_id, rank=ranks["node-a"],
                                                 data=data_to_proto(FASHION_MNIST))) is grpc.StatusCode.OK
    assert a.code("PsPull", pb.PsPullRequest(job_id=job_id, rank=ranks["node-a"], node_id="node-a")) is \
        grpc.StatusCode.OK


ALLREDUCE = """
name: ar
nodes: 2
steps: 10
algorithm: {name: allreduce}
data: {dataset: fashion-mnist, split: iid}
"""


def rendezvous(job_id: str, op: int, *keys: str, node_id: str = "", **fields) -> pb.RendezvousRequest:
    return pb.RendezvousRequest(node_id=node_id, job_id=job_id, op=op, keys=list(keys), **fields)


def test_an_allreduce_jobs_rendezvous_is_its_members_alone(secure):
    """Every operation an outsider of the collective used on the old open store, tried by every kind of caller
    that is not a member of the job: refused, and the members' keys stay as they were."""
    a, b = secure.client(Role.NODE, "node-a"), secure.client(Role.NODE, "node-b")
    _register(a, "", 7001)
    _register(b, "", 7002)
    operator = secure.client(Role.OPERATOR, "alice")
    job_id = operator.stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=ALLREDUCE), timeout=30).job_id
    outsider, peer_of_other_job = secure.client(Role.NODE, "node-c"), secure.client(Role.NODE, "node-d")
    _register(outsider, "", 7003)
    _register(peer_of_other_job, "", 7004)
    other_job = operator.stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC), timeout=30).job_id
    assert {m.node_id for m in secure.service.store.members(other_job)} == {"node-c", "node-d"}
    # The members' own keys: the quorum counters and a gloo address.
    a.stub.Rendezvous(rendezvous(job_id, pb.RENDEZVOUS_ADD, "knocks", amount=2), timeout=5)
    a.stub.Rendezvous(rendezvous(job_id, pb.RENDEZVOUS_SET, "q/0/pg//0/0", value=b"address of rank 0"), timeout=5)
    attempts = [
        rendezvous(job_id, pb.RENDEZVOUS_CHECK, "knocks"),
        rendezvous(job_id, pb.RENDEZVOUS_GET, "q/0/pg//0/0"),
        rendezvous(job_id, pb.RENDEZVOUS_WAIT, "q/0/members", wait_s=10),  # refused at once, not held
        rendezvous(job_id, pb.RENDEZVOUS_ADD, "knocks", amount=1),  # forced regroups
        rendezvous(job_id, pb.RENDEZVOUS_COMPARE_SET, "q/1/members", expected=b"", value=b"-"),  # quorums given up
        rendezvous(job_id, pb.RENDEZVOUS_SET, "q/1/pg//0/0", value=b"garbage"),  # gloo's keys pre-written
        rendezvous(job_id, pb.RENDEZVOUS_SET, "big", value=b"x" * 60_000),
        rendezvous(job_id, pb.RENDEZVOUS_DELETE, "knocks"),
        rendezvous(job_id, pb.RENDEZVOUS_ADD, "knocks", amount=1, node_id="node-a"),  # as a member, by its id
    ]
    callers = {"a node of no job": outsider, "a node of another job": peer_of_other_job, "an operator": operator}
    for who, caller in callers.items():
        for request in attempts:
            code = caller.code("Rendezvous", request)
            assert code is grpc.StatusCode.PERMISSION_DENIED, (who, request.op, code)
    # A member reaches its own job only.
    assert a.code("Rendezvous", rendezvous(other_job, pb.RENDEZVOUS_CHECK, "knocks")) is \
        grpc.StatusCode.PERMISSION_DENIED
    # Bounded before anything is stored, whoever asks.
    for request in (rendezvous(job_id, pb.RENDEZVOUS_SET, "v", value=b"x" * ((64 << 10) + 1)),
                    rendezvous(job_id, pb.RENDEZVOUS_SET, "k" * 257, value=b""),
                    rendezvous(job_id, pb.RENDEZVOUS_CHECK, *[f"k{i}" for i in range(65)]),
                    rendezvous(job_id, pb.RENDEZVOUS_GET, "k", wait_s=3600),
                    rendezvous(job_id, pb.RENDEZVOUS_ADD, "q/0/pg//0/0", amount=1),  # not a counter
                    rendezvous(job_id, 99, "k")):
        assert a.code("Rendezvous", request) in (grpc.StatusCode.INVALID_ARGUMENT,
                                                 grpc.StatusCode.FAILED_PRECONDITION), request
    assert b.stub.Rendezvous(rendezvous(job_id, pb.RENDEZVOUS_ADD, "knocks", amount=0), timeout=5).number == 2
    assert b.stub.Rendezvous(rendezvous(job_id, pb.RENDEZVOUS_GET, "q/0/pg//0/0"), timeout=5).value == \
        b"address of rank 0"
    for key in ("q/1/members", "q/1/pg//0/0", "big", "v"):
        assert not b.stub.Rendezvous(rendezvous(job_id, pb.RENDEZVOUS_CHECK, key), timeout=5).found, key
    # A revoked member is refused before its job is looked at.
    operator.stub.RevokeCertificate(pb.RevokeCertificateRequest(name="node-b"), timeout=5)
    assert b.code("Rendezvous", rendezvous(job_id, pb.RENDEZVOUS_CHECK, "knocks")) is \
        grpc.StatusCode.UNAUTHENTICATED
    assert secure.service.store.job(job_id).state == "RUNNING"


def test_a_jobs_rendezvous_store_keeps_its_latest_keys_within_its_bounds():
    store, made = Rendezvous().store("job", 2)
    assert made

    def answer(op: int, key: str, **fields) -> pb.RendezvousReply:
        return store.answer(rendezvous("job", op, key, **fields))

    for number in range(store.max_keys * 2):
        answer(pb.RENDEZVOUS_SET, f"q/{number}/here/0", value=b"1")
        answer(pb.RENDEZVOUS_ADD, "knocks", amount=1)  # written at every quorum: never the oldest
    assert answer(pb.RENDEZVOUS_ADD, "knocks", amount=0).number == store.max_keys * 2
    assert not answer(pb.RENDEZVOUS_CHECK, "q/0/here/0").found
    assert answer(pb.RENDEZVOUS_CHECK, f"q/{store.max_keys * 2 - 1}/here/0").found
    value = b"x" * (64 << 10)
    for number in range(2 * store.max_bytes // len(value)):
        answer(pb.RENDEZVOUS_SET, f"big/{number}", value=value)
    kept = [n for n in range(2 * store.max_bytes // len(value)) if answer(pb.RENDEZVOUS_CHECK, f"big/{n}").found]
    assert kept == list(range(kept[0], 2 * store.max_bytes // len(value)))
    assert len(kept) * len(value) <= store.max_bytes
    assert answer(pb.RENDEZVOUS_GET, "absent", wait_s=0.05).found is False


RING = """
name: ring
nodes: 3
steps: 1000
algorithm: {name: dsgd}
topology: {kind: ring}
data: {dataset: fashion-mnist, split: iid}
"""
ESCAPES = "\x1b[2J\x1b[31mred\x1b[0m\x1b]0;owned\x07\x9b2J\u202eevil\x07\rline\nforged"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def running(secure: SecureCoordinator, spec: str) -> tuple[str, dict[int, Attacker], Attacker]:
    """A job running on three nodes of its own: its id, its members by rank, and an operator."""
    clients = {name: secure.client(Role.NODE, name) for name in ("node-a", "node-b", "node-c")}
    for port, client in enumerate(clients.values(), 7001):
        _register(client, "", port)
    operator = secure.client(Role.OPERATOR, "alice")
    job_id = operator.stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=30).job_id
    return job_id, {m.rank: clients[m.node_id] for m in secure.service.store.members(job_id)}, operator


def test_a_report_no_run_can_have_is_refused_counted_and_changes_nothing(secure):
    job_id, members, operator = running(secure, RING)
    for rank, member in members.items():
        member.stub.ReportMetrics(pb.MetricsReport(job_id=job_id, rank=rank, step=100, loss=0.5, elapsed_s=10,
                                                   test_accuracy=math.nan), timeout=5)
    impossible = [{"step": 2**62, "loss": 4.6e27, "test_accuracy": 1.0}, {"step": -1}, {"step": 1001},
                  {"local_steps": 2**62}, {"loss": -1.0}, {"loss": math.inf}, {"test_loss": -math.inf},
                  {"test_accuracy": 1.5}, {"test_accuracy": -0.1}, {"elapsed_s": 1e9}, {"compute_s": -1.0},
                  {"wait_s": math.inf}]
    for fields in impossible:
        report = pb.MetricsReport(job_id=job_id, rank=0, step=100, loss=0.5, elapsed_s=10, test_accuracy=math.nan)
        for field, value in fields.items():
            setattr(report, field, value)
        assert members[0].code("ReportMetrics", report) is grpc.StatusCode.INVALID_ARGUMENT, fields
    status = operator.stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert status.state == pb.JOB_RUNNING
    assert [(n.step, n.loss) for n in status.nodes] == [(100, 0.5)] * 3
    refused = secure.service.metrics.registry.get_sample_value(
        "peertrain_coordinator_refused_reports_total", {"node": secure.service.store.members(job_id)[0].node_id,
                                                        "field": "step"})
    assert refused == 3
    # Its topology still changes: the switch step comes from the reports that were taken.
    change = operator.stub.ChangeTopology(pb.ChangeTopologyRequest(job_id=job_id, kind="complete"), timeout=5)
    assert change.switch_step < 1000


def test_escape_codes_from_a_node_never_reach_the_operators_terminal(secure, capsys):
    job_id, members, _ = running(secure, RING)  # the operator runs the command line below
    member = members[1]
    member.stub.ReportEvents(pb.EventReport(job_id=job_id, events=[
        pb.JobEvent(kind="log", level="WARNING", message=ESCAPES)]), timeout=5)
    member.stub.ReportMetrics(pb.MetricsReport(job_id=job_id, rank=1, step=3, waiting_for=ESCAPES, edges=[
        pb.EdgeTraffic(peer=ESCAPES)]), timeout=5)
    operator_dir = str(secure.root / "operator-alice")

    def printed(*command: str) -> str:
        assert cli_main([*command, "--coordinator", secure.address, "--tls-dir", operator_dir]) == 0
        out, err = capsys.readouterr()
        assert not any(code in out + err for code in RAW), (command, out)
        assert "owned" not in out  # an OSC string is dropped whole
        return out

    assert "red" in printed("edges", job_id)  # the edge's peer and what the node waits for
    member.stub.ReportFailure(pb.NodeFailure(job_id=job_id, rank=1, reason=ESCAPES), timeout=5)
    for command in (["status", job_id], ["logs", job_id], ["jobs"]):
        assert "redevil line forged" in printed(*command)  # its words, on one line
    assert secure.service.store.job(job_id).state == "FAILED"


class Liar(coordinator_pb2_grpc.CoordinatorServicer):
    """A coordinator (or one in the middle) that sends escape codes in every text the command line prints."""

    def JobStatus(self, request, context):
        return pb.JobStatusReply(job_id=ESCAPES, name=ESCAPES, state=pb.JOB_FAILED, reason=ESCAPES, spec_yaml="",
                                 run_dir=ESCAPES, nodes=[pb.NodeProgress(node_id=ESCAPES, failure=ESCAPES,
                                                                         waiting_for=ESCAPES, state=ESCAPES)])

    def JobEvents(self, request, context):
        events = [] if request.offset else [pb.JobEvent(kind=ESCAPES, level=ESCAPES, message=ESCAPES, node_id=ESCAPES)]
        return pb.JobEventsReply(job_id="j", state=pb.JOB_FAILED, events=events, next_offset=1)

    def ListNodes(self, request, context):
        return pb.ListNodesReply(nodes=[pb.NodeInfo(node_id=ESCAPES, name=ESCAPES, peer_address=ESCAPES,
                                                    job_id=ESCAPES)])

    def ListJobs(self, request, context):
        return pb.ListJobsReply(jobs=[pb.JobInfo(job_id=ESCAPES, name=ESCAPES, reason=ESCAPES)])

    def StopJob(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, ESCAPES)


def test_the_cli_escapes_every_text_of_the_coordinator_it_prints(capsys):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Liar(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        for command in (["status", "j"], ["logs", "j"], ["nodes"], ["jobs"], ["stop", "j"]):
            cli_main([*command, "--coordinator", address, "--insecure"])
            out, err = capsys.readouterr()
            assert not any(code in out + err for code in RAW), (command, out, err)
            assert "\\x1b[2J" in out + err, command  # shown, as its escape
    finally:
        server.stop(grace=None)


def test_enrollment_with_a_one_time_token_and_a_pinned_fingerprint(secure, tmp_path):
    operator = secure.client(Role.OPERATOR, "alice")
    token = operator.stub.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=60), timeout=5)
    assert token.ca_fingerprint == secure.ca.fingerprint
    with pytest.raises(EnrollmentError, match="does not have the CA fingerprint"):
        enroll(secure.enroll_address, token.token, "ab" * 32, "node-new", TlsDir(tmp_path / "wrong"))
    assert not TlsDir(tmp_path / "wrong").complete()
    tls_dir = TlsDir(tmp_path / "new")
    assert enroll(secure.enroll_address, token.token, token.ca_fingerprint.upper(), "node-new", tls_dir) == "node-new"
    assert Transport(tls_dir).identity.role is Role.NODE
    node = Attacker.with_dir(secure.address, tls_dir.path)
    assert _register(node, "", 7005).node_id == "node-new"
    # The token was good once; a fresh token does not buy a name that holds a valid certificate.
    with pytest.raises(EnrollmentError, match="join token is unknown, used or expired"):
        enroll(secure.enroll_address, token.token, token.ca_fingerprint, "node-other", TlsDir(tmp_path / "again"))
    second = operator.stub.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=60), timeout=5)
    with pytest.raises(EnrollmentError, match="holds a valid certificate"):
        enroll(secure.enroll_address, second.token, second.ca_fingerprint, "node-new", TlsDir(tmp_path / "dup"))


LOOK_ALIKES = ("coordinator.", "coordinator", "Coordinator", "coordinator.peertrain", "x.peertrain", "peertrain",
               "agent-0.", "Agent-0", "agent-0..", ".agent-0", "agent-0-", "agent\u20100",
               "\u0430gent-0", "agent-\uff10", "tester.", "a" * 64)


def test_no_certificate_can_be_issued_for_a_name_that_passes_for_another(secure, tmp_path):
    """The coordinator's name, the trust domain's names and every second form of a name (a trailing dot, upper case,
    Unicode look-alikes) are refused at enrollment and offline, before a token is spent."""
    operator = secure.client(Role.OPERATOR, "alice")
    token = operator.stub.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=60), timeout=5)
    channel = grpc.secure_channel(secure.enroll_address, grpc.ssl_channel_credentials(secure.ca.cert_pem),
                                  options=[("grpc.ssl_target_name_override", "coordinator")])
    enrollment = coordinator_pb2_grpc.EnrollmentStub(channel)
    for name in LOOK_ALIKES:
        csr = x509.CertificateSigningRequestBuilder().subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(pki.new_private_key(), hashes.SHA256())
        request = pb.EnrollRequest(token=token.token, csr_pem=csr.public_bytes(serialization.Encoding.PEM))
        with pytest.raises(grpc.RpcError) as refused:
            enrollment.Enroll(request, timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
        with pytest.raises(CertificateError):
            secure.ca.issue(pki.new_private_key().public_key(), Role.NODE, name)
    # A name is one role's: a node cannot be named as an operator is (nor the other way).
    with pytest.raises(CertificateError, match="held by a operator certificate"):
        secure.ca.issue(pki.new_private_key().public_key(), Role.NODE, "alice")
    assert {c.name for c in secure.ca.certificates()} == {"coordinator", "alice"}
    # The token was not spent on the refusals.
    assert enroll(secure.enroll_address, token.token, token.ca_fingerprint, "agent-0", TlsDir(tmp_path / "a0")) == \
        "agent-0"


def test_the_coordinator_names_the_live_certificates_an_earlier_version_issued_under_a_refused_name(tmp_path,
                                                                                                 caplog):
    coordinator = SecureCoordinator(tmp_path)
    coordinator.stop()
    cert_pem, _ = impostor_certificate(coordinator.ca, Role.NODE, "agent-0.", ["agent-0."])
    serial = pki.identity_of(pki.load_certificate(cert_pem)).serial
    with open(coordinator.ca.directory / "issued.jsonl", "a") as issued:  # as an earlier CA recorded it
        issued.write(json.dumps({"serial": serial, "role": "node", "name": "agent-0.", "issued_unix": time.time(),
                                 "not_after_unix": time.time() + 86400}) + "\n")
    service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path / "state"), Metrics(), ca=coordinator.ca)
    service.start()
    service.stop()
    assert f"the node certificate {serial} of 'agent-0.' has a name that must be" in caplog.text


def impostor_certificate(ca: ClusterCA, role: Role, name: str, dns: list[str]) -> tuple[bytes, bytes]:
    """A certificate of the cluster's CA as one issued before the names were checked (or by a careless CA): the
    identity spiffe://peertrain/ROLE/NAME with the DNS names given. Its PEM and its key's."""
    key = pki.new_private_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(pki.spiffe_uri(role, name)),
                                                        *map(x509.DNSName, dns)]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return pki.certificate_pem(cert), pki.private_key_pem(key)


class Impostor(coordinator_pb2_grpc.CoordinatorServicer):
    """A server that would take an agent's registration and an operator's calls."""

    def __init__(self, cert_pem: bytes, key_pem: bytes, ca_pem: bytes):
        self.calls: list[str] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, self.server)
        credentials = grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                                  require_client_auth=True)
        self.address = f"127.0.0.1:{self.server.add_secure_port('127.0.0.1:0', credentials)}"
        self.server.start()

    def Register(self, request, context):
        self.calls.append("Register")
        return pb.RegisterReply(node_id=request.node_id, heartbeat_interval_s=2)

    def ListNodes(self, request, context):
        self.calls.append("ListNodes")
        return pb.ListNodesReply(nodes=[pb.NodeInfo(node_id="agent-0", peer_address="attacker:1", up=True)])


def test_agents_and_the_cli_accept_only_a_coordinator_certificate_as_the_coordinator(secure, capsys):
    agent = Transport(TlsDir(secure.credentials(Role.NODE, "agent-0")))
    operator_dir = secure.credentials(Role.OPERATOR, "alice")
    ca = secure.ca
    mallory = TlsDir(secure.root / "node-m")
    secure.ca.issue_files(mallory, Role.NODE, "mallory")
    impostors = {
        "a node certificate": (mallory.cert.read_bytes(), mallory.key.read_bytes()),
        "a node named coordinator., as issued before names were checked": impostor_certificate(
            ca, Role.NODE, "coordinator.", ["coordinator."]),
        "a node with the coordinator's former DNS name": impostor_certificate(ca, Role.NODE, "x", ["coordinator"]),
    }
    for what, (cert_pem, key_pem) in impostors.items():
        impostor = Impostor(cert_pem, key_pem, ca.cert_pem)
        try:
            with agent.channel(impostor.address) as channel, pytest.raises(grpc.RpcError) as refused:
                coordinator_pb2_grpc.CoordinatorStub(channel).Register(
                    pb.RegisterRequest(peer_address="127.0.0.1:7001"), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, what
            assert cli_main(["nodes", "--coordinator", impostor.address, "--tls-dir", str(operator_dir)]) == 1
            out, err = capsys.readouterr()
            assert out == "" and "its certificate is not the coordinator's" in err, what
            assert impostor.calls == [], what
        finally:
            impostor.server.stop(grace=None)
    # The coordinator's own certificate passes.
    with agent.channel(secure.address) as channel:
        assert coordinator_pb2_grpc.CoordinatorStub(channel).Register(
            pb.RegisterRequest(peer_address="127.0.0.1:7001"), timeout=5).node_id == "agent-0"


def test_the_enrollment_port_serves_nothing_else_and_refuses_garbage(secure):
    channel = grpc.secure_channel(secure.enroll_address, grpc.ssl_channel_credentials(secure.ca.cert_pem),
                                  options=[("grpc.ssl_target_name_override", "coordinator")])
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    enrollment = coordinator_pb2_grpc.EnrollmentStub(channel)
    for request, code in (
        (pb.EnrollRequest(token="x", csr_pem=b"not a csr"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.EnrollRequest(token="x" * 100_000, csr_pem=b"-" * 100_000), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.EnrollRequest(token="guess", csr_pem=pki.signing_request(pki.new_private_key(), Role.NODE, "n1")),
         grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            enrollment.Enroll(request, timeout=5)
        assert refused.value.code() is code
        assert len(refused.value.details()) < 300  # never echoes the input
    assert secure.ca.certificates() == [c for c in secure.ca.certificates() if c.role == "coordinator"]


def test_revocation_is_enforced_at_once_and_sent_to_agents(secure):
    a, b = secure.client(Role.NODE, "node-a"), secure.client(Role.NODE, "node-b")
    _register(a, "", 7001)
    _register(b, "", 7002)
    operator = secure.client(Role.OPERATOR, "alice")
    revoked = operator.stub.RevokeCertificate(pb.RevokeCertificateRequest(name="node-a"), timeout=5).serials
    assert len(revoked) == 1
    assert a.code("Heartbeat", pb.HeartbeatRequest()) is grpc.StatusCode.UNAUTHENTICATED
    assert not secure.service.store.node("node-a").up
    assignment = next(iter(b.stub.WatchAssignment(pb.WatchAssignmentRequest(), timeout=5)))
    assert list(assignment.revoked_serials) == revoked
    listed = {c.serial: c for c in operator.stub.ListCertificates(pb.ListCertificatesRequest(), timeout=5).certificates}
    assert listed[revoked[0]].revoked_unix > 0


def renewal(key_name: str = "node-a") -> pb.RenewCertificateRequest:
    return pb.RenewCertificateRequest(csr_pem=pki.signing_request(pki.new_private_key(), Role.NODE, key_name))


def test_a_certificate_is_renewed_once_in_its_last_third_and_supersedes_the_old_one(secure):
    fresh = secure.client(Role.NODE, "node-f")
    assert fresh.code("RenewCertificate", renewal("node-f")) is grpc.StatusCode.FAILED_PRECONDITION
    # In its last third (a minute left): a flood of renewals with the same key issues one certificate.
    directory = secure.credentials(Role.NODE, "node-a", lifetime=datetime.timedelta(minutes=1))
    old = Transport(TlsDir(directory)).identity
    node = Attacker.with_dir(secure.address, directory)
    request = renewal()
    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(lambda _: node.code("RenewCertificate", request), range(64)))
    assert codes.count(grpc.StatusCode.OK) == 1, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED}
    issued = [c for c in secure.ca.certificates() if c.name == "node-a"]
    assert len(issued) == 2 and [c.serial for c in issued if c.revoked_unix] == [old.serial]
    assert node.code("Heartbeat", pb.HeartbeatRequest()) is grpc.StatusCode.UNAUTHENTICATED  # superseded
    # The agent's own renewal path writes the new certificate; `cert revoke --name` revokes every one of the name.
    agent_dir = secure.credentials(Role.NODE, "node-b", lifetime=datetime.timedelta(minutes=1))
    transport = Transport(TlsDir(agent_dir))
    serial = renew(transport, coordinator_pb2_grpc.CoordinatorStub(transport.channel(secure.address)))
    renewed = Attacker.with_dir(secure.address, agent_dir)
    assert transport.credentials().identity.serial == serial
    assert _register(renewed, "", 7002).node_id == "node-b"
    operator = secure.client(Role.OPERATOR, "alice")
    assert len(operator.stub.RevokeCertificate(pb.RevokeCertificateRequest(name="node-b"), timeout=5).serials) == 1
    assert renewed.code("Heartbeat", pb.HeartbeatRequest()) is grpc.StatusCode.UNAUTHENTICATED
    assert all(c.revoked_unix for c in secure.ca.certificates() if c.name == "node-b")


def test_renewal_keeps_the_callers_identity_and_role(secure):
    # An operator renewing asks for a node's name in its request: the certificate still names the operator.
    operator_dir = secure.credentials(Role.OPERATOR, "alice", lifetime=datetime.timedelta(minutes=1))
    operator = Attacker.with_dir(secure.address, operator_dir)
    reply = operator.stub.RenewCertificate(renewal("node-a"), timeout=5)
    renewed = pki.identity_of(pki.load_certificate(reply.certificate_pem))
    assert (renewed.role, renewed.name) == (Role.OPERATOR, "alice")
    # An operator keeps its other certificates (one per machine), but renews each once.
    assert operator.code("RenewCertificate", renewal()) is grpc.StatusCode.FAILED_PRECONDITION
    assert operator.code("ListCertificates", pb.ListCertificatesRequest()) is grpc.StatusCode.OK


def test_the_coordinator_renews_its_own_certificate_near_expiry(tmp_path):
    ca = ClusterCA.init(tmp_path / "state")
    tls = TlsDir(tmp_path / "tls")
    first = ca.coordinator_credentials(tls)
    assert ca.coordinator_credentials(tls).serial == first.serial  # far from expiry: kept
    ca.issue_files(tls, Role.COORDINATOR, "coordinator", lifetime=datetime.timedelta(minutes=1))
    short = Transport(tls).identity
    renewed = ca.coordinator_credentials(tls)
    assert renewed.serial != short.serial and renewed.not_after_unix > short.not_after_unix + 86400
