"""The start barrier in the coordinator, in-process over real gRPC: ready reports, the release, its timeout, a stopped
job, the data description every rank must share, and refused reports."""

import threading
import time
from concurrent import futures

import grpc
import pytest
import yaml

from coordinator.control.sqlite import SqliteState
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.messages import data_to_proto
from nodeagent.runtime.readiness import data_from_json
from nodeagent.training.data import DatasetInfo

pytestmark = pytest.mark.integration

DATA = DatasetInfo((1, 28, 28), 10, 60_000, 10_000)


def job(nodes: int = 3, **start) -> str:
    return yaml.safe_dump({"name": "t", "nodes": nodes, "steps": 10, "topology": {"kind": "ring"},
                           "start": start})


@pytest.fixture
def coordinator(coordinator_service):
    return coordinator_service


def running_job(stub, spec_yaml: str, nodes: int = 3) -> tuple[str, list[str]]:
    """A running job on `nodes` registered nodes; its id and the node id of each rank."""
    for i in range(nodes):
        stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{7000 + i}", name=f"a{i}"), timeout=5)
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec_yaml), timeout=5).job_id
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert status.state == pb.JOB_RUNNING
    return job_id, [n.node_id for n in sorted(status.nodes, key=lambda n: n.rank)]


def ready(stub, job_id: str, rank: int, node_id: str, data: DatasetInfo = DATA,
          wait_s: float = 0.0) -> pb.JobReadyReply:
    return stub.JobReady(pb.JobReadyRequest(node_id=node_id, job_id=job_id, rank=rank, data=data_to_proto(data),
                                            wait_s=wait_s), timeout=wait_s + 5)


def test_every_rank_waits_until_the_last_is_ready_and_a_late_rank_starts_at_once(coordinator):
    service, stub = coordinator
    job_id, nodes = running_job(stub, job())
    first = ready(stub, job_id, 0, nodes[0])
    assert not first.released and first.job_state == pb.JOB_RUNNING
    assert first.waiting_for == f"ranks 1 (node {nodes[1]}), 2 (node {nodes[2]})"
    with futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(ready, stub, job_id, rank, nodes[rank], wait_s=10.0) for rank in (0, 1)]
        time.sleep(0.3)
        assert not any(f.done() for f in held)  # held by the coordinator until the last rank is ready
        assert ready(stub, job_id, 2, nodes[2]).released
        assert all(f.result(timeout=5).released for f in held)
    # A rank that restarts after the release (a rejoin) starts without waiting.
    assert ready(stub, job_id, 1, nodes[1], wait_s=10.0).released
    events = stub.JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=5).events
    assert [e.kind for e in events].count("released") == 1
    # The job keeps its data's description (the parameter server's model is to be built from it).
    row = service.store.job(job_id)
    assert data_from_json(row.data_json) == DATA and row.released_unix > 0


def test_the_description_survives_a_restart(tmp_path, coordinator):
    service, stub = coordinator
    job_id, nodes = running_job(stub, job(nodes=1), nodes=1)
    assert ready(stub, job_id, 0, nodes[0]).released
    service.store.close()
    assert data_from_json(SqliteState(tmp_path / "coordinator.db").job(job_id).data_json) == DATA


def test_without_the_barrier_each_rank_starts_once_built(coordinator):
    _, stub = coordinator
    job_id, nodes = running_job(stub, job(barrier=False))
    assert ready(stub, job_id, 1, nodes[1], wait_s=10.0).released


def test_a_stopped_job_releases_its_waiters_with_its_state(coordinator):
    _, stub = coordinator
    job_id, nodes = running_job(stub, job())
    with futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(ready, stub, job_id, 0, nodes[0], wait_s=10.0)
        time.sleep(0.3)
        stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
        reply = held.result(timeout=5)
    assert (reply.released, reply.job_state, reply.reason) == (False, pb.JOB_STOPPED, "stopped by an operator")


