"""ESync: the READY decision with a fake clock, rounds, delta aggregation, metrics and the state round trip."""

import heapq
import io
import math

import pytest
import torch

from nodeagent.ps import (
    ESyncRound,
    ESyncServer,
    ProtocolError,
    RoundMetrics,
    WorkerReport,
    is_ready,
    steps_before_asking,
)

pytestmark = pytest.mark.unit


def test_decision_table():
    slow = WorkerReport(steps=1, duration=10.0, end=0.0)  # its current step should end at t = 10
    fast = WorkerReport(steps=3, duration=1.0, end=8.0)
    idle = WorkerReport(steps=0, duration=1.0, end=8.0)
    # k = 0: never, even for the slowest worker
    assert not is_ready(0, [WorkerReport(0, 10.0, 0.0), fast], [False, False], now=9.0)
    # the caller is the slowest
    assert is_ready(0, [slow, fast], [False, False], now=0.0)
    # the slowest is already ready
    assert is_ready(1, [slow, fast], [True, False], now=1.0)
    # time left: the slowest has 10 - (now - 0) left; another step of the caller needs 1 + epsilon 0.5
    assert not is_ready(1, [slow, fast], [False, False], now=3.0)
    assert not is_ready(1, [slow, fast], [False, False], now=8.5)  # 1.5 > 1.5 is false: one more step fits
    assert is_ready(1, [slow, fast], [False, False], now=8.75)
    assert not is_ready(1, [slow, fast], [False, False], now=8.75, epsilon=0.0)
    assert not is_ready(2, [slow, fast, idle], [False, False, False], now=9.9)
    # ties on the largest duration: the lowest rank is the slowest; the other one stops on the time rule
    tied = [WorkerReport(1, 2.0, 5.0), WorkerReport(1, 2.0, 5.0)]
    assert is_ready(0, tied, [False, False], now=5.0) and is_ready(1, tied, [False, False], now=5.0)


def test_a_worker_with_no_step_yet_counts_as_the_slowest():
    unknown = WorkerReport()  # no step since the job started: duration unknown
    fast = WorkerReport(steps=50, duration=1.0, end=50.0)
    assert not is_ready(1, [unknown, fast], [False, False], now=1e9)
    assert is_ready(0, [WorkerReport(1, 40.0, 60.0), fast], [False, False], now=60.0)


def run_round(
    round_: ESyncRound, durations: list[float], start: float, quotas: bool = True
) -> tuple[list[int], float, list[int]]:
    """Workers step back to back with fixed durations from `start` until READY, reporting when the last answer
    said to (`quotas`) or after every step; steps per worker, the round's end and the reports per worker."""
    events = [(start + duration, rank) for rank, duration in enumerate(durations)]
    heapq.heapify(events)
    steps = [0] * len(durations)
    reports = [0] * len(durations)
    report_at = [1] * len(durations)
    end = start
    while events:
        now, rank = heapq.heappop(events)
        steps[rank] += 1
        end = max(end, now)
        if steps[rank] >= report_at[rank]:
            reports[rank] += 1
            decision = round_.report(rank, durations[rank], now, steps[rank])
            if decision.ready:
                continue
            report_at[rank] = steps[rank] + (decision.steps_before_asking if quotas else 1)
        heapq.heappush(events, (now + durations[rank], rank))
    return steps, end, reports


def test_rounds_with_a_fake_clock_and_the_reset():
    round_ = ESyncRound(num_workers=3, epsilon=0.5, start=0.0)
    # Round 1: the slow worker's speed is unknown until its first step ends (t = 4.5), so the fast ones go on
    # until then, and stop after the step in flight.
    steps, end, reports = run_round(round_, [1.0, 1.0, 4.5], start=0.0)
    assert (steps, end, reports) == ([5, 5, 1], 5.0, [5, 5, 1])  # no speed known: a report after every step
    with pytest.raises(ProtocolError, match="worker 0 reported a step after READY"):
        round_.report(0, 1.0, 5.0)
    round_.reset(now=5.5)
    assert round_.reports == [WorkerReport(0, 1.0, 5.5), WorkerReport(0, 1.0, 5.5), WorkerReport(0, 4.5, 5.5)]
    assert round_.ready == [False, False, False] and round_.asked_after == [1, 1, 1]
    # Round 2: the slow step ends at 10; a fast worker still steps at 8.5 (1.5 left is not < 1 + epsilon) and
    # stops at 9.5. Its first report (t = 6.5, 3.5 left) predicts READY after 3 more steps: it asks again after 2.
    steps, end, reports = run_round(round_, [1.0, 1.0, 4.5], start=5.5)
    assert (steps, end, reports) == ([4, 4, 1], 10.0, [3, 3, 1])
    with pytest.raises(ProtocolError, match="finite"):
        ESyncRound(2).report(0, math.inf, 1.0)
    with pytest.raises(ProtocolError, match=r"worker -1 is not in 0\.\.1"):
        ESyncRound(2).report(-1, 1.0, 1.0)
    with pytest.raises(ProtocolError, match="worker 0 reported 1 steps of the round after 2"):
        late = ESyncRound(2)
        late.report(0, 1.0, 1.0, steps=2)
        late.report(0, 1.0, 2.0, steps=1)


