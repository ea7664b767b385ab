"""The parameter-server family's two halves without any runtime: workers' messages, server halves' exactly-once
pushes, AdaComp's delta pulls, ESync's worker round and report protocol, and the options' validation."""

import dataclasses

import pytest
import torch
from datafiles import FASHION_MNIST

from coordinator.jobs import validate_job
from nodeagent.algorithms import REGISTRY, NodeContext, build_server
from nodeagent.algorithms.base import Route, Send
from nodeagent.jobspec import JobSpecError, parse_job_spec
from nodeagent.ps import Decision, ProtocolError
from nodeagent.ps.messages import (
    SERVER_RANK,
    ReadyAnswer,
    ServerModel,
    ServerPull,
    ServerPush,
    StepReport,
    model_message,
    model_of,
)
from nodeagent.training.models import build_model
from nodeagent.wire.errors import WireError
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit


def job(name: str, nodes: int = 3, **algorithm):
    return parse_job_spec({"name": name, "nodes": nodes, "algorithm": {"name": name, "lr": 0.1, **algorithm},
                           "model": {"name": "logistic"}})


def worker(spec, rank: int):
    torch.manual_seed(spec.seed)
    model = build_model(spec.model)
    return REGISTRY[spec.algorithm.name](model, NodeContext(rank, spec.nodes, (), spec.algorithm))


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 1, 28, 28, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def push_of(algorithm):
    (send,) = algorithm.sends()
    assert send.route == Route.SERVER and send.peer == SERVER_RANK
    return send.message


def test_a_worker_pushes_its_gradient_and_waits_for_the_model():
    spec = job("asgd")
    alg = worker(spec, 1)
    w0 = alg.w.clone()
    alg.step(*batch(0))
    message = push_of(alg)
    assert isinstance(message, ServerPush)
    assert (message.kind, message.version, message.clock) == (Kind.GRADIENT, 0, 0)
    assert not alg.ready() and alg.sends() == []
    server = build_server(spec, FASHION_MNIST)
    assert torch.equal(server.w, w0)  # the server starts from the workers' seeded model
    result = server.push(1, message, "p1", now=0.0)
    assert (result.applied, result.version, result.release) == (True, 1, (1,))
    alg.receive(server.pull(1, 0, False, now=0.0))
    assert alg.ready() and alg.clock == 1 and alg.version == 1 and torch.equal(alg.w, server.w)
    with pytest.raises(WireError, match="only from the server"):
        alg.receive(Message(Kind.PARAMS, 0, 1, {}))


def test_a_retried_push_is_applied_once_and_released_again():
    spec = job("asgd")
    server = build_server(spec, FASHION_MNIST)
    alg = worker(spec, 0)
    alg.step(*batch(1))
    message = push_of(alg)
    first = server.push(0, message, "same", now=0.0)
    after = server.w.clone()
    retry = server.push(0, message, "same", now=1.0)
    assert (retry.duplicate, retry.applied, retry.version, retry.release) == (True, False, 1, (0,))
    assert first.applied and torch.equal(server.w, after) and server.version == 1
    assert [e["push_id"] for e in server.drain_events()] == ["same"]
    with pytest.raises(ProtocolError, match="needs an id"):
        server.push(0, message, "", now=0.0)


def test_ssgd_releases_everyone_when_the_round_completes_and_rejects_stale_pushes():
    spec = job("ssgd", nodes=2)
    server = build_server(spec, FASHION_MNIST)
    workers = [worker(spec, rank) for rank in range(2)]
    for rank, alg in enumerate(workers):
        alg.step(*batch(rank))
    first = server.push(0, push_of(workers[0]), "a", now=0.0)
    assert (first.applied, first.release) == (False, ()) and not server.is_released(0, "a")
    last = server.push(1, push_of(workers[1]), "b", now=0.0)
    assert last.release == (0, 1) and server.is_released(0, "a") and server.is_released(1, "b")
    workers[0].step(*batch(2))  # computed on version 0 (it never took the model of version 1)
    stale = server.push(0, push_of(workers[0]), "c", now=0.0)
    assert stale.rejected == "computed on version 0, the round is 1" and stale.release == (0,)


