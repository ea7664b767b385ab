"""`coordinator topology` / ChangeTopology against an in-process coordinator: what it refuses and with which code, the
switch step it picks, the assignment every member gets, the event in the run directory, and a coordinator restart
that keeps the job's new topology."""

from __future__ import annotations

import json

import grpc
import pytest
import test_coordinator
from test_coordinator import first_assignment, job, register

import coordinator.cli as cli
from coordinator.cli import main as coordinator_main
from coordinator.cli import topology_options
from coordinator.control.plane import MIN_SWITCH_MARGIN_STEPS
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.events import TOPOLOGY, read_events

pytestmark = pytest.mark.integration

coordinator = test_coordinator.coordinator  # the fixture: (start, stop_all) of in-process coordinators


def running_job(stub, nodes: int = 6, **overrides) -> tuple[str, list[str]]:
    ids = [register(stub, f"a{i}") for i in range(nodes)]
    spec = job(nodes=nodes, steps=1000, **overrides)
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id
    assert stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).state == pb.JOB_RUNNING
    return job_id, ids


def report(stub, job_id: str, ids: list[str], steps: list[int], elapsed_s: float = 10.0) -> None:
    for rank, (node_id, step) in enumerate(zip(ids, steps, strict=True)):
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=step,
                                            elapsed_s=elapsed_s), timeout=5)


