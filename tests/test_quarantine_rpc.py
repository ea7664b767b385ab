"""Suspicion and quarantine through an in-process coordinator (issue 28): the members' reports of what their robust
rule found outlying flag a liar in `status`, `edges` and an event; `coordinator quarantine` drops its edges from
every neighbour's assignment; what it refuses, and with which code. The policy itself is unit-tested in
test_control_plane."""

from __future__ import annotations

import time

import grpc
import pytest
import test_coordinator
from test_coordinator import first_assignment, job, register

import coordinator.cli as cli
from coordinator.cli import main as coordinator_main
from coordinator.display import edges_json, edges_text, status_text
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.events import QUARANTINED, SUSPECTED, read_events

pytestmark = pytest.mark.integration

coordinator = test_coordinator.coordinator  # the fixture: (start, stop_all) of in-process coordinators


def lying_ring(stub, liar: int = 3) -> tuple[str, list[str]]:
    """A running 4-node DSGD ring with a robust rule whose members report, every call, that the liar's
    contributions are all outlying (the liar says the same of its honest neighbours)."""
    ids = [register(stub, f"q{i}") for i in range(4)]
    spec = job(nodes=4, steps=1000, algorithm={"interval": 1, "robust": {"rule": "self-centered-clip",
                                                                          "window_s": 5}})
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id
    return job_id, ids


def report(stub, job_id: str, ids: list[str], received: int, liar: int = 3) -> None:
    for rank, node_id in enumerate(ids):
        edges = [pb.EdgeTraffic(peer=ids[peer], messages_received=received, robust_clipped=received,
                                robust_outlying=received if liar in (rank, peer) else 0)
                 for peer in ((rank - 1) % 4, (rank + 1) % 4)]
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=received,
                                            elapsed_s=received / 10, edges=edges), timeout=5)


def test_a_liar_is_flagged_in_status_edges_and_an_event_then_quarantined_by_an_operator(coordinator, monkeypatch,
                                                                                        capsys):
    start, _ = coordinator
    _, stub = start()
    job_id, ids = lying_ring(stub)
    status = None
    for tick in range(1, 40):  # the coordinator reviews suspicion once a second
        report(stub, job_id, ids, 10 * tick)
        status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
        if any(n.suspected for n in status.nodes):
            break
        time.sleep(0.25)
    assert status is not None
    assert [n.rank for n in status.nodes if n.suspected] == [3]
    assert status.nodes[3].suspicion == 1.0 and status.nodes[0].suspicion == 0.0
    assert f"rank 3 ({ids[3]}) is suspected: 100% of its recent contributions outlying" in status_text(status)
    shares = {(e["src"], e["dst"]): e["outlying_share"] for e in edges_json(status)["edges"]}
    assert (shares[ids[0], ids[3]], shares[ids[0], ids[1]]) == (1.0, 0.0)
    assert f"rank 3 ({ids[3]}) is suspected" in edges_text(status)
    events, _ = read_events(status.run_dir)
    assert [e.message for e in events if e.kind == SUSPECTED] == [
        f"rank 3 (node {ids[3]}): 100% of its contributions in the last 5 s were outlying (suspect_fraction 0.5): "
        "suspected"]

    monkeypatch.setattr(cli, "_stub", lambda args: stub)
    assert coordinator_main(["quarantine", job_id, "3"]) == 0
    assert "quarantined: by an operator; its edges are dropped from step" in capsys.readouterr().out
    for rank in (0, 2):
        assignment = first_assignment(stub, ids[rank])
        assert assignment.topology_kind == "edge-list" and [n.rank for n in assignment.neighbors] == [1]
    assert first_assignment(stub, ids[3]).neighbors == []
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert status.nodes[3].quarantined and status.nodes[3].state == "quarantined"
    events, _ = read_events(status.run_dir)
    assert any(e.kind == QUARANTINED and e.message.startswith(f"rank 3 (node {ids[3]}) quarantined") for e in events)

    for request, code, words in [
        (pb.QuarantineRequest(job_id=job_id, node="3"), grpc.StatusCode.FAILED_PRECONDITION, "quarantined already"),
        (pb.QuarantineRequest(job_id=job_id, node="3", release=True), grpc.StatusCode.FAILED_PRECONDITION,
         "change the job's topology"),
        (pb.QuarantineRequest(job_id=job_id, node="nobody"), grpc.StatusCode.NOT_FOUND, "has no member"),
        (pb.QuarantineRequest(job_id="nojob", node="1"), grpc.StatusCode.NOT_FOUND, "nojob"),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            stub.Quarantine(request, timeout=5)
        assert error.value.code() == code and words in error.value.details()
