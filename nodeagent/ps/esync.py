"""ESync (ALGORITHMS.md, "ESync"): rounds of local steps sized so that fast workers fill the slowest one's step.

`is_ready` is the coordinator's answer to "may I stop this round?", a pure function of the reported numbers and
the time, so the simulator and the tests drive it with a virtual or fake clock. `ESyncRound` keeps the reports
of one round; `ESyncServer` adds the model and the aggregation w <- w + global_lr * mean(delta_i).

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

from nodeagent.ps.rules import ProtocolError, PushResult, RoundServer, StateDict, state_tensor


@dataclass(frozen=True)
class WorkerReport:
    steps: int = 0  # k: local steps done this round
    duration: float = math.inf  # c: seconds of its last step (inf: none seen yet)
    end: float = 0.0  # t_end: when its last step ended (or the round started, when steps == 0)


def is_ready(
    caller: int, reports: Sequence[WorkerReport], ready: Sequence[bool], now: float, epsilon: float = 0.5
) -> bool:
    """READY when the caller has done a step and: it is the slowest worker (largest c, lowest rank on ties), or
    the slowest is already ready, or c_caller + epsilon > the slowest's remaining time c_slow - (now - t_end_slow)
    (another step of the caller would outlast the slowest worker's current one)."""
    if reports[caller].steps < 1:
        return False
    slowest = max(range(len(reports)), key=lambda rank: (reports[rank].duration, -rank))
    if caller == slowest or ready[slowest]:
        return True
    slow = reports[slowest]
    return reports[caller].duration + epsilon > slow.duration - (now - slow.end)


class ESyncRound:
    """The reports of the current round and the workers told READY."""

    def __init__(self, num_workers: int, epsilon: float = 0.5, start: float = 0.0):
        self.epsilon = epsilon
        self.reports = [WorkerReport(end=start) for _ in range(num_workers)]
        self.ready = [False] * num_workers

    def report(self, worker: int, duration: float, now: float) -> bool:
        """Worker `worker` finished a step of `duration` seconds at `now`; whether it must stop (READY)."""
        if not 0 <= worker < len(self.reports):
            raise ProtocolError(f"worker {worker} is not in 0..{len(self.reports) - 1}")
        if self.ready[worker]:
            raise ProtocolError(f"worker {worker} reported a step after READY")
        if not math.isfinite(duration) or duration < 0:
            raise ProtocolError(f"step duration must be finite and >= 0, got {duration}")
        self.reports[worker] = WorkerReport(self.reports[worker].steps + 1, duration, now)
        self.ready[worker] = is_ready(worker, self.reports, self.ready, now, self.epsilon)
        return self.ready[worker]

    def reset(self, now: float) -> None:
        """Start the next round at `now`: no steps, nobody ready; durations carry over as the speed estimates."""
        self.reports = [WorkerReport(0, report.duration, now) for report in self.reports]
        self.ready = [False] * len(self.reports)


class ESyncServer(RoundServer):
    """Holds w; each round, every worker reports its steps, and once READY pushes delta_i = w_local - w.

    When all deltas are in: w <- w + global_lr * mean(delta_i), version + 1, the next round starts and every
    worker is released to pull. `push` takes `now` because that moment starts the next round.
    """

    def __init__(
        self, w0: torch.Tensor, num_workers: int, global_lr: float = 1.0, epsilon: float = 0.5, start: float = 0.0
    ):
        super().__init__(w0, num_workers)
        self.global_lr = global_lr
        self.round = ESyncRound(num_workers, epsilon, start)

    def report(self, worker: int, duration: float, now: float) -> bool:
        return self.round.report(worker, duration, now)

    def push(self, worker: int, update: torch.Tensor, worker_version: int, now: float) -> PushResult:
        self.check_round(worker, worker_version)
        if not self.round.ready[worker]:
            raise ProtocolError(f"worker {worker} pushed its delta before READY")
        mean = self.gather(worker, update, worker_version)
        if mean is None:
            return PushResult(applied=False, version=self.version, release=())
        self.w.add_(mean, alpha=self.global_lr)
        self.version += 1
        self.round.reset(now)
        return PushResult(applied=True, version=self.version, release=tuple(range(self.num_workers)))

    def state_dict(self) -> StateDict:
        reports = self.round.reports
        return {
            **super().state_dict(),
            "steps": torch.tensor([r.steps for r in reports], dtype=torch.int64),
            "durations": torch.tensor([r.duration for r in reports], dtype=torch.float64),
            "ends": torch.tensor([r.end for r in reports], dtype=torch.float64),
            "ready": torch.tensor(self.round.ready, dtype=torch.bool),
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        n = self.num_workers
        steps = state_tensor(state, "steps", torch.zeros(n, dtype=torch.int64)).tolist()
        durations = state_tensor(state, "durations", torch.zeros(n, dtype=torch.float64)).tolist()
        ends = state_tensor(state, "ends", torch.zeros(n, dtype=torch.float64)).tolist()
        ready = state_tensor(state, "ready", torch.zeros(n, dtype=torch.bool)).tolist()
        super().load_state_dict(state)
        self.round.reports = [WorkerReport(*report) for report in zip(steps, durations, ends, strict=True)]
        self.round.ready = ready


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
