"""The coordinator in-process over real gRPC: job specs, scheduling, assignments, liveness, restarts."""

import json
import math
import time
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml

import coordinator.cli as cli
import coordinator.service as service_module
from coordinator.cli import main as coordinator_main
from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.jobspec import JobSpec, JobSpecError, parse_job_yaml
from nodeagent.metrics import Metrics

pytestmark = pytest.mark.integration


def job(**overrides) -> str:
    spec = {"name": "t", "nodes": 3, "steps": 10, "algorithm": {"interval": 4}, "topology": {"kind": "ring"}}
    spec.update(overrides)
    return yaml.safe_dump(spec)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("algorithm: {lr: -1}", "algorithm.lr"),
        ("nodes: 0", "nodes"),
        ("data: {batch_size: many}", "data.batch_size"),
        ("modle: {name: cnn}", "modle"),
        ("wire: {encoding: gzip}", "wire.encoding"),
        ("slowdown: {7: 2.0}\nnodes: 2", "slowdown"),
        ("- a list", "mapping"),
        ("name: [unclosed", "YAML"),
    ],
)
def test_bad_specs_name_the_field(text, field):
    with pytest.raises(JobSpecError, match=field.replace(".", r"\.")):
        parse_job_yaml(text)


def test_spec_survives_json_round_trip():
    spec = parse_job_yaml(job(slowdown={1: 3.0}))
    assert JobSpec.from_json(spec.to_json()) == spec


def test_cli_submit_rejects_a_bad_file_before_calling(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: {interval: 0}\n")
    with pytest.raises(SystemExit) as exit_info:
        coordinator_main(["submit", str(bad), "--coordinator", "127.0.0.1:1"])
    assert "algorithm.interval" in str(exit_info.value.code)


@pytest.fixture
def coordinator(tmp_path):
    """Yields (service, stub, start) where start() brings a fresh service up on the same state dir."""
    servers = []

    def start(heartbeat_timeout_s: float = 60.0):
        service = CoordinatorService(
            CoordinatorConfig(state_dir=tmp_path, heartbeat_timeout_s=heartbeat_timeout_s), Metrics()
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        add_coordinator_servicer(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        service.start()
        servers.append((server, service))
        return service, coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def stop_all():
        while servers:
            server, service = servers.pop()
            server.stop(grace=None)
            service.stop()

    yield start, stop_all
    stop_all()


def register(stub, name: str, node_id: str = "") -> str:
    # An address of its own (a node cannot take a live node's): a port from the name, the same in every run.
    request = pb.RegisterRequest(node_id=node_id, peer_address=f"127.0.0.1:{zlib.crc32(name.encode()) % 40000 + 2000}",
                                 name=name)
    return stub.Register(request, timeout=5).node_id


def first_assignment(stub, node_id: str) -> pb.Assignment:
    stream = stub.WatchAssignment(pb.WatchAssignmentRequest(node_id=node_id), timeout=5)
    assignment = next(stream)
    stream.cancel()
    return assignment


def test_a_watched_assignment_is_computed_again_only_after_a_change(coordinator_service, monkeypatch):
    """A watch does not rebuild its node's assignment on a timer, only after a change that may alter it (here, a
    job starting on it)."""
    service, stub = coordinator_service
    monkeypatch.setattr(service_module, "WATCH_POLL_S", 0.02)  # the stream looks whether it ended this often
    ids = [register(stub, f"w{i}") for i in range(2)]
    computed: list[str] = []
    original = service.assignment_for
    monkeypatch.setattr(service, "assignment_for", lambda node_id: computed.append(node_id) or original(node_id))
    stream = stub.WatchAssignment(pb.WatchAssignmentRequest(node_id=ids[0]), timeout=10)
    assert next(stream).state == pb.JOB_STATE_UNSPECIFIED
    time.sleep(0.5)  # some 25 looks, no change
    assert computed == [ids[0]]
    stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(nodes=2)), timeout=5)
    assert next(stream).state == pb.JOB_RUNNING
    stream.cancel()


def test_invalid_job_is_refused_with_the_field(coordinator):
    start, _ = coordinator
    _, stub = start()
    for text, field in (
        (job(topology={"kind": "hypercube"}), "topology"),
        (job(algorithm={"name": "x"}), "algorithm.name"),
        (job(nodes=4, algorithm={"name": "sgp"}, topology={"kind": "bipartite-exponential"}), "topology.kind"),
        (job(model={"name": "resnet"}), "model.name: unknown model 'resnet'"),
        (job(model={"name": "mlp", "options": {"hiden": [8]}}), "model.options: model 'mlp': options ['hiden']"),
    ):
        with pytest.raises(grpc.RpcError) as error:
            stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=text), timeout=5)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in error.value.details()