@pytest.mark.parametrize("name", ["asgd", "dc-asgd", "adacomp"])
def test_an_asynchronous_server_applies_one_push_per_step_of_a_worker(name):
    """A push for a step the worker's pushes had (a worker restarted from an older checkpoint redoes steps; a liar
    pushes one step many times) or past the job's last is answered with the model and not applied; the worker's
    next step is. The steps taken survive a restart of the server."""
    spec = job(name, nodes=2, options={"rate": 0.05}) if name == "adacomp" else job(name, nodes=2)
    server = build_server(spec, FASHION_MNIST)
    alg = worker(spec, 0)
    alg.step(*batch(0))
    first = push_of(alg)
    assert first.clock == 0 and server.push(0, first, "a", now=0.0).applied
    server.pull(0, 1, False, now=0.0)  # DC-ASGD's backup of the version the next pushes are computed on
    w = server.w.clone()
    # A redone step is not judged; a step past the job's last, which no honest worker pushes, is flagged.
    for clock, push_id, flagged, counts in [(0, "b", (), (0, 1)), (spec.steps, "c", (0,), (1, 2))]:
        again = server.push(0, dataclasses.replace(first, version=1, clock=clock), push_id, now=1.0)
        assert (again.applied, again.repeated, again.release, again.rejected) == (False, True, (0,), "")
        assert again.flagged == flagged and server.robust_counts()[0] == counts
        assert server.version == 1 and torch.equal(server.w, w)
    assert server.push(0, dataclasses.replace(first, version=1, clock=1), "d", now=2.0).applied
    assert server.push(1, first, "e", now=2.0).applied  # step 0 of worker 1, computed on version 0
    restored = build_server(spec, FASHION_MNIST)
    restored.load_state_dict(server.state_dict())
    assert restored.push(0, dataclasses.replace(first, version=3, clock=1), "f", now=3.0).repeated
    saved_before = {key: value for key, value in server.state_dict().items() if key != "taken"}
    restored.load_state_dict(saved_before)  # a state saved before the steps were kept: every step is new
    assert restored.taken == [-1, -1]


def test_dcasgd_logs_the_pulls_that_set_backups():
    spec = job("dc-asgd", options={"adaptive": True})
    server = build_server(spec, FASHION_MNIST)
    assert server.rule.adaptive and server.pull_mutates
    server.pull(2, 0, False, now=3.0)
    assert server.drain_events() == [{"event": "pull", "time": 3.0, "rank": 2, "version": 0}]


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_adacomp_delta_pulls_keep_every_worker_equal_to_the_server(codec):
    spec = job("adacomp", nodes=3, options={"rate": 0.05, "codec": codec, "pull": "delta", "residual": True})
    server = build_server(spec, FASHION_MNIST)
    workers = [worker(spec, rank) for rank in range(3)]
    kinds = []
    for step, rank in enumerate([0, 1, 2, 1, 1, 0, 2, 2, 0, 1]):
        alg = workers[rank]
        alg.step(*batch(step))
        message = push_of(alg)
        assert list(message.tensors) == ["payload"] and message.tensors["payload"].dtype == torch.uint8
        result = server.push(rank, message, f"{rank}-{step}", now=float(step))
        assert result.applied
        answer = server.pull(rank, message.version, True, now=float(step))
        kinds.append(answer.kind)
        alg.check_server_message(answer)
        alg.receive(answer)
        assert torch.equal(alg.w, server.w), f"step {step}: rank {rank} differs from the server"
    assert set(kinds) == {Kind.DELTA}
    # A payload that does not decode is refused before the model changes.
    bad = ServerPush(Kind.GRADIENT, {"payload": torch.tensor([0, 5], dtype=torch.uint8)}, 0)
    before = server.w.clone()
    with pytest.raises(ProtocolError, match="bad adacomp payload"):
        server.push(0, bad, "bad", now=0.0)
    assert torch.equal(server.w, before)
    with pytest.raises(WireError, match="cannot be a valid encoding"):
        server.push_specs(Kind.GRADIENT, [("payload", (10**9,))])


