"""Robust mixing and aggregation (nodeagent.robust), the attacks (nodeagent.byzantine) and `simulation.byzantine`:
each rule's mathematics on small tensors, each attack's effect, the job option's validation, and small simulated jobs
where a lying member ruins the plain rule and the robust rule holds."""

import itertools
import math
import random
import statistics

import pytest
import torch

from coordinator.control.states import JobState
from coordinator.jobs import validate_job
from coordinator.simulate import simulate
from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.base import ALLREDUCE_RANK, Neighbor, NodeContext, push_sum_share
from nodeagent.algorithms.dsgd import DSGD
from nodeagent.algorithms.sgp import SGP
from nodeagent.byzantine import forge, forge_tensor
from nodeagent.jobspec import AlgorithmSpec, JobSpecError, RobustSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.ps.messages import SERVER_NAME
from nodeagent.ps.rules import ASGDServer, SSGDServer
from nodeagent.robust import (
    AUTO_PULL,
    AUTO_WARM,
    AUTO_WINDOW,
    ECHO_FLOOR,
    EXCLUDED_SEEN,
    EXCLUDED_SHARE,
    EXCLUDED_WINDOW,
    GROUP_CAP,
    GROUP_WARM,
    NORM_CLIP_MULTIPLIER,
    OUTLYING_FACTOR,
    RATE_SLACK,
    RATE_WINDOW,
    STEP_DECAY,
    STEP_OUTLYING,
    STEP_SAMPLE,
    DistanceWindow,
    NormClip,
    RobustAggregator,
    SelfCenteredClip,
    centered_clip,
    clipped_shares,
    coordinate_median,
    krum,
    lower_median,
    sorted_rows,
    trimmed_mean,
    unsafe,
)
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.events import QUARANTINED, SUSPECTED, TOPOLOGY, read_events
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.unit


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- self-centered clipping -----------------------------------------------------------------------------------------



def test_the_auto_radius_quartile_is_statistics_lower_quartile_of_the_last_distances():
    """From one neighbour, or as many distances from each of several (the window's balanced), the window's quartile
    is statistics' lower quartile."""
    generator = random.Random(7)
    for _ in range(50):
        window, distances, peers = DistanceWindow(), [], generator.choice([1, 2, 4, 8])
        for sent in range(generator.randint(2, 3 * AUTO_WINDOW)):
            distance = generator.choice([generator.random(), generator.expovariate(0.01), 1.0])
            window.add(sent % peers, distance)
            distances.append(distance)
            if len(distances) >= 2 and len(window) % peers == 0:
                last = distances[-AUTO_WINDOW:]
                assert window.lower_quartile() == statistics.quantiles(last, n=4)[0], last
        assert len(window) == min(len(distances), AUTO_WINDOW)


def test_a_neighbour_that_sends_most_of_the_window_moves_its_quartile_no_more_than_another():
    """Pull gossip on a 4-node ring fetched its liar 7 times in its first 9 fetches by chance: the liar's distances,
    three quarters of the window, became its quartile, the radius let the liar's 1000s in, and the honest node,
    dragged 22,152 away, was excluded by its other neighbour and flagged (simulator, seed 2)."""
    window = DistanceWindow()
    for length in (88600.0, 88600.0, 0.5, 88600.0, 88600.0, 88600.0, 0.3, 88600.0, 88600.0):
        window.add(3 if length > 1 else 1, length)
    assert window.lower_quartile() < 1  # the honest neighbour's distances weigh half the window, as the liar's
    for length in (0.4, 0.2, 0.6):
        window.add(1, length)
    assert 0.2 < window.lower_quartile() < 0.5  # interpolated between the two that bracket the quarter point


def test_a_contribution_beyond_the_radius_is_clipped_around_the_own_state_and_counted():
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip", radius=1.0), weight=0.5)
    own = vec(1, 1)
    near, far = vec(1.5, 1), vec(4, 5)  # 0.5 and 5 away
    out = clip.clip_all(own, {2: near, 3: far}, origin=own)
    assert out[2] is near  # within the radius: mixed as sent
    assert torch.allclose(out[3], vec(1.6, 1.8))  # own + (3, 4) / 5
    assert math.isclose(float(torch.linalg.vector_norm(out[3] - own)), 1.0, rel_tol=1e-6)
    assert (clip.counts.seen[3], clip.counts.clipped[3], clip.counts.clipped[2]) == (1, 1, 0)


def test_the_auto_radius_starts_at_twice_the_drift_from_the_initial_model_then_follows_the_lower_quartile():
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin, own = vec(0, 0), vec(0.3, 0.4)  # drifted 0.5 from the shared start
    out = clip.clip_all(own, {1: own + vec(100, 0)}, origin)  # a first message from a liar is not taken whole
    assert math.isclose(float(torch.linalg.vector_norm(out[1] - own)), 1.0, rel_tol=1e-6)
    for _ in range(AUTO_WARM):
        clip.clip_all(own, {2: own + vec(0, 2)}, origin)  # honest distances of 2
    radius = clip.radius(own, origin)
    assert radius < 100 and math.isclose(radius, AUTO_PULL / 0.5 * 2.0)  # the liar's distance is not the quartile


def test_while_the_window_warms_the_radius_is_at_most_the_auto_radius_of_the_shortest_distance_seen():
    """Twice the drift from the shared start grows as a liar pulls the node away from it: a zeros liar on a 4-node
    ring, copies 2 steps stale, pulled its neighbours within reach of their honest distances for good before the
    window was warm (simulator: honest 52 to 60%, never flagged; 81 to 83% with the cap, as without an attack)."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin, own = vec(0, 0), vec(3, 4)  # drifted 5 from the start: twice that is 10
    factors = clip.scales(own, {1: own + vec(0, 0.5), 3: vec(0, 0)}, origin)
    assert clip.radius(own, origin) == AUTO_PULL / 0.5 * 0.5
    assert factors == {1: 1.0, 3: pytest.approx(0.5 / 5)}  # the liar would have passed whole at 10


def test_while_the_window_warms_the_radius_is_at_most_a_few_of_the_nodes_own_steps():
    """The drift from the start is what a liar's pull makes of it: each pull of a `constant` liar fetched before any
    honest neighbour doubled the drift, and with it the radius (4-node ring, pull gossip, simulator)."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin, own = vec(0, 0), vec(30, 40)  # dragged 50 from the start: twice that would be 100
    clip.stepped(vec(0, 1), lr=0.1)  # its own steps: 0.1 long
    clip.scales(own, {3: own + vec(0, 1000)}, origin)
    assert clip.radius(own, origin) == pytest.approx(AUTO_PULL / 0.5 * STEP_OUTLYING * 0.1)


def test_the_auto_radius_bounds_a_contributions_pull_whatever_its_weight_in_the_mix():
    """w tau, how far one contribution of weight w moves the node, is AUTO_PULL times the quartile at every weight."""
    pulls = []
    for weight in (0.5, 0.2, 0.125):
        clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=weight)
        origin = own = vec(0, 0)
        for _ in range(AUTO_WARM):
            clip.clip_all(own, {1: vec(0, 1)}, origin)  # honest distances of 1
        pulls.append(weight * clip.radius(own, origin))
    assert all(math.isclose(pull, AUTO_PULL) for pull in pulls), pulls


