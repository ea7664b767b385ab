"""Server halves of SSGD, ASGD and DC-ASGD (DC-ASGD: Zheng et al., ICML 2017), and DiLoCo's outer optimizer.

Each server holds the global model `w` (a flat float32 vector laid out like FlatParameters) and `version`
(+1 per applied update). Its runtime (the coordinator's gRPC service, or the simulator) calls, from one thread:
- `push(worker, update, worker_version) -> PushResult`: a worker's update, tagged with the version it was
  computed on; the result says whether `w` changed, the version after the push, and which workers to release
  (answer so that they pull);
- `pull(worker) -> (w, version)`: a copy of the current model (DC-ASGD records it as the worker's backup);
- `state_dict()` / `load_state_dict(state)`: plain tensors and ints, read after every push so that a restarted
  coordinator loses no applied update (hyper-parameters come from the job spec, not from the state).

A malformed or out-of-protocol call raises ProtocolError before any state changes. With `max_update_norm`, an
update longer than it (L2) is scaled down to it before it is applied (`bound`), and the result says so.

With a robust rule (`robust`, nodeagent.robust): a synchronous server keeps every worker's (bounded) update of the
round and applies the rule's aggregate in place of the mean; an asynchronous one clips each update's norm at the
rule's radius. The result names the workers whose contribution the rule clipped or trimmed (`flagged`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nodeagent.jobspec import RobustSpec
from nodeagent.robust import NormClip, RobustAggregator
from nodeagent.wire.message import all_finite

StateDict = dict[str, torch.Tensor | int]


class ProtocolError(ValueError):
    """A push or pull that the protocol does not allow (unknown worker, wrong shape, second push in a round...)."""


@dataclass(frozen=True)
class PushResult:
    applied: bool  # this push changed w
    version: int  # the server's version after the push
    release: tuple[int, ...]  # workers that may pull now (their wait is over)
    delay: int = 0  # updates applied since the version the worker computed on
    rejected: str = ""  # non-empty: the update was discarded (why); the worker must pull and recompute
    duplicate: bool = False  # a retry of a push the server already had (runtimes dedupe by push id)
    repeated: bool = False  # a step the worker's pushes already had, or past the job's last: answered, not applied
    clipped: bool = False  # the update was longer than max_update_norm and was scaled down to it
    flagged: tuple[int, ...] = ()  # workers whose contribution the robust rule clipped or trimmed (this push or round)


class ParameterServer:
    """What every server shares: the model, its version, the workers, pulls, validation and the norm bound."""

    def __init__(self, w0: torch.Tensor, num_workers: int, *, max_update_norm: float | None = None,
                 robust: RobustSpec | None = None):
        if w0.dim() != 1 or not w0.is_floating_point():
            raise ValueError(f"w0 must be a flat floating-point vector, got {w0.dtype} of shape {tuple(w0.shape)}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_update_norm is not None and not 0 < max_update_norm < math.inf:
            raise ValueError(f"max_update_norm must be a finite number > 0, got {max_update_norm}")
        self.w = w0.detach().clone()
        self.version = 0
        self.num_workers = num_workers
        self.max_update_norm = max_update_norm
        # An asynchronous server's robust rule (a synchronous one aggregates its rounds: RoundServer).
        self.norm_clip = NormClip(robust, num_workers) if robust is not None else None

    def pull(self, worker: int) -> tuple[torch.Tensor, int]:
        self.check_worker(worker)
        return self.w.clone(), self.version

    def state_dict(self) -> StateDict:
        return {"w": self.w.clone(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        # Subclasses validate their entries before calling this, so a bad state changes nothing.
        w = state_tensor(state, "w", self.w)
        self.version = state_int(state, "version")
        self.w.copy_(w)

    def check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ProtocolError(f"worker {worker} is not in 0..{self.num_workers - 1}")

    def check_dense(self, update: torch.Tensor) -> None:
        if update.shape != self.w.shape or update.dtype != self.w.dtype:
            raise ProtocolError(
                f"update must be {self.w.dtype} of shape {tuple(self.w.shape)}, "
                f"got {update.dtype} of shape {tuple(update.shape)}"
            )
        # One diverged worker must not poison the global model of everyone.
        if not all_finite(update):
            raise ProtocolError("update has non-finite entries")

    def bound(self, update: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The update (a checked, finite one), scaled down to an L2 norm of max_update_norm when it is longer, and
        whether it was: one worker's outlier or forged push then moves the model by a bounded step. Scaling keeps
        its direction, and a synchronous round goes on; refusing it would stall the round while the worker
        computed the same large update again."""
        if self.max_update_norm is None:
            return update, False
        # In float64: squaring a float32 of 1e30 overflows float32 to an infinity, which would scale to zero.
        norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
        if norm <= self.max_update_norm:
            return update, False
        return update * (self.max_update_norm / norm), True

    def robust_clip(self, worker: int, update: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """An asynchronous server's robust rule on one (bounded) update: its norm clipped at the rule's radius."""
        if self.norm_clip is None:
            return update, ()
        update, clipped = self.norm_clip.clip(worker, update)
        return update, (worker,) if clipped else ()

    def delay_of(self, worker_version: int) -> int:
        if not 0 <= worker_version <= self.version:
            raise ProtocolError(f"worker version {worker_version} is not in 0..{self.version}")
        return self.version - worker_version


class RoundServer(ParameterServer):
    """A synchronous server: one update per worker per round, applied together once all have arrived."""

    def __init__(self, w0: torch.Tensor, num_workers: int, *, max_update_norm: float | None = None,
                 robust: RobustSpec | None = None):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.pending = torch.zeros_like(self.w)  # sum of this round's updates
        self.arrived = torch.zeros(num_workers, dtype=torch.bool)
        # With a robust rule: every worker's update of the round (the rule needs each one, not their sum).
        self.aggregator = RobustAggregator(robust, num_workers) if robust is not None else None
        self.updates = self.w.repeat(num_workers, 1).zero_() if robust is not None else None
        self.flagged: tuple[int, ...] = ()  # of the last completed round

    def check_round(self, worker: int, worker_version: int) -> None:
        self.check_worker(worker)
        if worker_version != self.version:
            raise ProtocolError(f"worker {worker} pushed version {worker_version} in round {self.version}")
        if self.arrived[worker]:
            raise ProtocolError(f"worker {worker} pushed twice in round {self.version}")

    def holds(self, worker: int) -> bool:
        """Whether this round already has `worker`'s update (it waits for the round to complete)."""
        return bool(self.arrived[worker])

    def gather(self, worker: int, update: torch.Tensor, worker_version: int) -> tuple[torch.Tensor | None, bool]:
        """Take this round's update of `worker` (bounded); once every worker's is in, returns their mean (and clears
        the round), else None; and whether the update was clipped."""
        self.check_round(worker, worker_version)
        self.check_dense(update)
        update, clipped = self.bound(update)
        if self.updates is not None:
            self.updates[worker] = update
        else:
            self.pending.add_(update)
        self.arrived[worker] = True
        if not bool(self.arrived.all()):
            return None, clipped
        if self.aggregator is not None and self.updates is not None:
            mean, flags = self.aggregator.aggregate(self.updates)
            self.flagged = tuple(worker for worker, flag in enumerate(flags) if flag)
        else:
            mean = self.pending.div(self.num_workers)
        self.pending.zero_()
        self.arrived.zero_()
        return mean, clipped

    def state_dict(self) -> StateDict:
        state = {**super().state_dict(), "pending": self.pending.clone(), "arrived": self.arrived.clone()}
        if self.updates is not None:
            state["updates"] = self.updates.clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        pending = state_tensor(state, "pending", self.pending)
        arrived = state_tensor(state, "arrived", self.arrived)
        updates = state_tensor(state, "updates", self.updates) if self.updates is not None else None
        super().load_state_dict(state)
        self.pending.copy_(pending)
        self.arrived.copy_(arrived)
        if self.updates is not None and updates is not None:
            self.updates.copy_(updates)

    def completed(self) -> tuple[int, ...]:
        """The workers the robust rule flagged in the round that just completed."""
        return self.flagged


class SSGDServer(RoundServer):
    """One gradient per worker per round; the last one applies w <- w - lr * mean(g) and releases everyone."""

    def __init__(self, w0: torch.Tensor, num_workers: int, lr: float, *, max_update_norm: float | None = None,
                 robust: RobustSpec | None = None):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.lr = lr

    def push(self, worker: int, update: torch.Tensor, worker_version: int) -> PushResult:
        mean, clipped = self.gather(worker, update, worker_version)
        if mean is None:
            return PushResult(applied=False, version=self.version, release=(), clipped=clipped)
        self.w.sub_(mean, alpha=self.lr)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=tuple(range(self.num_workers)), clipped=clipped,
                          flagged=self.completed())


