"""What the command line prints about jobs: one formatting of a job's per-node progress, shared by `status`,
`simulate` and `demo`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from coordinator.progress_view import ProgressView
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import Progress, from_node_progress


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_").lower()


def progress_of(status: pb.JobStatusReply) -> list[Progress]:
    return [from_node_progress(status.job_id, node) for node in status.nodes]


def show_progress(view: ProgressView, status: pb.JobStatusReply) -> None:
    """A job's status on a live progress view: its nodes' steps by rank, mean accuracy and state."""
    steps = [node.step for node in sorted(status.nodes, key=lambda node: node.rank)]
    view.update(steps, mean_accuracy(progress_of(status)), state_name(status.state))


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def status_text(status: pb.JobStatusReply, now: float | None = None) -> str:
    """`coordinator status` of a job: its state, times and reason, then a row per node."""
    now = time.time() if now is None else now
    lines = [f"job {status.job_id} ({status.name}): {state_name(status.state)}, {status.world_size} nodes, "
             f"run dir {status.run_dir}"]
    if status.started_unix:
        end = status.ended_unix or now
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.started_unix))
        lines.append(f"started {started}, {'ran' if status.ended_unix else 'running for'} "
                     f"{_duration(end - status.started_unix)}")
    if status.reason:
        lines.append(("waits: " if status.state == pb.JOB_PENDING else "reason: ") + status.reason)
    states = {node.rank: node.state for node in status.nodes}
    ages = {node.rank: now - node.updated_unix if node.updated_unix else math.nan for node in status.nodes}
    lines.append(format_status(progress_of(status), states, ages))
    failed: dict[str, list[int]] = {}  # the nodes' own words, once for all the ranks that said the same
    for node in status.nodes:
        if node.failure:
            failed.setdefault(node.failure, []).append(node.rank)
    for failure, ranks in failed.items():
        lines.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} failed: {failure}")
    return "\n".join(lines)


def _fmt(value: float, pattern: str = "{:.4f}") -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def mean_accuracy(nodes: Sequence[Progress]) -> float:
    """The mean test accuracy of the nodes evaluated so far (NaN if none is)."""
    values = [n.test_accuracy for n in nodes if not math.isnan(n.test_accuracy)]
    return sum(values) / len(values) if values else math.nan


def format_status(nodes: Sequence[Progress], states: dict[int, str] | None = None,
                  ages: dict[int, float] | None = None) -> str:
    """A row per node (its state, from the coordinator, and the age of its last report when given), and the
    mean test accuracy."""
    states = states or {}
    ages = ages or {}
    lines = [
        f"{'rank':>4}  {'node':<14} {'state':<8} {'step':>7} {'steps/s':>8} {'loss':>8} {'test acc':>9} "
        f"{'sent MB':>9} {'recv MB':>9} {'report':>10}",
    ]
    for n in nodes:
        state = states.get(n.rank) or ("finished" if n.finished else "running")
        # The steps this run of the node made (a restarted node resumed, or rejoined, at a later step), per second.
        rate = (n.local_steps or n.step) / n.elapsed_s if n.elapsed_s > 0 else math.nan
        age = ages.get(n.rank, math.nan)
        lines.append(
            f"{n.rank:>4}  {n.node:<14} {state:<8} {n.step:>7} {_fmt(rate, '{:.1f}'):>8} {_fmt(n.loss):>8} "
            f"{_fmt(n.test_accuracy):>9} {n.bytes_sent / 1e6:>9.2f} {n.bytes_received / 1e6:>9.2f} "
            f"{'-' if math.isnan(age) else _duration(age) + ' ago':>10}"
        )
    evaluated = [n for n in nodes if not math.isnan(n.test_accuracy)]
    if evaluated:
        lines.append(f"mean test accuracy over {len(evaluated)} nodes: {mean_accuracy(evaluated):.4f}")
    return "\n".join(lines)
