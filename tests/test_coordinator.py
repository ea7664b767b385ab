"""The coordinator in-process over real gRPC: job specs, scheduling, assignments, liveness, restarts."""

import math
import time
from concurrent import futures

import grpc
import pytest
import yaml

from coordinator.cli import main as coordinator_main
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.jobspec import JobSpec, JobSpecError, parse_job_yaml
from nodeagent.metrics import Metrics


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
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
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
    request = pb.RegisterRequest(node_id=node_id, peer_address=f"127.0.0.1:{hash(name) % 1000 + 2000}", name=name)
    return stub.Register(request, timeout=5).node_id


def first_assignment(stub, node_id: str) -> pb.Assignment:
    stream = stub.WatchAssignment(pb.WatchAssignmentRequest(node_id=node_id), timeout=5)
    assignment = next(stream)
    stream.cancel()
    return assignment


def test_invalid_job_is_refused_with_the_field(coordinator):
    start, _ = coordinator
    _, stub = start()
    for text, field in (
        (job(topology={"kind": "hypercube"}), "topology"),
        (job(algorithm={"name": "x"}), "algorithm.name"),
        (job(nodes=4, algorithm={"name": "sgp"}, topology={"kind": "bipartite-exponential"}), "topology.kind"),
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
