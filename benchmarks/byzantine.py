"""Byzantine members against the robust rules (docs/results.md, issue 28), in the simulator.

16 nodes (peer-to-peer: DSGD and pairwise gossip on the multiplex ring, SGP on the static exponential graph, DiLoCo
over gossip on the one-peer exponential graph; parameter server: ASGD, ESync and DiLoCo through the server with 16
workers; all-reduce SGD and DiLoCo over the all-reduce, whose robust rules all-gather every member's contribution),
Fashion-MNIST with the logistic model (`--model`), the class-window and iid splits. Each algorithm runs with 0, 1
and 3 lying members (ranks 5; 2, 7 and 12: no honest node of the multiplex ring has two lying neighbours) under each
attack of `simulation.byzantine` (nodeagent.byzantine), with the plain rule and with the robust one: self-centered
clipping for the peer-to-peer algorithms, centered-clip for ASGD (each update's norm) and ESync, trimmed mean for
DiLoCo through the server and both all-reduce algorithms. PDMM-ISVR refuses a robust rule (nodeagent.algorithms.ecl
says why). Reported per row: the honest members' mean and worst final test accuracy, node steps per second of wall
time (the cost of the rule; the simulator's own overhead included), and, with the robust rule, the members the
coordinator's suspicion flagged (its rules run in the simulator's virtual time: a `suspected` event): liars caught
of those there were, and honest members flagged by mistake. A local step takes 0.05 virtual seconds (`--step-time`),
so that a run of 120 steps lasts several of the coordinator's reviews (one each virtual second).

Targets: with 1 liar of 16 every robust row within 2 points of the algorithm's no-attack row (the plain rule, no
liar), with 3 within 5 points; with no attack the robust rule costs at most 1 point and 10% of steps/s.

The default is a subset that finishes in about 4 minutes on an idle 2-core machine (237 s at 2b135ef): the
class-window split, the attacks sign-flip and alie, 120 steps (600 for ASGD and the three DiLoCo routes: 6 syncs of
H = 20 are too few for DiLoCo's nodes to judge a peer, and 16 asynchronous workers' accuracy at 120 steps moves by
points with the order of their pushes), and the plain rule under attack only with 1 liar (it shows what the attack
does). Steps per second count the run only, not the building of the nodes (which reads and splits the data).
`--full` runs everything (both splits, all 8 attacks and the echo, the plain rule with 3 liars too). The echo is
`dissensus` at strength 0: each neighbour's own state sent back. It is near every honest distance, where the 8
attacks at their default strengths are not, and its rows regressed unseen for three sessions while only those ran
(docs/results.md, "An echo heard less often").

    nice -n 10 .venv/bin/python benchmarks/byzantine.py                  # the default subset
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --full
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --only dsgd,asgd --attacks ipm --steps 300
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --cost 3    # only the no-attack pairs, alternated 3 times
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --only dsgd --attacks echo   # echoing liars
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --cost 3 --model cnn --only dsgd,gossip,sgp
    nice -n 10 .venv/bin/python benchmarks/byzantine.py --only asgd --liar-pushes 30   # liars that push fast

On a shared machine one run's steps/s moves with the other work, by up to 10% from one run to the next: `--cost N`
runs each algorithm's no-attack pair (plain, robust) N times, which of the two runs first alternating, each over at
least COST_MIN_STEPS steps (at 120, ESync's 30 rounds took 0.3 s of wall time, too short to time). The steps/s cost,
the figure for the 10% target, is the median over the pairs of each pair's cost (two adjacent runs share the
machine's state; the best rate of each rule, shown, can come from different moments), with its range.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from coordinator.simulate import simulate
from nodeagent.byzantine import ATTACKS
from nodeagent.jobspec import DEFAULT_DATA_DIR, parse_job_spec
from nodeagent.runtime.events import SUSPECTED, read_events

NODES = 16
LIARS = {0: [], 1: [5], 3: [2, 7, 12]}
TARGET_GAP = {1: 2.0, 3: 5.0}  # points below the no-attack row
TARGET_COST_POINTS = 1.0
TARGET_COST_RATE = 0.10
DEFAULT_ATTACKS = ("sign-flip", "alie")
LIES = {"echo": ("dissensus", 0.0)}  # further attacks, by name: an attack of nodeagent.byzantine at a strength
COST_MIN_STEPS = 480  # local steps of a --cost run, at least
ASYNCHRONOUS_SERVERS = ("asgd",)  # whose liars push --liar-pushes times a step


@dataclass(frozen=True)
class Algorithm:
    label: str
    name: str
    topology: str
    robust: str
    algorithm: dict  # the rest of the job's algorithm section
    steps_factor: float = 1.0  # of --steps (a round of DiLoCo is many local steps)
    # The fewest local steps a row is judged at: DiLoCo's 120 steps are 6 syncs, too few for its nodes to judge a
    # peer; 16 asynchronous workers' accuracy at 120 steps moves by points with the order of their pushes.
    min_steps: int = 0


ALGORITHMS = (
    Algorithm("DSGD", "dsgd", "multiplex-ring", "self-centered-clip", {"lr": 0.05, "interval": 1}),
    Algorithm("gossip", "gossip", "multiplex-ring", "self-centered-clip", {"lr": 0.05}),
    Algorithm("SGP", "sgp", "exponential", "self-centered-clip", {"lr": 0.05}),
    Algorithm("DiLoCo gossip", "diloco-gossip", "npeer-exponential", "self-centered-clip",
              {"lr": 0.001, "options": {"inner_steps": 20}}, min_steps=600),
    Algorithm("ASGD", "asgd", "ring", "centered-clip", {"lr": 0.05}, min_steps=600),
    Algorithm("ESync", "esync", "ring", "centered-clip", {"lr": 0.05}, steps_factor=0.25),
    Algorithm("DiLoCo PS", "diloco-ps", "ring", "trimmed-mean", {"lr": 0.001, "options": {"inner_steps": 20}},
              min_steps=600),
    Algorithm("all-reduce", "allreduce", "ring", "trimmed-mean", {"lr": 0.05}),
    Algorithm("DiLoCo AR", "diloco", "ring", "trimmed-mean", {"lr": 0.001, "options": {"inner_steps": 20}},
              min_steps=600),
)


@dataclass(frozen=True)
class Row:
    algorithm: str
    split: str
    attack: str  # "none" with no liar
    liars: int
    robust: bool
    mean: float  # honest members' final test accuracy, percent
    worst: float
    steps_per_s: float  # node steps per wall second
    caught: int  # liars the coordinator flagged
    wrongly_flagged: int  # honest members it flagged


def flagged_ranks(run_dir: Path) -> set[int]:
    """The members a run's coordinator flagged (its `suspected` events), at any time."""
    flagged = set()
    for event in read_events(run_dir)[0]:
        match = re.match(r"rank (\d+) \(node [^)]*\): .*: suspected$", event.message)
        if event.kind == SUSPECTED and match:
            flagged.add(int(match.group(1)))
    return flagged