def test_job_waits_for_nodes_then_assigns_ranks_signs_and_phases(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(2)]
    reply = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5)
    assert reply.state == pb.JOB_PENDING
    assert first_assignment(stub, ids[0]).state == pb.JOB_STATE_UNSPECIFIED
    ids.append(register(stub, "a2"))
    status = stub.JobStatus(pb.JobStatusRequest(job_id=reply.job_id), timeout=5)
    assert status.state == pb.JOB_RUNNING
    assert [n.node_id for n in status.nodes] == ids
    for rank, node_id in enumerate(ids):
        assignment = first_assignment(stub, node_id)
        assert (assignment.state, assignment.rank, assignment.world_size) == (pb.JOB_RUNNING, rank, 3)
        assert JobSpec.from_json(assignment.job_spec_json).nodes == 3
        assert sorted(n.rank for n in assignment.neighbors) == sorted({(rank - 1) % 3, (rank + 1) % 3})
        for neighbor in assignment.neighbors:
            assert neighbor.sign == (1 if rank < neighbor.rank else -1)
            assert 0 <= neighbor.phase < 4
            assert neighbor.node_id == ids[neighbor.rank] and neighbor.up
        assert math.isclose(assignment.self_weight + sum(n.weight for n in assignment.neighbors), 1.0)


def test_silent_node_is_marked_down_and_neighbours_are_told(coordinator):
    start, _ = coordinator
    _, stub = start(heartbeat_timeout_s=1.0)
    ids = [register(stub, f"a{i}") for i in range(3)]
    stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5)
    stream = stub.WatchAssignment(pb.WatchAssignmentRequest(node_id=ids[0]), timeout=15)
    assert all(n.up for n in next(stream).neighbors)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for node_id in ids[:2]:
            stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5)
        down = {n.node_id for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes if not n.up}
        if down:
            break
        time.sleep(0.2)
    assert down == {ids[2]}
    update = next(stream)
    assert {n.node_id: n.up for n in update.neighbors} == {ids[1]: True, ids[2]: False}
    stub.Heartbeat(pb.HeartbeatRequest(node_id=ids[2]), timeout=5)
    assert all(n.up for n in next(stream).neighbors)
    stream.cancel()


def test_finished_job_frees_its_nodes_and_state_survives_a_restart(coordinator):
    start, stop_all = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(3)]
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5).job_id
    for rank, node_id in enumerate(ids):
        stub.ReportMetrics(pb.MetricsReport(node_id=node_id, job_id=job_id, rank=rank, step=10, loss=0.5,
                                            test_accuracy=0.8, finished=True), timeout=5)
    assert stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).state == pb.JOB_FINISHED
    assert first_assignment(stub, ids[0]).state == pb.JOB_STATE_UNSPECIFIED
    # A report from a node that does not hold that rank is not recorded.
    reply = stub.ReportMetrics(pb.MetricsReport(node_id=ids[0], job_id=job_id, rank=2, step=99), timeout=5)
    assert not reply.job_active
    stop_all()
    _, stub = start()
    status = stub.JobStatus(pb.JobStatusRequest(), timeout=5)
    assert (status.job_id, status.state) == (job_id, pb.JOB_FINISHED)
    assert [n.step for n in status.nodes] == [10, 10, 10]
    assert register(stub, "a0", node_id=ids[0]) == ids[0]
    assert len(stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes) == 3


