"""DiLoCo: many local steps with an inner optimizer, then an outer Nesterov step on the averaged pseudo-gradient
(Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv:2311.08105;
OpenDiLoCo, Jaghouar et al. 2024, arXiv:2407.07852), its streaming form (Douillard et al. 2025, "Streaming
DiLoCo with overlapping communication", arXiv:2501.18512), over an all-reduce (`diloco`, the collective family),
through the parameter server, the coordinator as outer optimizer (`diloco-ps`, the server family), or over push-sum
gossip with no collective at all (`diloco-gossip`, the peer family).

Notation: n nodes, node i; H = `inner_steps`; the flat parameters w_i (the model, what the node trains and
evaluates); theta_i the node's copy of the last global parameters (all nodes start from the same seeded model,
theta_i = w_i); u_i the outer momentum (0 at start); eta = `outer_lr` (0.7), mu = `outer_momentum` (0.9).

Inner steps (every local step, lr = algorithm.lr): AdamW (default; betas, eps and decoupled weight decay are
options; its moments live across outer rounds, as in the paper) or SGD (`inner_optimizer: sgd`, with
algorithm.momentum / nesterov):
    w_i <- InnerOpt(w_i, g_i(w_i)).
Outer round (every H steps; F = `fragments` = 1):
    Delta_i = theta_i - w_i                                  (the pseudo-gradient: minus the progress of H steps)
    Delta   = (1/n) sum_i Delta_i                            (the averaging route)
    u      <- mu u + Delta                                   (Nesterov SGD on Delta, torch.optim.SGD's form)
    theta  <- theta - eta (Delta + mu u)     (`outer_nesterov: false`: theta - eta u)
    w_i    <- theta                                          (every node restarts from the new global).
With inner SGD (no momentum), H = 1, eta = 1 and mu = 0 this is AllReduce SGD: Delta = lr * mean g.

Streaming (F > 1): the flat vector is cut into F contiguous fragments of equal length L = ceil(N / F) (the last
padded with zeros on the wire). Fragment f is synchronised once every H steps: its update is applied at the steps
t with (t - 1) mod H + 1 = (f + 1) H / F (rounded down), spread evenly over the H steps, fragment F - 1 at
multiples of H. Only that fragment's Delta_i travels (F times fewer bytes per sync, the same per H steps). With
tau = `overlap_steps` > 0 the sync is sent tau steps before that point and overlaps those tau inner steps (the
node waits at the point only if the mean has not arrived); the outer update applies to the fragment's theta and
u as above, and its local parameters, which went on training meanwhile, are merged:
    w_i[f] <- alpha w_i[f] + (1 - alpha) theta[f]            (alpha = `overlap_mix`; tau = 0 replaces: alpha = 0).
tau must be below H / F, so at most one sync is outstanding. The job's steps must be a multiple of H, so that
it ends on the application of fragment F - 1's update (the one of every fragment with F = 1). The job's model is
then its global parameters, w_i <- theta for every fragment: with F > 1 or tau > 0 the local parameters are never
all global between syncs (F - 1 fragments have run up to H local steps since theirs, a merged one keeps alpha of
its local part), and the model a job delivers (its final evaluation, `coordinator export`) is the outer
optimiser's. The local steps since each fragment's last sync, which no sync carried, are left out, as the next
sync would have averaged them. (From a model trained synchronously first, benchmarks/lm.py: streaming DiLoCo,
F = 4, ended 12.7% above the baseline's perplexity on its local parameters; docs/results.md.)

Low precision (`precision`: full (the parameters' own dtype), fp16, bf16, int8 with absmax scales per
`int8_chunk` entries or per fragment; nodeagent.wire.lowprecision): what travels is Q(v) in that dtype, and the
bytes counted are its bytes. Error feedback (`error_feedback`, on by default for the lossy precisions), per node:
v_i = Delta_i + e_i, send Q(v_i), keep e_i <- v_i - D(Q(v_i)), so the sum over rounds of what was sent plus the
last residual is the sum of the true pseudo-gradients (the rounding is delayed, never lost).

Averaging routes:
- `diloco`, all-reduce: full-precision pseudo-gradients go through the runtime's all-reduce (the exact mean,
  identical on every node). Lossy ones cannot be summed by the collective (int8 codes overflow, and gloo sums in
  the wire dtype): the runtime all-gathers every node's codes (Route.ALLGATHER, n - 1 messages of the compressed
  size through each link in a ring, counted so), and every node decodes them and sums in rank order in the
  parameters' dtype, so the mean is again identical everywhere. (At n = 8 an int8 all-gather moves as many
  bytes as a float32 ring all-reduce, 7/4 of the float32 vector; low precision pays on the gossip route, or
  with fewer nodes.)
  A rank that is lost and restarted takes the job up from the group's state (`group_state()`: w, theta, u, the
  inner optimizer's state, the residual, the step), handed over by the runtime when it forms the group again,
  and the interrupted sync is sent again by every rank from that state (a rank that comes back after the others
  finished the job takes their final state, whose last sync is applied: nothing is sent again).
- `diloco-ps`, the parameter server: every H steps each worker pushes Q(Delta_i + e_i) (kind delta, tagged with
  the server's version, the rounds done); the server (nodeagent.ps.OuterServer, hosted by the coordinator, or by
  the simulator) waits for every worker's, decodes them, and applies the outer step above to its theta and u,
  which only it holds; each worker then pulls theta (in full: the pull carries the parameters, not a
  pseudo-gradient) and restarts from it, w_i = theta_i = theta. A worker's clock counts inner steps: after round
  v it is v H on every worker, which is where a worker restarted from its checkpoint, whose push of an old
  round the server refuses, takes the job up (the pull hands it theta; its inner optimizer's state is its own,
  from its checkpoint). The outer momentum is the server's state, persisted with it, so the job survives a
  coordinator restart like every parameter-server job. One fragment (F = 1) and no overlap: a round is the
  whole model. `max_update_norm` bounds each worker's pseudo-gradient before the mean.
- `diloco-gossip`, push-sum (Kempe et al. 2003, as in SGP) on the job's graph, `gossip_rounds` = G rounds per
  sync (default: one period of a time-varying graph's schedule; ceil(log2 n) on a static graph, at most H / F). Each
  node keeps its own theta_i and u_i, takes its outer step locally on its own pseudo-gradient, and the nodes
  average the results, outer momentum and global parameters together (NoLoCo's idea, arXiv:2506.10911, that the
  replicas are pulled together by averaging their parameters rather than an exact all-reduce; here by push-sum on
  the job's graph). At the sync of fragment f node i computes
      u_i^+ = mu u_i + Delta_i,   theta_i^+ = theta_i - eta (Delta_i + mu u_i^+)   (`outer_nesterov: false`: eta u_i^+)
  and starts push-sum with the numerator x_i = (u_i^+, theta_i^+) and the weight y_i = 1. Round g, with the k
  out-peers of gossip iteration s G + g (s: the sync's index, the same on every node): the node pushes each out-peer
  the share (x_i / (k + 1), y_i / (k + 1)) (u in the job's precision, theta in the parameters' dtype), keeps
  x_i - k D(Q(share)) and y_i / (k + 1), then adds the shares it receives. After G rounds its estimates x_i / y_i
  become its u_i and theta_i, and w_i <- theta_i (or the overlap's merge, as above).
  In matrix form over the nodes, P the G rounds' mixing matrix (column-stochastic; doubly stochastic on the graphs
  where every node receives as many shares as it sends, as the ring, torus and exponential graphs: y_i stays 1):
      U <- P (mu U + Delta),   Theta <- P (Theta - eta (Delta + mu (mu U + Delta))).
  * The mean is exact on those graphs: 1^T P = 1^T and the step is linear, so the mean over the nodes of (u_i,
    theta_i) follows the DiLoCo recursion on the mean of the Delta_i exactly, lossy shares included (a node keeps
    what its pushes' rounding took off: sum_i x_i is exact after every round). Where nodes receive unequal numbers
    of shares (y_i != 1) only the sums of the numerators are exact.
  * Each node's state is exact only where P is the exact average: one period (log2 n rounds) of the one-peer
    exponential graph (`npeer-exponential`) with n a power of two; then every (u_i, theta_i) is the all-reduce
    route's (to float rounding). With 6 or 12 nodes one period of that graph is not the exact average, nor is any
    number of rounds on a ring or a torus.
  * The disagreement is bounded by design. With local quadratic losses around each node's optimum, Delta_i =
    a (theta_i - opt_i), a in (0, 1); along an eigenvector of P with eigenvalue lambda the disagreement (theta, u)
    evolves by lambda M, M = [[1 - eta a (1 + mu), -eta mu^2], [a, mu]] the matrix of DiLoCo's own outer
    iteration (stable, spectral radius rho(M) <= 1, where DiLoCo converges), driven by the differences of the
    optima. |lambda| < 1 on a connected graph (after G rounds, |lambda|^G): the disagreement contracts at every
    sync and stays below the forcing over 1 - |lambda| rho(M), a geometric series. Two earlier forms do not hold:
    gossiping Delta alone (this route before) left Theta <- Theta - eta (P Delta + mu U) with nothing pulling the
    theta_i together, a random walk (on a ring of 8 with heterogeneous data the spread reached 94 in 120 syncs);
    gossiping Delta and theta but keeping u local gives the matrix [[lambda (1 - eta a (1 + mu)), -eta mu^2],
    [lambda a, mu]], unstable for negative lambda (lambda = -0.5, a = 0.5, eta = 0.7, mu = 0.9: spectral radius
    1.02; measured: the torus's spread grew).
  The global parameters travel in their own dtype: in int8 their rounding (relative to the largest parameter) would
  be re-injected into the disagreement at every sync. A push thus carries the fragment's outer momentum in the job's
  precision and its global parameters in full.
  The rounds of a sync are numbered by the steps after it (a push's clock is the sync's step plus its round), so G
  must be at most H / F, the steps to the next sync, defaults included (a set G or a time-varying graph's period
  above it is refused at submit); otherwise a sync's later rounds would be filed under the next sync.
  Lossy shares need no error feedback across syncs here (`error_feedback` is the all-reduce route's): the rounding
  of a push stays in its sender's numerator within the sync.
  No collective, no coordinator in the loop: pushes go to neighbours and are retried until delivered.
  Robust push-sum (`algorithm.robust: {rule: self-centered-clip}`): as SGP's (nodeagent.algorithms.sgp), a share
  (x_s, y_s) is absorbed as (y_s clip(x_s / y_s), y_s), its estimate of (u, theta) clipped around the node's own
  x / y; a weight is taken in [0, n], a share of weight 0 carries nothing, and one that could make the state
  non-finite is refused (received, with no mass). The auto radius's warm-up reference is (0, theta_0), the start of
  every node's (u, theta).

Robust rules on the other routes: `diloco-ps` takes the parameter server's (centered-clip, trimmed-mean, median,
krum; nodeagent.robust), applied to the round's pseudo-gradients. `diloco` takes trimmed-mean, median and krum: the
sum hides each contribution, so a robust job all-gathers the pseudo-gradients instead (n - 1 of them through each
link where a ring all-reduce moves 2 (n - 1) / n), and every member applies the rule to the same rows, in rank
order, where the mean would be: the replicas stay identical. On every gathered route a row that does not decode or
could overflow (nodeagent.robust.unsafe) is dropped first, alike on every member, as is a summed mean that could; a
sync with no row left is applied with a zero pseudo-gradient (the outer momentum still moves). CenteredClip is
refused: its center is state that would have to follow every fragment.

Evaluation sees w_i: the new global after a sync round (when eval_every is a multiple of H), local progress
otherwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import (
    ALLREDUCE_RANK,
    Algorithm,
    AlgorithmOptions,
    Family,
    Graph,
    NodeContext,
    Route,
    Send,
    Snapshot,
    push_sum_share,
)
from nodeagent.jobspec import JobSpec, JobSpecError
from nodeagent.ps.messages import ServerAnswer, ServerModel, ServerPush
from nodeagent.ps.rules import OuterServer, ParameterServer, ProtocolError, PushResult
from nodeagent.ps.server import ServerHalf, ServerOptions
from nodeagent.ps.worker import PSWorker, check_robust_workers
from nodeagent.robust import (
    RobustAggregator,
    aggregate_counted,
    clipped_shares,
    count_gathered,
    safe_rows,
    unsafe,
)
from nodeagent.wire import lowprecision
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.lowprecision import Precision
from nodeagent.wire.message import Kind, Message, TensorSpec, all_finite

THETA = "theta"  # diloco-gossip: the global parameters' share in a push


class DiLoCoOptions(AlgorithmOptions):
    inner_optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="the local optimizer of the H inner steps, at algorithm.lr (sgd: with algorithm.momentum)")
    inner_steps: int = Field(100, ge=1, description="H: local steps between two syncs of a fragment")
    outer_lr: float = Field(0.7, gt=0, description="eta: step size of the outer SGD on the mean pseudo-gradient")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="mu: momentum of the outer SGD")
    outer_nesterov: bool = Field(True, description="Nesterov's form of the outer momentum")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW's second-moment decay")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    precision: Precision = Field("full", description="how pseudo-gradients travel: full (the parameters' dtype), "
                                 "fp16, bf16 or int8")
    int8_chunk: int = Field(0, ge=0, description="int8: entries per absmax scale (0: one scale per fragment)")
    error_feedback: bool = Field(True, description="keep the rounding of lossy pseudo-gradients and add it to the "
                                 "next sync's (the all-reduce and server routes; gossip keeps it in the sender's "
                                 "numerator)")
    fragments: int = Field(1, ge=1, description="F: fragments synchronised in turn (streaming DiLoCo); 1: all at once")
    overlap_steps: int = Field(0, ge=0, description="tau: inner steps a sync overlaps before its update is applied")
    overlap_mix: float = Field(0.5, ge=0, lt=1, description="alpha: with tau > 0, the weight of the local fragment "
                               "in the merge alpha * local + (1 - alpha) * global (refused without an overlap)")


@dataclass
class PendingSync:
    """A fragment's sync that is out and not yet applied."""

    fragment: int
    sent_at: int  # the step (clock) that sent it, the messages' clock
    apply_at: int
    residual_before: torch.Tensor | None  # the fragment's residual before this sync took its rounding
    mean: torch.Tensor | None = None  # the averaged pseudo-gradient of the fragment, once known
    # gossip only: the round being absorbed, the push-sum numerator (the fragment's padded outer momentum, then its
    # padded global parameters, after the node's local outer step) and weight
    round: int = 0
    x: torch.Tensor | None = None
    weight: float = 1.0
    shares: dict[int, dict[int, tuple[torch.Tensor, float]]] = field(default_factory=lambda: defaultdict(dict))


