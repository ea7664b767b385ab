"""Per-edge debugging and metrics hygiene (issue 13): what the coordinator keeps of the edges agents report, how
`coordinator edges` orders them, the edge gauges and the removal of a finished job's series."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from prometheus_client import generate_latest

from coordinator.cli import main as coordinator_main
from coordinator.display import (
    STALE_MIN_S,
    Trouble,
    edge_rows,
    edges_json,
    edges_text,
    outlying_share,
    waits_on,
)
from coordinator.service import MAX_REPORTED_EDGES, MAX_WAITING_CHARS, OTHER_REASON, bounded_report
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.metrics import Metrics
from nodeagent.rpc import MAX_FIELD_CHARS
from nodeagent.runtime.messages import from_report, to_report
from nodeagent.runtime.progress import EdgeCounters, MemberJudgement, Progress, RunLog, read_run_log

pytestmark = pytest.mark.integration


def test_the_coordinator_bounds_what_a_report_says_of_its_edges():
    edges = tuple(EdgeCounters(f"peer{i:05d}" + "x" * 100, failure_reasons={"unavailable": 2, f"made up {i}": 1,
                                                                             "another": 5})
                  for i in range(MAX_REPORTED_EDGES + 10))
    forged = EdgeCounters("n1", last_message_age_s=math.inf, message_interval_s=-3.0, in_flight_s=math.nan,
                          last_failure_age_s=-math.inf, staleness_steps=math.inf, consensus_distance=math.nan)
    report = Progress(job="j", rank=0, node="n0", edges=(forged, *edges), waiting_for="w" * 10_000)
    bounded = bounded_report(report)
    assert len(bounded.edges) == MAX_REPORTED_EDGES and len(bounded.waiting_for) == MAX_WAITING_CHARS
    assert all(len(edge.peer) == MAX_FIELD_CHARS for edge in bounded.edges[1:])
    # Unknown reasons are counted together: a report cannot grow the set of reasons.
    assert bounded.edges[1].failure_reasons == {"unavailable": 2, OTHER_REASON: 6}
    first = bounded.edges[0]
    assert first.in_flight_s == 0.0
    assert all(math.isnan(value) for value in (first.last_message_age_s, first.message_interval_s,
                                               first.last_failure_age_s, first.staleness_steps,
                                               first.consensus_distance))
    # What is kept goes through the proto and the log unchanged.
    assert bounded_report(bounded) == bounded


def test_job_status_carries_each_nodes_edges_while_the_job_runs(coordinator_stub):
    stub = coordinator_stub
    ids = [stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{2000 + i}", name=f"a{i}"), timeout=5).node_id
           for i in range(2)]
    spec = {"name": "edgy", "nodes": 2, "steps": 10, "topology": {"kind": "ring"}}
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=yaml.safe_dump(spec)), timeout=5).job_id
    members = {n.rank: n.node_id for n in stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).nodes}
    assert set(members.values()) == set(ids)
    edge = EdgeCounters(members[1], messages_sent=7, last_message_age_s=0.5, staleness_steps=3.0,
                        failure_reasons={"deadline_exceeded": 1, "?" * 1000: 4})
    progress = Progress(job=job_id, rank=0, node=members[0], step=5, edges=(edge,), waiting_for="rank 1")
    stub.ReportMetrics(to_report(progress), timeout=5)
    (shown,) = [n for n in stub.JobStatus(pb.JobStatusRequest(job_id="edgy"), timeout=5).nodes if n.rank == 0]
    assert shown.waiting_for == "rank 1"
    assert [(e.peer, e.messages_sent, e.staleness_steps) for e in shown.edges] == [(members[1], 7, 3.0)]
    assert dict(shown.edges[0].failure_reasons) == {"deadline_exceeded": 1, OTHER_REASON: 4}
    # Once the job ended: its last known edges.
    stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    ended = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert ended.state == pb.JOB_STOPPED
    assert [(n.rank, [e.peer for e in n.edges]) for n in ended.nodes] == [(0, [members[1]]), (1, [])]
    assert "no edge reported" not in edges_text(ended)


def node(rank: int, edges: tuple[EdgeCounters, ...], finished: bool = False, waiting_for: str = "") -> Progress:
    return Progress(job="j", rank=rank, node=f"n{rank}", step=1000, local_steps=1000, elapsed_s=10.0, time=100.0,
                    finished=finished, edges=edges, waiting_for=waiting_for)


def test_edges_are_sorted_by_trouble_stalled_then_failing_then_stale():
    healthy = dict(last_message_age_s=0.1, message_interval_s=0.01, staleness_steps=1.0)
    nodes = [
        # 100 steps/s: 600 steps behind are 6 s
        node(0, (EdgeCounters("n1", **healthy), EdgeCounters("n3", **{**healthy, "staleness_steps": 600.0}))),
        node(1, (EdgeCounters("n0", **{**healthy, "last_failure_age_s": 2.0, "failure_reasons": {"unavailable": 1}}),
                 EdgeCounters("n2", **{**healthy, "last_message_age_s": 9.0}, in_flight_s=8.0)),
             waiting_for="the step-12 parameters of ranks [2]"),
        # An edge that never carried a message counts from the node's start.
        node(3, (EdgeCounters("n2"), EdgeCounters("n0", **healthy))),
        node(4, (EdgeCounters("n2", last_message_age_s=60.0),), finished=True),  # done: not judged
    ]
    rows = edge_rows(nodes, now=101.0, interval_steps=4)
    assert [(r.src, r.edge.peer, r.trouble) for r in rows] == [
        ("n3", "n2", Trouble.STALLED),  # 10 s + the report's 1 s of age: the oldest first
        ("n1", "n2", Trouble.STALLED),
        ("n1", "n0", Trouble.FAILING),
        ("n0", "n3", Trouble.STALE),
        ("n4", "n2", Trouble.OK),
        ("n0", "n1", Trouble.OK),
        ("n3", "n0", Trouble.OK),
    ]
    assert rows[1].last_message_s == 10.0 and rows[1].in_flight_s == 9.0
    # A slow edge (a message every 2 s) is not stalled after 9 s: its threshold is 10 of its intervals.
    slow = edge_rows([node(0, (EdgeCounters("n1", last_message_age_s=9.0, message_interval_s=2.0),))], now=100.0)
    assert slow[0].trouble is Trouble.OK
    assert waits_on(nodes, rows) == [
        "edge n3 -> n2 is stalled: no message for 11 s",
        "edge n1 -> n2 is stalled: no message for 10 s, a call in flight for 9 s",
        "rank 1 (n1) waits for the step-12 parameters of ranks [2]",
    ]


def test_an_edge_whose_neighbour_is_mostly_outlying_is_suspect_after_failing_and_before_stale():
    healthy = dict(last_message_age_s=0.1, message_interval_s=0.01, staleness_steps=600.0)  # 6 s at 100 steps/s
    rows = edge_rows([node(0, (
        EdgeCounters("n1", **healthy, messages_received=100, robust_clipped=90, robust_outlying=10),
        EdgeCounters("n3", **healthy, messages_received=100, robust_clipped=100, robust_outlying=60),
        EdgeCounters("n2", **healthy, messages_received=100, robust_outlying=60, last_failure_age_s=1.0),
    ))], now=100.0)
    assert [(r.edge.peer, r.trouble) for r in rows] == [
        ("n2", Trouble.FAILING), ("n3", Trouble.SUSPECT), ("n1", Trouble.STALE)]  # clipped alone is not suspect
    assert outlying_share(rows[1].edge) == 0.6 and math.isnan(outlying_share(EdgeCounters("n5")))
    # A node that counts what its rule judged is read by it: half its messages carried copies never mixed.
    judged = EdgeCounters("n1", **healthy, messages_received=200, robust_judged=100, robust_outlying=60)
    assert outlying_share(judged) == 0.6 and edge_rows([node(0, (judged,))], now=100.0)[0].trouble is Trouble.SUSPECT


def test_the_edges_command_prints_the_table_and_json(coordinator_stub, monkeypatch, capsys):
    import coordinator.cli as cli

    status = pb.JobStatusReply(job_id="job-1", name="ring", state=pb.JOB_RUNNING, spec_yaml="algorithm: {interval: 4}",
                               nodes=[pb.NodeProgress(rank=0, node_id="n0", step=10, elapsed_s=1.0, updated_unix=1.0,
                                                      edges=[pb.EdgeTraffic(peer="n1", last_message_age_s=30.0,
                                                                            staleness_steps=math.nan,
                                                                            consensus_distance=0.5,
                                                                            messages_received=4, robust_judged=2,
                                                                            robust_outlying=1)])])

    class Stub:
        def JobStatus(self, request, timeout):
            assert request.job_id == "ring"
            return status

    monkeypatch.setattr(cli, "_stub", lambda args: Stub())
    assert coordinator_main(["edges", "ring"]) == 0
    text = capsys.readouterr().out
    assert "stalled  n0" in text and "waits on: edge n0 -> n1 is stalled" in text
    assert coordinator_main(["edges", "ring", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["edges"][0]["trouble"] == "stalled" and shown["edges"][0]["staleness_steps"] is None
    assert shown["edges"][0]["consensus_distance"] == 0.5
    # The share is of the contributions judged (2), not of the messages received (4).
    assert shown["edges"][0]["robust_judged"] == 2 and shown["edges"][0]["outlying_share"] == 0.5


def test_the_run_log_and_a_report_keep_the_edges_and_the_log_reads_older_logs(tmp_path):
    edge = EdgeCounters("n1", messages_sent=3, last_message_age_s=0.25, failure_reasons={"unavailable": 1},
                        judged=(MemberJudgement(2, 10, 4, 3), MemberJudgement(3, 10, 0, 0)))
    progress = Progress(job="j", rank=0, node="n0", edges=(edge,), waiting_for="rank 1")
    assert from_report(to_report(progress), progress.time).edges[0].judged == edge.judged
    RunLog(tmp_path).append(progress)
    older = {"job": "j", "rank": 1, "node": "n1", "step": 4, "loss": None,
             "edges": [{"peer": "n0", "bytes_sent": 10, "bytes_received": 0, "exchanges": 1, "failures": 0}]}
    with open(tmp_path / "metrics.jsonl", "a") as log:
        log.write(json.dumps(older) + "\n")
    new, old = read_run_log(tmp_path)
    assert new.edges == (edge,) and new.waiting_for == "rank 1" and math.isnan(new.edges[0].staleness_steps)
    assert old.edges == (EdgeCounters("n0", 10, 0, 1, 0),) and old.waiting_for == ""
    assert math.isnan(old.edges[0].last_message_age_s) and "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_edge_gauges_come_from_the_report_in_unix_time():
    metrics = Metrics()
    edges = (EdgeCounters("n1", last_message_age_s=2.0, message_interval_s=0.1, in_flight_s=1.5, staleness_steps=4.0,
                          consensus_distance=0.75), EdgeCounters("n2"))
    metrics.observe_edges("j", "n0", edges, now_unix=1000.0)

    def sample(name: str, dst: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"job_id": "j", "src": "n0", "dst": dst})

    assert sample("peertrain_edge_last_message_timestamp_seconds", "n1") == 998.0
    assert sample("peertrain_edge_in_flight_since_timestamp_seconds", "n1") == 998.5
    assert sample("peertrain_edge_message_interval_seconds", "n1") == 0.1
    assert sample("peertrain_neighbor_staleness_steps", "n1") == 4.0
    assert sample("peertrain_edge_consensus_distance", "n1") == 0.75
    # Nothing known yet: no series that would read as "a message at 1970" or "in consensus".
    assert sample("peertrain_edge_last_message_timestamp_seconds", "n2") is None
    assert sample("peertrain_edge_consensus_distance", "n2") is None
    assert sample("peertrain_edge_in_flight_since_timestamp_seconds", "n2") == 0


def every_metric_with_a_job(metrics: Metrics) -> list:
    """Every metric of Metrics() whose series carry job_id, found by its labels (not by forget_job's list)."""
    return [value for value in vars(metrics).values()
            if hasattr(value, "_labelnames") and "job_id" in value._labelnames]


def test_forget_job_removes_every_series_of_the_job_and_only_those():
    metrics = Metrics()
    with_a_job = every_metric_with_a_job(metrics)
    assert len(with_a_job) >= 20
    for job in ("ended", "running"):
        for metric in with_a_job:
            child = metric.labels(**{name: job if name == "job_id" else "x" for name in metric._labelnames})
            (child.inc if hasattr(child, "inc") else child.observe)(1)
    metrics.forget_job("ended")
    exposed = generate_latest(metrics.registry).decode()
    assert 'job_id="ended"' not in exposed
    for metric in with_a_job:
        assert any(s.labels.get("job_id") == "running" for family in metric.collect() for s in family.samples), \
            metric._name


def test_metrics_expose_no_created_series_and_the_agents_identity():
    metrics = Metrics()
    metrics.local_steps.labels("j", "n0").inc()
    metrics.step_seconds.labels("j", "n0").observe(0.1)
    metrics.ps_staleness.labels("j").observe(2)
    metrics.agent_info.labels("node-1", "gpu-box", "0.1.0", "10.0.0.5:7100", "cuda").set(1)
    exposed = generate_latest(metrics.registry).decode()
    assert "_created" not in exposed
    assert ('peertrain_agent_info{address="10.0.0.5:7100",device="cuda",name="gpu-box",node="node-1",'
            'version="0.1.0"} 1.0') in exposed
    assert 'peertrain_ps_staleness_updates_bucket{job_id="j",le="2.0"} 1.0' in exposed  # the unit in the name


def test_a_fast_healthy_jobs_neighbours_are_not_stale_however_many_steps_apart():
    """Stale is judged in time at the node's pace: 150 steps at 1000 steps/s are 0.15 s (the old rule, a fixed 100
    steps, called it stale); 6000 steps are 6 s."""
    def fast(staleness_steps: float) -> Progress:
        edge = EdgeCounters("n1", last_message_age_s=0.01, message_interval_s=0.004, staleness_steps=staleness_steps)
        return Progress(job="j", rank=0, node="n0", step=10_000, local_steps=10_000, elapsed_s=10.0, time=100.0,
                        edges=(edge,))
    [healthy] = edge_rows([fast(150.0)], now=100.0, interval_steps=4)
    assert healthy.trouble is Trouble.OK and healthy.staleness_s == pytest.approx(0.15)
    [behind] = edge_rows([fast(1000.0 * (STALE_MIN_S + 1))], now=100.0, interval_steps=4)
    assert behind.trouble is Trouble.STALE


def test_flow_control_skips_are_counted_apart_from_failures():
    edge = pb.EdgeTraffic(peer="n1", last_message_age_s=0.1, message_interval_s=0.05, staleness_steps=1.0,
                          consensus_distance=math.nan, last_failure_age_s=math.nan,
                          failure_reasons={"in_flight": 37, "deadline_exceeded": 2})
    status = pb.JobStatusReply(job_id="job-1", name="ring", state=pb.JOB_RUNNING, nodes=[
        pb.NodeProgress(rank=0, node_id="n0", step=100, elapsed_s=10.0, updated_unix=100.0, edges=[edge])])
    header, row = edges_text(status, now=100.0).splitlines()[1:3]
    assert header.split()[-2:] == ["skips", "failures"]
    assert row.split()[0] == "ok" and row.split()[-2:] == ["37", "deadline_exceeded:2"]
    [shown] = edges_json(status, now=100.0)["edges"]
    assert (shown["skips"], shown["failures"]) == (37, {"deadline_exceeded": 2})


def test_an_ended_jobs_edges_are_judged_at_its_end():
    """A job that failed on a stalled edge shows it stalled, however long ago it ended, and a healthy one ok."""
    def ended(age_at_end: float) -> pb.JobStatusReply:
        edge = pb.EdgeTraffic(peer="n1", last_message_age_s=age_at_end, message_interval_s=0.05, staleness_steps=1.0,
                              consensus_distance=math.nan, last_failure_age_s=math.nan)
        return pb.JobStatusReply(job_id="job-1", name="ring", state=pb.JOB_FAILED, ended_unix=100.0, nodes=[
            pb.NodeProgress(rank=0, node_id="n0", step=100, elapsed_s=10.0, updated_unix=100.0, edges=[edge])])
    later = 100.0 + 86_400
    assert edges_json(ended(30.0), now=later)["edges"][0]["trouble"] == "stalled"
    assert edges_json(ended(0.1), now=later)["edges"][0]["trouble"] == "ok"
    assert "(their last report, at the job's end)" in edges_text(ended(0.1), now=later).splitlines()[0]