class OuterServer(RoundServer):
    """DiLoCo's outer optimizer as a synchronous server (nodeagent.algorithms.diloco, `diloco-ps`): one
    pseudo-gradient Delta_i = theta - w_i per worker per round; the last one applies Nesterov SGD to their mean,
        u <- mu u + Delta;  theta <- theta - eta (Delta + mu u)   (nesterov false: theta - eta u),
    and releases everyone. theta is `w`; the outer momentum u is the server's state, persisted with it."""

    def __init__(self, w0: torch.Tensor, num_workers: int, outer_lr: float, momentum: float, nesterov: bool, *,
                 max_update_norm: float | None = None, robust: RobustSpec | None = None):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.outer_lr, self.momentum, self.nesterov = outer_lr, momentum, nesterov
        self.velocity = torch.zeros_like(self.w)

    def push(self, worker: int, update: torch.Tensor, worker_version: int) -> PushResult:
        mean, clipped = self.gather(worker, update, worker_version)
        if mean is None:
            return PushResult(applied=False, version=self.version, release=(), clipped=clipped)
        self.velocity.mul_(self.momentum).add_(mean)
        direction = mean.add(self.velocity, alpha=self.momentum) if self.nesterov else self.velocity
        self.w.sub_(direction, alpha=self.outer_lr)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=tuple(range(self.num_workers)), clipped=clipped,
                          flagged=self.completed())

    def state_dict(self) -> StateDict:
        return {**super().state_dict(), "velocity": self.velocity.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        velocity = state_tensor(state, "velocity", self.velocity)
        super().load_state_dict(state)
        self.velocity.copy_(velocity)


class ASGDServer(ParameterServer):
    """Each gradient is applied on arrival: w <- w - lr * g."""

    def __init__(self, w0: torch.Tensor, num_workers: int, lr: float, *, max_update_norm: float | None = None,
                 robust: RobustSpec | None = None):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.lr = lr

    def push(self, worker: int, update: torch.Tensor, worker_version: int) -> PushResult:
        self.check_worker(worker)
        delay = self.delay_of(worker_version)
        self.check_dense(update)
        update, clipped = self.bound(update)
        update, flagged = self.robust_clip(worker, update)
        self.w.sub_(update, alpha=self.lr)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=(worker,), delay=delay, clipped=clipped,
                          flagged=flagged)


