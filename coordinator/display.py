"""What the command line prints about jobs: one formatting of a job's per-node progress, shared by `status`,
`simulate` and `demo`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import Progress, from_node_progress


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_").lower()


def progress_of(status: pb.JobStatusReply) -> list[Progress]:
    return [from_node_progress(status.job_id, node) for node in status.nodes]


def status_text(status: pb.JobStatusReply) -> str:
    """`coordinator status` of a job."""
    title = (f"job {status.job_id} ({status.name}): {state_name(status.state)}, {status.world_size} nodes, "
             f"run dir {status.run_dir}")
    return format_status(title, progress_of(status))


def _fmt(value: float, pattern: str = "{:.4f}") -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def mean_accuracy(nodes: Sequence[Progress]) -> float:
    """The mean test accuracy of the nodes evaluated so far (NaN if none is)."""
    values = [n.test_accuracy for n in nodes if not math.isnan(n.test_accuracy)]
    return sum(values) / len(values) if values else math.nan


def format_status(title: str, nodes: Sequence[Progress]) -> str:
    """A title line, one row per node, and the mean test accuracy."""
    lines = [
        title,
        f"{'rank':>4}  {'node':<14} {'step':>7} {'loss':>8} {'test acc':>9} {'sent MB':>9} {'recv MB':>9}  done",
    ]
    for n in nodes:
        lines.append(
            f"{n.rank:>4}  {n.node:<14} {n.step:>7} {_fmt(n.loss):>8} {_fmt(n.test_accuracy):>9} "
            f"{n.bytes_sent / 1e6:>9.2f} {n.bytes_received / 1e6:>9.2f}  {'yes' if n.finished else 'no'}"
        )
    evaluated = [n for n in nodes if not math.isnan(n.test_accuracy)]
    if evaluated:
        lines.append(f"mean test accuracy over {len(evaluated)} nodes: {mean_accuracy(evaluated):.4f}")
    return "\n".join(lines)