def test_stop_job(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(3)]
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5).job_id
    assert stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5).state == pb.JOB_STOPPED
    assert first_assignment(stub, ids[1]).state == pb.JOB_STATE_UNSPECIFIED
    with pytest.raises(grpc.RpcError) as error:
        stub.StopJob(pb.StopJobRequest(job_id="nope"), timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_jobs_are_listed_newest_first_and_named_by_id_prefix_or_name(coordinator):
    start, _ = coordinator
    _, stub = start()
    for i in range(2):
        register(stub, f"a{i}")
    first = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="alpha", nodes=2)), timeout=5).job_id
    stub.StopJob(pb.StopJobRequest(job_id="alpha"), timeout=5)  # by name
    second = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="alpha", nodes=2)), timeout=5).job_id
    other = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="beta", nodes=2)), timeout=5).job_id
    listed = stub.ListJobs(pb.ListJobsRequest(), timeout=5).jobs
    assert [j.job_id for j in listed] == [other, second, first]
    assert [pb.JobState.Name(j.state) for j in listed] == ["JOB_PENDING", "JOB_RUNNING", "JOB_STOPPED"]
    assert [j.job_id for j in stub.ListJobs(pb.ListJobsRequest(limit=1), timeout=5).jobs] == [other]
    # A name means the newest job of that name; a prefix that only one id starts with means that job.
    assert stub.JobStatus(pb.JobStatusRequest(job_id="alpha"), timeout=5).job_id == second
    assert stub.JobStatus(pb.JobStatusRequest(job_id=other[:6]), timeout=5).job_id == other
    stopped = stub.StopJob(pb.StopJobRequest(job_id="beta"), timeout=5)
    assert (stopped.job_id, stopped.state) == (other, pb.JOB_STOPPED)
    with pytest.raises(grpc.RpcError) as error:  # no job is named or begins x...
        stub.JobStatus(pb.JobStatusRequest(job_id="x" * 10_000), timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "coordinator jobs" in error.value.details() and len(error.value.details()) < 300


def test_an_ambiguous_job_prefix_is_refused_naming_the_jobs_it_begins(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="alpha", nodes=2)), timeout=5).job_id
           for _ in range(2)]
    for call, request in ((stub.JobStatus, pb.JobStatusRequest), (stub.StopJob, pb.StopJobRequest),
                          (stub.JobEvents, pb.JobEventsRequest)):
        with pytest.raises(grpc.RpcError) as error:
            call(request(job_id="alp"), timeout=5)  # "alp" begins both ids
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == f"'alp' begins several jobs' ids: {ids[1]}, {ids[0]}; give more of the id"


def test_a_job_too_large_waits_with_its_reason_and_does_not_hold_back_a_smaller_one(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(3)]
    big = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="big", nodes=5)), timeout=5)
    assert big.state == pb.JOB_PENDING and "needs 5 agents; 3 are up" in big.warning
    small = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="small", nodes=3)), timeout=5)
    assert small.state == pb.JOB_RUNNING and not small.warning
    waiting = stub.JobStatus(pb.JobStatusRequest(job_id=big.job_id), timeout=5)
    assert waiting.state == pb.JOB_PENDING and "needs 5 agents; 3 are up" in waiting.reason
    third = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="third", nodes=2)), timeout=5)
    assert third.state == pb.JOB_PENDING and "needs 2 idle agents; 0 are idle" in third.warning
    assert first_assignment(stub, ids[0]).job_id == small.job_id



