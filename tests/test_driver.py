"""The node driver's rules, one at a time, on a scripted algorithm and a hand-moved clock: the order of work, the
evaluation rule, flow control, retries, step-duration stamping and the accounting of compute and wait."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from nodeagent.algorithms import Neighbor, NodeContext, build_algorithm
from nodeagent.algorithms.base import Route, Send
from nodeagent.jobspec import AlgorithmSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.ps.messages import SERVER_RANK, ServerPull, StepReport
from nodeagent.runtime import driver as driver_module
from nodeagent.runtime.driver import Action, Failure, NodeDriver, Reply
from nodeagent.training.loop import EvalResult
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ScriptedAlgorithm:
    """What the driver calls, recorded; `plan` gives the sends after each step, `waiting` makes it not ready."""

    clock: int = 0
    plan: list[list[Send]] = field(default_factory=list)
    waiting: bool = False
    window: int | None = None  # rounds_ahead()
    sends_after_receive: bool = False
    calls: list[tuple] = field(default_factory=list)
    _outbox: list[Send] = field(default_factory=list)

    def step(self, inputs, targets) -> float:
        self.calls.append(("step", self.clock))
        self.clock += 1
        self._outbox = self.plan.pop(0) if self.plan else []
        return 0.5

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message) -> None:
        self.calls.append(("receive", message))

    def failed(self, send: Send, reason: str) -> None:
        self.calls.append(("failed", send.peer, reason))

    def ready(self) -> bool:
        return not self.waiting

    def rounds_ahead(self) -> int | None:
        return self.window

    def waiting_for(self) -> str:
        return "the step-1 parameters of ranks [3]"

    def consensus_distance(self, peer: int) -> float | None:
        return 0.25 * peer if peer == 1 else None

    def robust_clipped(self, peer: int) -> int:
        return 0

    def robust_outlying(self, peer: int) -> int:
        return 0

    def robust_judged(self, peer: int) -> int:
        return 0


class Batches:
    def next(self):
        return torch.zeros(2, 1), torch.zeros(2, dtype=torch.int64)


@dataclass
class ScriptedNode:
    algorithm: ScriptedAlgorithm
    clock: Clock
    eval_s: float = 0.0
    rank: int = 0
    spec: object = field(default_factory=lambda: parse_job_spec({"nodes": 2, "steps": 4, "eval_every": 2}))
    batches: Batches = field(default_factory=Batches)
    evaluations: list[int] = field(default_factory=list)

    def evaluate(self) -> EvalResult:
        self.evaluations.append(self.algorithm.clock)
        self.clock.now += self.eval_s
        return EvalResult(accuracy=0.5, loss=1.0)


def driver_for(algorithm: ScriptedAlgorithm, eval_s: float = 0.0, **options) -> tuple[NodeDriver, ScriptedNode]:
    clock = Clock()
    node = ScriptedNode(algorithm, clock, eval_s)
    driver = NodeDriver(node, job="job", name="rank0", clock=clock,
                        metrics=Metrics().node("job", "rank0"), name_of=lambda r: f"rank{r}",
                        **options)
    return driver, node


def message(sender: int = 1, clock: int = 0) -> Message:
    return Message(Kind.PARAMS, sender, 0, {"w": torch.zeros(1)}, clock=clock)


def exchange(peer: int = 1) -> Send:
    return Send(Route.EXCHANGE, peer, Kind.PARAMS, message(0))


def test_the_initial_model_is_evaluated_before_anything_received_and_then_every_eval_every_steps():
    algorithm = ScriptedAlgorithm()
    driver, node = driver_for(algorithm)
    driver.arrived(message())
    decision = driver.next()
    assert node.evaluations == [0] and algorithm.calls == [("receive", message())]
    assert decision.action is Action.STEP and [r.evaluated for r in decision.reports] == [True]
    steps = 0
    while decision.action is Action.STEP:
        driver.step()
        driver.stepped(0.1)
        steps += 1
        decision = driver.next()
    assert steps == 4 and node.evaluations == [0, 2, 4]  # eval_every 2, and the last step
    assert decision.action is Action.DONE and decision.reports[-1].progress.finished
    driver.arrived(message())  # a finished node absorbs nothing more
    assert driver.next().action is Action.DONE and algorithm.calls.count(("receive", message())) == 1


def test_one_exchange_per_edge_in_flight_and_the_skip_is_a_failure_of_no_call():
    algorithm = ScriptedAlgorithm(plan=[[exchange(1)], [exchange(1), exchange(2)], [exchange(1)]])
    driver, _ = driver_for(algorithm)
    driver.next()
    driver.step()
    (first,) = driver.stepped(0.1)
    driver.next()
    driver.step()
    second = driver.stepped(0.1)
    assert [t.send.peer for t in second] == [2]  # the edge to 1 is busy: not called again
    driver.next()
    assert ("failed", 1, "in_flight") in algorithm.calls and driver.failures == 0
    driver.arrived(Reply(first, message(1)))  # the reply frees the edge
    driver.step()
    (third,) = driver.stepped(0.1)
    assert third.send.peer == 1 and driver.exchanges == 1


def test_a_failed_push_is_retried_until_delivered_even_after_the_node_finished():
    push = Send(Route.PUSH, 1, Kind.PARAMS, message(0))
    algorithm = ScriptedAlgorithm(plan=[[push]])
    driver, _ = driver_for(algorithm)
    driver.next()
    driver.step()
    (sent,) = driver.stepped(0.1)
    delays = []
    for _ in range(8):  # each retry fails again: the delays double, up to the cap
        due = driver.arrived(Failure(sent, "unavailable"))
        delays.append(due - driver.clock())
        assert driver.due_retries() == []
        driver.clock.now = due
        assert driver.due_retries() == [sent]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    driver.done = True
    assert driver.arrived(Failure(sent, "unavailable")) is not None  # still retried
    assert all(call[0] != "failed" for call in driver.algorithm.calls)  # the algorithm never hears of it


def test_server_calls_carry_the_step_duration_and_transient_failures_are_retried_with_the_same_id():
    report = Send(Route.SERVER, SERVER_RANK, Kind.DELTA, StepReport(version=0, round_step=1))
    pull = Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, ServerPull())
    algorithm = ScriptedAlgorithm(plan=[[report], [pull]])
    driver, _ = driver_for(algorithm)
    driver.next()
    driver.step()
    (call,) = driver.stepped(0.25)
    assert call.step_s == 0.25 and call.call_id
    assert driver.arrived(Failure(call, "deadline_exceeded", transient=True)) == driver.clock()  # at once
    second_try = driver.arrived(Failure(call, "unavailable", transient=True))
    assert second_try == driver.clock() + 2 * driver_module.RETRY_FIRST_S  # its second failure: backed off
    assert driver.due_retries() == [call]  # the same call: its id names it to the server
    driver.next()
    driver.step()
    (second,) = driver.stepped(0.1)
    assert second.call_id != call.call_id
    assert driver.arrived(Failure(second, "failed_precondition")) is None  # refused: the algorithm decides
    driver.next()
    assert ("failed", SERVER_RANK, "failed_precondition") in algorithm.calls


def test_compute_is_the_executors_measure_and_wait_is_the_time_until_ready_less_evaluations():
    algorithm = ScriptedAlgorithm()
    driver, node = driver_for(algorithm, eval_s=3.0)
    driver.next()  # evaluates for 3 s: not waiting
    driver.step()
    driver.stepped(0.5)  # the step (with its slow-down) took 0.5 s
    algorithm.waiting = True
    driver.clock.now += 0.5 + 2.0  # the step's end, then 2 s for its round
    assert driver.next().action is Action.WAIT
    driver.clock.now += 1.0
    algorithm.waiting = False
    assert driver.next().action is Action.STEP  # ready after 3 s
    progress = driver.progress()
    assert (progress.compute_s, progress.wait_s) == (0.5, 3.0)
    assert math.isclose(progress.elapsed_s, 3.0 + 0.5 + 3.0)
    assert driver.samples == 2 and node.evaluations == [0]


def test_periodic_reports_between_evaluations_when_asked_for():
    algorithm = ScriptedAlgorithm()
    driver, _ = driver_for(algorithm, report_every_s=1.0)
    assert len(driver.next().reports) == 1  # the initial evaluation
    driver.step()
    driver.stepped(0.1)
    assert driver.next().reports == ()  # step 1: no evaluation due, and reported less than 1 s ago
    driver.step()
    driver.stepped(0.1)
    driver.clock.now += 5.0
    driver.next()  # step 2 evaluates
    driver.step()
    driver.stepped(0.1)
    driver.clock.now += 1.5
    (report,) = driver.next().reports
    assert not report.evaluated and report.progress.step == 3



def test_a_finished_node_reports_the_traffic_it_serves_afterwards_and_nothing_when_there_is_none():
    algorithm = ScriptedAlgorithm()
    driver, _ = driver_for(algorithm, report_every_s=1.0)
    while (decision := driver.next()).action is not Action.DONE:
        driver.step()
        driver.stepped(0.1)
    assert decision.reports[-1].progress.finished and decision.reports[-1].progress.bytes_received == 0
    driver.clock.now += 5.0
    assert driver.next().reports == ()  # nothing new: no report
    driver.traffic.add_received(1, 300)  # a neighbour exchanged with it while it served
    driver.traffic.add_sent(1, 200)
    (report,) = driver.next().reports
    assert report.progress.finished and (report.progress.bytes_sent, report.progress.bytes_received) == (200, 300)
    driver.traffic.add_received(1, 300)
    assert driver.next().reports == ()  # at most one report a second
    driver.clock.now += 1.0
    (report,) = driver.next().reports
    assert report.progress.bytes_received == 600


def test_a_long_wait_counts_as_it_passes_and_is_logged_once_with_what_it_waits_for(caplog):
    algorithm = ScriptedAlgorithm()
    driver, _ = driver_for(algorithm, report_every_s=1.0)
    driver.next()
    driver.step()
    driver.stepped(0.5)
    algorithm.waiting = True  # a neighbour is gone: its round never completes
    driver.clock.now += 0.5
    with caplog.at_level("INFO", logger="nodeagent"):
        waits = []
        for _ in range(4):
            driver.clock.now += 6.0
            decision = driver.next()
            assert decision.action is Action.WAIT
            (report,) = decision.reports  # the node keeps reporting while it waits, and what for
            waits.append(report.progress.wait_s)
            assert report.progress.waiting_for == "the step-1 parameters of ranks [3]"
    assert waits == [6.0, 12.0, 18.0, 24.0]
    algorithm.waiting = False
    driver.clock.now += 1.0
    assert driver.next().reports[-1].progress.waiting_for == ""  # ready again: it waits for nothing
    logged = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert logged == ["job job: rank0 has waited 12 s at step 1 for the step-1 parameters of ranks [3]"]


def future_clock_rejections(driver: NodeDriver) -> float | None:
    return driver.metrics.metrics.registry.get_sample_value(
        "peertrain_stream_rejections_total", {"src": "rank1", "dst": "rank0", "reason": "future_clock"})


def test_a_message_beyond_the_algorithms_window_is_dropped_and_counted():
    algorithm = ScriptedAlgorithm(window=2)
    driver, _ = driver_for(algorithm)
    for clock in (0, 2, 3, 2**62):
        driver.arrived(message(clock=clock))
    driver.next()
    assert [item.clock for call, item in algorithm.calls if call == "receive"] == [0, 2]
    assert future_clock_rejections(driver) == 2
    driver.step()  # the window moves with the node's clock
    driver.stepped(0.1)
    driver.arrived(message(clock=3))
    driver.next()
    assert [item.clock for call, item in algorithm.calls if call == "receive"] == [0, 2, 3]
    unbounded = ScriptedAlgorithm()
    driver, _ = driver_for(unbounded)
    driver.arrived(message(clock=2**62))
    driver.next()
    assert unbounded.calls == [("receive", message(clock=2**62))] and future_clock_rejections(driver) is None


def test_a_synchronous_dsgd_node_keeps_no_copy_of_a_far_future_round():
    torch.manual_seed(0)
    context = NodeContext(0, 3, (Neighbor(1, weight=0.25), Neighbor(2, weight=0.25)),
                          AlgorithmSpec(name="dsgd", mode="sync"), self_weight=0.5)
    dsgd = build_algorithm(nn.Linear(3, 2), context)
    clock = Clock()
    driver = NodeDriver(ScriptedNode(dsgd, clock), job="job", name="rank0", clock=clock,
                        metrics=Metrics().node("job", "rank0"),
                        name_of=lambda rank: f"rank{rank}")
    copy = dsgd.params.views(torch.ones_like(dsgd.w))
    for round_ in [*range(1000), 2**62]:  # one neighbour's copies of 1001 rounds, forged or early
        driver.arrived(Message(Kind.PARAMS, 1, 0, copy, clock=round_))
    driver.next()
    assert sorted(dsgd.round_copies) == [0, 1, 2] and future_clock_rejections(driver) == 998


def edge(report_or_driver, peer: str):
    progress = report_or_driver.progress() if isinstance(report_or_driver, NodeDriver) else report_or_driver
    return next(e for e in progress.edges if e.peer == peer)


def test_per_edge_accounting_last_message_in_flight_staleness_and_failures_by_reason():
    algorithm = ScriptedAlgorithm(plan=[[exchange(1), exchange(2)], [exchange(1)], [exchange(1)]])
    driver, _ = driver_for(algorithm, report_every_s=1.0)
    driver.next()
    driver.step()
    to_1, to_2 = driver.stepped(0.1)
    assert math.isnan(edge(driver, "rank1").last_message_age_s)  # nothing on the edge yet
    driver.clock.now += 2.0
    assert edge(driver, "rank1").in_flight_s == 2.0
    driver.arrived(Reply(to_1, message(1, clock=0)))  # the call completed, with the peer's step-0 message
    driver.arrived(Failure(to_2, "deadline_exceeded"))
    driver.next()
    driver.clock.now += 3.0
    one, two = edge(driver, "rank1"), edge(driver, "rank2")
    assert (one.last_message_age_s, one.in_flight_s, one.messages_sent, one.messages_received) == (3.0, 0.0, 1, 1)
    assert one.staleness_steps == 1 and one.consensus_distance == 0.25  # this node is at step 1, the peer at 0
    assert two.failure_reasons == {"deadline_exceeded": 1} and two.last_failure_age_s == 3.0
    assert math.isnan(two.last_message_age_s) and math.isnan(two.staleness_steps)
    assert math.isnan(two.consensus_distance)  # the algorithm keeps no copy of rank 2
    driver.arrived(message(2, clock=0))  # the peer's own message counts on the edge too
    driver.clock.now += 1.0
    assert edge(driver, "rank2").last_message_age_s == 1.0 and edge(driver, "rank2").messages_received == 1
    driver.arrived(message(1, clock=1))
    driver.step()
    driver.stepped(0.1)  # the exchange with rank 1 is in flight again
    decision = driver.next()
    driver.step()
    assert driver.stepped(0.1) == []  # and stays so: the third is skipped
    driver.clock.now += 5.0
    decision = driver.next()
    one = edge(decision.reports[-1].progress, "rank1")
    assert one.failure_reasons == {"in_flight": 1} and math.isnan(one.last_failure_age_s)  # a skip is no call
    assert one.in_flight_s == 5.0 and one.last_message_age_s == 5.0 and one.staleness_steps == 2
    assert one.message_interval_s == 4.0  # two messages, 4 s apart


def test_a_restarted_collective_node_asks_for_the_groups_state_before_its_first_step():
    torch.manual_seed(0)
    context = NodeContext(0, 2, (), AlgorithmSpec(name="allreduce", lr=0.1))
    allreduce = build_algorithm(nn.Linear(3, 2), context)
    clock = Clock()
    driver = NodeDriver(ScriptedNode(allreduce, clock), job="job", name="rank0", clock=clock,
                        metrics=Metrics().node("job", "rank0"),
                        name_of=lambda rank: f"rank{rank}")
    driver.rejoin()
    decision = driver.next()
    (heal,) = decision.sends
    assert decision.action is Action.WAIT
    assert (heal.send.route, heal.send.kind, heal.send.message.clock) == (Route.ALLREDUCE, Kind.PARAMS, 0)
    assert driver.next().action is Action.WAIT and not driver.next().sends  # asked once, until the answer
    group = {"w": torch.full_like(allreduce.w, 0.5)}
    driver.arrived(Reply(heal, Message(Kind.PARAMS, -1, 0, group, clock=3)))
    assert driver.next().action is Action.STEP
    assert allreduce.clock == 3 and torch.equal(allreduce.w, group["w"])  # its first step is the group's next
