"""A language model like the DiLoCo paper's, on a laptop (docs/results.md, issue 26): validation perplexity against
tokens and against bytes sent per worker.

A small GPT (byte-level, vocabulary 256) on Python's standard library sources (the .py files of this interpreter's
stdlib directory, in name order up to --corpus-bytes: text every Python install has, offline), 8 workers in the
simulator (the same algorithm code and byte counting as agents), two splits: iid (every worker a share of every
file's sequences) and by-file (each worker its own files: the heterogeneous setting). Runs:
- all-reduce AdamW, the synchronous baseline (one AdamW step on the mean gradient every step, a ring all-reduce);
- DiLoCo over the all-reduce, H = 50, 100, 500 (inner AdamW at the baseline's step size, outer Nesterov SGD
  lr 0.7 momentum 0.9, as in the paper);
- DiLoCo through the parameter server (diloco-ps), H = 100;
- decentralised DiLoCo (diloco-gossip), H = 100, push-sum on the one-peer exponential graph (log2 8 = 3 rounds);
- streaming DiLoCo, H = 100, 4 fragments, each sync overlapped with 5 inner steps, int8 pseudo-gradients.
Every run starts from the same model, trained first by the synchronous baseline for --warmup-steps (1,500; the
paper's runs start from a model trained synchronously, and they ask how to go on from there); --warmup-steps 0
starts every run from the seeded model instead. Each run prints its curve (mean validation perplexity over the
workers at each evaluation, with the tokens the workers had trained on and the bytes each had sent), then the
comparison with the targets: DiLoCo at H = 100 within 2% of the all-reduce baseline's final perplexity with at
least 100x fewer bytes per worker.

The default is sized for a 2-core machine (about 5 minutes with the warm-up: see results.md); --long is the
1 M-parameter GPT of the issue over longer sequences and 3,000 steps (hours on such a machine).

    .venv/bin/python benchmarks/lm.py                            # the default (results.md)
    .venv/bin/python benchmarks/lm.py --long                     # a GPT of 0.83 M parameters, 3000 steps
    .venv/bin/python benchmarks/lm.py --only 'AllReduce,DiLoCo H=100' --steps 200 --png /tmp/lm.png
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import shutil
import sysconfig
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.simulate import simulate, simulated_model
from nodeagent.jobspec import parse_job_spec
from nodeagent.runtime.progress import read_run_log
from nodeagent.training.modelfile import write_model_file
from nodeagent.training.models import gpt

NODES = 8
TARGET_GAP_PERCENT = 2.0
TARGET_RATIO = 100.0
SPLITS = ("iid", "by-file")


@dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str
    options: dict
    topology: str = "ring"


@dataclass(frozen=True)
class Point:
    step: int
    tokens: int  # trained on by all the workers together
    bytes_per_worker: float
    perplexity: float  # mean over the workers


@dataclass(frozen=True)
class Outcome:
    split: str
    label: str
    curve: tuple[Point, ...]
    wall_s: float

    @property
    def final(self) -> Point:
        return self.curve[-1]


def variants(args: argparse.Namespace) -> list[Variant]:
    h = 100
    runs = [Variant("AllReduce AdamW", "allreduce", {"optimizer": "adamw"})]
    runs += [Variant(f"DiLoCo H={h}", "diloco", {"inner_steps": h}) for h in (50, 100, 500)]
    runs.append(Variant(f"DiLoCo PS H={h}", "diloco-ps", {"inner_steps": h}))
    runs.append(Variant(f"DiLoCo gossip H={h}", "diloco-gossip", {"inner_steps": h}, "npeer-exponential"))
    runs.append(Variant(f"Streaming DiLoCo int8 H={h} F=4", "diloco", {
        "inner_steps": h, "fragments": 4, "overlap_steps": 5, "precision": "int8"}))
    if args.only:
        wanted = [label.strip() for label in args.only.split(",")]
        runs = [run for run in runs if any(run.label == label or run.label.startswith(label + " ") for label in wanted)]
    return runs


def corpus(directory: Path, size: int) -> Path:
    """The stdlib's .py files in name order, copied into `directory` until `size` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    directory.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= size:
            break
        shutil.copyfile(path, directory / path.name)
        total += path.stat().st_size
    return directory


