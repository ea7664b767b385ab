"""A job's events: what nodes may report (their own jobs, bounded kinds, levels, sizes and rates), what `logs`
reads back (by offset, rank and level), and the agent's forwarding queue (its bound, what stays local, what is
tried again)."""

from __future__ import annotations

import logging

import grpc
import pytest
import yaml

from coordinator.service import EVENT_BURST
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.agent.forward import MAX_PENDING, EventForwarder
from nodeagent.runtime import events
from nodeagent.runtime.events import Event, EventLog, read_events

pytestmark = pytest.mark.integration


@pytest.fixture
def stub(coordinator_stub):
    return coordinator_stub


def running_job(stub) -> tuple[str, list[str]]:
    ids = [stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{2000 + i}", name=f"a{i}"), timeout=5).node_id
           for i in range(2)]
    spec = yaml.safe_dump({"name": "ev", "nodes": 2, "steps": 10, "topology": {"kind": "ring"}})
    return stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id, ids


def report(stub, node_id: str, job_id: str, *batch: pb.JobEvent) -> pb.EventReportReply:
    return stub.ReportEvents(pb.EventReport(node_id=node_id, job_id=job_id, events=batch), timeout=5)


def test_nodes_report_events_that_logs_reads_back_by_offset_rank_and_level(stub):
    job_id, ids = running_job(stub)
    report(stub, ids[0], job_id, pb.JobEvent(kind="started", level="INFO", message="rank 0 started", step=0,
                                             rank=7, node_id="forged", time_unix=1.0))
    report(stub, ids[1], job_id, pb.JobEvent(kind="log", level="WARNING", message="slow <neighbour>\x1b[31m", step=4))
    everything = stub.JobEvents(pb.JobEventsRequest(job_id="ev"), timeout=5)  # by name
    assert everything.job_id == job_id and everything.state == pb.JOB_RUNNING
    seen = [(e.kind, e.rank, e.node_id) for e in everything.events]
    # The coordinator's own events come first; a node's rank, id and time are the coordinator's, never its words.
    assert seen == [("submitted", -1, ""), ("started", -1, ""), ("started", 0, ids[0]), ("log", 1, ids[1])]
    assert everything.events[2].time_unix > 1e9
    assert everything.events[3].message == "slow <neighbour>"  # terminal escapes never reach a terminal
    # From the offset on: nothing new, then only what came since.
    assert not stub.JobEvents(pb.JobEventsRequest(job_id=job_id, offset=everything.next_offset), timeout=5).events
    stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    since = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, offset=everything.next_offset), timeout=5)
    assert [(e.kind, e.message) for e in since.events] == [("stopped", "stopped by an operator")]
    assert since.state == pb.JOB_STOPPED
    one = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, rank=1), timeout=5)
    assert {e.rank for e in one.events} == {-1, 1}
    warnings = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, min_level="WARNING"), timeout=5)
    assert [e.kind for e in warnings.events] == ["log"]
    inside_a_line = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, offset=5), timeout=5)  # skipped, not a crash
    assert inside_a_line.events[0].kind == "started"


@pytest.mark.parametrize(("batch", "code"), [
    ([pb.JobEvent(kind="submitted", level="INFO")], grpc.StatusCode.INVALID_ARGUMENT),  # the coordinator's kind
    ([pb.JobEvent(kind="log", level="LOUD")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.JobEvent(kind="log", level="INFO")] * 65, grpc.StatusCode.INVALID_ARGUMENT),
], ids=["kind", "level", "too-many"])
def test_a_bad_report_is_refused_whole(stub, batch, code):
    job_id, ids = running_job(stub)
    with pytest.raises(grpc.RpcError) as error:
        report(stub, ids[0], job_id, pb.JobEvent(kind="started", level="INFO"), *batch)
    assert error.value.code() == code and len(error.value.details()) < 300
    assert [e.rank for e in stub.JobEvents(pb.JobEventsRequest(job_id=job_id), timeout=5).events] == [-1, -1]