def test_steps_before_asking():
    slow = WorkerReport(steps=1, duration=10.0, end=0.0)  # its current step should end at t = 10
    fast = WorkerReport(steps=3, duration=1.0, end=2.0)
    # 8 s left at t = 2: after j more steps READY once (j + 1) * 1 > 8 - 0.5, first at j = 7; half, rounded up
    assert steps_before_asking(1, [slow, fast], [False, False], now=2.0) == 4
    assert steps_before_asking(1, [slow, fast], [False, False], now=2.0, epsilon=0.0) == 4  # j = 8
    assert steps_before_asking(1, [slow, fast], [False, False], now=5.0) == 2  # 5 s left: j = 4
    assert steps_before_asking(1, [slow, fast], [False, False], now=7.0) == 1  # 3 s left: j = 2
    assert steps_before_asking(1, [slow, fast], [False, False], now=8.0) == 1  # 2 s left: j = 1
    # nothing to predict: the slowest's speed is unknown, or the caller's step took no measurable time
    assert steps_before_asking(1, [WorkerReport(), fast], [False, False], now=2.0) == 1
    assert steps_before_asking(1, [slow, WorkerReport(3, 0.0, 2.0)], [False, False], now=2.0) == 1
    with pytest.raises(ValueError, match="worker 1 is READY"):
        steps_before_asking(1, [slow, fast], [True, False], now=2.0)


def test_quotas_give_the_same_rounds_as_a_report_after_every_step():
    durations = [0.010, 0.013, 0.0171, 1.0, 1.3]
    per_step, quota = ESyncRound(5, epsilon=0.02), ESyncRound(5, epsilon=0.02)
    start = 0.0
    for _ in range(4):
        expected = run_round(per_step, durations, start, quotas=False)
        got = run_round(quota, durations, start)
        assert got[:2] == expected[:2]
        start = got[1] + 0.05
        per_step.reset(start)
        quota.reset(start)
    steps, _, reports = got
    assert steps[4] == 1 and steps[0] > 100  # the slowest does one step, the fastest over a hundred
    assert reports[0] <= 10 and expected[2][0] == steps[0]  # against one report per step


def test_server_aggregates_the_mean_delta_with_global_lr_and_starts_the_next_round():
    server = ESyncServer(torch.tensor([1.0, 1.0]), num_workers=2, global_lr=0.5)
    assert not server.report(0, 1.0, now=1.0).ready  # worker 1 has not been seen yet
    with pytest.raises(ProtocolError, match="worker 0 pushed its delta before READY"):
        server.push(0, torch.tensor([2.0, 0.0]), 0, now=1.0)
    assert server.report(1, 3.0, now=3.0).ready and server.report(0, 1.0, now=3.0).ready
    first = server.push(0, torch.tensor([2.0, 0.0]), 0, now=3.1)
    assert (first.applied, first.release) == (False, ())
    with pytest.raises(ProtocolError, match="pushed twice"):
        server.push(0, torch.tensor([2.0, 0.0]), 0, now=3.1)
    last = server.push(1, torch.tensor([0.0, 4.0]), 0, now=3.2)
    assert (last.applied, last.version, last.release) == (True, 1, (0, 1))
    w, version = server.pull(0)
    assert (w.tolist(), version) == ([1.5, 2.0], 1)  # w + 0.5 * mean((2, 0), (0, 4))
    assert server.round.ready == [False, False] and [r.end for r in server.round.reports] == [3.2, 3.2]
    with pytest.raises(ProtocolError, match="version 0 in round 1"):
        server.push(1, torch.tensor([0.0, 4.0]), 0, now=4.0)


def test_server_state_round_trip_in_the_middle_of_a_round():
    def make():
        return ESyncServer(torch.zeros(3), num_workers=3, global_lr=1.0)

    def finish(server):
        ready = server.report(0, 1.0, now=3.5).ready  # the slowest, worker 2, is ready
        for worker in (0, 2):
            result = server.push(worker, torch.full((3,), float(worker)), 0, now=3.6)
        return ready, result, server.w.tolist(), server.round.reports

    original = make()
    original.report(0, 1.0, now=1.0)
    original.report(1, 2.0, now=2.0)
    original.report(2, 2.5, now=2.5)  # the slowest so far: READY
    original.report(1, 1.0, now=3.0)
    original.push(1, torch.tensor([3.0, 6.0, 9.0]), 0, now=3.0)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = make()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    outcome = finish(original)
    assert finish(restored) == outcome
    assert outcome[0] and outcome[2] == pytest.approx([5 / 3, 8 / 3, 11 / 3])


def test_round_metrics():
    metrics = RoundMetrics(
        3, 300, compute_s=6.0, wait_s=1.0, aggregation_s=1.0, elapsed_s=8.0, bytes_sent=800, bytes_received=800
    )
    assert (metrics.throughput, metrics.traffic, metrics.computing_time_ratio) == (37.5, 200.0, 0.75)
    total = RoundMetrics.total([metrics, metrics])
    assert (total.steps, total.elapsed_s, total.computing_time_ratio) == (6, 16.0, 0.75)
    with pytest.raises(ValueError, match="elapsed_s > 0"):
        RoundMetrics(0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0)