def test_an_fp16_job_runs_only_on_agents_with_a_cuda_device(coordinator):
    start, _ = coordinator
    _, stub = start()
    on_cpu = [register(stub, f"c{i}") for i in range(3)]
    fp16 = job(name="half", nodes=2, training={"precision": "fp16"})
    waiting = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=fp16), timeout=5)
    assert waiting.state == pb.JOB_PENDING
    assert "needs 2 agents on a CUDA device (training.precision fp16); 0 are up" in waiting.warning
    on_gpu = [stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{7100 + i}", name=f"g{i}", device=f"cuda:{i}"),
                            timeout=5).node_id for i in range(2)]
    status = stub.JobStatus(pb.JobStatusRequest(job_id=waiting.job_id), timeout=5)
    assert status.state == pb.JOB_RUNNING and {n.node_id for n in status.nodes} == set(on_gpu)
    assert first_assignment(stub, on_cpu[0]).job_id == ""  # the CPU agents stay free for other jobs

def test_a_node_failure_fails_the_job_with_its_reason_and_frees_the_agents(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(3)]
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5).job_id
    waiting = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="next")), timeout=5).job_id
    with pytest.raises(grpc.RpcError) as forged:  # only the node that holds the rank may report its failure
        stub.ReportFailure(pb.NodeFailure(node_id=ids[0], job_id=job_id, rank=1, reason="x"), timeout=5)
    assert forged.value.code() == grpc.StatusCode.PERMISSION_DENIED
    reply = stub.ReportFailure(pb.NodeFailure(node_id=ids[1], job_id=job_id, rank=1,
                                              reason="DataError: train-images-idx3-ubyte not found"), timeout=5)
    assert reply.job_state == pb.JOB_FAILED
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert status.state == pb.JOB_FAILED and status.ended_unix >= status.started_unix > 0
    assert status.reason == f"rank 1 (node {ids[1]}) failed: DataError: train-images-idx3-ubyte not found"
    assert [n.state for n in status.nodes] == ["up", "failed", "up"]
    # Its agents are free: the next job runs on them.
    assert stub.JobStatus(pb.JobStatusRequest(job_id=waiting), timeout=5).state == pb.JOB_RUNNING
    assert first_assignment(stub, ids[1]).job_id == waiting


def test_drain_remove_and_deregister(coordinator):
    start, _ = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(4)]
    assert stub.DrainNode(pb.DrainRequest(node_id=ids[3], drain=True), timeout=5).draining
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5).job_id
    assert [n.node_id for n in stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).nodes] == ids[:3]
    with pytest.raises(grpc.RpcError) as busy:
        stub.RemoveNode(pb.NodeRequest(node_id=ids[0]), timeout=5)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION and job_id in busy.value.details()
    with pytest.raises(grpc.RpcError) as live:  # its agent runs: it would register again a second later
        stub.RemoveNode(pb.NodeRequest(node_id=ids[3]), timeout=5)
    assert live.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stop its agent first" in live.value.details()
    stub.Deregister(pb.DeregisterRequest(node_id=ids[3]), timeout=5)
    assert stub.RemoveNode(pb.NodeRequest(node_id=ids[3]), timeout=5).node_id == ids[3]
    stub.Deregister(pb.DeregisterRequest(node_id=ids[2]), timeout=5)
    nodes = {n.node_id: n for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes}
    assert set(nodes) == set(ids[:3]) and not nodes[ids[2]].up and nodes[ids[0]].up
    states = [n.state for n in stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).nodes]
    assert states == ["up", "up", "down"]


def run_with_rank_2_silent(stub, ids: list[str], spec: str) -> pb.JobStatusReply:
    """Submit `spec` on three registered nodes: ranks 0 and 1 finish and keep beating, rank 2 never beats again; the
    job's status once it is no longer running (or after 15 s)."""
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id
    for rank in (0, 1):
        stub.ReportMetrics(pb.MetricsReport(node_id=ids[rank], job_id=job_id, rank=rank, step=10, loss=0.5,
                                            test_accuracy=0.8, finished=True), timeout=5)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for node_id in ids[:2]:
            stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5)
        status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
        if status.state != pb.JOB_RUNNING:
            break
        time.sleep(0.2)
    return status