def test_esync_worker_round_with_ready_answers():
    spec = job("esync", nodes=2)
    alg = worker(spec, 0)
    start = alg.w.clone()
    alg.step(*batch(0))
    (send,) = alg.sends()
    report = send.message
    assert report == StepReport(version=0, round_step=1)
    assert not alg.ready()
    alg.receive(ReadyAnswer(ready=False, steps_before_asking=3, version=0))
    assert alg.ready() and alg.sends() == []
    for index in (1, 2):  # told to run 3 steps before asking again: no report after the first two
        alg.step(*batch(index))
        assert alg.ready() and alg.sends() == []
    alg.step(*batch(3))
    assert push_of(alg).round_step == 4
    alg.receive(ReadyAnswer(ready=True, steps_before_asking=1, version=0))
    delta = push_of(alg)
    assert delta.kind == Kind.DELTA and not alg.ready()
    flat = alg.params.flatten(delta.tensors)
    assert torch.allclose(flat, alg.w - start)
    new_model = alg.params.views(start + 0.5 * flat)
    alg.receive(ServerModel(Kind.PARAMS, new_model, version=1))
    assert alg.ready() and alg.clock == 1 and alg.version == 1 and alg.local_steps == 4 and alg.round_steps == 0
    assert torch.equal(alg.round_start, alg.w)
    alg.step(*batch(4))  # a new round: its first step is reported
    assert push_of(alg) == StepReport(version=1, round_step=1)


def test_esync_server_half_reports_are_idempotent_and_ordered():
    spec = job("esync", nodes=2, options={"epsilon": 0.0})
    server = build_server(spec, FASHION_MNIST)
    assert server.report(0, 0, 1, 1.0, now=1.0) == Decision(False, 1)  # rank 1 not seen: it counts as the slowest
    assert server.report(0, 0, 1, 1.0, now=1.0) == Decision(False, 1)  # a retry: same answer, no second step
    assert server.rule.round.reports[0].steps == 1
    assert server.report(1, 0, 1, 9.0, now=9.0) == Decision(True)  # the slowest
    server.rule.round.reset(now=10.0)
    # Rank 1's next step should end at 19: 8 s left at t = 11, READY after 7 more steps of 1 s; ask after 4.
    assert server.report(0, 0, 1, 1.0, now=11.0) == Decision(False, 4)
    assert server.report(0, 0, 1, 1.0, now=11.0) == Decision(False, 4)  # the retry's answer is the same
    assert server.report(0, 0, 5, 1.0, now=15.0) == Decision(False, 2)  # 4 s left: READY after 4, ask after 2
    assert server.report(0, 0, 8, 1.0, now=18.5) == Decision(True)  # more steps than asked for are accepted
    with pytest.raises(ProtocolError, match="step 4 of the round after step 8"):
        server.report(0, 0, 4, 1.0, now=19.0)
    with pytest.raises(ProtocolError, match="round 3, the round is 0"):
        server.report(0, 3, 3, 1.0, now=19.0)
    assert {k: v.tolist() for k, v in server.round_state().items()} == {
        "steps": [8, 0], "durations": [1.0, 9.0], "ends": [18.5, 10.0], "ready": [True, False], "asked_after": [2, 1],
    }


@pytest.mark.parametrize(("name", "clock"), [("ssgd", 7), ("asgd", 0)])
def test_a_refused_call_makes_the_worker_rejoin_from_the_servers_model(name, clock):
    spec = job(name)
    alg = worker(spec, 0)
    alg.step(*batch(0))
    pushed = alg.sends()
    alg.failed(pushed[0], "failed_precondition")  # e.g. "pushed twice in round 7" after a restart
    (pull,) = alg.sends()
    assert pull.message == ServerPull() and pull.kind == Kind.PARAMS and not alg.ready()
    model = alg.params.views(torch.full_like(alg.w, 0.25))
    alg.receive(ServerModel(Kind.PARAMS, model, version=7))
    # Not an answered push; a synchronous worker counts the rounds it missed (version 7), an asynchronous one not.
    assert alg.ready() and alg.version == 7 and alg.clock == clock
    assert torch.equal(alg.w, torch.full_like(alg.w, 0.25))
    alg.step(*batch(1))
    assert push_of(alg).version == 7
    alg.failed(Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, ServerPull()), "failed_precondition")
    assert alg.ready() and alg.sends() == []  # a refused pull: step on from the own model