class _DiLoCo(Algorithm):
    """Inner and outer optimizers, fragments, precision and error feedback: all but the averaging route."""

    modes = ("sync",)
    Options = DiLoCoOptions
    options: DiLoCoOptions

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        options = self.options
        if options.inner_optimizer == "adamw" and (self.spec.momentum or self.spec.nesterov):
            raise JobSpecError("algorithm.momentum: AdamW keeps its own moments (set beta1 in the options)")
        self.global_w = self.w.detach().clone()  # theta
        self.outer_momentum = torch.zeros_like(self.w)  # u
        self.adam_m = torch.zeros_like(self.w) if options.inner_optimizer == "adamw" else None
        self.adam_v = torch.zeros_like(self.w) if options.inner_optimizer == "adamw" else None
        self.lossy = options.precision != "full"
        self.residual = torch.zeros_like(self.w) if self.lossy and options.error_feedback else None
        self.fragment_length = math.ceil(self.w.numel() / options.fragments)
        self.pending: PendingSync | None = None
        self._outbox: list[Send] = []
        self.republish()

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        options = cls.options_of(spec.algorithm)
        assert isinstance(options, DiLoCoOptions)
        inner = options.inner_steps
        if options.inner_optimizer == "adamw" and (spec.algorithm.momentum or spec.algorithm.nesterov):
            raise JobSpecError("algorithm.momentum: AdamW keeps its own moments (set beta1 in the options, or use "
                               "inner_optimizer: sgd)")
        if spec.steps % inner:
            raise JobSpecError(f"steps: {spec.steps} is not a multiple of algorithm.options.inner_steps ({inner}): "
                               "a DiLoCo job ends on an outer round")
        if options.fragments > inner:
            raise JobSpecError(f"algorithm.options.fragments: {options.fragments} fragments cannot each sync once in "
                               f"{inner} inner steps")
        gap = inner // options.fragments
        if options.overlap_steps >= gap:
            raise JobSpecError(f"algorithm.options.overlap_steps: must be below inner_steps / fragments ({gap}), so "
                               "that a fragment's sync is applied before the next one is sent")
        if options.int8_chunk and options.precision != "int8":
            raise JobSpecError("algorithm.options.int8_chunk: applies only to precision int8")
        default_mix = type(options).model_fields["overlap_mix"].default  # what `coordinator init` writes out
        if options.overlap_steps == 0 and options.overlap_mix != default_mix:
            raise JobSpecError("algorithm.options.overlap_mix: applies only with overlap_steps > 0 (without an "
                               "overlap the global fragment replaces the local one)")

    # -- the schedule --------------------------------------------------------------------------------------------

    def fragment_due(self, clock: int) -> int | None:
        """The fragment whose sync is sent at the end of the step that brought the clock to `clock`, if any: its
        update is applied tau steps later, at the fragment's point (f + 1) H / F of the H steps."""
        if clock < 1:
            return None
        options = self.options
        position = (clock - 1) % options.inner_steps + 1 + options.overlap_steps
        for f in range(options.fragments):
            if position == (f + 1) * options.inner_steps // options.fragments:
                return f
        return None

    def sync_index(self, clock: int, fragment: int) -> int:
        """The number of syncs before the one of `fragment` at `clock`, on every node alike."""
        return (clock - 1) // self.options.inner_steps * self.options.fragments + fragment

    def fragment_slice(self, fragment: int) -> slice:
        start = fragment * self.fragment_length
        return slice(start, min(start + self.fragment_length, self.w.numel()))

    def padded(self, vector: torch.Tensor) -> torch.Tensor:
        """A fragment's vector padded with zeros to the fragment length (what travels)."""
        if vector.numel() == self.fragment_length:
            return vector.clone()
        out = torch.zeros(self.fragment_length, dtype=vector.dtype, device=vector.device)
        out[: vector.numel()] = vector
        return out

    def wire_specs(self) -> list[TensorSpec]:
        return lowprecision.specs(self.fragment_length, self.options.precision, self.options.int8_chunk, self.w.dtype)

    def encode(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        return lowprecision.encode(vector, self.options.precision, self.options.int8_chunk)

    def decode(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return lowprecision.decode(dict(tensors), self.options.precision, self.options.int8_chunk, self.w.dtype)

    # -- the mathematics -----------------------------------------------------------------------------------------

    def inner_step(self, grad: torch.Tensor) -> None:
        options, lr = self.options, self.spec.lr
        with torch.no_grad():
            if self.adam_m is None or self.adam_v is None:
                self.w.sub_(self.sgd_direction(grad), alpha=lr)
                return
            t = self.clock + 1  # the AdamW step count: one per inner step
            if options.weight_decay:
                self.w.mul_(1 - lr * options.weight_decay)
            self.adam_m.mul_(options.beta1).add_(grad, alpha=1 - options.beta1)
            self.adam_v.mul_(options.beta2).addcmul_(grad, grad, value=1 - options.beta2)
            denominator = (self.adam_v.sqrt() / math.sqrt(1 - options.beta2**t)).add_(options.eps)
            self.w.addcdiv_(self.adam_m, denominator, value=-lr / (1 - options.beta1**t))

    def pseudo_gradient(self, fragment: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What this node contributes to the fragment's sync (Delta_i plus its residual), padded, and the
        fragment's residual before this sync."""
        part = self.fragment_slice(fragment)
        delta = self.padded(self.global_w[part] - self.w.detach()[part])
        if self.residual is None:
            return delta, None
        before = self.residual[part].clone()
        delta[: before.numel()].add_(before)
        return delta, before

    def keep_residual(self, fragment: int, sent: torch.Tensor, value: torch.Tensor) -> None:
        """Error feedback: what the rounding of `value` (sent as `sent`, decoded) took off, for the next sync."""
        if self.residual is not None:
            part = self.fragment_slice(fragment)
            self.residual[part] = (value - sent)[: part.stop - part.start]

    def outer_step(self, fragment: int, mean: torch.Tensor) -> None:
        """The outer Nesterov step on the fragment's mean pseudo-gradient, and the restart (or merge) of its local
        parameters from the new global ones."""
        part = self.fragment_slice(fragment)
        momentum, theta = self.outer_update(part, mean[: part.stop - part.start])
        with torch.no_grad():
            self.outer_momentum[part] = momentum
            self.global_w[part] = theta
            self.restart(part)

    def outer_update(self, part: slice, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fragment's outer momentum and global parameters after a step on `delta` (this node's state is left
        as it is): u' = mu u + delta, theta' = theta - eta (delta + mu u') (or theta - eta u')."""
        options = self.options
        with torch.no_grad():
            momentum = self.outer_momentum[part] * options.outer_momentum + delta
            direction = delta.add(momentum, alpha=options.outer_momentum) if options.outer_nesterov else momentum
            return momentum, self.global_w[part] - options.outer_lr * direction

    def restart(self, part: slice) -> None:
        """The fragment's local parameters restart from its new global ones, or, with an overlap, are merged."""
        options = self.options
        with torch.no_grad():
            if options.overlap_steps:
                self.w[part] = options.overlap_mix * self.w[part] + (1 - options.overlap_mix) * self.global_w[part]
            else:
                self.w[part] = self.global_w[part]

    def _apply_due(self) -> None:
        pending = self.pending
        if pending is not None and pending.mean is not None and self.clock >= pending.apply_at:
            self.outer_step(pending.fragment, pending.mean)
            if pending.apply_at == self.context.steps:  # the job's last sync: it ends on its global parameters
                with torch.no_grad():
                    self.w.copy_(self.global_w)
            self.pending = None
            self.republish()

    # -- the interface -------------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        self.inner_step(grad)
        self.clock += 1
        self._apply_due()  # a sync whose mean came during the overlapped steps
        fragment = self.fragment_due(self.clock)
        if fragment is not None:
            self._start_sync(fragment)
        self.republish()
        return loss

    def _start_sync(self, fragment: int) -> None:
        value, before = self.pseudo_gradient(fragment)
        self.pending = PendingSync(fragment, self.clock, self.clock + self.options.overlap_steps, before)
        self._outbox.extend(self._sync_sends(self.pending, value))

    def _sync_sends(self, pending: PendingSync, value: torch.Tensor) -> list[Send]:
        """Start averaging `value`, this node's padded contribution to the pending sync."""
        raise NotImplementedError

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def ready(self) -> bool:
        return self.pending is None or self.pending.mean is not None or self.clock < self.pending.apply_at

    def waiting_for(self) -> str:
        pending = self.pending
        assert pending is not None
        return f"the average of fragment {pending.fragment}'s pseudo-gradients of step {pending.sent_at}"

    def _publish(self) -> Snapshot:
        return Snapshot(self.context.rank, self.clock, self.last_loss, {})

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        # Checkpoints are taken between steps at evaluations; a sync still out is lost with them (the all-reduce
        # route recovers from the group's state instead).
        return {**super().state_dict(), **self._state_tensors()}

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"global": self.global_w.clone(), "outer_momentum": self.outer_momentum.clone()}
        if self.adam_m is not None and self.adam_v is not None:
            tensors["adam_m"] = self.adam_m.clone()
            tensors["adam_v"] = self.adam_v.clone()
        elif self.spec.momentum:
            buffer = self._momentum_buffer
            tensors["momentum"] = buffer.clone() if buffer is not None else torch.zeros_like(self.w)
        if self.residual is not None:
            tensors["residual"] = self.residual.clone()
        return tensors

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        for name, tensor in self._state_tensors().items():
            value = state[name]
            if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
                raise ValueError(f"the checkpoint's {name} does not fit this model")
        self._take_state(state)
        super().load_state_dict(state)

    def _take_state(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        with torch.no_grad():
            self.global_w.copy_(state["global"])  # type: ignore[arg-type]
            self.outer_momentum.copy_(state["outer_momentum"])  # type: ignore[arg-type]
            if self.adam_m is not None and self.adam_v is not None:
                self.adam_m.copy_(state["adam_m"])  # type: ignore[arg-type]
                self.adam_v.copy_(state["adam_v"])  # type: ignore[arg-type]
            elif self.spec.momentum:
                momentum = state["momentum"]
                assert isinstance(momentum, torch.Tensor)
                self._momentum_buffer = momentum.clone()
            if self.residual is not None:
                self.residual.copy_(state["residual"])  # type: ignore[arg-type]
        self.pending = None
        self._outbox = []


class DiLoCo(_DiLoCo):
    """DiLoCo over the runtime's all-reduce (all-gather for lossy pseudo-gradients and robust rules)."""

    name = "diloco"
    family = Family.COLLECTIVE
    sends_after_receive = True  # a group state taken up sends the interrupted sync again
    robust_rules = ("trimmed-mean", "median", "krum")
    robust_refusal = ("centered-clip's center is state that would have to follow every fragment; trimmed-mean, "
                      "median and krum keep none")

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        super().check(spec, topology)
        check_robust_workers(spec)

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        robust = self.spec.robust
        self.aggregator = RobustAggregator(robust, context.world_size) if robust is not None else None

    def _sync_sends(self, pending: PendingSync, value: torch.Tensor) -> list[Send]:
        tensors = self.encode(value)
        if self.lossy:
            self.keep_residual(pending.fragment, self.decode(tensors), value)
        route = Route.ALLGATHER if self.lossy or self.aggregator is not None else Route.ALLREDUCE
        message = Message(Kind.DELTA, self.context.rank, ALLREDUCE_RANK, tensors, clock=pending.sent_at,
                          loss=self.last_loss)
        return [Send(route, ALLREDUCE_RANK, Kind.DELTA, message)]

    def receive(self, message: Message) -> None:
        if message.kind == Kind.PARAMS:
            self._take_group_state(message)
            return
        pending = self.pending
        if pending is None or pending.mean is not None or message.clock != pending.sent_at:
            # Applying another sync's mean would silently fork this node from the others.
            out = f"waiting for step {pending.sent_at}" if pending else "with none out"
            raise RuntimeError(f"rank {self.context.rank}: the average of step {message.clock} arrived at step "
                               f"{self.clock}, {out}")
        if self.aggregator is None and not self.lossy:
            pending.mean = message.tensors["delta"].clone()
            if unsafe(pending.mean):  # a member's values summed past the dtype: the same mean on every member
                self.mixing.refused[ALLREDUCE_RANK] += 1
                pending.mean = torch.zeros_like(pending.mean)
        else:
            rows, members = self._gathered_rows(message)
            if not members:
                pending.mean = torch.zeros(self.fragment_length, dtype=self.w.dtype, device=self.w.device)
            elif self.aggregator is not None:
                pending.mean = aggregate_counted(self.aggregator, rows, self.mixing, ALLREDUCE_RANK, self.judged,
                                                 self.context.rank, members)
            else:
                total = torch.zeros(self.fragment_length, dtype=self.w.dtype, device=self.w.device)
                for vector in rows:  # in rank order: the same float sum on every node
                    total.add_(vector)
                pending.mean = total / len(rows)
        self._apply_due()

    def _gathered_rows(self, message: Message) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Every member's pseudo-gradient of an all-gather (one row per member of the quorum, in rank order, decoded
        when lossy), without the rows that do not decode (a liar's negative int8 scales) or could overflow
        (nodeagent.robust.unsafe), and the job ranks of the members whose rows are kept. The rows dropped are dropped
        alike on every member, counted as refused under the all-reduce and under the member that sent each."""
        members = message.members  # the quorum's: a lost rank is not in it
        options = self.options
        decoded, decoded_rows = lowprecision.decode_rows(dict(message.tensors), options.precision,
                                                         options.int8_chunk, self.w.dtype)
        decoded = decoded.to(self.w.device)
        safe = safe_rows(decoded) if decoded_rows else []
        kept = [decoded_rows[index] for index in safe]
        count_gathered(self.mixing, ALLREDUCE_RANK, self.judged, self.context.rank, members, kept)
        rows = decoded if len(safe) == len(decoded_rows) else decoded[safe]
        return rows, tuple(members[row] for row in kept)

    def group_state(self) -> Message:
        """What the all-reduce hands from this rank to every other when the group is formed again: parameters,
        global parameters, outer momentum, inner optimizer state and residual (as before the sync out, which every
        rank sends again from this state), at this rank's step; and `synced`, 1 when the sync of this step is already
        applied (a rank that finished the job hands over its final state: nothing is sent again)."""
        tensors = {"w": self.w.detach().clone(), **self._state_tensors()}
        pending = self.pending
        if pending is not None and pending.residual_before is not None and "residual" in tensors:
            part = self.fragment_slice(pending.fragment)
            tensors["residual"][part] = pending.residual_before
        tensors["synced"] = torch.tensor([1.0 if self.round_applied() else 0.0], dtype=self.w.dtype,
                                         device=self.w.device)
        return Message(Kind.PARAMS, self.context.rank, ALLREDUCE_RANK, tensors, clock=self.clock)

    def round_applied(self) -> bool:
        """Whether the sync sent at this step is applied already (the clock does not move at a sync: a quorum's
        agreement must not take an applied sync for a pending one at the same step)."""
        return self.pending is None and self.fragment_due(self.clock) is not None

    def _take_group_state(self, message: Message) -> None:
        with torch.no_grad():
            self.w.copy_(message.tensors["w"])
        self._take_state(message.tensors)
        self.clock = message.clock
        fragment = self.fragment_due(self.clock)
        if fragment is not None and not float(message.tensors["synced"][0]):
            self._start_sync(fragment)  # the sync the group was formed in: every rank sends it again
        self.republish()

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        if peer != ALLREDUCE_RANK:
            raise WireError(Reason.NOT_NEIGHBOR,
                            f"{self.name} takes messages only from the all-reduce, not rank {peer}")
        if kind != Kind.DELTA:
            raise WireError(Reason.UNEXPECTED_KIND, f"{self.name} accepts only delta, not {kind.name.lower()}")
        return self.wire_specs()


class ServerDiLoCoOptions(DiLoCoOptions, ServerOptions):
    """DiLoCo's options, and the parameter server's (`max_update_norm` bounds each worker's pseudo-gradient)."""


class DiLoCoServerHalf(ServerHalf):
    """The coordinator as DiLoCo's outer optimizer: one pseudo-gradient per worker per round, in the job's precision."""

    synchronous = True
    push_kind = Kind.DELTA
    options: ServerDiLoCoOptions

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        options = self.options
        return OuterServer(w0, self.num_workers, options.outer_lr, options.outer_momentum, options.outer_nesterov,
                           max_update_norm=self.update_bound(options.outer_lr),
                           robust=self.spec.algorithm.robust)

    def push_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        super().push_specs(kind, shapes)  # the kind
        return lowprecision.specs(self.params.vector.numel(), self.options.precision, self.options.int8_chunk,
                                  self.params.vector.dtype)

    def decode(self, push: ServerPush) -> torch.Tensor:
        try:
            return lowprecision.decode(dict(push.tensors), self.options.precision, self.options.int8_chunk,
                                       self.params.vector.dtype)
        except WireError as error:
            raise ProtocolError(str(error)) from error

    def push(self, rank: int, push: ServerPush, push_id: str, now: float) -> PushResult:
        result = super().push(rank, push, push_id, now)
        if result.applied:
            self.events.append({"event": "round", "time": now, "version": result.version})
        return result


class ServerDiLoCo(_DiLoCo, PSWorker):
    """DiLoCo through the parameter server: the coordinator holds the global parameters and the outer momentum."""

    name = "diloco-ps"
    family = Family.SERVER
    Options = ServerDiLoCoOptions
    options: ServerDiLoCoOptions
    server_half = DiLoCoServerHalf
    refuses_momentum = ""  # the inner SGD may take it (AdamW's check is DiLoCo's)
    robust_rules = ("centered-clip", "trimmed-mean", "median", "krum")
    robust_refusal = "self-centered-clip is the peer-to-peer family's; the server aggregates the workers' updates"

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        super().check(spec, topology)
        options = cls.options_of(spec.algorithm)
        assert isinstance(options, ServerDiLoCoOptions)
        if options.fragments != 1 or options.overlap_steps:
            raise JobSpecError(f"algorithm.options: {cls.name}'s rounds sync the whole model (fragments 1, "
                               "overlap_steps 0); streaming is the all-reduce's and gossip's")
        check_robust_workers(spec)

    def _sync_sends(self, pending: PendingSync, value: torch.Tensor) -> list[Send]:
        tensors = self.encode(value)
        if self.lossy:
            self.keep_residual(pending.fragment, self.decode(tensors), value)
        self.waiting = True
        return [self.push(tensors, Kind.DELTA)]

    def receive(self, message: Message | ServerAnswer) -> None:
        """The new global parameters after a round (the one this worker pushed to, or, when its push was refused or
        it rejoined, the current one): every worker restarts from them at step rounds * H."""
        if not isinstance(message, ServerModel):
            raise WireError(Reason.NOT_SERVER, f"{self.name} takes messages only from the server, not a "
                            f"{type(message).__name__}")
        if not self.waiting:
            raise RuntimeError(f"rank {self.context.rank}: a model from the server arrived with no push out")
        pending = self.pending
        if pending is not None and message.version != self.version + 1 and pending.residual_before is not None:
            assert self.residual is not None  # the round did not take this push: nor its rounding
            self.residual[self.fragment_slice(pending.fragment)] = pending.residual_before
        with torch.no_grad():
            self.global_w.copy_(self.params.flatten(message.tensors))
            self.w.copy_(self.global_w)
        self.version = message.version
        self.clock = message.version * self.options.inner_steps
        self.waiting = self.rejoining = False
        self.pending = None
        self.republish()

    def ready(self) -> bool:
        return not self.waiting

    def waiting_for(self) -> str:
        return f"the parameter server's global parameters after round {self.version}"


class GossipDiLoCoOptions(DiLoCoOptions):
    gossip_rounds: int | None = Field(
        None, ge=1, description="push-sum rounds per sync, at most inner_steps / fragments; unset: one period of a "
        "time-varying graph's schedule (log2 n on npeer-exponential: the exact average when n is a power of two), "
        "ceil(log2 n) on a static graph (at most inner_steps / fragments)")
    final_gossip_rounds: int | None = Field(
        None, ge=1, description="push-sum rounds of the job's last sync, which no sync follows, so that the replicas "
        "end in agreement; unset: 3 times a sync's rounds with fragments 1, a sync's rounds with fragments (the last "
        "sync carries only the last fragment: set it only with fragments 1)")


FINAL_ROUNDS_FACTOR = 3  # the last sync's rounds, unset: this times a sync's (GossipDiLoCo's text)


def final_rounds(options: GossipDiLoCoOptions, rounds: int) -> int:
    """The push-sum rounds of the job's last sync, `rounds` those of any other."""
    if options.fragments != 1:
        return rounds
    return options.final_gossip_rounds or FINAL_ROUNDS_FACTOR * rounds


def default_rounds(options: GossipDiLoCoOptions, nodes: int, period: int) -> int:
    """The push-sum rounds of a sync when `gossip_rounds` is unset, the same on every node: one `period` of a
    time-varying graph's schedule; on a static graph (period 0) ceil(log2 n), at most H / F."""
    if period:
        return period
    return max(1, min(math.ceil(math.log2(max(nodes, 1))), options.inner_steps // options.fragments))


class GossipDiLoCo(_DiLoCo):
    """Decentralised DiLoCo: each node takes its outer step on its own pseudo-gradient, then the nodes average their
    outer momenta and global parameters by push-sum gossip on the job's graph, no collective: u_i <- P (mu u_i +
    Delta_i), theta_i <- P (theta_i - eta (Delta_i + mu (mu u_i + Delta_i))), P the mixing of G rounds. Along each
    eigenvector of P (eigenvalue lambda, |lambda| < 1 on a connected graph) the replicas' disagreement evolves by
    lambda times DiLoCo's own outer iteration, so it contracts at every sync and stays bounded however
    heterogeneous the data (gossiping the pseudo-gradients alone let it grow without bound). Exact: the mean over
    the nodes of theta_i and u_i on graphs where every node receives as many shares as it sends (ring, torus,
    exponential graphs), which follows DiLoCo on the mean pseudo-gradient, lossy shares included; each node's
    theta_i only after one period of npeer-exponential with a power-of-two node count (log2 n rounds). Not exact:
    each node's state on a ring, a torus, or npeer-exponential with 6 or 12 nodes, at any number of rounds. A push
    carries the outer momentum in the job's precision and the global parameters in their own dtype. gossip_rounds
    must be at most inner_steps / fragments: set, or a time-varying graph's period, it is refused above that. More
    rounds bring each node nearer the average where the default does not make it exact: on a ring of 6 nodes with
    the class-window split, 500 syncs of H = 10, 3 rounds (the default) ended 1.95 points below DiLoCo over the
    all-reduce, 4 rounds 1.15, 5 rounds 0.70, each round one more push of the model per node, though the mean of
    the replicas' models was 0.60 below with 3: what they lacked at the end was agreement (docs/results.md). So the
    job's last sync, which no sync follows and whose rounds are therefore not bounded by inner_steps / fragments,
    takes `final_gossip_rounds` (unset: 3 times a sync's rounds, FINAL_ROUNDS_FACTOR, with fragments 1): its
    disagreement contracts by lambda^(G_final) instead of lambda^G, once, at the cost of G_final - G more pushes of
    the model per node. With fragments, the last sync carries only the last fragment, so it keeps a sync's rounds.
    Each node ends on its global parameters (as every DiLoCo job does), not merged with its local ones, so an overlap no
    longer keeps part of their disagreement: a 6-node ring, 40 steps, H = 10, tau = 2 ends with a spread of 0.003
    (0.063 when the merge was kept), against 0.002 without an overlap."""

    name = "diloco-gossip"
    family = Family.PEER
    Options = GossipDiLoCoOptions
    options: GossipDiLoCoOptions
    sends_after_receive = True  # a complete round sends the next
    robust_rules = ("self-centered-clip",)

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.rounds = self.options.gossip_rounds or default_rounds(self.options, context.world_size,
                                                                   len(context.peer_schedule))
        self.final_rounds = final_rounds(self.options, self.rounds)
        self.residual = None  # a push's rounding stays in the sender's numerator: nothing is carried to later syncs
        # Shares of syncs this node has not started yet: clock -> sender -> (decoded share, weight).
        self.early: dict[int, dict[int, tuple[torch.Tensor, float]]] = defaultdict(dict)
        self.origin = self.w.detach().clone() if self.clipper is not None else None  # theta_0

    def contribution_weight(self, context: NodeContext) -> float:
        return push_sum_share(context)

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        super().check(spec, topology)
        options = cls.options_of(spec.algorithm)
        assert isinstance(options, GossipDiLoCoOptions)
        if topology.passive:
            raise JobSpecError(f"topology.kind: {cls.name} needs every node to send (push-sum expects as many shares "
                               f"as it sends); {spec.topology.kind} has passive nodes")
        alone = [rank for rank in range(topology.nodes) if topology.degree(rank) == 0]
        if alone and topology.nodes > 1:
            raise JobSpecError(f"topology: ranks {alone} have no neighbour to gossip with")
        gap = options.inner_steps // options.fragments
        # The default is held to the same bound as a number the user sets (a static graph's is capped by it): a
        # sync's later rounds would be filed under the next sync, and the nodes would stop.
        period = topology.schedule_period if topology.schedule_period > 1 else 0
        rounds = options.gossip_rounds or default_rounds(options, topology.nodes, period)
        if rounds > gap:
            given = "" if options.gossip_rounds else (f" (unset: one period of {spec.topology.kind}'s schedule, "
                                                      f"{rounds} rounds)")
            raise JobSpecError(f"algorithm.options.gossip_rounds{given}: at most inner_steps / fragments ({gap}): a "
                               "sync's rounds are numbered by the steps up to the next sync; set fewer rounds or "
                               "more inner steps")
        if options.final_gossip_rounds is not None and options.fragments != 1:
            raise JobSpecError("algorithm.options.final_gossip_rounds: applies only with fragments 1 (the job's last "
                               "sync carries the last fragment alone)")

    # -- push-sum ------------------------------------------------------------------------------------------------

    def _iteration(self, pending: PendingSync) -> int:
        return self.sync_index(pending.sent_at, pending.fragment) * self.rounds + pending.round

    def _rounds_of(self, pending: PendingSync) -> int:
        """The push-sum rounds of `pending`: more for the job's last sync (the class's text)."""
        return self.final_rounds if pending.apply_at == self.context.steps else self.rounds

    def _sync_sends(self, pending: PendingSync, value: torch.Tensor) -> list[Send]:
        part = self.fragment_slice(pending.fragment)
        momentum, theta = self.outer_update(part, value[: part.stop - part.start])  # the local outer step
        pending.x, pending.weight = torch.cat([self.padded(momentum), self.padded(theta)]), 1.0
        pending.shares = defaultdict(dict)
        for clock in sorted(self.early):
            if clock < pending.sent_at + self._rounds_of(pending):  # this sync's, or repeated deliveries of one
                shares = self.early.pop(clock)
                if clock >= pending.sent_at:
                    pending.shares[clock] = shares
        return self._round_sends(pending)

    def _round_sends(self, pending: PendingSync) -> list[Send]:
        """Split (x, weight) among this round's out-peers and this node; the pushes of the shares: the outer momentum
        in the job's precision, the global parameters (`theta`) in their own dtype."""
        assert pending.x is not None
        peers = self.context.out_peers(self._iteration(pending))
        share = pending.x / (len(peers) + 1)
        length = self.fragment_length
        tensors = {**self.encode(share[:length]), THETA: share[length:].clone()}
        if self.lossy:
            share[:length] = self.decode(tensors)
        pending.x = pending.x - len(peers) * share  # what the rounding took off stays here: the mass is exact
        pending.weight /= len(peers) + 1
        clock = pending.sent_at + pending.round
        return [Send(Route.PUSH, peer, Kind.PUSHSUM,
                     Message(Kind.PUSHSUM, self.context.rank, peer, tensors, clock=clock, loss=self.last_loss,
                             weight=pending.weight))
                for peer in peers]

    def _advance(self) -> None:
        """Absorb the complete rounds of the pending sync, send the next, and finish it after the last."""
        pending = self.pending
        while pending is not None and pending.mean is None:
            assert pending.x is not None
            clock = pending.sent_at + pending.round
            received = pending.shares.get(clock, {})
            if len(received) < len(self.context.out_peers(self._iteration(pending))):
                return
            # In sender order: the float sums do not depend on timing.
            shares = (self._clipped(pending, received) if self.clipper is not None
                      else [received[sender] for sender in sorted(received)])
            for x_share, weight_share in shares:
                pending.x.add_(x_share)
                pending.weight += weight_share
            pending.shares.pop(clock, None)
            pending.round += 1
            if pending.round < self._rounds_of(pending):
                self._outbox.extend(self._round_sends(pending))
            else:
                pending.mean = pending.x / pending.weight  # the estimates of the outer momentum's mean, then theta's
                self._apply_due()

    def _clipped(self, pending: PendingSync,
                 received: Mapping[int, tuple[torch.Tensor, float]]) -> list[tuple[torch.Tensor, float]]:
        """What the round adds to the pending (x, weight), its shares' estimates of (u, theta) clipped around this
        node's (the module's text)."""
        assert self.clipper is not None and self.origin is not None and pending.x is not None
        own = pending.x / pending.weight if pending.weight > 0 else pending.x
        start = self.padded(self.origin[self.fragment_slice(pending.fragment)].to(own.device))
        origin = torch.cat([torch.zeros_like(start), start])
        # Judged by the round's distances: they fall from round to round (nodeagent.robust, "several scales"). The
        # last sync's extra rounds come once a job, too few for a group of their own: they are judged by the last
        # round of a sync, whose distances are the nearest to theirs.
        group = min(pending.round, self.rounds - 1)
        return clipped_shares(self.clipper, own, received, origin, group=group)

    def outer_step(self, fragment: int, mean: torch.Tensor) -> None:
        """The gossip's estimates of the means of the nodes' outer momenta and global parameters after their local
        outer steps (the module's text) become this node's."""
        part = self.fragment_slice(fragment)
        length, size = self.fragment_length, part.stop - part.start
        with torch.no_grad():
            self.outer_momentum[part] = mean[:size]
            self.global_w[part] = mean[length : length + size]
            self.restart(part)

    def _start_sync(self, fragment: int) -> None:
        super()._start_sync(fragment)
        self._advance()  # a node without in-peers this round, or whose shares came first

    def receive(self, message: Message) -> None:
        if message.kind != Kind.PUSHSUM:
            return
        theta = message.tensors[THETA].to(device=self.w.device, dtype=self.w.dtype)
        if not all_finite(theta):
            raise WireError(Reason.NON_FINITE, "a push-sum share's parameters hold NaN or infinity")
        vector = torch.cat([self.decode(message.tensors), theta])
        weight = min(max(float(message.weight), 0.0), float(self.context.world_size))  # the whole mass is n
        if self.refused(message.sender, vector):
            vector, weight = torch.zeros_like(vector), 0.0  # received, with no mass: the round completes
        share = (vector, weight)
        pending = self.pending
        if pending is not None and pending.sent_at <= message.clock < pending.sent_at + self._rounds_of(pending):
            if message.clock < pending.sent_at + pending.round or pending.mean is not None:
                return  # a repeated delivery of a retried push of a round absorbed already
            pending.shares[message.clock][message.sender] = share
            self._advance()
        elif message.clock >= self.clock:  # a sync this node has not reached yet
            self.early[message.clock][message.sender] = share
        # else: a round of a sync absorbed already (a retried push delivered twice)

    def rounds_ahead(self) -> int:
        """A neighbour waits for this node's shares at each of its syncs, so it is at most one sync (H steps) ahead
        of it per link between them; a sender reaches this node over at most world_size - 1 links."""
        return self.context.world_size * self.options.inner_steps

    def waiting_for(self) -> str:
        pending = self.pending
        assert pending is not None
        clock = pending.sent_at + pending.round
        received = sorted(pending.shares.get(clock, {}))
        return (f"push-sum shares of round {pending.round} of fragment {pending.fragment}'s sync at step "
                f"{pending.sent_at} (from ranks so far: {received})")

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        self.reject_unless_neighbor(peer)
        if kind != Kind.PUSHSUM:
            raise WireError(Reason.UNEXPECTED_KIND, f"{self.name} accepts only pushsum, not {kind.name.lower()}")
        return [*self.wire_specs(), TensorSpec(THETA, self.w.dtype, (self.fragment_length,))]