@pytest.mark.parametrize(("algorithm", "outcome"), [({"name": "dsgd", "mode": "sync"}, pb.JOB_FAILED),
                                                     ({"name": "pdmm-isvr"}, pb.JOB_FINISHED)])
def test_a_lost_node_fails_a_synchronous_job_and_an_asynchronous_one_goes_on(coordinator, algorithm, outcome):
    start, _ = coordinator
    _, stub = start(heartbeat_timeout_s=1.0)
    ids = [register(stub, f"a{i}") for i in range(3)]
    spec = job(algorithm={"interval": 4, **algorithm}, failure={"lost_grace_s": 1.0})
    status = run_with_rank_2_silent(stub, ids, spec)
    assert status.state == outcome
    assert f"rank 2 (node {ids[2]}" in status.reason and "lost" in status.reason


def test_a_restarted_coordinator_marks_no_node_down_before_a_heartbeat_timeout(coordinator):
    start, stop_all = coordinator
    _, stub = start(heartbeat_timeout_s=2.0)
    ids = [register(stub, f"a{i}") for i in range(2)]
    stop_all()
    time.sleep(2.5)  # longer than the timeout: the nodes' last heartbeats are old when it comes back
    _, stub = start(heartbeat_timeout_s=2.0)
    time.sleep(1.5)  # the monitor runs every second; the agents beat again within their interval
    assert all(n.up for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes)
    for node_id in ids:
        stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5)
    assert all(n.up for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes)


def test_status_shows_the_jobs_times_reason_and_each_nodes_state_rate_and_report_age():
    from coordinator.display import status_text

    status = pb.JobStatusReply(
        job_id="j-1", name="j", state=pb.JOB_FAILED, world_size=2, run_dir="/runs/j-1", started_unix=1000.0,
        ended_unix=1090.0, reason="rank 1 (node n1) failed: DataError: no data",
        nodes=[pb.NodeProgress(rank=0, node_id="n0", step=200, elapsed_s=50.0, loss=0.5, test_accuracy=0.8,
                               updated_unix=1089.0, state="up"),
               pb.NodeProgress(rank=1, node_id="n1", step=0, loss=math.nan, test_accuracy=math.nan,
                               updated_unix=1001.0, state="failed", failure="DataError: no data")],
    )
    lines = status_text(status, now=1100.0).splitlines()
    assert lines[0].startswith("job j-1 (j): failed, 2 nodes")
    assert lines[1].endswith("ran 90 s") and lines[2] == "reason: rank 1 (node n1) failed: DataError: no data"
    row0, row1 = lines[4].split(), lines[5].split()
    assert row0[:5] == ["0", "n0", "up", "200", "4.0"] and row0[-3:] == ["11", "s", "ago"]
    assert row1[:4] == ["1", "n1", "failed", "0"] and row1[-3:] == ["99", "s", "ago"]
    assert lines[-1] == "rank 1 failed: DataError: no data"


def test_status_counts_the_steps_of_a_restarted_nodes_run_and_says_each_failure_once():
    from coordinator.display import status_text

    nodes = [pb.NodeProgress(rank=0, node_id="n0", step=1200, local_steps=1000, elapsed_s=10.0, state="finished"),
             # reported by an agent that does not count local steps: the job's step stands for them
             pb.NodeProgress(rank=1, node_id="n1", step=1200, elapsed_s=24.0, state="finished")]
    failed = [pb.NodeProgress(rank=r, node_id=f"n{r}", state="failed", failure="DataError: no data") for r in (0, 1)]
    lines = status_text(pb.JobStatusReply(job_id="j-1", state=pb.JOB_FINISHED, nodes=nodes)).splitlines()
    assert lines[2].split()[4] == "100.0" and lines[3].split()[4] == "50.0"
    lines = status_text(pb.JobStatusReply(job_id="j-2", state=pb.JOB_FAILED, nodes=failed)).splitlines()
    assert [line for line in lines if "failed:" in line] == ["ranks 0, 1 failed: DataError: no data"]