def run(algorithm: Algorithm, split: str, attack: str, liars: int, robust: bool, args: argparse.Namespace) -> Row:
    wanted = max(args.steps, COST_MIN_STEPS) if args.cost else args.steps
    steps = max(20, algorithm.min_steps, int(wanted * algorithm.steps_factor) // 20 * 20)  # a multiple of H
    forged, strength = LIES.get(attack, (attack, args.strength))
    pushes = args.liar_pushes if algorithm.name in ASYNCHRONOUS_SERVERS else 1
    section = {"name": algorithm.name, **algorithm.algorithm}
    if robust:
        section["robust"] = {"rule": algorithm.robust}
    ranks = LIARS[liars]
    spec = parse_job_spec({
        "name": "byzantine", "nodes": NODES, "steps": steps, "eval_every": steps, "seed": 0,
        "algorithm": section,
        "model": {"name": args.model},
        "data": {"data_dir": args.data_dir, "split": split, "batch_size": 32, "test_limit": args.test_limit},
        "topology": {"kind": algorithm.topology, "seed": 1},
        "simulation": {"byzantine": [{"ranks": ranks, "attack": forged, "strength": strength, "pushes": pushes}]
                       if ranks else [],
                       "step_time_s": args.step_time},
    })
    run_started: list[float] = []  # when the nodes start (building them reads and splits the data: not counted)

    def first_event(_mesh: object) -> None:
        if not run_started:
            run_started.append(time.monotonic())

    with tempfile.TemporaryDirectory(prefix="byzantine-") as run_dir:
        result = simulate(spec, run_dir=Path(run_dir), on_progress=first_event)
        wall = time.monotonic() - run_started[0]
        flagged = flagged_ranks(Path(run_dir))
    honest = [100 * p.test_accuracy for p in result.progress if p.rank not in ranks]
    row = Row(algorithm.label, split, attack if ranks else "none", liars, robust, sum(honest) / len(honest),
              min(honest), NODES * steps / wall, len(flagged & set(ranks)), len(flagged - set(ranks)))
    print(f"  {row.algorithm:<14} {split:<13} {row.attack:<10} {liars}  {'robust' if robust else 'plain ':<6}  "
          f"mean {row.mean:6.2f}  worst {row.worst:6.2f}  {row.steps_per_s:7.0f} steps/s  flagged "
          f"{row.caught}/{liars} (+{row.wrongly_flagged} honest)", flush=True)
    return row


def table(rows: list[Row], pair_costs: dict[tuple[str, str], list[float]]) -> list[str]:
    """The markdown table, each robust row under attack compared with its algorithm's no-attack row (plain rule), and
    each robust row without attack with the plain one (its steps/s cost: the median of `pair_costs`, by algorithm and
    split, where --cost measured them)."""
    baseline = {(r.algorithm, r.split): r for r in rows if r.liars == 0 and not r.robust}
    lines = ["| algorithm | split | attack | liars | rule | honest mean | honest worst | steps/s | flagged "
             "| vs no attack | target |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    misses = []
    for r in rows:
        base = baseline.get((r.algorithm, r.split))
        gap = "" if base is None or r is base else f"{r.mean - base.mean:+.2f}"
        verdict = ""
        if base is not None and r.robust:
            if r.liars == 0:
                costs = pair_costs.get((r.algorithm, r.split))
                rate_cost = 1 - r.steps_per_s / base.steps_per_s if costs is None else statistics.median(costs)
                met = base.mean - r.mean <= TARGET_COST_POINTS and rate_cost <= TARGET_COST_RATE
                cost = f"cost {base.mean - r.mean:.2f} points, {100 * rate_cost:.0f}% steps/s"
                if costs is not None:
                    cost += f" (median of {len(costs)} pairs, {100 * min(costs):.0f} to {100 * max(costs):.0f}%)"
                verdict = f"{'met' if met else 'MISSED'} ({cost})"
            else:
                met = base.mean - r.mean <= TARGET_GAP[r.liars]
                verdict = f"{'met' if met else 'MISSED'} (<= {TARGET_GAP[r.liars]:.0f})"
            if not met:
                misses.append(f"{r.algorithm} {r.split} {r.attack} x{r.liars}")
        flagged = "" if not r.robust else f"{r.caught}/{r.liars}" + (
            f" (+{r.wrongly_flagged} honest)" if r.wrongly_flagged else "")
        lines.append(f"| {r.algorithm} | {r.split} | {r.attack} | {r.liars} | {'robust' if r.robust else 'plain'} | "
                     f"{r.mean:.2f} | {r.worst:.2f} | {r.steps_per_s:.0f} | {flagged} | {gap} | {verdict} |")
    robust_rows = [r for r in rows if r.robust and (r.algorithm, r.split) in baseline]
    lines += ["", f"Robust rows meeting their target: {len(robust_rows) - len(misses)} of {len(robust_rows)}."]
    if misses:
        lines.append("Missed: " + "; ".join(misses) + ".")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="both splits, all attacks, the plain rule with 3 liars")
    parser.add_argument("--steps", type=int, default=120, help="local steps per node (ESync: a quarter, in rounds; "
                        "ASGD and DiLoCo: at least 600)")
    parser.add_argument("--attacks", default="", help="comma-separated, of "
                        f"{', '.join([*ATTACKS, *LIES])} (default: {', '.join(DEFAULT_ATTACKS)}; --full: all)")
    parser.add_argument("--splits", default="", help="comma-separated splits (default: class-window; --full: both)")
    parser.add_argument("--only", default="", help="comma-separated algorithm names (dsgd, gossip, sgp, "
                        "diloco-gossip, asgd, esync, diloco-ps, allreduce, diloco)")
    parser.add_argument("--step-time", type=float, default=0.05, help="virtual seconds of a local step "
                        "(simulation.step_time_s): the coordinator reviews its suspicion each virtual second")
    parser.add_argument("--test-limit", type=int, default=2000, help="test images each node is evaluated on")
    parser.add_argument("--model", default="logistic", help="the job's model (the rule's cost per contribution is "
                        "fixed, its share of a step falls as the model's compute grows)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--strength", type=float, default=None, help="every attack's strength but the echo's "
                        "(simulation.byzantine's; unset: each attack's own default, nodeagent.byzantine)")
    parser.add_argument("--liar-pushes", type=int, default=1, metavar="N", help="ASGD's liars push each forged update "
                        "N times a step, each copy claiming a step of its own (simulation.byzantine[].pushes: a liar "
                        "that pushes as often as the server answers it; the server applies one push per step)")
    parser.add_argument("--cost", type=int, default=0, metavar="N", help="only the no-attack pairs, run N times "
                        "(which rule first alternating): the steps/s cost is the pairs' median")
    args = parser.parse_args()
    if args.liar_pushes < 1:
        parser.error("--liar-pushes is at least 1")
    attacks = [a for a in args.attacks.split(",") if a] or ([*ATTACKS, *LIES] if args.full else list(DEFAULT_ATTACKS))
    unknown = set(attacks) - set(ATTACKS) - set(LIES)
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(sorted(unknown))}; known: {', '.join([*ATTACKS, *LIES])}")
    splits = [s for s in args.splits.split(",") if s] or (["class-window", "iid"] if args.full else ["class-window"])
    algorithms = [a for a in ALGORITHMS if not args.only or a.name in args.only.split(",")]
    strength = "" if args.strength is None else f" at strength {args.strength:g}"
    fast = f", ASGD's liars pushing {args.liar_pushes} times a step" if args.liar_pushes > 1 else ""
    print(f"{NODES} nodes, {args.model}, {args.steps} steps, splits {splits}, attacks {attacks}{strength}{fast}",
          flush=True)
    started = time.monotonic()
    rows: list[Row] = []
    pair_costs: dict[tuple[str, str], list[float]] = {}
    for split in splits:
        for algorithm in algorithms:
            if args.cost:
                pairs = []
                for i in range(args.cost):
                    ran = {robust: run(algorithm, split, "none", 0, robust, args)
                           for robust in ((False, True) if i % 2 == 0 else (True, False))}
                    pairs.append((ran[False], ran[True]))
                pair_costs[(algorithm.label, split)] = [1 - robust.steps_per_s / plain.steps_per_s
                                                        for plain, robust in pairs]
                for robust in (False, True):
                    rows.append(max((pair[robust] for pair in pairs), key=lambda row: row.steps_per_s))
                continue
            rows.append(run(algorithm, split, "none", 0, False, args))
            rows.append(run(algorithm, split, "none", 0, True, args))
            for attack in attacks:
                for liars in (1, 3):
                    if liars == 1 or args.full:
                        rows.append(run(algorithm, split, attack, liars, False, args))
                    rows.append(run(algorithm, split, attack, liars, True, args))
    print()
    print("\n".join(table(rows, pair_costs)))
    print(f"\n(wall {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