def job(variant: Variant, split: str, args: argparse.Namespace) -> dict:
    return {
        "name": f"lm-{split}-{variant.label}".lower().replace(" ", "-").replace("=", ""),
        "task": "language-model", "nodes": NODES, "steps": args.steps, "eval_every": max(1, args.steps // 10),
        "seed": 0,
        "algorithm": {"name": variant.algorithm, "mode": "sync", "lr": args.lr, "options": variant.options},
        "model": {"name": "gpt", "options": {"layers": args.layers, "heads": args.heads, "width": args.width},
                  "init": args.init},
        "data": {"dataset": "text", "data_dir": str(args.corpus), "split": split, "batch_size": args.batch_size,
                 "options": {"sequence_length": args.sequence_length}, "test_limit": args.test_limit},
        "topology": {"kind": variant.topology, "seed": 1},
        "simulation": {"step_time_s": 0.01, "network": {"bandwidth_bytes_per_s": 125e6, "latency_s": 1e-4}},
    }


def warmed_up(args: argparse.Namespace, path: Path) -> None:
    """The paper's start: `args.warmup_steps` of the synchronous baseline (all-reduce AdamW, iid) from the seeded
    model, whose model every run then starts from (its `model.init`)."""
    spec = parse_job_spec(job(Variant("warm-up", "allreduce", {"optimizer": "adamw"}), "iid",
                              argparse.Namespace(**{**vars(args), "steps": args.warmup_steps, "init": None})))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as run_dir:
        result = simulate(spec, Path(run_dir), device=torch.device(args.device))
    state_dict, manifest = simulated_model(result)
    write_model_file(path, state_dict, manifest)
    perplexity = sum(p.test_perplexity for p in result.progress) / len(result.progress)
    print(f"  warm-up: {args.warmup_steps} steps of all-reduce AdamW (iid) from the seeded model: perplexity "
          f"{perplexity:.3f} (wall {time.monotonic() - started:.0f} s); every run starts from it", flush=True)


def simulated(split: str, variant: Variant, args: argparse.Namespace) -> Outcome:
    spec = parse_job_spec(job(variant, split, args))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as run_dir:
        simulate(spec, Path(run_dir), device=torch.device(args.device))
        records = read_run_log(run_dir)
    tokens_per_step = NODES * args.batch_size * args.sequence_length
    latest: dict[int, tuple[float, int]] = {}  # rank -> its last perplexity and bytes sent
    curve: dict[int, Point] = {}
    for record in records:
        if math.isnan(record.test_perplexity):
            continue
        latest[record.rank] = (record.test_perplexity, record.bytes_sent)
        if len(latest) == NODES:  # every worker evaluated at this step: the step's point
            perplexity = sum(p for p, _ in latest.values()) / NODES
            sent = sum(b for _, b in latest.values()) / NODES
            curve[record.step] = Point(record.step, record.step * tokens_per_step, sent, perplexity)
    outcome = Outcome(split, variant.label, tuple(curve[step] for step in sorted(curve)), time.monotonic() - started)
    points = "  ".join(f"{p.tokens / 1e3:.0f}k:{p.perplexity:.2f}" for p in outcome.curve)
    print(f"  {split:<8} {variant.label:<32} {outcome.final.bytes_per_worker / 1e6:9.2f} MB/worker  perplexity "
          f"{outcome.final.perplexity:7.3f}  (wall {outcome.wall_s:.0f} s)\n           tokens:perplexity {points}",
          flush=True)
    return outcome


def compare(outcomes: list[Outcome]) -> None:
    print("\ncomparison with the all-reduce AdamW baseline (final mean validation perplexity; bytes sent per worker)")
    print(f"{'split':<8} {'run':<32} {'MB/worker':>10} {'fewer bytes':>12} {'perplexity':>10} {'gap':>8}")
    for split in SPLITS:
        runs = [o for o in outcomes if o.split == split]
        base = next((o for o in runs if o.label.startswith("AllReduce")), None)
        for o in runs:
            ratio = base.final.bytes_per_worker / o.final.bytes_per_worker if base and o.final.bytes_per_worker \
                else math.nan
            gap = 100 * (o.final.perplexity / base.final.perplexity - 1) if base else math.nan
            print(f"{split:<8} {o.label:<32} {o.final.bytes_per_worker / 1e6:10.2f} {ratio:11.1f}x "
                  f"{o.final.perplexity:10.3f} {gap:+7.2f}%")
        target = next((o for o in runs if o.label == "DiLoCo H=100"), None)
        if base and target:
            ratio = base.final.bytes_per_worker / target.final.bytes_per_worker
            gap = 100 * (target.final.perplexity / base.final.perplexity - 1)
            met = gap <= TARGET_GAP_PERCENT and ratio >= TARGET_RATIO
            print(f"{split:<8} target: DiLoCo H=100 within {TARGET_GAP_PERCENT:g}% of the baseline's perplexity "
                  f"({gap:+.2f}%) with >= {TARGET_RATIO:g}x fewer bytes ({ratio:.1f}x): "
                  f"{'met' if met else 'MISSED'}")


def draw(outcomes: list[Outcome], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 7), dpi=72, layout="constrained")
    axes = figure.subplots(2, 2)
    labels = sorted({o.label for o in outcomes}, key=[o.label for o in outcomes].index)
    for row, split in enumerate(SPLITS):
        for o in (o for o in outcomes if o.split == split):
            color = f"C{labels.index(o.label) % 10}"
            axes[row][0].plot([p.tokens / 1e6 for p in o.curve], [p.perplexity for p in o.curve], color=color,
                              label=o.label)
            sent = [(p.bytes_per_worker / 1e6, p.perplexity) for p in o.curve if p.bytes_per_worker > 0]
            if sent:
                axes[row][1].plot(*zip(*sent, strict=True), color=color, marker="o", markersize=3)
        axes[row][0].set(title=f"{split}: against tokens", xlabel="tokens trained on, all workers (M)",
                         ylabel="validation perplexity")
        axes[row][1].set(title=f"{split}: against bytes", xlabel="MB sent per worker (log)",
                         ylabel="validation perplexity", xscale="log")
    axes[0][0].legend(fontsize=7)
    figure.savefig(path)
    print(f"curves: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="a GPT of 0.83 M parameters (4 layers of width 128) over "
                        "sequences of 64 bytes, batch 16, 3000 steps, a 4 MB corpus (hours on a 2-core machine)")
    parser.add_argument("--steps", type=int, help="local steps per worker (default 500; --long 3000)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--sequence-length", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--warmup-steps", type=int, default=1500, help="steps of the synchronous baseline every run "
                        "starts from, as the paper's runs start from a synchronously trained model (0: from the seeded "
                        "model; default %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's step size (baseline and inner)")
    parser.add_argument("--test-limit", type=int, default=64, help="validation sequences (of every file's tail)")
    parser.add_argument("--corpus", type=Path, help="a directory of text files instead of the stdlib's sources")
    parser.add_argument("--corpus-bytes", type=int, help="of the stdlib's sources (default 1.5 MB; --long 4 MB)")
    parser.add_argument("--processes", type=int, default=3, help="runs at once")
    parser.add_argument("--only", help="comma-separated run labels, or their first words")
    parser.add_argument("--splits", default=",".join(SPLITS), help="comma-separated: iid, by-file")
    parser.add_argument("--png", type=Path, help="draw the curves to this PNG")
    parser.add_argument("--device", default="cpu", help="where every simulated worker trains (cuda: one GPU shared "
                        "by the runs at once)")
    args = parser.parse_args()
    defaults = (3000, 4, 128, 64, 16, 4_000_000) if args.long else (500, 2, 64, 32, 8, 1_500_000)
    for name, value in zip(("steps", "layers", "width", "sequence_length", "batch_size", "corpus_bytes"), defaults,
                           strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    with tempfile.TemporaryDirectory() as scratch:
        if args.corpus is None:
            args.corpus = corpus(Path(scratch) / "corpus", args.corpus_bytes)
        args.init = None
        files = sorted(p for p in Path(args.corpus).rglob("*") if p.is_file())
        parameters = sum(p.numel() for p in gpt((args.sequence_length,), 256, args.layers, args.heads,
                                                 args.width).parameters())
        print(f"corpus {args.corpus}: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.2f} MB "
              f"({files[0].name} .. {files[-1].name}); GPT of {parameters / 1e6:.2f} M parameters: "
              f"{args.layers} layers x {args.width} wide, "
              f"{args.heads} heads, sequences of {args.sequence_length} bytes, batch {args.batch_size}, "
              f"{args.steps} steps, {NODES} workers")
        if args.warmup_steps > 0:
            args.init = str(Path(scratch) / "warm.pt")
            warmed_up(args, Path(args.init))
        # The target's runs first (the baseline and DiLoCo H=100 of each split), then the others.
        runs = sorted(((split, variant) for split in args.splits.split(",") for variant in variants(args)),
                      key=lambda run: (run[1].label not in ("AllReduce AdamW", "DiLoCo H=100"),))
        started = time.monotonic()
        # CUDA cannot be used in a forked child: the runs' processes are spawned (the parent never touches the GPU).
        with ProcessPoolExecutor(max_workers=args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(simulated, *zip(*runs, strict=True), [args] * len(runs)))
    compare(outcomes)
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    if args.png:
        draw(outcomes, args.png)


if __name__ == "__main__":
    main()