def test_a_barrier_that_times_out_fails_the_job_naming_the_ranks_never_ready(coordinator):
    _, stub = coordinator
    job_id, nodes = running_job(stub, job(timeout_s=0.5))
    ready(stub, job_id, 1, nodes[1])
    stub.Deregister(pb.DeregisterRequest(node_id=nodes[2]), timeout=5)
    deadline = time.monotonic() + 10
    while (status := stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)).state == pb.JOB_RUNNING:
        assert time.monotonic() < deadline, "the barrier did not time out"
        time.sleep(0.1)
    assert status.state == pb.JOB_FAILED
    assert status.reason == (f"start barrier: ranks 0 (node {nodes[0]}), 2 (node {nodes[2]}, down) not ready within "
                             "start.timeout_s (0.5 s) of the job's start")


def test_a_rank_with_other_data_fails_the_job_naming_it_and_what_differs(coordinator):
    _, stub = coordinator
    job_id, nodes = running_job(stub, job())
    ready(stub, job_id, 0, nodes[0])
    ready(stub, job_id, 1, nodes[1])
    other = DatasetInfo((1, 28, 28), 10, 50_000, 10_000)
    reply = ready(stub, job_id, 2, nodes[2], other)
    assert reply.job_state == pb.JOB_FAILED and not reply.released
    assert reply.reason == (f"rank 2 (node {nodes[2]}) has other data than ranks 0, 1: train_samples 50000 vs "
                            "60000")


@pytest.mark.parametrize(("data", "wait_s", "field"), [
    (DatasetInfo((), 10, 60_000, 10_000), 0.0, "data.input_shape"),
    (DatasetInfo((1, 2, 3, 4, 5), 10, 60_000, 10_000), 0.0, "data.input_shape"),
    (DatasetInfo((1, 0, 28), 10, 60_000, 10_000), 0.0, "data.input_shape"),
    (DatasetInfo((4096, 4096, 4096), 10, 60_000, 10_000), 0.0, "data.input_shape"),
    (DatasetInfo((1, 28, 28), 0, 60_000, 10_000), 0.0, "data.num_classes"),
    (DatasetInfo((1, 28, 28), 10, 0, 10_000), 0.0, "data.train_samples"),
    (DatasetInfo((1, 28, 28), 10, 10**12, 10_000), 0.0, "data.train_samples"),
    (DATA, 3600.0, "wait_s"),
    (DATA, -1.0, "wait_s"),
])
def test_an_absurd_ready_report_is_refused_naming_the_field_and_changes_nothing(coordinator, data, wait_s, field):
    service, stub = coordinator
    job_id, nodes = running_job(stub, job())
    with pytest.raises(grpc.RpcError) as error:
        ready(stub, job_id, 0, nodes[0], data, wait_s)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field)
    assert not any(m.ready for m in service.store.members(job_id))
    assert service.store.job(job_id).data_json == ""


def test_a_ready_report_for_a_rank_the_node_does_not_hold_is_refused_and_changes_nothing(coordinator):
    service, stub = coordinator
    job_id, nodes = running_job(stub, job())
    for rank, node_id, job_reference in ((1, nodes[0], job_id), (7, nodes[0], job_id), (0, nodes[0], "other-job"),
                                         (0, "node-unknown", job_id)):
        with pytest.raises(grpc.RpcError) as error:
            ready(stub, job_reference, rank, node_id)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED, (rank, node_id, job_reference)
        assert f"does not hold rank {rank} of job" in error.value.details()
    assert not any(m.ready for m in service.store.members(job_id))
    assert service.store.job(job_id).data_json == ""


def test_many_waiters_are_released_together(coordinator):
    _, stub = coordinator
    job_id, nodes = running_job(stub, job(nodes=6), nodes=6)
    replies: list[pb.JobReadyReply] = []
    threads = [threading.Thread(target=lambda r=rank: replies.append(ready(stub, job_id, r, nodes[r], wait_s=10.0)))
               for rank in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert len(replies) == 6 and all(reply.released for reply in replies)
