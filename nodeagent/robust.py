"""Numbers from a member are checked, not trusted: robust mixing for the peer-to-peer family and robust aggregation
for the parameter server (`algorithm.robust`, nodeagent.jobspec.RobustSpec). Tensor arithmetic only: no I/O.

Self-centered clipping (He, Karimireddy and Jaggi 2022, "Byzantine-robust decentralized learning via
ClippedGossip"). A node i with state x_i mixes each neighbour's contribution x_j only after clipping it around its
own state:
    clip_i(x_j) = x_i + min(1, tau / ||x_j - x_i||) (x_j - x_i),
so one neighbour moves the node by at most its mixing weight times tau, whatever it sends; an honest neighbour
within tau of the node is mixed exactly as before. The algorithms apply it where they mix (DSGD, gossip, AD-PSGD)
and in the forms their mathematics allows (push-sum and ECL-ISVR, derived in their modules).

The radius tau. Set (`radius: <float>`), or `auto`: the lower quartile of the last AUTO_WINDOW distances the node
has seen (every neighbour's, before clipping), times AUTO_PULL / w, w the weight one contribution has in the node's
mix (the algorithm's `contribution_weight`: 1/5 for DSGD on the multiplex ring, 1/8 for SGP on the exponential graph
of 16, 1/2 for a pairwise average or a one-peer push-sum). A contribution then moves the node by at most w tau =
AUTO_PULL times the quartile, whatever the graph. A fixed multiplier of the quartile (0.7 on every graph) held
gossip's liars (weight 1/2) but cost SGP (weight 1/8) 1.86 points without an attack, clipping honest shares whose
pull was small; at 2.0 SGP cost nothing and held 3 liars, where gossip and DiLoCo over gossip failed. At w = 1/2 the
radius is now the quartile itself: 0.7 times it had cost DiLoCo over gossip 1.78 points without an attack (its
sync's average is taken once, so every clipped honest share biases it), 1.5 times it let 3 liars cost 8 to 16 points
(benchmarks/byzantine.py, docs/results.md). Exclusion and the outlying count (below) catch what a wider radius lets
through. A quartile is moved by far liars only when they are three quarters of the node's neighbours (below), so tau
stays of the order of the honest distances even where one of a ring node's two neighbours lies (a median was not:
with half the window a liar's, tau followed the liar, and a constant 1000 dragged its honest neighbours to it;
4-node ring, async DSGD, logistic: 0.64 honest accuracy with the median, 0.80 with the quartile, 0.80 without an
attack). Until AUTO_WARM distances are seen, tau is twice the node's own distance from the shared initial model,
||x_i - x_0||: every honest node starts from x_0, so two of them are about that far apart, and no first
contribution, a liar's included, passes unclipped. It is capped by AUTO_PULL / w times the shortest distance seen
yet: the drift grows as a liar pulls the node, and the tau it gives grew with it. A zeros liar on a 4-node ring,
with copies 2 steps stale, pulled its neighbours' norms from 1.85 to 0.6 before the window was warm, within twice
their honest distances from then on: never outlying, never excluded (async DSGD, simulator, 0.1 s latency: honest
52 to 65%; 81 to 83% with the cap, as without an attack). Before any honest distance is seen the shortest is a
liar's, so a node that takes local steps caps it by the auto radius of STEP_OUTLYING of its own steps as well (see
"echoes"): pull gossip's first fetches of a `constant` liar doubled the drift, and tau, at each pull.

A neighbour's share. The window is pooled over the neighbours, and a neighbour may send more than its share of it:
pull gossip on a 4-node ring fetched its liar 7 times in its first 9 fetches by chance, and the liar's three
quarters of the window became its quartile (44,300 where the honest distances were 0.3 to 5), which let the liar's
values in: the honest node was dragged 22,152 away, excluded by its other neighbour and flagged (seed 2, simulator).
So a neighbour's distances weigh in the quartile at most its share of the window, window / neighbours of them: each
weighs 1, or share / its count where it sent more (a balanced window's quartile is the plain one). A liar heard more
often than the others moves the quartile no more than one heard as often. A neighbour heard less often is not
raised to a full share either: when every neighbour weighed 1 / (neighbours x its distances), an echoing liar (its
distances about 0, below) heard less than the others was raised to a quarter of the window among 4 in-neighbours,
which set the quartile, and the radius, near 0: DiLoCo over gossip on 16 nodes with one echo clipped every honest
share, and one honest node ended at 64.65% and was flagged (84.15% and none flagged since; 3 echoes: -7.35 points
and 2 honest nodes flagged, -3.05 and 1 since; benchmarks/byzantine.py --attacks echo). The
price: an honest neighbour heard far less often than a liar weighs only what it sent (in pull gossip between two
neighbours, the window warm at 8 distances holds 1 or none of the honest one's 4% of the time, by chance).

Distances of several scales (groups). The rounds of one push-sum average are not alike: DiLoCo over gossip on the
one-peer exponential graph of 16 compares, in round r, two averages of 2^r nodes each, and the honest distances
fall from round to round (median 0.91, 0.78, 0.52, 0.38 in its 4 rounds, class-window; 1.07, 0.42, 0.31, 0.21
iid). Against one window's quartile, the last rounds', the first rounds' honest shares were outlying, and their
senders excluded (in 388 of 480 first rounds, iid): the sync's average, taken once, lost their mass (1.05 points
without an attack, class-window). So a caller may name a contribution's group (the round): it enters the node's
window and its group's, and counts as outlying beyond OUTLYING_FACTOR times the group's quartile, capped at
GROUP_CAP times the window's; until GROUP_WARM distances of its group are seen it is not judged (not outlying, not
counted towards exclusion). The radius stays the window's: a group may hold one peer's distances only (one peer per
round), and a radius from a liar's own distances, even capped, let 1 sign-flipping liar of 16 pull its receivers
GROUP_CAP times as far in every sync until their distances, and with them the window's quartile, grew without
bound (honest worst 3.00, a NaN model). The cap keeps such a liar outlying beyond OUTLYING_FACTOR x GROUP_CAP times
the honest scale.

Refused before it is applied, clip or no clip: a contribution with an entry above SAFE_MAGNITUDE (the square root
of the dtype's largest finite value: a product of two such entries, as in any forward pass or norm, is not
finite) or not finite. Mixing a convex combination of finite values below it cannot overflow, and the next local
step's forward pass stays finite; such a contribution is dropped and counted, and the node keeps what it had.

Outlying contributions (detection, coordinator.control.suspicion). Clipping says little about a neighbour: at the
auto radius most honest contributions are clipped a little. A contribution counts as outlying when its distance is
above OUTLYING_FACTOR times the lower quartile of the window (once AUTO_WARM distances are seen), or when it is
refused: a quartile is moved by far liars only when they are three quarters of the node's neighbours, and an
honest neighbour is rarely that far. The factor was 4 until a liar sending zeros showed what it let through: it
drags its neighbours towards the origin, which inflates their honest distances too, and its own distance, ||x_i||,
stayed within 4 times them (4-node ring, synchronous DSGD: honest 0.49 to 0.59 with 4, 0.78 to 0.82 with 2, as
without an attack; 16 nodes, gossip, 3 zeros liars: 7.94 points lost with 4, 0.95 with 2). At 2
benchmarks/byzantine.py flagged 5 honest members in 272 runs, 4 at 4, in the same runs (docs/results.md); at 1.5 a
4-node ring flagged one. The node reports, per neighbour, how many of its contributions were outlying
(`robust_outlying`, where the node takes local steps far on their scale too: "echoes" below) next to how many were
clipped; the coordinator's suspicion score of a member is built from the
former. A liar that stays within the honest spread (alie, ipm at a small scale) is not outlying and not flagged: its
harm is bounded by the clipping instead.

Echoes, and a scale no neighbour can shrink (a deviation). The lower quartile resists liars that send far values,
not close ones: a liar that sends each neighbour its own state back (`dissensus` at strength 0, an echo) is at
distance about 0, and where a quarter of a node's window is echoes its quartile falls towards 0. The node then found
its honest neighbours outlying, excluded them and reported them: on a 4-node ring the honest rank opposite the liar
was quarantined (98% outlying); on 16 nodes with 3 echoing liars, two of them among some honest nodes' four
neighbours, 4 honest members were flagged and the honest nodes lost 9 points (synchronous DSGD, class-window). The
node's own steps are a scale the liars cannot move: the algorithms that take local SGD steps between mixes (DSGD,
gossip, AD-PSGD, SGP) note the length lr ||d|| of one step in STEP_SAMPLE (`stepped`), averaged with decay
STEP_DECAY: an average needs no more, and a norm at every step was a tenth of the rule's cost. Two uses:
- Once the window is warm, a distance below ECHO_FLOOR times the average step enters no window (it is judged and
  mixed all the same). Before, every honest distance is as small (one initial model for all), and the floor would
  leave the liars' distances alone in the window: 3 `zeros` liars then cost 26 points.
- A contribution counts towards what the node reports (`robust_outlying`, the coordinator's suspicion) only beyond
  STEP_OUTLYING times the average step as well. An honest neighbour is rarely that far: 0.9 to 1.7 steps at the
  median, 1.3 to 3.3 at the 95th percentile of the honest distances in the runs below, where a `zeros`, `sign-flip`
  or `ipm` liar is 12 to 30 steps away at the median and 2.8 or more from its first contribution. The node's own
  exclusion keeps the quartile's judgement alone: at 3 steps a `zeros` liar on a 4-node ring with stale copies,
  whose distance, the node's norm, is 1.7 to 2.8 steps at the start, was not excluded (honest 57 to 67%).
With both, the 4-node ring reports its honest neighbour in 9 of 800 contributions, and nobody is flagged; the 16
nodes lose 0.65 points, nobody flagged (docs/results.md). DiLoCo over gossip takes no local step between its
mixes that a replica's distance could be compared with, and keeps the quartile alone.

Exclusion (beyond ClippedGossip, a deviation). Clipping bounds a liar's pull per mix by its weight times tau, but a
sign-flipping liar pulls the same way at every mix, and with several liars among a node's peers (pull gossip, the
exponential graph of SGP) those bounded pulls add up: 16 nodes, 3 sign-flipping liars, class-window split, gossip
lost 9.1 points and SGP 14.0 with clipping alone. So a node also excludes, on its own judgement, a neighbour
EXCLUDED_SHARE of whose last contributions were outlying (at least EXCLUDED_SEEN judged, the last EXCLUDED_WINDOW
counted): it clips it to radius 0 (its own state in the neighbour's place, the push-sum weight kept) until the share
falls again; the contribution is still judged and counted. No honest neighbour was excluded in
benchmarks/byzantine.py's no-attack rows (their accuracy did not move), and gossip and SGP under 3 sign-flipping
liars came within 1.5 and 2.4 points of the no-attack rows (docs/results.md). A node-local decision: the
coordinator's quarantine acts on the whole job.

Robust aggregation at the parameter server, over the n workers' updates of one round (U, n x d):
- centered-clip (Karimireddy, He and Jaggi 2021): v <- v + (1/n) sum_i clip(U_i - v, tau), CENTERED_CLIP_ITERATIONS
  times from the previous round's aggregate (0 at the start); auto tau: the median of ||U_i - v||;
- trimmed-mean: each coordinate's mean after dropping its f largest and f smallest values;
- median: each coordinate's median (the mean of the two middle values when n is even);
- krum (Blanchard et al. 2017): the update whose n - f - 2 nearest others are nearest (sum of squared distances).
f is `robust.byzantine`, default floor((n - 1) / 4). A worker counts as clipped (per member, for the metrics and the
coordinator's suspicion) when its update is farther from the aggregate than twice the median distance of the
updates to it, whatever the rule: centered-clip at its auto radius clips half the updates in every iteration, so
counting those flagged 9 of the 16 honest workers of an ESync job without a liar in 30 rounds
(benchmarks/byzantine.py). An asynchronous server applies one update at a time and has no round to
aggregate: its centered-clip clips each update's norm (center 0) at the auto radius of the recent norms, each
worker holding its own share of them however fast it pushes (NormClip). It applies every push, though, so a worker
that pushes 30 times as often as the others pulled the model 30 times as hard, each push clipped: per round of 15
honest pushes (norms 1 to 1.14), 30 clipped pushes of a liar added up to 103 against their 16. So it also bounds a
worker's rate: among the last pushes (max(RATE_WINDOW, RATE_WINDOW_PER_WORKER x workers) of them), a worker's beyond
the median count of the other workers among them (at least 1) plus RATE_SLACK are scaled by allowed / its count
(a worker alone among them, the others lost or not started, is not scaled), so that over time no
worker moves the model much more than one worker pushing at the median rate with the longest norm the clip lets
through, however fast it pushes. The slack is one push: counts move by one from push to push, and without it the
honest workers of a round that a short window held twice were scaled by half. The window holds about
RATE_WINDOW_PER_WORKER pushes of each worker at the median rate, so the slack is a small part of what each is
allowed; the bound applies from the first pushes (with the slack, a worker's second push in a row is not scaled).
The bound was 3 times the median count, in a window of 64 pushes and only once it was full, until a fast liar on
agents showed what that let through: a sign-flipping worker that steps 30 times as often as 3 honest ones held as
much pull as all of them together, and the model went nowhere (4 agents, ASGD: the honest workers at 9.95% against
82.62% without the liar, 77.12% and 79.90% with this bound: benchmarks/byzantine_agents.py --jobs ASGD --liar-speed
30; 3 such liars of 16 in the simulator: 8.25% and 81.84%, iid: byzantine.py --only asgd --liar-pushes 30;
docs/results.md). The server half now also applies one push per step of a worker (nodeagent.ps.server), so a liar
that claims a step per push spends the job's steps early, at this bound's rate, and one that repeats its steps
counts once a step. The scaling is a bound, not a judgement: it does not count as clipped; an
honest worker on faster hardware is slowed to about the median rate's pull, not suspected (in the simulator, 16
workers of which 4 twice as fast and 2 at half speed, class-window and iid: 77.84% and 79.47% with the bound,
79.06% and 79.36% at 3 times).
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from nodeagent.jobspec import RobustSpec

AUTO_WINDOW = 64  # recent distances the auto radius is the lower quartile of
AUTO_WARM = 8  # distances seen before the window's quartile is trusted
# tau = AUTO_PULL / w * the window's lower quartile, w a contribution's weight in the mix (the module's text): the
# quartile itself at w = 1/2.
AUTO_PULL = 0.5
GROUP_CAP = 4.0  # a group's quartile counts at most this times the whole window's (the module's text)
GROUP_WARM = 4  # a group's distances before its quartile is trusted (a round's come once per sync)
# An asynchronous server's: tau = NORM_CLIP_MULTIPLIER * the median of the recent norms. At 2 it clipped honest
# workers whose class-window shard gives longer updates (ASGD without an attack, 600 steps: 1.18 points); at 3 every
# robust row of benchmarks/byzantine.py --full --only asgd is met, 34 of 34 (docs/results.md).
NORM_CLIP_MULTIPLIER = 3.0
# An asynchronous server's: a worker's pushes beyond the other workers' median count among the recent pushes plus
# RATE_SLACK are scaled down to it; the recent pushes are at least RATE_WINDOW, and RATE_WINDOW_PER_WORKER a worker
# (NormClip, the module's text).
RATE_SLACK = 1
RATE_WINDOW = 256
RATE_WINDOW_PER_WORKER = 16
CENTERED_CLIP_ITERATIONS = 3
OUTLYING_FACTOR = 2.0  # a neighbour's contribution farther than this times the window's lower quartile is outlying
# A neighbour with at least EXCLUDED_SEEN of its last EXCLUDED_WINDOW contributions judged, EXCLUDED_SHARE of them
# outlying, is excluded: the node clips it to radius 0 (mixes its own state in its place) until its share falls.
EXCLUDED_WINDOW = 16
EXCLUDED_SEEN = 4
EXCLUDED_SHARE = 0.75
VERDICT_BITS = (1 << EXCLUDED_WINDOW) - 1  # a neighbour's last EXCLUDED_WINDOW verdicts, one bit each
# Once the window is warm, a distance below ECHO_FLOOR times the node's average step length does not enter it (the
# module's text, "echoes").
ECHO_FLOOR = 0.5
STEP_DECAY = 0.9  # of the running average of the node's step lengths
STEPS_UNREAD = 64  # steps' norms held for the next judgement at most (a node that judges nothing for long)
STEP_SAMPLE = 4  # one local step in this many has its length noted (the module's text, "echoes")
# A contribution counts towards the node's report only beyond STEP_OUTLYING times its average step too (the module's
# text).
STEP_OUTLYING = 3.0
OUTLIER_FACTOR = 2.0  # a server-side contribution farther than this times the median distance counts as clipped


def safe_magnitude(dtype: torch.dtype) -> float:
    """The largest entry a contribution may hold (see the module's text)."""
    return math.sqrt(torch.finfo(dtype).max)


def unsafe(contribution: torch.Tensor) -> bool:
    """Whether mixing `contribution` could make the node's state non-finite: an entry not finite, or above
    safe_magnitude. One pass over the tensor, as the wire's finiteness check."""
    if not contribution.is_floating_point() or contribution.numel() == 0:
        return False
    low, high = torch.aminmax(contribution)
    largest = max(abs(float(low)), abs(float(high)))
    return not largest <= safe_magnitude(contribution.dtype)  # NaN compares false


def safe_rows(rows: torch.Tensor) -> list[int]:
    """The indices of the rows of `rows` (one contribution each, floating) that are not `unsafe`: one pass and one
    read back for all of them, where a check per row would synchronise with a GPU once per row."""
    largest = rows.abs().amax(dim=1)
    return torch.nonzero(largest <= safe_magnitude(rows.dtype)).flatten().tolist()  # NaN compares false


def sorted_lower_quartile(entries: Sequence[tuple[float, int]]) -> float:
    """The 25th percentile of the values of at least two (value, neighbour) entries sorted by value, as
    statistics.quantiles(values, n=4)[0] (its exclusive method), without the other two quartiles (and without a
    copy of the values: it reads two)."""
    count = len(entries)
    m = count + 1
    j = min(max(m // 4, 1), count - 1)
    delta = m - 4 * j
    return (entries[j - 1][0] * (4 - delta) + entries[j][0] * delta) / 4


class DistanceWindow:
    """The last AUTO_WINDOW distances in arrival order with the neighbour each came from, and the same kept sorted:
    the lower quartile is read at every contribution a node mixes, and one insertion into a sorted list is cheaper
    than a sort. A neighbour's distances weigh in the quartile at most its share of the window, however many of them
    are its (the module's text, "a neighbour's share")."""

    def __init__(self) -> None:
        self.arrived: deque[tuple[float, int]] = deque()
        self.ordered: list[tuple[float, int]] = []
        self.held: dict[int, int] = {}  # per neighbour: its distances in the window

    def __len__(self) -> int:
        return len(self.arrived)

    def add(self, peer: int, length: float) -> None:
        arrived, ordered, held = self.arrived, self.ordered, self.held
        if len(arrived) == AUTO_WINDOW:
            oldest = arrived.popleft()
            del ordered[bisect.bisect_left(ordered, oldest)]
            left = held[oldest[1]] - 1
            if left:
                held[oldest[1]] = left
            else:
                del held[oldest[1]]
        entry = (length, peer)
        arrived.append(entry)
        bisect.insort(ordered, entry)
        held[peer] = held.get(peer, 0) + 1

    def lower_quartile(self) -> float:
        """statistics.quantiles(window, n=4)[0] (its exclusive method) with each distance weighing 1, or share / count
        where its neighbour holds count distances, more than its share of the window (window / neighbours): the
        quarter point (weight + 1) / 4 interpolated between the two distances whose cumulative weights, in order,
        bracket it (a balanced window's: the plain quartile)."""
        held = self.held.values()
        if max(held) == min(held):
            return sorted_lower_quartile(self.ordered)
        share = len(self.ordered) / len(self.held)  # a neighbour's fair share of the window
        weight = {peer: min(1.0, share / count) for peer, count in self.held.items()}
        quarter = (sum(min(count, share) for count in held) + 1) / 4
        below, at = 0.0, self.ordered[0][0]
        for length, peer in self.ordered:
            reached = below + weight[peer]
            if reached >= quarter:
                return at if below == 0.0 else at + (quarter - below) / (reached - below) * (length - at)
            below, at = reached, length
        return at

    def shortest(self) -> float | None:
        return self.ordered[0][0] if self.ordered else None


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    # In float64: the square of a large float32 difference overflows float32.
    return float(torch.linalg.vector_norm(a - b, dtype=torch.float64))


def row_norms(rows: torch.Tensor) -> list[float]:
    """Each row's norm, read back: computed in the rows' dtype, and again in float64 only where a square overflowed
    (a full float64 copy of the rows costs the server three times the norm). The overflow check reads the floats
    read back anyway instead of making two more passes (under a profiler, a sixth of the rule's time in asynchronous
    DSGD)."""
    lengths = torch.linalg.vector_norm(rows, dim=1).tolist()
    if all(map(math.isfinite, lengths)):
        return lengths
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).tolist()


def lower_median(values: Sequence[float]) -> float:
    """The lower of the two middle values of an even count, as torch.median takes it."""
    return sorted(values)[(len(values) - 1) // 2]


class MixingCounts:
    """Per neighbour: contributions seen, clipped, outlying and refused (the algorithm's state a runtime exports)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = defaultdict(int)
        self.clipped: dict[int, int] = defaultdict(int)
        self.outlying: dict[int, int] = defaultdict(int)
        self.refused: dict[int, int] = defaultdict(int)


class SelfCenteredClip:
    """A node's self-centered clipping: the radius (set or auto) and the counts per neighbour. `weight`: the weight
    one contribution has in the node's mix (the auto radius is AUTO_PULL / weight times the quartile)."""

    def __init__(self, spec: RobustSpec, weight: float):
        if not 0 < weight <= 1:
            raise ValueError(f"a contribution's weight in a mix is in (0, 1], not {weight}")
        self.weight = weight
        self.fixed_radius = None if spec.radius == "auto" else float(spec.radius)
        self.window = DistanceWindow()
        self.groups: dict[int, DistanceWindow] = {}  # the windows of the callers' groups (the module's text)
        self.counts = MixingCounts()
        # Per neighbour: its last contributions' verdicts as bits (1: outlying; the newest lowest) and how many they
        # are (at most EXCLUDED_WINDOW): a share read at every contribution is a bit count, not a sum over a deque.
        self.recent: dict[int, tuple[int, int]] = {}
        # The average ||d|| of the node's local steps, the norms of those not yet read into it, and their lr.
        self.steps_taken = 0
        self.direction_norm: float | None = None
        self.step_norms: list[torch.Tensor] = []
        self.lr = 0.0

    def excluded(self, peer: int) -> bool:
        """Whether `peer`'s recent contributions are persistently outlying (see EXCLUDED_SHARE)."""
        verdicts, count = self.recent.get(peer, (0, 0))
        return count >= EXCLUDED_SEEN and verdicts.bit_count() >= EXCLUDED_SHARE * count

    def stepped(self, direction: torch.Tensor, lr: float) -> None:
        """The node took a local step of `lr` along `direction`: the length of one step in STEP_SAMPLE scales the
        echo floor and what is reported as outlying (the module's text, "echoes"). Its norm is read back with the
        steps' since, at the next judgement (a GPU synchronises there, not at every step)."""
        self.steps_taken += 1
        if (self.steps_taken - 1) % STEP_SAMPLE:
            return
        if self.step_norms and lr != self.lr:
            self._read_steps()  # the steps before at their own lr
        self.step_norms.append(torch.linalg.vector_norm(direction))  # lr is applied when the average is read
        self.lr = lr
        if len(self.step_norms) == STEPS_UNREAD:
            self._read_steps()

    def _read_steps(self) -> None:
        norms = self.step_norms
        values = [float(norms[0])] if len(norms) == 1 else torch.stack(norms).tolist()  # most reads: one step's
        norms.clear()
        for value in values:  # an average: one step's length varies severalfold from the next
            average = self.direction_norm
            self.direction_norm = value if average is None else STEP_DECAY * average + (1 - STEP_DECAY) * value

    def step_length(self) -> float | None:
        """The average length of the node's local steps, lr ||d|| (None: it takes none, or none yet)."""
        if self.step_norms:
            self._read_steps()
        return None if self.direction_norm is None else self.lr * self.direction_norm

    def radius(self, own: torch.Tensor, origin: torch.Tensor, quartile: float | None = None) -> float:
        """tau: set, or the auto radius (`quartile`: the window's lower quartile when the caller has it)."""
        if self.fixed_radius is not None:
            return self.fixed_radius
        if len(self.window) < AUTO_WARM:
            warm, shortest, step = 2 * distance(own, origin), self.window.shortest(), self.step_length()
            if step is not None:  # a scale no neighbour can move: the drift grows as a liar pulls the node
                warm = min(warm, AUTO_PULL / self.weight * STEP_OUTLYING * step)
            return warm if shortest is None else min(warm, AUTO_PULL / self.weight * shortest)
        return AUTO_PULL / self.weight * (self.window.lower_quartile() if quartile is None else quartile)

    def scales(self, own: torch.Tensor, contributions: Mapping[int, torch.Tensor],
               origin: torch.Tensor) -> dict[int, float]:
        """Each neighbour's clipping factor min(1, tau / ||x_j - own||): its contribution clipped around `own` is
        own + factor (x_j - own), which a mix can apply as weights without building it. `origin` is what `own` was
        at the start of the job, on every node alike (the auto radius's warm-up). The contributions' distances
        enter the window first, so that one round's contributions are judged together."""
        if not contributions:
            return {}
        lengths = {}
        for peer, value in contributions.items():  # the callers mix one at a time (a mix of several measures them
            length = float(torch.dist(value, own))  # on its stacked differences: mix_clipped, clipped_shares)
            lengths[peer] = length if math.isfinite(length) else distance(value, own)
        return self.judge(own, lengths, origin)

    def judge(self, own: torch.Tensor, lengths: Mapping[int, float], origin: torch.Tensor,
              group: int | None = None) -> dict[int, float]:
        """`scales` from the contributions' distances ||x_j - own||, measured by the caller; `group`: theirs, if any
        (the module's text, "several scales")."""
        grouped = None if group is None else self.groups.setdefault(group, DistanceWindow())
        step = self.step_length()
        floor = ECHO_FLOOR * step if step is not None and len(self.window) >= AUTO_WARM else 0.0
        for peer, length in lengths.items():
            if length < floor:
                continue  # an echo's, or as close: it would pull the quartile down (judged and mixed all the same)
            self.window.add(peer, length)
            if grouped is not None:
                grouped.add(peer, length)
        quartile = self.window.lower_quartile() if len(self.window) >= AUTO_WARM else None
        scale = quartile  # what outlying is measured against: the group's where it has one (the module's text)
        if quartile is not None and grouped is not None:
            scale = min(grouped.lower_quartile(), GROUP_CAP * quartile) if len(grouped) >= GROUP_WARM else None
        radius = self.radius(own, origin, quartile)
        judged = scale is not None
        outlying_above = OUTLYING_FACTOR * scale if scale is not None else math.inf
        # What the node reports (the coordinator's suspicion) must also be far on a scale no neighbour can shrink.
        reported_above = outlying_above if step is None else max(outlying_above, STEP_OUTLYING * step)
        seen, clipped, outlying_counts = self.counts.seen, self.counts.clipped, self.counts.outlying
        recent = self.recent
        factors = {}
        for peer, length in lengths.items():
            if judged:  # before, no contribution is outlying, and none may count towards a peer's record
                verdicts, count = recent.get(peer, (0, 0))
                verdicts = (verdicts << 1 | (length > outlying_above)) & VERDICT_BITS
                recent[peer] = verdicts, min(count + 1, EXCLUDED_WINDOW)
            factor = 0.0 if self.excluded(peer) else 1.0 if length <= radius else radius / length
            factors[peer] = factor
            seen[peer] += 1
            if factor < 1.0:
                clipped[peer] += 1
            if length > reported_above:
                outlying_counts[peer] += 1
        return factors

    def clip_all(self, own: torch.Tensor, contributions: Mapping[int, torch.Tensor],
                 origin: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each neighbour's contribution clipped around `own`, own + factor (x_j - own) (a contribution within the
        radius is returned as it is, not copied)."""
        factors = self.scales(own, contributions, origin)
        return {peer: value if factors[peer] == 1.0 else torch.lerp(own, value, factors[peer])
                for peer, value in contributions.items()}

    def clip(self, own: torch.Tensor, peer: int, value: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
        return self.clip_all(own, {peer: value}, origin)[peer]


def clipped_shares(clipper: SelfCenteredClip, own: torch.Tensor, received: Mapping[int, tuple[torch.Tensor, float]],
                   origin: torch.Tensor, group: int | None = None) -> list[tuple[torch.Tensor, float]]:
    """What a push-sum round adds to the node's (x, weight): its shares (x, y), each with its estimate x / y clipped
    around `own`, the node's estimate (SGP's and DiLoCo over gossip's robust push-sum, derived in
    nodeagent.algorithms.sgp). A share clipped by the factor f is y (own + f (x / y - own)) = f (x - y own) + y own,
    so the round adds F (X - y own) + (sum y) own: one product over the stacked differences, which the distances are
    measured on too, where clipping each share and adding it read every share three more times. One share within
    the radius is added as it came (the plain rule's, bit for bit: the one-peer graphs' every round); several, as
    the sum of their differences plus (sum y) own. Shares of one weight (a regular graph's rounds) are measured
    without a tensor of their weights. A share of weight 0 carries nothing. `group`: the shares' (see
    SelfCenteredClip.judge), if any."""
    weighted = [(sender, *received[sender]) for sender in sorted(received) if received[sender][1] > 0]
    if not weighted:
        clipper.judge(own, {}, origin, group)
        return []
    if len(weighted) == 1:  # without a stack's copy or a weights tensor
        _, x, y = weighted[0]
        differences = torch.sub(x, own, alpha=y).unsqueeze(0)
    else:  # one read back for all of them (a GPU synchronises once)
        # The differences in the stack's own memory: a second allocation of a large model's size per round faulted
        # its pages in again whenever the heap had been trimmed (the cnn's 7 shares: 1.7 against 2.5 to 14.7 ms).
        differences = torch.stack([x for _, x, _ in weighted])
        ys = [y for _, _, y in weighted]
        if min(ys) == max(ys):  # every round of a regular graph's: no weights tensor
            differences.sub_(own, alpha=ys[0])
        else:
            differences.addr_(torch.tensor(ys, dtype=differences.dtype, device=differences.device), own, alpha=-1)
    norms = row_norms(differences)  # of x - y own, which over y is ||x / y - own||
    judged = clipper.judge(own, {sender: norm / y for (sender, _, y), norm in zip(weighted, norms, strict=True)},
                           origin, group)
    factors = [judged[sender] for sender, _, _ in weighted]
    weight = sum(y for _, _, y in weighted)
    if factors == [1.0]:
        return [(weighted[0][1], weight)]
    if all(factor == 1.0 for factor in factors):
        return [(differences.sum(dim=0).add_(own, alpha=weight), weight)]  # the shares' sum, to rounding
    summed = torch.tensor(factors, dtype=differences.dtype, device=differences.device) @ differences
    return [(summed.add_(own, alpha=weight), weight)]


@dataclass(frozen=True)
class MixingWeights:
    """A node's mixing weights in the form one mix over its stacked copies takes them (`mix_clipped`), built once
    per topology: a tensor built at every mix costs as much as the mix's arithmetic."""

    ranks: tuple[int, ...]
    vector: torch.Tensor  # the neighbours' weights in the order of `ranks`, on the model's device
    total: float  # the node's own weight and its neighbours'

    @staticmethod
    def of(neighbors: Sequence[tuple[int, float]], self_weight: float, like: torch.Tensor) -> MixingWeights:
        """From (rank, weight) pairs, with a vector of `like`'s dtype and device."""
        weights = [weight for _, weight in neighbors]
        return MixingWeights(tuple(rank for rank, _ in neighbors),
                             torch.tensor(weights, dtype=like.dtype, device=like.device), self_weight + sum(weights))


def mix_clipped(clipper: SelfCenteredClip, own: torch.Tensor, copies: Mapping[int, torch.Tensor],
                weights: MixingWeights, judged: Collection[int], origin: torch.Tensor) -> dict[int, torch.Tensor]:
    """Mixes the neighbours' `copies` into `own` in place with `weights`, those of `judged` clipped around `own`
    first (DSGD's robust mix): s x + sum_j w_j (x + f_j (x_j - x)) = (s + sum_j w_j) x + sum_j w_j f_j (x_j - x),
    one product over the stacked differences, which the distances are measured on too, where a mix of each copy
    reads every copy once more. The others (copies clipped before) count with f_j = 1. Returns the copies of
    `judged` that were clipped, each as it was mixed (own + f_j (x_j - own), own before the mix)."""
    ranks = weights.ranks
    differences = torch.stack([copies[rank] for rank in ranks]).sub_(own)
    lengths = row_norms(differences)  # one read back for all of them (a GPU synchronises once)
    factors = clipper.judge(own, {rank: length for rank, length in zip(ranks, lengths, strict=True) if rank in judged},
                            origin)
    clipped, coefficients = {}, weights.vector
    shrunk = [factors.get(rank, 1.0) for rank in ranks]
    if min(shrunk) < 1.0:  # under an attack only: the vector is built
        clipped = {rank: torch.add(own, differences[i], alpha=factor)
                   for i, (rank, factor) in enumerate(zip(ranks, shrunk, strict=True)) if factor < 1.0}
        coefficients = coefficients * torch.tensor(shrunk, dtype=own.dtype, device=own.device)
    own.addmv_(differences.T, coefficients, beta=weights.total)
    return clipped


def refuse_unsafe(counts: MixingCounts, peer: int, value: torch.Tensor) -> bool:
    """Whether `value` from `peer` must be refused (see `unsafe`); counted when it is."""
    if unsafe(value):
        counts.refused[peer] += 1
        return True
    return False


# -- the parameter server ------------------------------------------------------------------------------------------


def default_byzantine(n: int) -> int:
    return max(0, (n - 1) // 4)


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort of `n` values as compare-exchanges (i, j), i < j: the smaller value to i. Built
    for the next power of two, less the pairs that touch a position past n: those hold +inf, which no compare-exchange
    moves, so the network sorts any n finite values."""
    size = 1 << max(0, n - 1).bit_length()
    pairs = []
    span = 1
    while span < size:
        step = span
        while step >= 1:
            for start in range(step % span, size - step, 2 * step):
                for offset in range(min(step, size - start - step)):
                    low, high = start + offset, start + offset + step
                    if low // (2 * span) == high // (2 * span) and high < n:
                        pairs.append((low, high))
            step //= 2
        span *= 2
    return tuple(pairs)


def sorted_rows(updates: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `updates` (finite) sorted coordinate by coordinate: row k of the result holds each coordinate's k-th
    smallest value. A sorting network of elementwise minima and maxima over whole rows: torch's sort along dim 0
    sorts each column of n values separately, 6 times slower for 16 x 7,850 on a CPU (benchmarks/byzantine.py's
    all-reduce). Leaving out the compare-exchanges that only order values within the kept middle saved a tenth of
    that, and made the mean's order of summation differ from a sort's."""
    rows = list(updates.unbind(0))
    for low, high in sorting_network(len(rows)):
        rows[low], rows[high] = torch.minimum(rows[low], rows[high]), torch.maximum(rows[low], rows[high])
    return rows


def trimmed_mean(updates: torch.Tensor, f: int) -> torch.Tensor:
    n = updates.shape[0]
    if 2 * f >= n:
        raise ValueError(f"trimmed-mean cannot drop {f} of {n} values at each end")
    return torch.stack(sorted_rows(updates)[f : n - f]).mean(dim=0)


def coordinate_median(updates: torch.Tensor) -> torch.Tensor:
    n = updates.shape[0]
    ordered = sorted_rows(updates)
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def krum(updates: torch.Tensor, f: int) -> torch.Tensor:
    n = updates.shape[0]
    neighbours = max(1, n - f - 2)
    squared = torch.cdist(updates.double(), updates.double()).pow(2)
    scores = squared.sort(dim=1).values[:, 1 : neighbours + 1].sum(dim=1)  # column 0: the update itself
    return updates[int(scores.argmin())].clone()


def centered_clip(updates: torch.Tensor, center: torch.Tensor, radius: float | None,
                  differences: torch.Tensor) -> torch.Tensor:
    """The CenteredClip aggregate from `center`; `differences`, of the updates' shape, is where each iteration's
    U_i - v are taken (one allocation of the round's size, not one per iteration). The clipping factors, one per
    update, are computed in float64 from the norms read back and applied in the updates' dtype: a few
    tensor operations on a handful of scalars took longer than the arithmetic (docs/results.md)."""
    v = center.clone()
    for _ in range(CENTERED_CLIP_ITERATIONS):
        torch.sub(updates, v, out=differences)
        lengths = row_norms(differences)
        tau = lower_median(lengths) if radius is None else radius
        scale = torch.tensor([tau / length if length > tau else 1.0 for length in lengths], dtype=updates.dtype,
                             device=updates.device)
        v = v + (scale @ differences) / updates.shape[0]
    return v


def outliers(updates: torch.Tensor, aggregate: torch.Tensor, differences: torch.Tensor) -> list[bool]:
    """The updates farther from `aggregate` than OUTLIER_FACTOR times the median distance (`differences`: a buffer of
    the updates' shape)."""
    lengths = row_norms(torch.sub(updates, aggregate, out=differences))
    bound = OUTLIER_FACTOR * lower_median(lengths)
    return [length > bound for length in lengths]


class RobustAggregator:
    """A synchronous server's rule over one round's updates, with its state (CenteredClip's center) and counts."""

    def __init__(self, spec: RobustSpec, num_workers: int):
        self.rule = spec.rule
        self.radius = None if spec.radius == "auto" else float(spec.radius)
        self.assumed_byzantine = spec.byzantine  # None: a quarter of each round's contributions (default_byzantine)
        self.center: torch.Tensor | None = None
        self.clipped = [0] * num_workers

    def byzantine_of(self, n: int) -> int:
        """The liars assumed among a round's `n` contributions: the job's count, or its default for n; at most what
        the rule can drop from n (a collective's quorum may be smaller than the job the count was checked for)."""
        f = default_byzantine(n) if self.assumed_byzantine is None else self.assumed_byzantine
        if self.rule == "trimmed-mean":
            return min(f, (n - 1) // 2)
        if self.rule == "krum":
            return max(0, min(f, n - 3))
        return f

    def aggregate(self, updates: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        """The round's aggregate of `updates` (one row per contribution) and which rows count as clipped (`outliers`;
        also added to `clipped`)."""
        differences = torch.empty_like(updates)  # for every U_i - v of the round (centered_clip, outliers)
        if self.rule == "centered-clip":
            center = torch.zeros_like(updates[0]) if self.center is None else self.center
            result = centered_clip(updates, center, self.radius, differences)
            self.center = result.clone()
        elif self.rule == "trimmed-mean":
            result = trimmed_mean(updates, self.byzantine_of(updates.shape[0]))
        elif self.rule == "median":
            result = coordinate_median(updates)
        elif self.rule == "krum":
            result = krum(updates, self.byzantine_of(updates.shape[0]))
        else:
            raise ValueError(f"{self.rule} is not a rule of the parameter server")
        flags = outliers(updates, result, differences)
        for worker, flag in enumerate(flags):
            self.clipped[worker] += int(flag)
        return result, flags


def count_gathered(counts: MixingCounts, route: int, judged: MixingCounts, own: int, members: Sequence[int],
                   kept: Sequence[int]) -> None:
    """A collective's gathered rows seen, and those not `kept` (row indices) refused: counted in total under `route`
    (the all-reduce's edge) and under the member that sent each row (`judged`, by job rank: `members` holds one per
    row, in order; this node's own row aside), from which the coordinator's suspicion scores each member."""
    counts.seen[route] += len(members)
    counts.refused[route] += len(members) - len(kept)
    taken = set(kept)
    for row, member in enumerate(members):
        if member != own:
            judged.seen[member] += 1
            if row not in taken:
                judged.refused[member] += 1


def aggregate_counted(aggregator: RobustAggregator, rows: torch.Tensor, counts: MixingCounts, route: int,
                      judged: MixingCounts, own: int, members: Sequence[int]) -> torch.Tensor:
    """The rule's aggregate of a collective's `rows` (one contribution each of `members`, job ranks), counted in total
    under `route` and per member in `judged` (this node's own row aside): the rows outlying (`outliers`), counted as
    clipped and as outlying."""
    aggregate, outlying = aggregator.aggregate(rows)
    counts.clipped[route] += sum(outlying)
    counts.outlying[route] += sum(outlying)
    for member, was_outlying in zip(members, outlying, strict=True):
        if member != own:
            judged.clipped[member] += was_outlying
            judged.outlying[member] += was_outlying
    return aggregate


class NormClip:
    """An asynchronous server's centered-clip: each update's norm clipped (center 0) at the radius, set or auto: the
    median of the recent norms times NORM_CLIP_MULTIPLIER once AUTO_WARM are seen from at least half the workers, the
    smallest norm held before (so a liar among the first pushes is held to an honest one's length). The recent norms
    are each worker's last AUTO_WINDOW / workers (at least one): a worker that pushes more often than the others (an
    asynchronous server takes every push as it comes) replaces its own norms, not theirs, so it holds no more of the
    median than its share, however fast it pushes. A worker's pushes beyond its rate's bound are scaled down too
    (RATE_SLACK, the module's text)."""

    def __init__(self, spec: RobustSpec, num_workers: int):
        self.fixed_radius = None if spec.radius == "auto" else float(spec.radius)
        share = max(1, AUTO_WINDOW // num_workers)
        self.recent: list[deque[float]] = [deque(maxlen=share) for _ in range(num_workers)]
        self.seen = 0
        self.heard = 0  # workers with a norm held
        self.clipped = [0] * num_workers
        # Who made the recent pushes.
        self.pushers: deque[int] = deque(maxlen=max(RATE_WINDOW, RATE_WINDOW_PER_WORKER * num_workers))
        self.pushes = [0] * num_workers  # each worker's among them

    def clip(self, worker: int, update: torch.Tensor) -> tuple[torch.Tensor, bool]:
        norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
        recent = self.recent[worker]
        self.heard += not recent
        recent.append(norm)
        self.seen += 1
        if self.fixed_radius is not None:
            radius = self.fixed_radius
        elif self.seen < AUTO_WARM or 2 * self.heard < len(self.recent):
            # Until half the workers are heard: a fast liar alone at the start cannot warm it.
            radius = min(n for held in self.recent for n in held)
        else:
            radius = NORM_CLIP_MULTIPLIER * statistics.median(n for held in self.recent for n in held)
        scale, clipped = 1.0, norm > radius
        if clipped:
            self.clipped[worker] += 1
            scale = radius / norm
        scale *= self._rate_scale(worker)
        return (update, clipped) if scale == 1.0 else (update * scale, clipped)

    def _rate_scale(self, worker: int) -> float:
        """The factor a push of `worker` is scaled by for its rate (the module's text): allowed / its count among the
        recent pushes, where it has more than allowed: the median count of the others among them (at least 1) plus
        RATE_SLACK."""
        if len(self.pushers) == self.pushers.maxlen:
            self.pushes[self.pushers[0]] -= 1
        self.pushers.append(worker)
        self.pushes[worker] += 1
        count = self.pushes[worker]
        if count <= 1 + RATE_SLACK:  # within the least allowed: no median of the others needed
            return 1.0
        # The others that pushed lately: a lost worker's 0 would hold the workers left to 1 + RATE_SLACK pushes.
        others = [held for other, held in enumerate(self.pushes) if held and other != worker]
        allowed = max(1.0, statistics.median(others)) + RATE_SLACK if others else math.inf
        return 1.0 if count <= allowed else allowed / count
