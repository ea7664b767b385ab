"""ESync: rounds of local steps sized so that fast workers fill the slowest one's step.

`is_ready` is the coordinator's answer to "may I stop this round?", a pure function of the reported numbers and
the time, so the simulator and the tests drive it with a virtual or fake clock. `ESyncRound` keeps the reports
of one round; `ESyncServer` adds the model and the aggregation w <- w + global_lr * mean(delta_i).

Quotas: a worker told to continue is also told how many local steps to run before it reports again
(`steps_before_asking`, pure as well): half of the steps that the READY rule predicts still fit, at least one. The
decision is the same as with a report after every step while step durations hold (the rule is re-evaluated at
each report), but a fast worker asks about log2(steps per round) times per round rather than after every step: a
round trip to the coordinator costs several fast steps on a loaded host (docs/results.md, ESync on agents).
Halving bounds what a misprediction costs (the slowest worker finishing early, a fast one slowing down) to half
of the time that was left.

Times are the coordinator's own clock (`now` of each call): a worker reports only the duration of its step,
which needs no shared clock, and the coordinator stamps t_end at the report. A worker whose duration is not yet
known (it has finished no step since the job started) counts as infinitely slow, so nobody stops before the
slowest worker's first step has been seen; at the start of a round every t_end is the round's start, the moment
its current step began.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from nodeagent.jobspec import RobustSpec
from nodeagent.ps.rules import ProtocolError, PushResult, RoundServer, StateDict, state_tensor


@dataclass(frozen=True)
class WorkerReport:
    steps: int = 0  # k: local steps done this round
    duration: float = math.inf  # c: seconds of its last step (inf: none seen yet)
    end: float = 0.0  # t_end: when its last step ended (or the round started, when steps == 0)


MAX_STEPS_BEFORE_ASKING = 1 << 20


@dataclass(frozen=True)
class Decision:
    """The answer to a step report: READY, or how many more local steps to run before reporting again."""

    ready: bool
    steps_before_asking: int = 1


def _slowest(reports: Sequence[WorkerReport]) -> int:
    """The slowest worker: largest c, lowest rank on ties."""
    return max(range(len(reports)), key=lambda rank: (reports[rank].duration, -rank))


def is_ready(
    caller: int, reports: Sequence[WorkerReport], ready: Sequence[bool], now: float, epsilon: float = 0.5
) -> bool:
    """READY when the caller has done a step and: it is the slowest worker (largest c, lowest rank on ties), or
    the slowest is already ready, or c_caller + epsilon > the slowest's remaining time c_slow - (now - t_end_slow)
    (another step of the caller would outlast the slowest worker's current one)."""
    if reports[caller].steps < 1:
        return False
    slowest = _slowest(reports)
    if caller == slowest or ready[slowest]:
        return True
    slow = reports[slowest]
    return reports[caller].duration + epsilon > slow.duration - (now - slow.end)


def steps_before_asking(
    caller: int, reports: Sequence[WorkerReport], ready: Sequence[bool], now: float, epsilon: float = 0.5
) -> int:
    """For a caller that is not READY: the local steps it runs before its next report. After j more steps of
    c_caller each, `is_ready` holds once (j + 1) * c_caller > left - epsilon, left being the slowest worker's
    remaining time; the answer is half of that first j, rounded up. One when nothing can be predicted (the
    slowest worker's speed is not known yet, a step of no measurable duration)."""
    if is_ready(caller, reports, ready, now, epsilon):
        raise ValueError(f"worker {caller} is READY: it runs no more steps this round")
    own = reports[caller].duration
    slow = reports[_slowest(reports)]
    if not (math.isfinite(slow.duration) and math.isfinite(own) and own > 0):
        return 1
    left = slow.duration - (now - slow.end)
    fit = math.floor((left - epsilon) / own)  # the first j at which the rule says READY
    return max(1, min(MAX_STEPS_BEFORE_ASKING, -(-fit // 2)))


class ESyncRound:
    """The reports of the current round and the workers told READY."""

    def __init__(self, num_workers: int, epsilon: float = 0.5, start: float = 0.0):
        self.epsilon = epsilon
        self.reports = [WorkerReport(end=start) for _ in range(num_workers)]
        self.ready = [False] * num_workers
        self.asked_after = [1] * num_workers  # the steps_before_asking of each worker's last answer

    def answer(self, worker: int) -> Decision:
        """The decision last given to `worker` (a retried report gets it again)."""
        return Decision(self.ready[worker], 1 if self.ready[worker] else self.asked_after[worker])

    def report(self, worker: int, duration: float, now: float, steps: int | None = None) -> Decision:
        """Worker `worker` has done `steps` local steps this round (None: one more than it last reported), the
        last of `duration` seconds ending at `now`; whether it must stop, or how many steps to run before its
        next report."""
        if not 0 <= worker < len(self.reports):
            raise ProtocolError(f"worker {worker} is not in 0..{len(self.reports) - 1}")
        if self.ready[worker]:
            raise ProtocolError(f"worker {worker} reported a step after READY")
        if not math.isfinite(duration) or duration < 0:
            raise ProtocolError(f"step duration must be finite and >= 0, got {duration}")
        done = self.reports[worker].steps
        steps = done + 1 if steps is None else steps
        if steps <= done:
            raise ProtocolError(f"worker {worker} reported {steps} steps of the round after {done}")
        self.reports[worker] = WorkerReport(steps, duration, now)
        self.ready[worker] = is_ready(worker, self.reports, self.ready, now, self.epsilon)
        if not self.ready[worker]:
            self.asked_after[worker] = steps_before_asking(worker, self.reports, self.ready, now, self.epsilon)
        return self.answer(worker)

    def restart(self, worker: int, now: float) -> bool:
        """Worker `worker` starts the current round again from its first step (it was restarted, or its calls
        were refused); its speed estimate stays. Whether its entry changed."""
        report = self.reports[worker]
        if report.steps == 0 and not self.ready[worker]:
            return False
        self.reports[worker] = WorkerReport(0, report.duration, now)
        self.ready[worker] = False
        self.asked_after[worker] = 1
        return True

    def reset(self, now: float) -> None:
        """Start the next round at `now`: no steps, nobody ready; durations carry over as the speed estimates."""
        self.reports = [WorkerReport(0, report.duration, now) for report in self.reports]
        self.ready = [False] * len(self.reports)
        self.asked_after = [1] * len(self.reports)


class ESyncServer(RoundServer):
    """Holds w; each round, every worker reports its steps, and once READY pushes delta_i = w_local - w.

    When all deltas are in: w <- w + global_lr * mean(delta_i), version + 1, the next round starts and every
    worker is released to pull. `push` takes `now` because that moment starts the next round.
    """

    def __init__(
        self, w0: torch.Tensor, num_workers: int, global_lr: float = 1.0, epsilon: float = 0.5, start: float = 0.0,
        *, max_update_norm: float | None = None, robust: RobustSpec | None = None,
    ):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.global_lr = global_lr
        self.round = ESyncRound(num_workers, epsilon, start)

    def report(self, worker: int, duration: float, now: float, steps: int | None = None) -> Decision:
        return self.round.report(worker, duration, now, steps)

    def push(self, worker: int, update: torch.Tensor, worker_version: int, now: float) -> PushResult:
        self.check_round(worker, worker_version)
        if not self.round.ready[worker]:
            raise ProtocolError(f"worker {worker} pushed its delta before READY")
        mean, clipped = self.gather(worker, update, worker_version)
        if mean is None:
            return PushResult(applied=False, version=self.version, release=(), clipped=clipped)
        self.w.add_(mean, alpha=self.global_lr)
        self.version += 1
        self.round.reset(now)
        return PushResult(applied=True, version=self.version, release=tuple(range(self.num_workers)), clipped=clipped,
                          flagged=self.completed())

    def state_dict(self) -> StateDict:
        reports = self.round.reports
        return {
            **super().state_dict(),
            "steps": torch.tensor([r.steps for r in reports], dtype=torch.int64),
            "durations": torch.tensor([r.duration for r in reports], dtype=torch.float64),
            "ends": torch.tensor([r.end for r in reports], dtype=torch.float64),
            "ready": torch.tensor(self.round.ready, dtype=torch.bool),
            "asked_after": torch.tensor(self.round.asked_after, dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        n = self.num_workers
        steps = state_tensor(state, "steps", torch.zeros(n, dtype=torch.int64)).tolist()
        durations = state_tensor(state, "durations", torch.zeros(n, dtype=torch.float64)).tolist()
        ends = state_tensor(state, "ends", torch.zeros(n, dtype=torch.float64)).tolist()
        ready = state_tensor(state, "ready", torch.zeros(n, dtype=torch.bool)).tolist()
        # Absent from states written before quotas: one step before asking is the safe answer.
        ones = torch.ones(n, dtype=torch.int64)
        asked_after = state_tensor(state, "asked_after", ones).tolist() if "asked_after" in state else ones.tolist()
        super().load_state_dict(state)
        self.round.reports = [WorkerReport(*report) for report in zip(steps, durations, ends, strict=True)]
        self.round.ready = ready
        self.round.asked_after = asked_after


@dataclass(frozen=True)
class RoundMetrics:
    """One worker's round (or, summed with `total`, a whole run): what the ESync paper plots."""

    steps: int
    samples: int
    compute_s: float
    wait_s: float
    aggregation_s: float
    elapsed_s: float  # wall time of the round, start to the next round's start
    bytes_sent: int
    bytes_received: int

    def __post_init__(self) -> None:
        if self.elapsed_s <= 0 or any(getattr(self, f.name) < 0 for f in fields(self)):
            raise ValueError(f"metrics must be >= 0 with elapsed_s > 0: {self}")

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.samples / self.elapsed_s

    @property
    def traffic(self) -> float:
        """Bytes per second, both directions."""
        return (self.bytes_sent + self.bytes_received) / self.elapsed_s

    @property
    def computing_time_ratio(self) -> float:
        return 1 - (self.aggregation_s + self.wait_s) / self.elapsed_s

    @classmethod
    def total(cls, rounds: Iterable[RoundMetrics]) -> RoundMetrics:
        rounds = list(rounds)
        if not rounds:
            raise ValueError("no rounds to add up")
        return cls(*(sum(getattr(r, f.name) for r in rounds) for f in fields(cls)))
