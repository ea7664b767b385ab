"""`coordinator backup` and `coordinator restore`: a restore drill on an in-process coordinator (a finished job, its
results and the CA come back on a fresh state directory), and the archive's safety (0600, no overwrite, checked)."""

from __future__ import annotations

import io
import stat
import tarfile
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509

from coordinator.ca import ClusterCA
from coordinator.cli import main
from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.metrics import Metrics
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir

pytestmark = pytest.mark.integration

ACCURACIES = (0.7963, 0.8012)


class Coordinator:
    """A coordinator serving `state_dir` in this process (plaintext: the drill is about its state)."""

    def __init__(self, state_dir: Path):
        self.service = CoordinatorService(CoordinatorConfig(state_dir=state_dir), Metrics())
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        add_coordinator_servicer(self.service, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.service.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)
        self.service.stop()


def finished_job(stub) -> str:
    ids = [stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{zlib.crc32(name.encode()) % 40000 + 2000}",
                                            name=name), timeout=5).node_id for name in ("w0", "w1")]
    spec = {"name": "drill", "nodes": 2, "steps": 10, "topology": {"kind": "ring"}}
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=yaml.safe_dump(spec)), timeout=5).job_id
    for rank, node_id in enumerate(ids):
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=10, loss=0.5,
                                            test_accuracy=ACCURACIES[rank], bytes_sent=1000 + rank, elapsed_s=1.0,
                                            finished=True), timeout=5)
    return job_id


def test_restore_drill_brings_back_jobs_results_and_the_ca(tmp_path, capsys):
    old, new, archive = tmp_path / "old", tmp_path / "new", tmp_path / "coordinator.tar.gz"
    ca = ClusterCA.init(old)
    ca.issue_files(TlsDir(tmp_path / "agent-tls"), Role.NODE, "worker-0")
    agent_cert = x509.load_pem_x509_certificate((tmp_path / "agent-tls" / "tls.crt").read_bytes())
    running = Coordinator(old)
    try:
        job_id = finished_job(running.stub)
        # Online: the coordinator runs and holds its state directory.
        assert main(["backup", "--out", str(archive), "--state-dir", str(old)]) == 0
        assert stat.S_IMODE(archive.stat().st_mode) == 0o600
        with pytest.raises(SystemExit, match="exists: give another --out, or --force"):
            main(["backup", "--out", str(archive), "--state-dir", str(old)])
        assert main(["backup", "--out", str(archive), "--state-dir", str(old), "--force"]) == 0
        before = running.stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    finally:
        running.stop()

    assert main(["restore", str(archive), "--state-dir", str(new)]) == 0
    assert "restored" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is not empty"):
        main(["restore", str(archive), "--state-dir", str(new)])

    restored = Coordinator(new)
    try:
        status = restored.stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
        assert status.state == pb.JOB_FINISHED
        assert [(n.rank, n.node_id, n.test_accuracy, n.bytes_sent) for n in status.nodes] == \
            [(n.rank, n.node_id, n.test_accuracy, n.bytes_sent) for n in before.nodes]
        assert [n.test_accuracy for n in status.nodes] == pytest.approx(ACCURACIES)
        assert status.run_dir.startswith(f"{new.resolve()}/runs/")  # moved with the state
        events = restored.stub.JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=5).events
        assert "submitted" in [e.kind for e in events]
        assert {n.name for n in restored.stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes} == {"w0", "w1"}
    finally:
        restored.stop()
    back = ClusterCA.load(new)
    assert back.fingerprint == ca.fingerprint
    agent_cert.verify_directly_issued_by(back.cert)  # the agents' certificates still verify
    assert "worker-0" in {c.name for c in back.certificates()}
    assert stat.S_IMODE((new / "ca" / "ca.key").stat().st_mode) == 0o600


def test_restore_refuses_a_damaged_or_foreign_archive(tmp_path):
    state, archive = tmp_path / "state", tmp_path / "backup.tar.gz"
    ClusterCA.init(state)
    running = Coordinator(state)
    running.stop()
    assert main(["backup", "--out", str(archive), "--state-dir", str(state), "--without-runs"]) == 0
    with tarfile.open(archive, "r:gz") as source:
        members = [(m, source.extractfile(m).read()) for m in source.getmembers()]
    damaged = tmp_path / "damaged.tar.gz"
    with tarfile.open(damaged, "w:gz") as out:
        for member, data in members:
            if member.name == "ca/ca.key":
                data = data.replace(b"A", b"B", 1)
            out.addfile(member, io.BytesIO(data))
    with pytest.raises(SystemExit, match=r"ca/ca\.key is damaged"):
        main(["restore", str(damaged), "--state-dir", str(tmp_path / "a")])
    assert not (tmp_path / "a" / "coordinator.db").exists()
    escaping = tmp_path / "escaping.tar.gz"
    with tarfile.open(escaping, "w:gz") as out:
        for member, data in members:
            out.addfile(member, io.BytesIO(data))
        evil = tarfile.TarInfo("../evil")
        evil.size = 1
        out.addfile(evil, io.BytesIO(b"x"))
    with pytest.raises(SystemExit, match="does not hold the files its manifest names"):
        main(["restore", str(escaping), "--state-dir", str(tmp_path / "b")])
    assert not (tmp_path / "evil").exists()
    with pytest.raises(SystemExit, match="no backup"):
        main(["restore", str(tmp_path / "absent.tar.gz"), "--state-dir", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()
    (tmp_path / "junk.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(SystemExit, match="cannot read the backup"):
        main(["restore", str(tmp_path / "junk.tar.gz"), "--state-dir", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="no coordinator state"):
        main(["backup", "--out", str(tmp_path / "x.tar.gz"), "--state-dir", str(tmp_path / "nowhere")])