def test_the_jobs_command_lists_jobs_as_a_table_or_json_lines(coordinator, monkeypatch, capsys):
    start, _ = coordinator
    _, stub = start()
    for i in range(2):
        register(stub, f"a{i}")
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="alpha", nodes=2)), timeout=5).job_id
    monkeypatch.setattr(cli, "_stub", lambda args: stub)
    assert coordinator_main(["jobs", "--json"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert (record["job_id"], record["name"], record["state"], record["nodes"]) == (job_id, "alpha", "RUNNING", 2)
    assert record["started_unix"] and record["ended_unix"] is None
    assert coordinator_main(["stop", "alpha"]) == 0
    assert capsys.readouterr().out == f"{job_id}: stopped\n"
    assert coordinator_main(["jobs"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["job", "name", "state", "nodes"]
    assert row.split()[:4] == [job_id, "alpha", "stopped", "2"] and "stopped by an operator" in row


@pytest.mark.parametrize(("failure", "outcome"), [({}, pb.JOB_FINISHED), ({"min_members": 3}, pb.JOB_FAILED)],
                         ids=["quorum-of-two-finishes", "below-min-members-fails"])
def test_a_lost_member_of_an_allreduce_job_is_left_behind_while_the_quorum_keeps_its_minimum(coordinator, failure,
                                                                                             outcome):
    start, _ = coordinator
    _, stub = start(heartbeat_timeout_s=1.0)
    ids = [register(stub, f"a{i}") for i in range(3)]
    spec = yaml.safe_dump({"name": "t", "nodes": 3, "steps": 10, "algorithm": {"name": "allreduce"},
                           "failure": {"lost_grace_s": 1.0, **failure}})
    status = run_with_rank_2_silent(stub, ids, spec)
    assert status.state == outcome, status.reason
    assert f"rank 2 (node {ids[2]}" in status.reason and "lost" in status.reason


def test_an_allreduce_jobs_rendezvous_serves_its_members_and_starts_empty_after_a_restart(coordinator):
    start, stop_all = coordinator
    _, stub = start()
    ids = [register(stub, f"a{i}") for i in range(2)]
    spec = yaml.safe_dump({"name": "t", "nodes": 2, "steps": 10, "algorithm": {"name": "allreduce"}})
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id

    def call(node_id: str, op: int, key: str, **fields) -> pb.RendezvousReply:
        return stub.Rendezvous(pb.RendezvousRequest(node_id=node_id, job_id=job_id, op=op, keys=[key], **fields),
                               timeout=5)

    call(ids[0], pb.RENDEZVOUS_SET, "k", value=b"v")
    assert call(ids[1], pb.RENDEZVOUS_GET, "k").value == b"v"
    assert call(ids[1], pb.RENDEZVOUS_ADD, "knocks", amount=2).number == 2
    stop_all()
    _, stub = start()
    assert not call(ids[0], pb.RENDEZVOUS_CHECK, "k").found  # as the collective expects: it forms its quorum again
    assert call(ids[1], pb.RENDEZVOUS_ADD, "knocks", amount=1).number == 1


def test_the_nodes_command_shows_each_nodes_device_with_its_name_and_memory(coordinator_stub, monkeypatch, capsys):
    h100 = 85_017_493_504  # what torch reports for an H100 80GB HBM3: 79.18 GiB
    coordinator_stub.Register(pb.RegisterRequest(peer_address="127.0.0.1:7100", name="gpu-host-gpu0", device="cuda:0",
                                                 device_name="NVIDIA H100 80GB HBM3", device_memory_bytes=h100),
                              timeout=5)
    coordinator_stub.Register(pb.RegisterRequest(peer_address="127.0.0.1:7101", name="laptop", device="cpu",
                                                 device_name="cpu"), timeout=5)
    monkeypatch.setattr(cli, "_stub", lambda args: coordinator_stub)
    assert coordinator_main(["nodes"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[-2:] == ["rank", "device"]
    devices = {row.split()[1]: row[header.index("device"):] for row in rows}
    assert devices == {"gpu-host-gpu0": "cuda:0 NVIDIA H100 80GB HBM3 (79 GiB)", "laptop": "cpu"}
    assert coordinator_main(["nodes", "--json"]) == 0
    records = {record["name"]: record for record in map(json.loads, capsys.readouterr().out.splitlines())}
    gpu = records["gpu-host-gpu0"]
    assert (gpu["device"], gpu["device_name"], int(gpu["device_memory_bytes"])) == (
        "cuda:0", "NVIDIA H100 80GB HBM3", h100)


def test_a_database_from_before_the_device_columns_gets_them_and_keeps_its_nodes(tmp_path):
    import sqlite3

    from coordinator.control.sqlite import SCHEMA, SqliteState

    path = tmp_path / "coordinator.db"
    with sqlite3.connect(path) as old:  # the tables' first version, as an older coordinator wrote them
        old.executescript(SCHEMA)
        old.execute("INSERT INTO nodes VALUES ('n0', 'old', '127.0.0.1:7100', '', 'cuda:0', '0.1.0', 1.0, 1.0, 1)")
    old.close()
    store = SqliteState(path)
    [node] = store.nodes()
    assert (node.node_id, node.device, node.device_name, node.device_memory_bytes) == ("n0", "cuda:0", "", 0)
    store.register_node("n0", "old", "127.0.0.1:7100", "", "cuda:0", "0.1.0", "NVIDIA H100 80GB HBM3", 2**36)
    [node] = store.nodes()
    assert (node.device_name, node.device_memory_bytes) == ("NVIDIA H100 80GB HBM3", 2**36)
    store.close()


def test_jobs_delete_refuses_a_running_job_and_forgets_an_ended_one(coordinator_service, tmp_path, capsys):
    service, stub = coordinator_service
    for i in range(3):
        stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{7000 + i}", name=f"a{i}"), timeout=5)
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job()), timeout=5).job_id
    run_dir = service.store.job(job_id).run_dir
    with pytest.raises(grpc.RpcError) as refused:
        stub.DeleteJob(pb.DeleteJobRequest(job_id=job_id), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (f"job {job_id} is running: stop it first (`coordinator stop {job_id}`), then "
                                       "delete it")
    stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    reply = stub.DeleteJob(pb.DeleteJobRequest(job_id="t"), timeout=5)  # by name
    assert reply.job_id == job_id and reply.run_dir and not Path(run_dir).exists()
    with pytest.raises(grpc.RpcError) as gone:
        stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert service.store.members(job_id, with_left=True) == []
    assert job_id not in [j.job_id for j in stub.ListJobs(pb.ListJobsRequest(limit=10), timeout=5).jobs]
    with pytest.raises(grpc.RpcError) as again:
        stub.DeleteJob(pb.DeleteJobRequest(job_id=job_id), timeout=5)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND


def test_cli_jobs_delete_says_what_went_and_why_a_pending_job_stays(coordinator_address, capsys):
    client = ["--insecure", "--coordinator", coordinator_address]
    with grpc.insecure_channel(coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job(name="waits")), timeout=5).job_id  # no agents
    assert coordinator_main(["jobs", "delete", "waits", *client]) == 1
    assert f"FAILED_PRECONDITION: job {job_id} is pending: stop it first" in capsys.readouterr().err
    assert coordinator_main(["stop", "waits", *client]) == 0
    capsys.readouterr()
    assert coordinator_main(["jobs", "delete", "waits", *client]) == 0
    assert capsys.readouterr().out.startswith(f"{job_id}: deleted (its record, results and events and its run "
                                              "directory ")
    assert coordinator_main(["jobs", "--json", *client]) == 0
    assert capsys.readouterr().out == ""