def test_a_node_reports_only_on_its_own_jobs_and_within_its_rate(stub):
    job_id, ids = running_job(stub)
    outsider = stub.Register(pb.RegisterRequest(peer_address="127.0.0.1:3000", name="b"), timeout=5).node_id
    with pytest.raises(grpc.RpcError) as error:
        report(stub, outsider, job_id, pb.JobEvent(kind="log", level="ERROR", message="lies"))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    dropped = 0
    for _ in range(EVENT_BURST // 64 + 2):
        dropped += report(stub, ids[0], job_id, *[pb.JobEvent(kind="log", level="WARNING", message="x")] * 64).dropped
    kept = [e for e in stub.JobEvents(pb.JobEventsRequest(job_id=job_id, rank=0), timeout=5).events if e.rank == 0]
    assert dropped > 0 and EVENT_BURST <= len(kept) < EVENT_BURST + 10  # the rate refills a little meanwhile
    assert len(kept) + dropped == (EVENT_BURST // 64 + 2) * 64


def test_a_torn_or_long_event_log_is_read_in_bounded_whole_lines(tmp_path):
    log = EventLog(tmp_path)
    for i in range(100):
        log.append(Event(1.7e9 + i, "j", events.LOG, "m" * 1000, "WARNING", 0, "n", i))
    with open(log.path, "a") as out:
        out.write('{"time": 1, "job": "j", "kind": "lo')  # a line being written (or torn by a crash)
    read, offset = read_events(tmp_path, 0, max_bytes=10_000)
    assert 0 < len(read) < 10 and [e.step for e in read] == list(range(len(read)))
    rest, end = read_events(tmp_path, offset)
    assert [e.step for e in read + rest] == list(range(100))
    assert read_events(tmp_path, end) == ([], end)
    assert events.bounded("x" * 5000).endswith(" [cut]") and len(events.bounded("x" * 5000)) < 2100


class FakeStub:
    def __init__(self, failures: list[grpc.StatusCode]):
        self.failures = failures
        self.reports: list[pb.EventReport] = []

    def ReportEvents(self, request, timeout):
        if self.failures:
            raise _RpcError(self.failures.pop(0))
        self.reports.append(request)
        return pb.EventReportReply()


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def test_the_forwarder_sends_a_jobs_warnings_and_events_in_order_and_keeps_them_while_unreachable():
    current: list[tuple[str, int] | None] = [None]
    forwarder = EventForwarder(lambda: current[0])
    logger = logging.getLogger("test-forward")
    logger.addHandler(forwarder)
    logger.propagate = False
    try:
        logger.warning("before any job")  # stays local: no job to file it under
        current[0] = ("job-a", 12)
        logger.info("below the level")
        logger.warning("slow neighbour %s", "n1")
        forwarder.add("job-a", events.FINISHED, "done", "INFO", 20)
        current[0] = ("job-b", 0)
        logger.error("boom")
    finally:
        logger.removeHandler(forwarder)
    stub = FakeStub([grpc.StatusCode.UNAVAILABLE])
    forwarder.send(stub, "node-1")  # the coordinator is away: nothing lost
    assert stub.reports == []
    forwarder.send(stub, "node-1")
    assert [(r.job_id, [(e.kind, e.level, e.message, e.step) for e in r.events]) for r in stub.reports] == [
        ("job-a", [("log", "WARNING", "slow neighbour n1", 12), ("finished", "INFO", "done", 20)]),
        ("job-b", [("log", "ERROR", "boom", 0)]),
    ]
    refused = FakeStub([grpc.StatusCode.PERMISSION_DENIED])
    forwarder.add("job-c", events.LOG, "x", "WARNING")
    forwarder.send(refused, "node-1")  # refused for good: dropped, not retried forever
    forwarder.send(refused, "node-1")
    assert refused.reports == []


def test_the_forwarder_queue_is_bounded_and_counts_what_it_drops():
    forwarder = EventForwarder(lambda: None)
    for i in range(MAX_PENDING + 5):
        forwarder.add("j", events.LOG, str(i), "WARNING")
    stub = FakeStub([])
    forwarder.send(stub, "n")
    sent = [e.message for r in stub.reports for e in r.events]
    assert forwarder.dropped == 5 and sent == [str(i) for i in range(5, MAX_PENDING + 5)]
    assert max(len(r.events) for r in stub.reports) <= 64


def test_a_simulated_run_writes_its_events_in_virtual_time(tmp_path, fashion_mnist_dir):
    from coordinator.simulate import simulate
    from nodeagent.jobspec import parse_job_spec

    spec = parse_job_spec({"name": "sim", "nodes": 3, "steps": 20, "eval_every": 10,
                           "data": {"data_dir": str(fashion_mnist_dir), "train_limit": 300, "test_limit": 100},
                           "topology": {"kind": "ring"}})
    result = simulate(spec, tmp_path / "run")
    found, _ = read_events(tmp_path / "run")
    assert (found[0].kind, found[0].rank, found[0].time) == ("started", -1, 0.0)
    assert sorted(e.rank for e in found if e.kind == "finished") == [-1, 0, 1, 2]
    assert found[-1].kind == "finished" and found[-1].time == pytest.approx(result.mesh.now)
    assert all(e.step == 20 for e in found if e.kind == "finished" and e.rank >= 0)