class DCASGDServer(ParameterServer):
    """ASGD with delay compensation: w <- w - lr * (g_m + lambda * g_m * g_m * (w - w_bak[m])).

    w_bak[m] is the model worker m last pulled (every worker starts from w0 at version 0). Constant lambda, or
    adaptive: MS_m <- mom * MS_m + (1 - mom) * g_m^2 first, then lambda = lambda0 / sqrt(MS_m + 1e-7)
    elementwise, as in DC-ASGD-a (Zheng et al. 2017).
    """

    def __init__(
        self,
        w0: torch.Tensor,
        num_workers: int,
        lr: float,
        lam: float = 0.04,
        adaptive: bool = False,
        lam0: float = 2.0,
        momentum: float = 0.95,
        *,
        max_update_norm: float | None = None,
        robust: RobustSpec | None = None,
    ):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        self.lr = lr
        self.lam = lam
        self.adaptive = adaptive
        self.lam0 = lam0
        self.momentum = momentum
        self.backup = self.w.repeat(num_workers, 1)
        # The version of each backup: a push must be computed on the model its worker last pulled, otherwise the
        # compensation would correct against the wrong model.
        self.backup_version = torch.zeros(num_workers, dtype=torch.int64)
        self.mean_square = torch.zeros_like(self.backup) if adaptive else None

    def pull(self, worker: int) -> tuple[torch.Tensor, int]:
        w, version = super().pull(worker)
        self.backup[worker].copy_(w)
        self.backup_version[worker] = version
        return w, version

    def push(self, worker: int, update: torch.Tensor, worker_version: int) -> PushResult:
        self.check_worker(worker)
        delay = self.delay_of(worker_version)
        self.check_dense(update)
        if worker_version != int(self.backup_version[worker]):
            reason = f"computed on version {worker_version}, but worker {worker} last pulled version "
            reason += str(int(self.backup_version[worker]))
            return PushResult(applied=False, version=self.version, release=(worker,), delay=delay, rejected=reason)
        update, clipped = self.bound(update)  # g itself: the compensation is computed from the bounded g
        update, flagged = self.robust_clip(worker, update)
        square = update * update
        if self.mean_square is None:
            lam: torch.Tensor | float = self.lam
        else:
            self.mean_square[worker].mul_(self.momentum).add_(square, alpha=1 - self.momentum)
            lam = self.lam0 / torch.sqrt(self.mean_square[worker] + 1e-7)
        compensated = update + lam * square * (self.w - self.backup[worker])
        self.w.sub_(compensated, alpha=self.lr)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=(worker,), delay=delay, clipped=clipped,
                          flagged=flagged)

    def state_dict(self) -> StateDict:
        state = {**super().state_dict(), "backup": self.backup.clone(), "backup_version": self.backup_version.clone()}
        if self.mean_square is not None:
            state["mean_square"] = self.mean_square.clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        backup = state_tensor(state, "backup", self.backup)
        backup_version = state_tensor(state, "backup_version", self.backup_version)
        mean_square = None if self.mean_square is None else state_tensor(state, "mean_square", self.mean_square)
        super().load_state_dict(state)
        self.backup.copy_(backup)
        self.backup_version.copy_(backup_version)
        if self.mean_square is not None and mean_square is not None:
            self.mean_square.copy_(mean_square)


def state_tensor(state: Mapping[str, torch.Tensor | int], key: str, like: torch.Tensor) -> torch.Tensor:
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
        raise ValueError(f"state[{key!r}] must be {like.dtype} of shape {tuple(like.shape)}")
    return value


def state_int(state: Mapping[str, torch.Tensor | int], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"state[{key!r}] must be a non-negative int")
    return value