def test_a_restarted_asynchronous_worker_takes_its_steps_up_where_the_server_is_and_redoes_none():
    """Restarted from a checkpoint at step 1 (or from none) after the server applied its steps 0 to 2, the worker
    rejoins (it pulls) and its next step is 3, the one the server would apply; the pull's answer names it, over
    the wire too."""
    spec = job("asgd", nodes=2)
    server = build_server(spec, FASHION_MNIST)
    alg = worker(spec, 0)
    for step in range(3):
        alg.step(*batch(step))
        server.push(0, push_of(alg), f"p{step}", now=0.0)
        alg.receive(server.pull(0, step, False, now=0.0))
    restarted = worker(spec, 0)
    restarted.load_state_dict({**alg.state_dict(), "clock": 1})
    restarted.rejoin()
    (pull,) = restarted.sends()
    answer = server.pull(0, pull.message.since_version, False, now=1.0)
    assert answer.step == 3 and model_of(model_message(answer, 0, 2)).step == 3
    restarted.receive(answer)
    assert restarted.clock == 3 and restarted.version == 3
    restarted.step(*batch(3))
    assert server.push(0, push_of(restarted), "p3", now=1.0).applied


def test_an_esync_worker_rejoins_the_round_and_the_server_restarts_its_entry():
    spec = job("esync", nodes=2, options={"epsilon": 0.0})
    server = build_server(spec, FASHION_MNIST)
    assert server.report(0, 0, 1, 1.0, now=1.0) == Decision(False)
    assert server.report(1, 0, 1, 9.0, now=9.0) == Decision(True)  # the slowest
    assert server.report(0, 0, 2, 1.0, now=10.0) == Decision(True)  # the slowest is ready
    # Rank 0 restarts from its checkpoint and reports step 1 of the round again: refused. Its worker pulls, and
    # the pull restarts its entry.
    with pytest.raises(ProtocolError, match="step 1 of the round after step 2"):
        server.report(0, 0, 1, 1.0, now=11.0)
    model = server.pull(0, 0, False, now=11.0)
    assert model.version == 0 and server.rule.round.reports[0].steps == 0 and not server.rule.round.ready[0]
    assert server.drain_events()[-1] == {"event": "rejoin", "time": 11.0, "rank": 0, "version": 0}
    assert server.report(0, 0, 1, 1.0, now=12.0) == Decision(True)
    # A worker whose delta is already in waits for the round: its pull leaves the round's table alone.
    delta = {name: torch.zeros_like(t) for name, t in server.params.views(server.rule.w).items()}
    server.push(0, ServerPush(Kind.DELTA, delta, version=0), "p0", now=12.5)
    assert server.holds_update(0) and not server.holds_update(1)

    alg = worker(spec, 0)
    alg.step(*batch(0))
    (report,) = alg.sends()
    alg.failed(report, "failed_precondition")
    (pull,) = alg.sends()
    assert pull.message == ServerPull() and not alg.ready()
    alg.receive(ServerModel(Kind.PARAMS, alg.params.views(alg.w.detach().clone()), version=3))
    assert alg.ready() and alg.round_steps == 0 and alg.version == 3 and alg.clock == 3
    alg.step(*batch(1))
    assert push_of(alg) == StepReport(version=3, round_step=1)  # the first step of the round is reported


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"name": "asgd", "options": {"rate": 0.1}}, "algorithm.options.rate: unknown option of asgd, which takes "
         "max_update_norm"),
        ({"name": "ssgd", "options": {"max_update_norm": 0}}, "algorithm.options.max_update_norm: Input should be "
         "greater than 0"),
        ({"name": "esync", "options": {"max_update_norm": float("inf")}}, "algorithm.options.max_update_norm: "
         "Input should be a finite number"),
        ({"name": "adacomp", "options": {"max_update_norm": "big"}}, "algorithm.options.max_update_norm: Input "
         "should be a valid number"),
        ({"name": "ssgd", "momentum": 0.9}, "algorithm.momentum: the workers push plain gradients"),
        ({"name": "adacomp", "options": {"codec": "int4"}}, "algorithm.options.codec: Input should be 'fp32', "
         "'fp16' or 'int8'"),
        ({"name": "adacomp", "options": {"rate": "high"}}, "algorithm.options.rate: Input should be a valid number"),
        ({"name": "dc-asgd", "options": {"mean_square_decay": 1.0}}, "algorithm.options.mean_square_decay"),
        ({"name": "esync", "options": {"epsilon": -1}}, "algorithm.options.epsilon: Input should be greater than or "
         "equal to 0"),
    ],
)
def test_bad_options_name_the_field_at_submission(algorithm, message):
    spec = parse_job_spec({"nodes": 2, "algorithm": algorithm})
    with pytest.raises(JobSpecError, match=message):
        validate_job(spec)


def test_the_server_starts_from_the_model_of_every_node():
    spec = job("asgd")
    assert torch.equal(build_server(spec, FASHION_MNIST).w, worker(spec, 2).w)
