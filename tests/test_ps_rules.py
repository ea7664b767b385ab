"""SSGD, ASGD and DC-ASGD server halves on known vectors, their state round trips, and the bound on an update's norm
that every rule applies."""

import io
import math

import pytest
import torch

from nodeagent.ps import AdaCompServer, ASGDServer, DCASGDServer, ESyncServer, ProtocolError, SSGDServer

pytestmark = pytest.mark.unit


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def persisted(state: dict) -> dict:
    """The state as the coordinator would store it and read it back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_ssgd_applies_the_mean_once_every_worker_pushed_and_releases_all():
    server = SSGDServer(vec(1, 2, 3, 4), num_workers=3, lr=0.5)
    first = server.push(0, vec(3, 0, 3, 6), 0)
    second = server.push(2, vec(0, 0, 3, -3), 0)
    assert (first.applied, first.release, second.applied, second.release) == (False, (), False, ())
    assert torch.equal(server.pull(1)[0], vec(1, 2, 3, 4)) and server.version == 0
    last = server.push(1, vec(0, 3, 3, 0), 0)
    assert (last.applied, last.version, last.release) == (True, 1, (0, 1, 2))
    # mean = (1, 1, 3, 1); w <- w - 0.5 * mean
    assert torch.equal(server.pull(0)[0], vec(0.5, 1.5, 1.5, 3.5))
    for worker in range(3):
        result = server.push(worker, vec(2, 2, 2, 2), 1)
    assert result.version == 2 and torch.equal(server.w, vec(-0.5, 0.5, 0.5, 2.5))


def test_ssgd_refuses_a_second_push_in_a_round_and_other_protocol_errors():
    server = SSGDServer(vec(0, 0), num_workers=2, lr=1.0)
    server.push(0, vec(1, 1), 0)
    with pytest.raises(ProtocolError, match="worker 0 pushed twice in round 0"):
        server.push(0, vec(1, 1), 0)
    with pytest.raises(ProtocolError, match="pushed version 1 in round 0"):
        server.push(1, vec(1, 1), 1)
    with pytest.raises(ProtocolError, match=r"worker 2 is not in 0\.\.1"):
        server.push(2, vec(1, 1), 0)
    with pytest.raises(ProtocolError, match="shape"):
        server.push(1, vec(1, 1, 1), 0)
    with pytest.raises(ProtocolError, match="non-finite"):
        server.push(1, vec(1, math.nan), 0)
    assert torch.equal(server.w, vec(0, 0)) and server.arrived.tolist() == [True, False]


def test_asgd_applies_each_push_on_arrival_and_counts_them():
    server = ASGDServer(vec(0, 0), num_workers=2, lr=0.5)
    seen = []
    for worker, grad, version in [(1, vec(2, 4), 0), (0, vec(10, 0), 0), (0, vec(0, -8), 2), (1, vec(4, 4), 1)]:
        result = server.push(worker, grad, version)
        seen.append((result.version, result.release, result.delay, server.pull(worker)[0].tolist()))
    assert seen == [
        (1, (1,), 0, [-1.0, -2.0]),
        (2, (0,), 1, [-6.0, -2.0]),
        (3, (0,), 0, [-6.0, 2.0]),
        (4, (1,), 2, [-8.0, 0.0]),
    ]
    with pytest.raises(ProtocolError, match=r"worker version 5 is not in 0\.\.4"):
        server.push(0, vec(1, 1), 5)


def dcasgd_script(server: DCASGDServer) -> list[list[float]]:
    """Worker 0 and worker 1 both start from w0; worker 0 pulls after its push, worker 1 does not."""
    models = []
    server.push(0, vec(1, -2), 0)
    models.append(server.pull(0)[0].tolist())
    server.push(1, vec(2, 1), 0)  # compensated against w0, worker 1's backup
    models.append(server.w.tolist())
    server.push(0, vec(-1, 0.5), 1)  # compensated against worker 0's backup of version 1
    models.append(server.w.tolist())
    return models


def test_dcasgd_constant_lambda_compensates_against_each_workers_own_backup():
    models = dcasgd_script(DCASGDServer(vec(1, 2), num_workers=2, lr=0.5, lam=0.04))
    # push 1: w - w_bak0 = 0, plain step: (1, 2) - 0.5 * (1, -2)
    # push 2: w - w_bak1 = (0.5, 3) - (1, 2) = (-0.5, 1); g + 0.04 g^2 (w - w_bak) = (1.92, 1.04)
    # push 3: w - w_bak0 = (-0.46, 2.48) - (0.5, 3) = (-0.96, -0.52); compensated g = (-1.0384, 0.4948)
    expected = [[0.5, 3.0], [-0.46, 2.48], [0.0592, 2.2326]]
    for got, want in zip(models, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_dcasgd_adaptive_lambda_keeps_a_mean_square_per_worker():
    models = dcasgd_script(DCASGDServer(vec(1, 2), num_workers=2, lr=0.5, adaptive=True))

    def lam(mean_square: float) -> float:
        return 2 / math.sqrt(mean_square + 1e-7)

    w1 = [0.5, 3.0]
    ms1 = [0.05 * 4, 0.05 * 1]  # worker 1's first gradient (2, 1)
    g1, diff1 = [2.0, 1.0], [-0.5, 1.0]
    w2 = [w - 0.5 * (g + lam(m) * g * g * d) for w, g, m, d in zip(w1, g1, ms1, diff1, strict=True)]
    ms0 = [0.95 * 0.05 * 1 + 0.05 * 1, 0.95 * 0.05 * 4 + 0.05 * 0.25]  # worker 0: (1, -2) then (-1, 0.5)
    g0, diff0 = [-1.0, 0.5], [w2[0] - 0.5, w2[1] - 3.0]
    w3 = [w - 0.5 * (g + lam(m) * g * g * d) for w, g, m, d in zip(w2, g0, ms0, diff0, strict=True)]
    for got, want in zip(models, [w1, w2, w3], strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    # The compensation is large here: a shared mean square (or backup) would give other numbers.
    assert w2 == pytest.approx([3.97214, -1.97214], abs=1e-4)


def test_dcasgd_rejects_a_gradient_not_computed_on_the_workers_last_pull():
    server = DCASGDServer(vec(1, 2), num_workers=2, lr=0.5)
    server.push(1, vec(1, 1), 0)
    server.pull(0)  # worker 0's backup is now version 1
    result = server.push(0, vec(1, 1), 0)
    assert not result.applied and result.release == (0,) and "last pulled version 1" in result.rejected
    assert server.version == 1 and server.w.tolist() == [0.5, 1.5]


def continue_identically(make, script, state_script):
    """Run `state_script` on one server, restore its persisted state into a fresh one, then run `script` on both."""
    original = make()
    state_script(original)
    restored = make()
    restored.load_state_dict(persisted(original.state_dict()))
    outcomes = [script(server) for server in (original, restored)]
    assert outcomes[0] == outcomes[1]
    assert torch.equal(original.w, restored.w) and original.version == restored.version


def test_ssgd_state_round_trip_keeps_a_half_done_round():
    def make():
        return SSGDServer(vec(1, 2, 3), num_workers=3, lr=0.1)

    def before(server):
        for worker in range(3):
            server.push(worker, vec(worker, 1, 2), 0)
        server.push(2, vec(1, 1, 1), 1)

    def after(server):
        return [server.push(worker, vec(3, worker, 1), 1) for worker in (0, 1)]

    continue_identically(make, after, before)


def test_asgd_and_dcasgd_state_round_trips():
    def asgd_before(server):
        server.push(0, vec(1, 2, 3), 0)

    def asgd_after(server):
        return [server.push(1, vec(1, 0, 1), 0), server.w.tolist()]

    continue_identically(lambda: ASGDServer(vec(1, 2, 3), num_workers=2, lr=0.1), asgd_after, asgd_before)

    for adaptive in (False, True):

        def make(adaptive=adaptive):
            return DCASGDServer(vec(1, 2, 3), num_workers=2, lr=0.1, adaptive=adaptive)

        def before(server):
            server.push(0, vec(1, 2, 3), 0)
            server.pull(0)
            server.push(1, vec(-1, 2, 0.5), 0)

        def after(server):
            return [server.push(0, vec(0.5, -1, 2), 1), server.push(1, vec(1, 1, 1), 0), server.w.tolist()]

        continue_identically(make, after, before)


def test_load_state_dict_refuses_a_state_of_another_shape():
    server = DCASGDServer(vec(1, 2, 3), num_workers=2, lr=0.1, adaptive=True)
    state = server.state_dict()
    state["w"] = vec(7, 7, 7)
    del state["mean_square"]
    target = DCASGDServer(vec(1, 2, 3), num_workers=2, lr=0.1, adaptive=True)
    with pytest.raises(ValueError, match="mean_square"):
        target.load_state_dict(state)
    assert target.w.tolist() == [1, 2, 3]  # a refused state changes nothing
    with pytest.raises(ValueError, match="backup"):
        DCASGDServer(vec(1, 2, 3), num_workers=3, lr=0.1).load_state_dict(server.state_dict())


# -- the bound on an update's norm ----------------------------------------------------------------------------------


def norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


@pytest.mark.parametrize(
    "make",
    [
        lambda bound: ASGDServer(vec(1, 1, 1, 1), num_workers=1, lr=0.5, max_update_norm=bound),
        lambda bound: DCASGDServer(vec(1, 1, 1, 1), num_workers=1, lr=0.5, max_update_norm=bound),
        lambda bound: DCASGDServer(vec(1, 1, 1, 1), num_workers=1, lr=0.5, adaptive=True, max_update_norm=bound),
        lambda bound: SSGDServer(vec(1, 1, 1, 1), num_workers=1, lr=0.5, max_update_norm=bound),
        lambda bound: ESyncServer(vec(1, 1, 1, 1), num_workers=1, global_lr=-0.5, max_update_norm=bound),
    ],
    ids=["asgd", "dcasgd", "dcasgd_adaptive", "ssgd", "esync"],
)
def test_a_1e30_update_is_scaled_down_to_max_update_norm_and_says_so(make):
    def push(server, update: torch.Tensor):
        if isinstance(server, ESyncServer):
            server.report(0, duration=1.0, now=1.0)  # the only worker is READY at once
            return server.push(0, update, 0, now=2.0)
        return server.push(0, update, 0)

    server = make(2.0)
    result = push(server, vec(1e30, -1e30, 0, 0))
    assert result.applied and result.clipped
    # The direction is kept, the length is the bound: w moved by lr * 2 along (1, -1) / sqrt(2).
    step = server.w - vec(1, 1, 1, 1)
    assert math.isclose(norm(step), 0.5 * 2.0, rel_tol=1e-6)
    assert torch.allclose(step, vec(-1, 1, 0, 0) * 0.5 * 2.0 / math.sqrt(2), rtol=1e-5)
    within = make(2.0)
    small = push(within, vec(0.3, 0.4, 0, 0))  # norm 0.5: applied as it is
    assert small.applied and not small.clipped
    assert torch.allclose(within.w - vec(1, 1, 1, 1), vec(-0.15, -0.2, 0, 0))


def test_without_a_bound_a_large_update_is_applied_as_it_is():
    server = ASGDServer(vec(0, 0), num_workers=1, lr=1.0)
    result = server.push(0, vec(1e30, 0), 0)
    assert not result.clipped and torch.equal(server.w, vec(-1e30, 0))


def test_ssgd_bounds_each_workers_update_before_the_mean():
    server = SSGDServer(vec(0, 0), num_workers=2, lr=1.0, max_update_norm=1.0)
    forged = server.push(0, vec(0, 1e30), 0)
    honest = server.push(1, vec(0.3, 0.4), 0)
    assert (forged.clipped, forged.applied, honest.clipped, honest.applied) == (True, False, False, True)
    assert torch.allclose(server.w, -(vec(0, 1) + vec(0.3, 0.4)) / 2)


def test_adacomp_bounds_the_norm_of_a_sparse_update():
    server = AdaCompServer(torch.zeros(6), num_workers=1, tensor_sizes=[4, 2], lr=1.0, max_delay=4, max_update_norm=5.0)
    update = [(torch.tensor([1, 3]), vec(3e30, 4e30)), (torch.tensor([0]), vec(0))]
    result = server.push(0, update, 0)
    assert result.clipped and torch.allclose(server.w, vec(0, -3, 0, -4, 0, 0))


def test_max_update_norm_must_be_a_finite_positive_number():
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_update_norm"):
            ASGDServer(vec(0, 0), num_workers=1, lr=1.0, max_update_norm=bad)