def test_a_round_whose_honest_distances_are_longer_is_judged_by_its_own_quartile_capped_by_the_whole_windows():
    """A push-sum's first rounds compare nodes farther apart than its last: judged by one window, their honest senders
    are outlying and excluded; judged by their round's (the group's) quartile, they are not, and are clipped at the
    window's radius. A liar alone in its round cannot widen its radius, and beyond GROUP_CAP times the window's
    quartile (twice that) it is outlying and excluded all the same."""
    origin = own = vec(0, 0)
    grouped = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    pooled = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    for _ in range(AUTO_WARM):
        for group, length in ((0, 3.0), (1, 1.0), (2, 1.0), (3, 1.0)):  # rounds 1 to 3 at 1, round 0 at 3
            grouped.judge(own, {group: length}, origin, group=group)
            pooled.judge(own, {group: length}, origin)
    assert grouped.judge(own, {0: 3.0}, origin, group=0) == {0: pytest.approx(1 / 3)}  # the window's radius, 1
    assert pooled.judge(own, {0: 3.0}, origin) == {0: 0.0}  # outlying every time: the honest sender is excluded
    assert grouped.counts.outlying[0] == 0 and pooled.excluded(0)
    # A liar alone in its round, just beyond the cap: its own quartile would let it pass, the cap does not.
    far = OUTLYING_FACTOR * GROUP_CAP * 1.0 + 1.0
    for _ in range(GROUP_WARM - 1):
        grouped.judge(own, {9: far}, origin, group=4)  # clipped, not yet judged
    assert grouped.counts.clipped[9] == GROUP_WARM - 1 and grouped.counts.outlying[9] == 0
    assert grouped.judge(own, {9: far}, origin, group=4) == {9: pytest.approx(1 / far)}  # the window's radius
    assert grouped.counts.outlying[9] == 1
    for _ in range(EXCLUDED_SEEN):
        grouped.judge(own, {9: far}, origin, group=4)
    assert grouped.excluded(9)


def test_a_push_sum_share_is_the_senders_mass_over_its_out_peers_and_itself():
    static = NodeContext(rank=0, world_size=16, neighbors=tuple(Neighbor(rank) for rank in (1, 2, 4, 8, 12, 14, 15)),
                         spec=AlgorithmSpec(name="sgp"))
    assert push_sum_share(static) == 1 / 8
    one_peer = NodeContext(rank=0, world_size=16, neighbors=static.neighbors, spec=AlgorithmSpec(name="sgp"),
                           peer_schedule=((1,), (2,), (4,), (8,)))
    assert push_sum_share(one_peer) == 1 / 2