def change(stub, job_id: str, kind: str, options: dict | None = None, **fields) -> pb.ChangeTopologyReply:
    return stub.ChangeTopology(pb.ChangeTopologyRequest(job_id=job_id, kind=kind,
                                                        options_json=json.dumps(options or {}), **fields), timeout=5)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_a_change_is_assigned_to_every_member_with_one_switch_step_and_survives_a_restart(coordinator):
    start, stop_all = coordinator
    _, stub = start()
    job_id, ids = running_job(stub, name="swap")
    report(stub, job_id, ids, [100, 120, 90, 110, 100, 100])  # 12 steps/s at the fastest
    reply = change(stub, job_id="swap", kind="multiplex-ring", seed=3)  # by name
    # The highest step reported plus what the fastest node steps in SWITCH_LEAD_S (5 s): 120 + 60.
    assert (reply.job_id, reply.topology_version, reply.switch_step, reply.previous_kind) == \
        (job_id, 2, 180, "ring")
    for rank, node_id in enumerate(ids):
        assignment = first_assignment(stub, node_id)
        assert (assignment.topology_version, assignment.switch_step, assignment.topology_kind) == \
            (2, 180, "multiplex-ring")
        assert sorted(n.rank for n in assignment.neighbors) == sorted({(rank + d) % 6 for d in (-2, -1, 1, 2)})
        assert all(n.sign == (1 if rank < n.rank else -1) for n in assignment.neighbors)
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    events, _ = read_events(status.run_dir)
    assert [e.message for e in events if e.kind == TOPOLOGY] == [
        "topology ring -> multiplex-ring (version 2) at step 180"]
    # A second change waits until every node has reached the first one's step.
    error = refused(lambda: change(stub, job_id, "complete"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "has not reached step 180" in error.details()
    stop_all()
    _, stub = start()
    assignment = first_assignment(stub, ids[0])
    assert (assignment.topology_version, assignment.switch_step) == (2, 180)
    assert sorted(n.rank for n in assignment.neighbors) == [1, 2, 4, 5]
    report(stub, job_id, ids, [181] * 6)
    assert change(stub, job_id, "complete").topology_version == 3


def test_the_switch_step_keeps_a_margin_at_the_start(coordinator):
    start, _ = coordinator
    _, stub = start()
    job_id, _ids = running_job(stub)
    assert change(stub, job_id, "complete").switch_step == MIN_SWITCH_MARGIN_STEPS


@pytest.mark.parametrize(("kind", "options", "code", "words"), [
    ("hypercube", {}, grpc.StatusCode.INVALID_ARGUMENT, "topology: unknown topology kind 'hypercube'"),
    ("random-regular", {}, grpc.StatusCode.INVALID_ARGUMENT, "option 'degree' is required"),
    ("random-regular", {"degree": 3, "colour": 1}, grpc.StatusCode.INVALID_ARGUMENT, "unknown option(s) colour"),
    ("torus", {"rows": 4}, grpc.StatusCode.INVALID_ARGUMENT, "torus"),
    ("x" * 65, {}, grpc.StatusCode.INVALID_ARGUMENT, "topology.kind: String should have at most 64 characters"),
    ("edge-list", {"edges": "0 1\n" * 20_000}, grpc.StatusCode.INVALID_ARGUMENT, "topology.options: 100013 characters"),
])
def test_a_topology_the_job_cannot_take_is_refused_naming_the_field(coordinator, kind, options, code, words):
    start, _ = coordinator
    _, stub = start()
    job_id, _ids = running_job(stub)
    error = refused(lambda: change(stub, job_id, kind, options))
    assert error.code() == code
    assert words in error.details()
    assert len(error.details()) < 1000  # bounded: what the caller sent is not echoed at length


def test_bad_options_json_and_unknown_jobs_are_refused(coordinator):
    start, _ = coordinator
    _, stub = start()
    job_id, _ids = running_job(stub)
    for options_json, words in (("[1]", "must be a JSON object"), ("{", "not JSON")):
        error = refused(lambda options_json=options_json: stub.ChangeTopology(
            pb.ChangeTopologyRequest(job_id=job_id, kind="ring", options_json=options_json), timeout=5))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details()
    assert refused(lambda: change(stub, "nope", "ring")).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("algorithm", "words"), [
    ({"name": "ssgd"}, "ssgd has no topology to change (its nodes talk to the parameter server)"),
    ({"name": "allreduce"}, "allreduce has no topology to change (its nodes talk all at once)"),
    ({"name": "ad-psgd"}, "ad-psgd cannot change its topology while it runs"),
])
def test_jobs_without_a_changeable_topology_are_refused(coordinator, algorithm, words):
    start, _ = coordinator
    _, stub = start()
    job_id, _ids = running_job(stub, nodes=3, algorithm=algorithm)
    error = refused(lambda: change(stub, job_id, "complete"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and words in error.details()


def test_only_a_running_job_changes_and_not_past_its_end(coordinator):
    start, _ = coordinator
    _, stub = start()
    job_id, ids = running_job(stub, nodes=3)
    report(stub, job_id, ids, [995, 990, 992])
    error = refused(lambda: change(stub, job_id, "complete"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "ends at step 1000" in error.details()
    stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    error = refused(lambda: change(stub, job_id, "complete"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "is stopped" in error.details()


def test_the_cli_reads_options_as_json_or_text_and_prints_the_switch(coordinator, monkeypatch, capsys):
    assert topology_options(["degree=4", "weights=metropolis-hastings", "edges=0 1"]) == \
        {"degree": 4, "weights": "metropolis-hastings", "edges": "0 1"}
    with pytest.raises(SystemExit, match="write KEY=VALUE"):
        topology_options(["degree"])
    with pytest.raises(SystemExit):
        coordinator_main(["topology", "some-job", "--kind", "hypercube", "--coordinator", "127.0.0.1:1"])
    assert "invalid choice: 'hypercube'" in capsys.readouterr().err
    start, _ = coordinator
    _, stub = start()
    job_id, _ids = running_job(stub)
    monkeypatch.setattr(cli, "_stub", lambda args: stub)
    assert coordinator_main(["topology", job_id, "--kind", "random-regular", "--option", "degree=3"]) == 0
    assert capsys.readouterr().out == f"{job_id}: topology ring -> random-regular (version 2); every node switches " \
        f"just before step {MIN_SWITCH_MARGIN_STEPS}\n"
    assert coordinator_main(["topology", job_id, "--kind", "complete"]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