def test_a_liar_sending_half_the_contributions_does_not_set_the_auto_radius_and_is_outlying():
    """A ring node with one lying neighbour of two: half its window is the liar's distances."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin = own = vec(0, 0)
    for _ in range(2 * AUTO_WARM):
        clip.clip_all(own, {1: vec(0, 1), 3: vec(1000, 1000)}, origin)
    assert math.isclose(clip.radius(own, origin), AUTO_PULL / 0.5 * 1.0)
    assert clip.counts.outlying[1] == 0
    # Counted once the window is warm: from the AUTO_WARM-th distance on (two a round).
    assert clip.counts.outlying[3] == 2 * AUTO_WARM - AUTO_WARM // 2 + 1


def test_a_neighbour_persistently_outlying_is_excluded_until_it_is_mixed_within_the_radius_again():
    """Exclusion: a neighbour with EXCLUDED_SHARE of its last contributions outlying (at least EXCLUDED_SEEN judged,
    at most EXCLUDED_WINDOW) is clipped to radius 0 (the node's own state in its place); honest again, it is mixed
    again once its share falls."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin = own = vec(0, 0)
    for _ in range(AUTO_WARM):
        clip.clip_all(own, {1: vec(0, 1), 2: vec(1, 0)}, origin)  # warm: honest distances of 1
    factors = [clip.scales(own, {1: vec(0, 1), 3: vec(-50, 0)}, origin)[3] for _ in range(EXCLUDED_WINDOW)]
    assert all(0 < factor < 1 for factor in factors[: EXCLUDED_SEEN - 1])  # clipped, still mixed
    assert factors[EXCLUDED_SEEN - 1 :] == [0.0] * (EXCLUDED_WINDOW - EXCLUDED_SEEN + 1)
    assert torch.equal(clip.clip_all(own, {3: vec(-50, 0)}, origin)[3], own)
    assert clip.counts.outlying[3] == EXCLUDED_WINDOW + 1  # still judged and counted
    honest = [clip.scales(own, {3: vec(0.5, 0)}, origin)[3] for _ in range(EXCLUDED_WINDOW)]
    still = EXCLUDED_WINDOW - math.ceil(EXCLUDED_SHARE * EXCLUDED_WINDOW)  # honest ones before the share falls
    assert honest[:still] == [0.0] * still and honest[still] > 0
    assert honest[-1] > 0  # mixed again (within the radius, or clipped to it)
    assert not clip.excluded(1) and clip.scales(own, {1: vec(0, 1)}, origin)[1] > 0  # never excluded


def test_the_nodes_step_length_is_an_average_of_lr_times_the_norm_of_one_direction_in_step_sample():
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    assert clip.step_length() is None  # no local step taken: no step scale
    clip.stepped(vec(3, 4), lr=0.1)
    assert clip.step_length() == pytest.approx(0.5)
    for _ in range(STEP_SAMPLE - 1):
        clip.stepped(vec(0, 100), lr=0.1)  # not noted
    assert clip.step_length() == pytest.approx(0.5)
    clip.stepped(vec(0, 10), lr=0.1)
    assert clip.step_length() == pytest.approx(STEP_DECAY * 0.5 + (1 - STEP_DECAY) * 1.0)


def test_once_the_window_is_warm_a_distance_far_below_the_nodes_own_step_enters_no_window():
    """An echoing neighbour (its distance about 0) would pull the lower quartile, and the radius and what counts as
    outlying with it, towards 0; before the window is warm every honest distance is as small, and kept."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin = own = vec(0, 0)
    clip.stepped(vec(0, 1), lr=1.0)  # an average step of 1
    for _ in range(AUTO_WARM):
        clip.scales(own, {1: vec(0, 0.01)}, origin)  # the first steps: honest and close alike
    assert len(clip.window) == AUTO_WARM
    for _ in range(AUTO_WINDOW):
        factors = clip.scales(own, {1: vec(0, 1.2), 3: vec(0, ECHO_FLOOR / 2)}, origin)
    assert len(clip.window) == AUTO_WINDOW and clip.window.lower_quartile() == pytest.approx(1.2)  # no echo in it
    assert factors == {1: 1.0, 3: 1.0} and clip.counts.seen[3] == AUTO_WINDOW  # judged and mixed all the same


def test_a_neighbour_is_reported_outlying_only_beyond_step_outlying_of_the_nodes_own_steps_but_excluded_as_before():
    """The quartile is the node's own defence; a report accuses a member, so it also needs a distance that no
    neighbour can make look long by shrinking the quartile (a 4-node ring with an echoing liar quarantined the honest
    rank opposite it, 98% of its contributions outlying)."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin = own = vec(0, 0)
    clip.stepped(vec(0, 1), lr=1.0)
    for _ in range(EXCLUDED_WINDOW):
        clip.scales(own, {3: vec(0, 0.6), 1: vec(0, 0.6 * OUTLYING_FACTOR * 2)}, origin)  # 2.4 < 3 steps
    assert clip.excluded(1) and clip.counts.outlying[1] == 0
    for _ in range(EXCLUDED_WINDOW):
        clip.scales(own, {3: vec(0, 0.6), 2: vec(0, 1.1 * STEP_OUTLYING)}, origin)
    assert clip.excluded(2) and clip.counts.outlying[2] == EXCLUDED_WINDOW


def test_a_neighbour_lying_from_its_first_contribution_is_excluded_at_its_excluded_seen_th_judged_one():
    """Contributions seen while the window warms are not judged and do not count towards exclusion (counted as not
    outlying, they let a zeros liar on a 4-node ring pull its neighbours for 8 more steps, long enough to stay
    within their inflated distances for good: honest 0.32 to 0.45 in the simulator, 0.76 to 0.83 without them)."""
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip"), weight=0.5)
    origin, own = vec(0, 0), vec(0.3, 0.4)  # the warm-up radius: 1
    excluded_from = AUTO_WARM // 2 - 1 + EXCLUDED_SEEN - 1  # two distances a call; the one that warms is judged
    factors = [clip.scales(own, {1: own + vec(0, 1), 3: vec(1000, 1000)}, origin)[3] for _ in range(excluded_from + 2)]
    assert all(factor > 0 for factor in factors[:excluded_from])
    assert factors[excluded_from:] == [0.0, 0.0]


def test_contributions_that_could_overflow_are_unsafe():
    assert not unsafe(vec(1e10, -3.0))
    assert unsafe(vec(3e38, 0.0))  # finite, but its square is not: the next forward pass would overflow
    assert unsafe(vec(float("nan"), 0.0))
    assert unsafe(vec(0.0, float("-inf")))


# -- the parameter server's rules ------------------------------------------------------------------------------------


def honest_and_liar() -> torch.Tensor:
    return torch.stack([vec(1, 2), vec(1.2, 1.8), vec(0.8, 2.2), vec(1.0, 2.0), vec(1e6, -1e6)])


def test_trimmed_mean_and_median_ignore_one_outlier_coordinate_by_coordinate():
    updates = honest_and_liar()
    assert torch.allclose(trimmed_mean(updates, 1), vec(1.0667, 1.9333), atol=1e-3)  # drops 0.8, 1e6; -1e6, 2.2
    assert torch.allclose(coordinate_median(updates), vec(1.0, 2.0))
    assert torch.allclose(coordinate_median(updates[:4]), vec(1.0, 2.0))  # even count: mean of the middle two
    with pytest.raises(ValueError, match="cannot drop"):
        trimmed_mean(updates, 3)


def test_the_sorting_network_sorts_every_binary_input_of_up_to_13_rows_and_ties_and_signs_as_torch_sort():
    # The 0-1 principle: a comparator network that sorts every 0/1 input sorts every input.
    for n in range(1, 14):
        inputs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n))).t()
        assert torch.equal(torch.stack(sorted_rows(inputs)), inputs.sort(dim=0).values), n
    updates = torch.tensor([[3.0, -0.5, 2.0], [-1e30, -0.5, 2.0], [7.0, 4.0, -2.0], [3.0, 1e30, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(torch.stack(sorted_rows(updates)), updates.sort(dim=0).values)


def test_krum_picks_the_update_closest_to_its_neighbours():
    assert torch.equal(krum(honest_and_liar(), 1), vec(1.0, 2.0))


def test_the_servers_median_distance_is_the_lower_middle_one_as_torch_takes_it():
    # The auto radius of centered-clip and the outliers' bound: one value of the round's, never a mean of two.
    generator = torch.Generator().manual_seed(0)
    for count in (1, 2, 3, 4, 15, 16):
        values = torch.rand(count, generator=generator, dtype=torch.float64)
        assert lower_median(values.tolist()) == float(values.median())


def test_centered_clip_moves_from_its_center_by_at_most_the_radius_per_update():
    updates = honest_and_liar()
    aggregate = centered_clip(updates, torch.zeros(2), radius=None, differences=torch.empty_like(updates))
    assert torch.linalg.vector_norm(aggregate - vec(1, 2)) < 0.5  # the honest mean, give or take the liar's pull


def test_centered_clip_counts_only_the_outlier_as_clipped():
    # At its auto radius centered-clip clips half the updates in every iteration; the honest ones are not counted.
    generator = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(11, 10, generator=generator)
    updates = torch.cat([honest, torch.full((1, 10), -50.0)])
    aggregator = RobustAggregator(RobustSpec(rule="centered-clip"), num_workers=12)
    for _ in range(3):
        aggregate, flags = aggregator.aggregate(updates)
        assert flags == [False] * 11 + [True]
    assert aggregator.clipped == [0] * 11 + [3]
    assert torch.linalg.vector_norm(aggregate - honest.mean(dim=0)) < 0.5


def test_a_synchronous_server_applies_the_robust_aggregate_and_flags_the_outlier():
    server = SSGDServer(vec(0, 0), num_workers=5, lr=1.0, robust=RobustSpec(rule="median"))
    for worker, update in enumerate(honest_and_liar()):
        result = server.push(worker, update, 0)
    assert result.applied and result.flagged == (4,)
    assert torch.allclose(server.w, vec(-1, -2))
    state = server.state_dict()
    assert "updates" in state  # the round's updates are the server's state, persisted with it


def test_an_asynchronous_server_clips_a_long_update_to_the_recent_norms():
    server = ASGDServer(vec(0, 0), num_workers=2, lr=1.0, robust=RobustSpec(rule="centered-clip"))
    for _ in range(AUTO_WARM):
        server.push(0, vec(1, 0), server.version)
    result = server.push(1, vec(0, -1e6), server.version)
    assert result.flagged == (1,)
    assert float(server.w[1]) == pytest.approx(NORM_CLIP_MULTIPLIER)  # clipped to that times the median norm, 1


def test_a_worker_that_pushes_thirty_times_as_often_holds_no_more_of_the_norm_clips_median_than_its_share():
    clip = NormClip(RobustSpec(rule="centered-clip"), num_workers=16)
    liar_pushes = liar_clipped = 0
    for round_ in range(20):  # every honest worker pushes once a round, the liar 30 times: 2 in 3 of all pushes
        for worker in range(15):
            _update, clipped = clip.clip(worker, vec(1.0 + worker / 100, 0))
            assert not clipped or round_ == 0  # the first round warms the radius up at the shortest norm held
        for _ in range(30):
            update, clipped = clip.clip(15, vec(0, 1e3))
            liar_pushes += 1
            liar_clipped += clipped
            assert float(torch.linalg.vector_norm(update)) <= NORM_CLIP_MULTIPLIER * 1.15
    assert liar_clipped == liar_pushes == clip.clipped[15] == 600


def test_a_worker_that_pushes_thirty_times_as_often_moves_the_server_no_more_than_one_honest_worker():
    """Each of a fast liar's pushes was clipped to 3 honest norms, but it pushed 30 times for each honest push: per
    round its clipped pushes added up to 103 against the 15 honest workers' 16, and an asynchronous server applies
    every one. A worker's pushes beyond the others' median count (and a push's slack) in the recent window are scaled
    down, so its pull over time is about one honest worker's longest clipped pushes, however fast it pushes: at 3
    times the median count a liar stepping 30 times as often as 3 honest workers held as much pull as all of them."""
    server = ASGDServer(torch.zeros(2), 16, lr=1.0, robust=RobustSpec(rule="centered-clip"))
    honest_round = sum(1.0 + worker / 100 for worker in range(15))
    positions = []
    for _ in range(40):  # every honest worker pushes once a round (descending along x), the liar 30 times (along -x)
        for worker in range(15):
            server.push(worker, vec(1.0 + worker / 100, 0), server.version)
        for _ in range(30):
            server.push(15, vec(-1e3, 0), server.version)
        positions.append(float(server.w[0]))
    liar_pull = positions[-1] - positions[19] + 20 * honest_round  # rounds 21 to 40; w = -(honest) + liar, lr 1
    # The longest clipped pushes of one honest worker, and of the slack: 1 + RATE_SLACK a round.
    assert liar_pull <= 20 * (1 + RATE_SLACK) * NORM_CLIP_MULTIPLIER * 1.15
    assert positions[-1] < positions[19] < 0  # the honest workers' direction wins, and keeps winning


def test_a_worker_twice_as_fast_as_the_others_moves_the_server_about_as_much_as_one_and_equal_ones_are_not_scaled():
    """An honest worker on faster hardware is slowed to the median rate's pull, not suspected (the scaling is a
    bound, not a judgement); workers that push as often as each other are not scaled (once the radius is warm)."""
    clip = NormClip(RobustSpec(rule="centered-clip"), num_workers=16)
    for round_ in range(20):
        for worker in range(16):
            update = vec(1.0 + worker / 100, 0)
            assert clip.clip(worker, update)[0] is update or round_ == 0
    clip = NormClip(RobustSpec(rule="centered-clip"), num_workers=16)
    pulls = [0.0] * 16
    for round_ in range(40):
        for worker in range(16):
            for _ in range(2 if worker == 0 else 1):
                scaled, clipped = clip.clip(worker, vec(1.0, 0))
                if round_ >= 20:
                    assert not clipped
                    pulls[worker] += float(torch.linalg.vector_norm(scaled))
    honest = statistics.median(pulls[1:])  # 20 pushes of norm 1 each: never scaled
    assert honest == 20 and honest < pulls[0] <= 1.5 * honest, pulls  # the slack's push of 4 in the window


def test_a_worker_whose_fellows_are_lost_is_not_held_to_their_rate_once_they_leave_the_window():
    """The others' counts of 0 once made the median 0: a worker left alone was held to a few pushes' pull in every
    window for the rest of the job."""
    clip = NormClip(RobustSpec(rule="centered-clip"), num_workers=4)
    for _ in range(100):
        for worker in range(4):
            clip.clip(worker, vec(1.0, 0))
    alone = [float(torch.linalg.vector_norm(clip.clip(0, vec(1.0, 0))[0])) for _ in range(2 * RATE_WINDOW)]
    assert alone[-RATE_WINDOW // 2:] == [1.0] * (RATE_WINDOW // 2)


def test_norm_clip_during_warm_up_holds_a_long_update_to_the_shortest_seen():
    clip = NormClip(RobustSpec(rule="centered-clip"), num_workers=2)
    clip.clip(0, vec(3, 4))
    update, clipped = clip.clip(1, vec(0, 1e6))
    assert clipped and math.isclose(float(torch.linalg.vector_norm(update)), 5.0, rel_tol=1e-6)


def test_the_aggregator_counts_per_member():
    aggregator = RobustAggregator(RobustSpec(rule="trimmed-mean"), num_workers=5)
    aggregator.aggregate(honest_and_liar())
    aggregator.aggregate(honest_and_liar())
    assert aggregator.clipped == [0, 0, 0, 0, 2]


# -- the attacks ------------------------------------------------------------------------------------------------------


def test_each_attack_forges_what_it_says():
    own = vec(1, -2)
    honest = [vec(0, 0), vec(2, 2)]  # mean (1, 1), std (1, 1)
    receiver = vec(4, 4)
    assert torch.equal(forge_tensor("sign-flip", own, honest, receiver), vec(-1, 2))
    assert torch.equal(forge_tensor("scale", own, honest, receiver), vec(1e6, -2e6))
    assert torch.equal(forge_tensor("constant", own, honest, receiver), vec(1000, 1000))
    assert torch.equal(forge_tensor("zeros", own, honest, receiver), vec(0, 0))
    assert torch.equal(forge_tensor("alie", own, honest, receiver, strength=1.5), vec(-0.5, -0.5))
    assert torch.allclose(forge_tensor("ipm", own, honest, receiver), vec(-0.1, -0.1))
    assert torch.equal(forge_tensor("dissensus", own, honest, receiver), vec(7, 7))  # r - (mean - r)
    noise = forge_tensor("random", torch.zeros(10_000), honest, None, generator=torch.Generator().manual_seed(0))
    assert 0.95 < float(noise.std()) < 1.05
    with pytest.raises(ValueError, match="unknown attack"):
        forge_tensor("nice", own, honest, receiver)


def test_forge_leaves_tensors_that_are_not_floating_alone():
    codes = torch.tensor([1, 2, 3], dtype=torch.int8)
    forged = forge("sign-flip", {"codes": codes, "scale": vec(2)}, [])
    assert forged["codes"] is codes and torch.equal(forged["scale"], vec(-2))


# -- the job option ---------------------------------------------------------------------------------------------------


def job(fashion_mnist_dir, algorithm: dict, nodes: int = 8, steps: int = 120, byzantine: list | None = None,
        topology: str = "multiplex-ring", interval: int = 1, pace_s: float = 0.0, latency_s: float | None = None):
    network = {} if latency_s is None else {"network": {"latency_s": latency_s}}
    return parse_job_spec({
        "name": "robust", "nodes": nodes, "steps": steps, "eval_every": steps, "seed": 0, "min_step_s": pace_s,
        "algorithm": {"lr": 0.05, "interval": interval, **algorithm},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "train_limit": 8000,
                 "test_limit": 1000},
        "topology": {"kind": topology},
        "simulation": {"byzantine": byzantine or [], **network},
    })


@pytest.mark.parametrize(("algorithm", "message"), [
    ({"name": "allreduce", "robust": {"rule": "self-centered-clip"}}, "algorithm.robust.rule: allreduce takes "
     "centered-clip or trimmed-mean or median or krum, not self-centered-clip"),
    ({"name": "allreduce", "robust": {"rule": "krum", "byzantine": 6}}, "algorithm.robust.byzantine: krum needs"),
    ({"name": "allreduce", "robust": {"rule": "median", "quarantine": {}}}, "algorithm.robust.quarantine: allreduce "
     "aggregates every member's rows in each round: the coordinator flags"),
    ({"name": "diloco", "options": {"inner_steps": 10}, "robust": {"rule": "centered-clip"}}, "algorithm.robust.rule: "
     "diloco takes trimmed-mean or median or krum, not centered-clip: centered-clip's center is state"),
    ({"name": "asgd", "robust": {"rule": "trimmed-mean"}}, "algorithm.robust.rule: asgd takes centered-clip, not "
     "trimmed-mean: its server applies each update on arrival"),
    ({"name": "dsgd", "robust": {"rule": "median"}}, "algorithm.robust.rule: dsgd takes self-centered-clip, not "
     "median"),
    ({"name": "ssgd", "robust": {"rule": "self-centered-clip"}}, "algorithm.robust.rule: ssgd takes centered-clip or "
     "trimmed-mean or median or krum"),
    ({"name": "ssgd", "robust": {"rule": "trimmed-mean", "byzantine": 4}}, "algorithm.robust.byzantine: trimmed-mean "
     "cannot drop 4 of 8"),
    ({"name": "dsgd", "robust": {"rule": "self-centered-clip", "radius": -1.0}}, "radius"),
    ({"name": "pdmm-isvr", "robust": {"rule": "self-centered-clip"}}, "algorithm.robust: pdmm-isvr takes no robust "
     "rule: only duals travel"),
])
def test_a_robust_rule_an_algorithm_cannot_apply_is_refused_at_validation_with_the_reason(fashion_mnist_dir, algorithm,
                                                                                          message):
    with pytest.raises(JobSpecError, match=message.replace("(", r"\(")):
        validate_job(job(fashion_mnist_dir, algorithm))


@pytest.mark.parametrize(("algorithm", "message"), [
    ({"name": "dsgd"}, "simulation.byzantine: pushes is a parameter-server liar's; dsgd has no server"),
    ({"name": "ssgd"}, "simulation.byzantine: pushes needs an asynchronous server; ssgd's takes one update per "
     "worker and round"),
])
def test_a_liar_that_pushes_many_times_a_step_is_refused_where_no_asynchronous_server_takes_its_pushes(
        fashion_mnist_dir, algorithm, message):
    liar = [{"ranks": [3], "attack": "sign-flip", "pushes": 30}]
    with pytest.raises(JobSpecError, match=message):
        validate_job(job(fashion_mnist_dir, algorithm, byzantine=liar))
    validate_job(job(fashion_mnist_dir, {"name": "asgd"}, byzantine=liar))


@pytest.mark.parametrize("name", ["dsgd", "gossip", "ad-psgd", "sgp", "osgp"])
def test_the_peer_algorithms_take_self_centered_clipping(fashion_mnist_dir, name):
    validate_job(job(fashion_mnist_dir, {"name": name, "robust": {"rule": "self-centered-clip", "radius": 2}},
                     topology="ring"))


@pytest.mark.parametrize("algorithm", [{"name": "dsgd"}, {"name": "dsgd", "mode": "sync"}, {"name": "gossip"},
                                       {"name": "ad-psgd"}, {"name": "sgp"}, {"name": "osgp"}])
def test_every_algorithm_that_steps_between_its_mixes_gives_its_clipper_the_step_scale(fashion_mnist_dir, algorithm):
    """The echo floor and the report's step scale exist only where the algorithm notes its local steps."""
    spec = job(fashion_mnist_dir, {**algorithm, "robust": {"rule": "self-centered-clip"}}, nodes=4, steps=6,
               topology="ring")
    for sim in simulate(spec).mesh.nodes:
        step = sim.node.algorithm.clipper.step_length()
        assert step is not None and step > 0, (algorithm, sim.rank)


def test_byzantine_ranks_are_validated(fashion_mnist_dir):
    with pytest.raises(JobSpecError, match=r"simulation\.byzantine: rank 8 is not in 0\.\.7"):
        job(fashion_mnist_dir, {"name": "dsgd"}, byzantine=[{"ranks": [8], "attack": "zeros"}])
    with pytest.raises(JobSpecError, match="rank 2 is named twice"):
        job(fashion_mnist_dir, {"name": "dsgd"}, byzantine=[{"ranks": [2], "attack": "zeros"},
                                                           {"ranks": [2], "attack": "scale"}])


# -- small simulated jobs ---------------------------------------------------------------------------------------------


def honest_accuracies(spec, liars=(3,), metrics: Metrics | None = None) -> list[float]:
    result = simulate(spec, metrics=metrics)
    return [p.test_accuracy for p in result.progress if p.rank not in liars]


def test_one_liar_ruins_plain_dsgd_and_self_centered_clipping_holds(fashion_mnist_dir):
    liar = [{"ranks": [3], "attack": "scale"}]
    baseline = honest_accuracies(job(fashion_mnist_dir, {"name": "dsgd"}))
    plain = honest_accuracies(job(fashion_mnist_dir, {"name": "dsgd"}, byzantine=liar))
    metrics = Metrics()
    robust = honest_accuracies(job(fashion_mnist_dir, {"name": "dsgd", "robust": {"rule": "self-centered-clip"}},
                                   byzantine=liar), metrics=metrics)
    assert min(plain) < 0.4 < min(baseline)
    assert min(robust) > min(baseline) - 0.05
    assert sum(robust) / len(robust) > sum(baseline) / len(baseline) - 0.03


def test_a_zeros_liar_with_stale_copies_is_excluded_before_it_shrinks_its_ring_neighbours(fashion_mnist_dir):
    """Asynchronous DSGD on a 4-node ring whose copies arrive 2 steps late (0.1 s at 0.05 s a step): the liar's
    zeros pull its neighbours towards the origin, within reach of their honest distances unless it is excluded early
    (while the window warms, the radius followed the node's drift, which the pull itself made: honest 56 to 67%,
    models' norms 0.26 against 2.06 without an attack)."""
    def ring(byzantine=None):
        return job(fashion_mnist_dir, {"name": "dsgd", "robust": {"rule": "self-centered-clip"}}, nodes=4, steps=300,
                   byzantine=byzantine, topology="ring", interval=2, pace_s=0.05, latency_s=0.1)
    baseline = honest_accuracies(ring())
    result = simulate(ring([{"ranks": [3], "attack": "zeros"}]))
    robust = [p.test_accuracy for p in result.progress if p.rank != 3]
    assert min(robust) > min(baseline) - 0.03
    assert all(sim.node.algorithm.clipper.excluded(3) for sim in result.mesh.nodes if sim.rank in (0, 2))


@pytest.mark.parametrize(("nodes", "liars"), [(4, [3]), (16, [3, 8, 12])])
def test_echoing_liars_get_no_honest_member_flagged_or_quarantined(fashion_mnist_dir, tmp_path, nodes, liars):
    """A liar that sends each neighbour its own state back (`dissensus` at strength 0) shrank the lower quartile of
    the nodes it shares with an honest member: a 4-node ring quarantined the honest rank opposite it (99% of its
    contributions outlying); 16 nodes on the multiplex ring, where some honest nodes have two echoing neighbours of
    four, flagged honest ranks 5 and 9."""
    robust = {"rule": "self-centered-clip", "quarantine": {}}
    spec = job(fashion_mnist_dir, {"name": "dsgd", "mode": "sync", "robust": robust}, nodes=nodes,
               steps=400 if nodes == 4 else 200, topology="ring" if nodes == 4 else "multiplex-ring", pace_s=0.05,
               byzantine=[{"ranks": liars, "attack": "dissensus", "strength": 0}])
    result = simulate(spec, run_dir=tmp_path)
    assert result.job.state == JobState.FINISHED
    log, _ = read_events(tmp_path)
    assert not [e.message for e in log if e.kind in (SUSPECTED, QUARANTINED)]
    assert min(p.test_accuracy for p in result.progress if p.rank not in liars) > 0.7


def test_an_echoing_liar_heard_less_than_its_share_does_not_set_the_quartile():
    """An echo's distances, about 0, weigh in the window's quartile no more than their count: boosted to a full
    neighbour's share (a quarter of the window among 4 in-neighbours), they set the quartile and the radius near 0,
    every honest share was clipped, and DiLoCo over gossip on 16 nodes with one echoing liar got an honest node
    flagged (benchmarks/byzantine.py --attacks echo: worst honest 64.65%, 84.15% since)."""
    window, honest = DistanceWindow(), iter([0.9 + 0.2 * (k % 7) / 6 for k in range(52)])
    for turn in range(AUTO_WINDOW):  # the echo is heard 12 times, the three honest neighbours 52
        peer = 0 if turn % 16 < 3 else 1 + turn % 3
        window.add(peer, 0.001 * (1 + turn % 5) if peer == 0 else next(honest))
    assert 0.9 <= window.lower_quartile() <= 1.1  # an honest distance, as the plain quartile of the window is


def test_an_echoing_liar_gets_no_honest_member_of_diloco_over_gossip_flagged(fashion_mnist_dir, tmp_path):
    spec = parse_job_spec({
        "name": "robust", "nodes": 16, "steps": 600, "eval_every": 600, "seed": 0,
        "algorithm": {"name": "diloco-gossip", "lr": 0.001, "robust": {"rule": "self-centered-clip"},
                      "options": {"inner_steps": 20}},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "class-window", "batch_size": 32, "test_limit": 500},
        "topology": {"kind": "npeer-exponential", "seed": 1},
        "simulation": {"step_time_s": 0.05, "byzantine": [{"ranks": [5], "attack": "dissensus", "strength": 0}]},
    })
    result = simulate(spec, run_dir=tmp_path)
    log, _ = read_events(tmp_path)
    assert not [e.message for e in log if e.kind == SUSPECTED and not e.message.startswith("rank 5 ")]
    assert min(p.test_accuracy for p in result.progress if p.rank != 5) > 0.8


def test_a_liar_fetched_most_while_the_window_warms_gets_no_honest_neighbour_flagged(fashion_mnist_dir, tmp_path):
    """Pull gossip on a 4-node ring: honest rank 2 fetched the `constant` liar 7 times in its first 9 fetches. It was
    dragged 22,152 away before it excluded the liar, and flagged (55%), with the liar."""
    spec = parse_job_spec({
        "name": "robust", "nodes": 4, "steps": 800, "eval_every": 800, "seed": 2, "min_step_s": 0.05,
        "algorithm": {"name": "gossip", "lr": 0.05, "interval": 2, "robust": {"rule": "self-centered-clip"},
                      "options": {"interpolation": "constant", "factor": 0.5}},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "test_limit": 1000},
        "topology": {"kind": "ring", "seed": 1},
        "simulation": {"step_time_s": 0.05, "jitter": 0.3, "seed": 2,
                       "byzantine": [{"ranks": [3], "attack": "constant"}]},
    })
    result = simulate(spec, run_dir=tmp_path)
    log, _ = read_events(tmp_path)
    assert [e.message.split(":")[0] for e in log if e.kind == SUSPECTED] == ["rank 3 (node rank3)"]
    assert min(p.test_accuracy for p in result.progress if p.rank != 3) > 0.75


def test_one_liar_ruins_plain_push_sum_and_clipped_shares_hold(fashion_mnist_dir):
    liar = [{"ranks": [3], "attack": "scale"}]
    baseline = honest_accuracies(job(fashion_mnist_dir, {"name": "sgp"}, topology="exponential"))
    plain = honest_accuracies(job(fashion_mnist_dir, {"name": "sgp"}, byzantine=liar, topology="exponential"))
    robust = honest_accuracies(job(fashion_mnist_dir, {"name": "sgp", "robust": {"rule": "self-centered-clip"}},
                                   byzantine=liar, topology="exponential"))
    assert min(plain) < 0.4 < min(baseline)
    # The liar's scaled shares are clipped: every honest node trains on, where without the rule the worst is near
    # chance.
    assert min(robust) > 0.7
    assert sum(robust) / len(robust) > sum(baseline) / len(baseline) - 0.04


def test_a_clipped_push_sum_share_is_its_weight_times_the_clipped_model():
    spec = AlgorithmSpec(name="sgp", lr=0.05, robust=RobustSpec(rule="self-centered-clip", radius=1.0))
    context = NodeContext(rank=0, world_size=3, neighbors=(), spec=spec)
    node = SGP(torch.nn.Linear(3, 1, bias=False), context)
    own = node.x / node.weight
    far, near = own + torch.tensor([6.0, 0.0, 8.0]), own + torch.tensor([0.3, 0.0, 0.4])  # 10 and 0.5 away
    ((x_sum, weight_sum),) = node._clipped({3: (far, 0.0), 2: (near * 0.5, 0.5), 1: (far * 0.25, 0.25)})
    clipped = 0.25 * (own + torch.tensor([0.6, 0.0, 0.8]))  # clipped to radius 1
    assert torch.allclose(x_sum, clipped + near * 0.5)  # within the radius: the share as it came; weight 0: nothing
    assert weight_sum == 0.75
    assert node.mixing.clipped == {1: 1} and node.mixing.seen == {1: 1, 2: 1}


def test_push_sum_shares_of_equal_weight_are_clipped_and_summed_as_shares_of_different_weights():
    """A regular graph's rounds bring shares of one weight, measured without a weights tensor: the same result."""
    spec = AlgorithmSpec(name="sgp", lr=0.05, robust=RobustSpec(rule="self-centered-clip", radius=1.0))
    node = SGP(torch.nn.Linear(3, 1, bias=False), NodeContext(rank=0, world_size=3, neighbors=(), spec=spec))
    own = node.x / node.weight
    far, near = own + torch.tensor([6.0, 0.0, 8.0]), own + torch.tensor([0.3, 0.0, 0.4])  # 10 and 0.5 away
    ((x_sum, weight_sum),) = node._clipped({1: (far * 0.25, 0.25), 2: (near * 0.25, 0.25)})
    assert torch.allclose(x_sum, 0.25 * (own + torch.tensor([0.6, 0.0, 0.8])) + near * 0.25) and weight_sum == 0.5
    ((x_sum, weight_sum),) = node._clipped({1: (near * 0.25, 0.25), 2: ((own - 0.2) * 0.25, 0.25)})
    assert torch.allclose(x_sum, near * 0.25 + (own - 0.2) * 0.25) and weight_sum == 0.5
    assert node.mixing.clipped == {1: 1} and node.mixing.seen == {1: 2, 2: 2}


def test_push_sum_shares_within_the_radius_are_absorbed_as_they_came():
    spec = AlgorithmSpec(name="sgp", lr=0.05, robust=RobustSpec(rule="self-centered-clip", radius=1.0))
    node = SGP(torch.nn.Linear(64, 1, bias=False), NodeContext(rank=0, world_size=3, neighbors=(), spec=spec))
    own = node.x / node.weight
    shares = {1: ((own + 0.05) * 0.3, 0.3), 2: ((own - 0.1) * 0.25, 0.25)}
    assert node._clipped({1: shares[1]}) == [shares[1]]  # one share within the radius: the plain rule's, bit for bit
    ((x_sum, weight_sum),) = node._clipped(shares)
    assert torch.allclose(x_sum, shares[1][0] + shares[2][0]) and weight_sum == 0.55
    assert node.mixing.clipped == {} and node.mixing.seen == {1: 2, 2: 1}


def test_a_push_sum_round_is_clipped_and_summed_on_the_shares_device(device):
    """A round of shares of several weights (one clipped) and one of equal weights (none clipped), where the model
    lives: on a GPU the differences, their norms and the sum stay there."""
    own = torch.tensor([1.0, 2.0, 3.0], device=device)
    far, near = own + torch.tensor([6.0, 0.0, 8.0], device=device), own + torch.tensor([0.3, 0.0, 0.4], device=device)
    clip = SelfCenteredClip(RobustSpec(rule="self-centered-clip", radius=1.0), 0.25)
    ((x_sum, weight_sum),) = clipped_shares(clip, own, {1: (far * 0.25, 0.25), 2: (near * 0.5, 0.5)}, own)
    clipped = 0.25 * (own + torch.tensor([0.6, 0.0, 0.8], device=device))  # far, clipped to radius 1
    assert x_sum.device == own.device and weight_sum == 0.75
    assert torch.allclose(x_sum, clipped + near * 0.5)
    ((x_sum, weight_sum),) = clipped_shares(clip, own, {1: (near * 0.25, 0.25), 2: ((own - 0.2) * 0.25, 0.25)}, own)
    assert x_sum.device == own.device and weight_sum == 0.5
    assert torch.allclose(x_sum, near * 0.25 + (own - 0.2) * 0.25)
    assert clip.counts.clipped == {1: 1}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_dsgd_mix_with_every_copy_within_the_radius_is_the_plain_mix(mode):
    """No attack, no clipping: the robust mix (one product over the stacked differences) mixes what the plain one
    does, to rounding."""
    def node(robust: RobustSpec | None) -> DSGD:
        torch.manual_seed(0)
        spec = AlgorithmSpec(name="dsgd", lr=0.05, mode=mode, robust=robust)
        context = NodeContext(rank=0, world_size=4, spec=spec, self_weight=0.4,
                              neighbors=(Neighbor(1, weight=0.3), Neighbor(2, weight=0.2), Neighbor(3, weight=0.1)))
        return DSGD(torch.nn.Linear(16, 2), context)

    plain, robust = node(None), node(RobustSpec(rule="self-centered-clip", radius=100.0))
    copies = {rank: plain.w.detach() + 0.1 * torch.randn_like(plain.w) for rank in (1, 2, 3)}
    for each in (plain, robust):
        each.unjudged |= set(copies)
        with torch.no_grad():
            each._mix(dict(copies))
    assert torch.allclose(robust.w, plain.w, rtol=0, atol=1e-6) and not torch.equal(plain.w, copies[1])
    assert robust.mixing.seen == {1: 1, 2: 1, 3: 1} and robust.mixing.clipped == {}


def test_asynchronous_dsgd_judges_a_copy_at_its_first_mix_around_the_state_it_is_mixed_into():
    spec = AlgorithmSpec(name="dsgd", lr=0.05, robust=RobustSpec(rule="self-centered-clip", radius=1.0))
    context = NodeContext(rank=0, world_size=3, neighbors=(Neighbor(1, weight=0.25), Neighbor(2, weight=0.25)),
                          spec=spec, self_weight=0.5)
    node = DSGD(torch.nn.Linear(3, 1, bias=False), context)

    def send(sender: int, offset: list[float]) -> None:
        tensors = {"weight": (node.w + torch.tensor(offset)).reshape(1, 3)}
        node.receive(Message(Kind.PARAMS, sender, 0, tensors, clock=1))

    send(1, [30.0, 0.0, 40.0])  # replaced before any mix: never judged
    send(1, [6.0, 0.0, 8.0])  # 10 away
    assert node.mixing.seen == {}  # nothing judged on arrival
    node.w.add_(torch.tensor([0.0, 1.0, 0.0]))  # the node moved before the mix (its own step)
    before = node.w.clone()
    node._mix(node.last_copy)
    far = before + (torch.tensor([6.0, -1.0, 8.0]) / math.sqrt(101))  # clipped to radius 1 around the mixed-into w
    initial = before - torch.tensor([0.0, 1.0, 0.0])  # neighbour 2's copy until its first message
    assert torch.allclose(node.w, 0.5 * before + 0.25 * far + 0.25 * initial)
    assert node.mixing.seen == {1: 1}
    assert node.robust_judged(1) == 1 and node.robust_clipped(1) == 1
    node._mix(node.last_copy)  # the clipped copy is mixed as it is from now on, not judged again
    assert node.robust_judged(1) == 1


@pytest.mark.parametrize("name", ["dsgd", "sgp"])
def test_a_node_that_joins_starts_from_its_neighbours_median_under_a_robust_rule_and_refuses_an_overflowing_model(
        name):
    """Joining (or rejoining) mixes the neighbours' models too: their mean let one liar of three place the new node
    anywhere (here a million times away); the median does not. A model that could overflow is refused and counted,
    rule or no rule."""
    honest = [vec(1.0, 2.0, 3.0), vec(1.2, 2.2, 2.8)]

    def joined(robust: RobustSpec | None, liar: torch.Tensor) -> DSGD | SGP:
        spec = AlgorithmSpec(name=name, lr=0.05, robust=robust)
        context = NodeContext(rank=0, world_size=4, neighbors=tuple(Neighbor(rank, weight=0.25) for rank in (1, 2, 3)),
                              spec=spec, self_weight=0.25)
        node = (DSGD if name == "dsgd" else SGP)(torch.nn.Linear(3, 1, bias=False), context)
        states = {rank: Message(Kind.PARAMS, rank, 0, {"weight": model.reshape(1, 3)}, clock=5)
                  for rank, model in zip((1, 2, 3), [*honest, liar], strict=True)}
        node.join(states, at_step=5)
        return node

    scaled = honest[0] * 1e6
    plain = joined(None, scaled)
    assert float(plain.w.abs().max()) > 1e5  # the mean
    robust = joined(RobustSpec(rule="self-centered-clip"), scaled)
    assert torch.allclose(robust.w, vec(1.2, 2.2, 3.0))  # each coordinate's middle value
    for rule in (None, RobustSpec(rule="self-centered-clip")):
        node = joined(rule, vec(3e38, 0.0, 0.0))
        assert node.mixing.refused == {3: 1}
        assert torch.allclose(node.w, (honest[0] + honest[1]) / 2)  # the two left: mean and median alike


def test_a_synchronous_dsgd_node_that_rejoins_refuses_an_overflowing_model_and_mixes_its_own_in_its_place():
    spec = AlgorithmSpec(name="dsgd", mode="sync", lr=0.05, robust=RobustSpec(rule="self-centered-clip"))
    context = NodeContext(rank=0, world_size=4, neighbors=tuple(Neighbor(rank, weight=0.25) for rank in (1, 2, 3)),
                          spec=spec, self_weight=0.25)
    node = DSGD(torch.nn.Linear(3, 1, bias=False), context)
    models = {1: vec(1.0, 2.0, 3.0), 2: vec(1.2, 2.2, 2.8), 3: vec(3e38, 0.0, 0.0)}
    node.rejoin({rank: Message(Kind.PARAMS, rank, 0, {"weight": model.reshape(1, 3)}, clock=7)
                 for rank, model in models.items()})
    assert node.clock == 7 and node.mixing.refused == {3: 1}
    assert torch.allclose(node.w, vec(1.1, 2.1, 2.9))
    assert torch.equal(node.round_copies[7][3], node.w)  # the round completes without the refused model


def test_a_finite_message_that_would_overflow_is_refused_and_the_honest_models_stay_finite(fashion_mnist_dir):
    # Every parameter at 3e38: finite, so it passes the wire's check, but any forward pass through it overflows.
    liar = [{"ranks": [3], "attack": "constant", "strength": 3e38}]
    accuracies = honest_accuracies(job(fashion_mnist_dir, {"name": "dsgd"}, steps=40, byzantine=liar))
    assert all(a > 0.35 for a in accuracies)  # a NaN model is at chance, 0.1 (0.6 with no liar, 40 steps)


def test_a_liar_through_the_parameter_server_is_trimmed_and_counted(fashion_mnist_dir):
    liar = [{"ranks": [3], "attack": "scale"}]
    metrics = Metrics()
    spec = job(fashion_mnist_dir, {"name": "ssgd", "robust": {"rule": "trimmed-mean"}}, steps=60, byzantine=liar)
    accuracies = honest_accuracies(spec, metrics=metrics)
    assert min(accuracies) > 0.6
    flagged = metrics.registry.get_sample_value("peertrain_robust_clipped_total",
                                                {"job_id": "robust", "src": "rank3", "dst": SERVER_NAME})
    assert flagged == 60  # the liar, in every round


def test_a_liar_that_pushes_thirty_times_a_step_to_an_asynchronous_server_spends_the_jobs_steps_and_is_suspected(
        fashion_mnist_dir, tmp_path):
    """A sign-flipping worker that pushes 30 times for each honest push, each copy claiming a step of its own (the
    server applies one push per step of a worker): it spends the job's 120 steps in its first 4, its pushes scaled
    down by the rate bound, and costs the honest workers about what a liar pushing once a step costs them. Its pushes
    past the job's last step, which no honest worker sends, are flagged, and the coordinator suspects it. (While its
    rate was bounded at 3 times the median and every push applied, it held as much pull as the 3 honest workers
    together: 26 to 29%.)"""
    robust = {"name": "asgd", "robust": {"rule": "centered-clip"}}

    def honest_with_liar(pushes: int, run_dir=None) -> list[float]:
        liar = [{"ranks": [3], "attack": "sign-flip", "pushes": pushes}]
        result = simulate(job(fashion_mnist_dir, robust, nodes=4, byzantine=liar), run_dir=run_dir)
        return [p.test_accuracy for p in result.progress if p.rank != 3]

    once, fast = honest_with_liar(1), honest_with_liar(30, tmp_path)
    assert min(fast) > min(once) - 0.1
    assert min(once) > 0.6
    log, _ = read_events(tmp_path)
    assert [e.message.split(":")[0] for e in log if e.kind == SUSPECTED] == ["rank 3 (node rank3)"]


DILOCO = {"name": "diloco", "options": {"inner_steps": 10}}  # 6 syncs in 60 steps


@pytest.mark.parametrize(("algorithm", "rule", "rounds"), [
    ({"name": "allreduce"}, "trimmed-mean", 60),
    ({"name": "allreduce"}, "median", 60),
    ({"name": "allreduce"}, "centered-clip", 60),
    (DILOCO, "median", 6),
])
def test_a_liar_in_an_all_reduce_job_is_outvoted_over_the_all_gather_and_the_replicas_stay_identical(
        fashion_mnist_dir, algorithm, rule, rounds):
    liar = [{"ranks": [3], "attack": "ipm", "strength": 20.0}]  # -20 times the honest mean: the mean ascends
    plain = simulate(job(fashion_mnist_dir, algorithm, steps=60, byzantine=liar))
    robust = simulate(job(fashion_mnist_dir, {**algorithm, "robust": {"rule": rule}}, steps=60, byzantine=liar))
    assert max(p.test_accuracy for p in plain.progress) < 0.4
    assert min(p.test_accuracy for p in robust.progress) > 0.6
    # Every member applied the same aggregate: one model, the liar's own replica included.
    models = [sim.node.algorithm.w for sim in robust.mesh.nodes]
    assert all(torch.equal(model, models[0]) for model in models)
    # The liar's row is outlying in every round (an honest row now and then too), alike on every member.
    outlying = [sim.node.algorithm.robust_outlying(ALLREDUCE_RANK) for sim in robust.mesh.nodes]
    assert len(set(outlying)) == 1 and rounds <= outlying[0] < rounds + 10
    # Each member reports, on its all-reduce edge, every other member's rows by rank (its own aside): the liar's
    # outlying in every round, which the coordinator's suspicion scores per member.
    for progress in robust.progress:
        (edge,) = [edge for edge in progress.edges if edge.peer == ALLREDUCE_NAME]
        judged = {judgement.rank: judgement for judgement in edge.judged}
        assert sorted(judged) == [rank for rank in range(8) if rank != progress.rank]
        assert all(judgement.seen == rounds for judgement in judged.values())
        if progress.rank != 3:
            assert judged[3].outlying == rounds
            assert sum(judgement.outlying for rank, judgement in judged.items() if rank != 3) < 10


def test_int8_diloco_refuses_a_liars_codes_that_do_not_decode_on_every_member_alike(fashion_mnist_dir):
    # -20 times the honest mean makes the liar's int8 scales negative: its rows cannot be decoded.
    liar = [{"ranks": [3], "attack": "ipm", "strength": 20.0}]
    algorithm = {"name": "diloco", "options": {"inner_steps": 10, "precision": "int8"},
                 "robust": {"rule": "trimmed-mean"}}
    robust = simulate(job(fashion_mnist_dir, algorithm, steps=60, byzantine=liar))
    assert min(p.test_accuracy for p in robust.progress) > 0.6
    models = [sim.node.algorithm.w for sim in robust.mesh.nodes]
    assert all(torch.equal(model, models[0]) for model in models)
    refused = [sim.node.algorithm.mixing.refused[ALLREDUCE_RANK] for sim in robust.mesh.nodes]
    assert refused == [6] * 8  # the liar's row of each of the 6 syncs, on every member
    # ... counted under the liar by every other member.
    assert [dict(sim.node.algorithm.judged.refused) for sim in robust.mesh.nodes if sim.rank != 3] == [{3: 6}] * 7


@pytest.mark.parametrize("algorithm", [{"name": "allreduce"}, DILOCO,
                                       {**DILOCO, "options": {"inner_steps": 10, "precision": "int8"}}])
def test_a_plain_all_reduce_job_applies_no_round_that_a_liar_made_overflow_or_undecodable(fashion_mnist_dir,
                                                                                         algorithm):
    # Finite values that overflow once summed (full precision), or negative int8 scales that cannot be decoded.
    attack = {"name": "ipm", "strength": 20.0} if "precision" in algorithm.get("options", {}) else \
        {"name": "constant", "strength": 3e38}
    liar = [{"ranks": [3], "attack": attack["name"], "strength": attack["strength"]}]
    result = simulate(job(fashion_mnist_dir, algorithm, steps=60, byzantine=liar))
    models = [sim.node.algorithm.w for sim in result.mesh.nodes]
    assert all(torch.isfinite(model).all() for model in models)
    assert all(torch.equal(model, models[0]) for model in models)
    assert min(sim.node.algorithm.mixing.refused[ALLREDUCE_RANK] for sim in result.mesh.nodes) > 0


def test_the_centered_clip_center_of_an_all_reduce_job_travels_in_the_group_state():
    def member(rank: int) -> AllReduceSGD:
        torch.manual_seed(0)
        spec = AlgorithmSpec(name="allreduce", lr=0.1, robust=RobustSpec(rule="centered-clip"))
        return AllReduceSGD(torch.nn.Linear(3, 2), NodeContext(rank=rank, world_size=4, neighbors=(), spec=spec))

    restarted, live = member(0), member(1)
    # Before the first round the center is the rule's zeros: every member's state has the same tensors, which the
    # quorum's broadcast relies on.
    assert set(restarted.group_state().tensors) == set(live.group_state().tensors) == {"w", "robust_center"}
    live.aggregator.center = torch.full_like(live.w, 0.5)
    restarted.receive(live.group_state())
    assert torch.equal(restarted.aggregator.center, live.aggregator.center)


def test_without_max_update_norm_a_1e30_gradient_is_bounded_by_the_default(fashion_mnist_dir):
    liar = [{"ranks": [3], "attack": "scale", "strength": 1e30}]
    metrics = Metrics()
    accuracies = honest_accuracies(job(fashion_mnist_dir, {"name": "asgd"}, steps=60, byzantine=liar),
                                   metrics=metrics)
    assert all(math.isfinite(a) and a > 0.2 for a in accuracies)  # damaged but bounded, never NaN
    assert metrics.registry.get_sample_value("peertrain_ps_updates_clipped_total", {"job_id": "robust"}) >= 50


# -- detection and quarantine in the simulator (the coordinator's rules in virtual time) ------------------------------


@pytest.mark.parametrize(("algorithm", "quarantined"), [
    ({"name": "dsgd", "robust": {"rule": "self-centered-clip"}}, "its edges are dropped from step"),
    # Synchronous: the quarantined member, left without neighbours, steps on alone (its rounds once raised KeyError).
    ({"name": "dsgd", "mode": "sync", "robust": {"rule": "self-centered-clip"}}, "its edges are dropped from step"),
    ({"name": "ssgd", "robust": {"rule": "trimmed-mean"}}, "its pushes are ignored"),
    ({"name": "allreduce", "robust": {"rule": "median"}}, None),  # flagged from the gathered rows; not quarantined
])
def test_a_simulated_liar_is_flagged_by_the_coordinator_and_quarantined_where_the_job_asks(
        fashion_mnist_dir, tmp_path, algorithm, quarantined):
    robust = {**algorithm["robust"], "window_s": 2}
    if quarantined is not None:
        robust["quarantine"] = {"fraction": 0.8, "after_s": 1}
    liar = [{"ranks": [3], "attack": "constant"}]
    # Paced at 20 steps/s (virtual): a live topology change switches some seconds of steps ahead (SWITCH_LEAD_S).
    result = simulate(job(fashion_mnist_dir, {**algorithm, "robust": robust}, steps=300, byzantine=liar,
                          topology="ring", pace_s=0.05), run_dir=tmp_path)
    assert result.job.state == JobState.FINISHED
    log, _ = read_events(tmp_path)
    suspected = [e.message for e in log if e.kind == SUSPECTED]
    assert suspected and all(message.startswith("rank 3 (node rank3): ") for message in suspected), suspected
    done = [e.message for e in log if e.kind == QUARANTINED]
    if quarantined is None:
        assert not done
    else:
        assert len(done) == 1 and done[0].startswith("rank 3 (node rank3) quarantined: ") and quarantined in done[0]
    if algorithm["name"] == "dsgd":  # carried out: the live topology change reached every node
        assert any(e.kind == TOPOLOGY and "edge-list (version 2)" in e.message for e in log)
        assert all(3 not in sim.node.algorithm.context.neighbor_ranks for sim in result.mesh.nodes if sim.rank != 3)
    if algorithm["name"] == "ssgd":
        assert result.mesh.server is not None and result.mesh.server.half.quarantined == {3}
    assert min(p.test_accuracy for p in result.progress if p.rank != 3) > 0.7
