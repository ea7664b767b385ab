"""What the command line prints about jobs: one formatting of a job's per-node progress, shared by `status`,
`simulate` and `demo`; the per-edge table of `edges`; a node's device in `nodes`."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.control.states import JobState
from coordinator.progress_view import ProgressView
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.defaults import RATE_WINDOW_S
from nodeagent.jobspec import JobSpecError, parse_job_yaml
from nodeagent.runtime.messages import from_node_progress
from nodeagent.runtime.progress import IN_FLIGHT, EdgeCounters, Metric, Progress, task_metrics

# When an edge is in trouble (`coordinator edges`; docs/operations.md, "Per-edge debugging"):
STALL_INTERVALS = 10  # stalled: no message for this many of the edge's message intervals (the alert's too),
STALL_MIN_S = 5.0  # and for at least this long (nodes report once a second: a younger age says nothing)
FAILING_WINDOW_S = 60.0  # failing: a call on the edge failed this recently
# stale: the neighbour is behind by more than this many of the edge's message intervals, and by at least this long
# at the node's step rate (a fast job's neighbours are many steps apart in a fraction of a second)
STALE_INTERVALS = 10
STALE_MIN_S = 5.0
SUSPECT_SHARE = 0.5  # suspect: this share of the neighbour's contributions so far was outlying (nodeagent.robust)


def device_text(node: pb.NodeInfo) -> str:
    """A node's device as `coordinator nodes` shows it: `cuda:0 NVIDIA H100 80GB HBM3 (79 GiB)`, or `cpu`."""
    if not node.device_memory_bytes:
        return node.device
    return f"{node.device} {node.device_name} ({node.device_memory_bytes / 2**30:.0f} GiB)"


def state_name(state: int) -> str:
    """A job's state as the tables show it: running."""
    return pb.JobState.Name(state).removeprefix("JOB_").lower()


def json_state(state: int) -> str:
    """A job's state as every `--json` names it: the coordinator's own name (JobState), RUNNING."""
    return JobState(pb.JobState.Name(state).removeprefix("JOB_")).value


def progress_of(status: pb.JobStatusReply) -> list[Progress]:
    return [from_node_progress(status.job_id, node) for node in status.nodes]


def show_progress(view: ProgressView, status: pb.JobStatusReply) -> None:
    """A job's status on a live progress view: its members' steps by rank, the mean of its task's headline figure
    (test accuracy, validation perplexity) and state (an elastic job's members that left are not shown)."""
    members = [node for node in sorted(status.nodes, key=lambda node: node.rank) if node.state != "left"]
    headline = task_metrics(status.task)[0]
    view.update([node.step for node in members],
                mean_measured(headline.of(from_node_progress(status.job_id, node)) for node in members),
                state_name(status.state), metric=headline)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def members_text(job: pb.JobStatusReply | pb.JobInfo) -> str:
    """How many nodes a job has: its size, or an elastic job's members now and its least and most."""
    if job.max_nodes:
        return f"{job.world_size} members (elastic, {job.min_nodes}..{job.max_nodes})"
    return f"{job.world_size} nodes"


def status_text(status: pb.JobStatusReply, now: float | None = None) -> str:
    """`coordinator status` of a job: its state, times and reason, then a row per node."""
    now = time.time() if now is None else now
    lines = [f"job {status.job_id} ({status.name}): {state_name(status.state)}, {members_text(status)}, "
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
    rates = {node.rank: node.recent_steps_per_s for node in status.nodes if node.HasField("recent_steps_per_s")}
    if status.state == pb.JOB_RUNNING and status.nodes:
        lines.append(_pace(status, rates))
    if status.HasField("server_version"):
        lines.append(f"parameter server (at the coordinator): model version {status.server_version}")
    lines.append(format_status(progress_of(status), states, ages, status.task, rates))
    failed: dict[str, list[int]] = {}  # the nodes' own words, once for all the ranks that said the same
    for node in status.nodes:
        if node.failure:
            failed.setdefault(node.failure, []).append(node.rank)
    for failure, ranks in failed.items():
        lines.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} failed: {failure}")
    lines += suspicion_lines(status)
    return "\n".join(lines)


def _pace(status: pb.JobStatusReply, rates: Mapping[int, float]) -> str:
    """A running job's progress and ETA at its nodes' recent rates: the slowest running member's time to the last
    step (a member that does not move leaves it unknown, and is named)."""
    try:
        steps = parse_job_yaml(status.spec_yaml).steps
    except JobSpecError:
        return "progress: unknown (the job's spec cannot be read)"
    running = [node for node in status.nodes if node.state in ("up", "down") and not node.finished]
    line = f"progress: step {min((n.step for n in status.nodes), default=0)} of {steps}"
    if not running:
        return line
    still = [node.rank for node in running if rates.get(node.rank) == 0.0]
    if still:
        return line + f"; ETA unknown: {'rank' if len(still) == 1 else 'ranks'} {', '.join(map(str, still))} " \
            f"made no step in the last {RATE_WINDOW_S:g} s"
    if any(node.rank not in rates for node in running):
        return line + "; ETA once every running node reported twice"
    eta = max((steps - node.step) / rates[node.rank] for node in running)
    return line + f"; ETA {_duration(eta)} at the recent rates (the slowest node's)"


def suspicion_lines(status: pb.JobStatusReply) -> list[str]:
    """The members a robust rule flags or the coordinator quarantined, with their suspicion (issue 28)."""
    lines = []
    for node in sorted(status.nodes, key=lambda node: node.rank):
        share = "" if math.isnan(node.suspicion) else f": {node.suspicion:.0%} of its recent contributions outlying"
        if node.quarantined:
            lines.append(f"rank {node.rank} ({node.node_id}) is quarantined{share}")
        elif node.suspected:
            lines.append(f"rank {node.rank} ({node.node_id}) is suspected{share}")
    return lines


def _fmt(value: float, pattern: str = "{:.4f}") -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def mean_accuracy(nodes: Sequence[Progress]) -> float:
    """The mean test accuracy of the nodes evaluated so far (NaN if none is)."""
    return mean_measured(n.test_accuracy for n in nodes)


def mean_measured(values: Iterable[float]) -> float:
    """The mean of the values measured (NaN: not measured; NaN if none is)."""
    measured = [value for value in values if not math.isnan(value)]
    return sum(measured) / len(measured) if measured else math.nan


def format_status(nodes: Sequence[Progress], states: dict[int, str] | None = None,
                  ages: dict[int, float] | None = None, task: str = "classification",
                  rates: Mapping[int, float] | None = None) -> str:
    """A row per node (its state, from the coordinator, its recent steps/s, and the age of its last report when
    given) with the figures of the job's task (test accuracy; validation perplexity and loss), and their means. A
    node without a recent rate (finished, or not given) shows its run's."""
    states = states or {}
    ages = ages or {}
    rates = rates or {}
    metrics = task_metrics(task)
    headings = " ".join(f"{metric.heading:>9}" for metric in metrics)
    lines = [
        f"{'rank':>4}  {'node':<14} {'state':<8} {'step':>7} {'steps/s':>8} {'loss':>8} {headings} "
        f"{'sent MB':>9} {'recv MB':>9} {'report':>10}",
    ]
    for n in nodes:
        state = states.get(n.rank) or ("finished" if n.finished else "running")
        # The steps this run of the node made (a restarted node resumed, or rejoined, at a later step), per second.
        rate = (n.local_steps or n.step) / n.elapsed_s if n.elapsed_s > 0 else math.nan
        rate = rates.get(n.rank, rate)
        age = ages.get(n.rank, math.nan)
        lines.append(
            f"{n.rank:>4}  {n.node:<14} {state:<8} {n.step:>7} {_fmt(rate, '{:.1f}'):>8} {_fmt(n.loss):>8} "
            f"{' '.join(f'{metric.text(metric.of(n)):>9}' for metric in metrics)} "
            f"{n.bytes_sent / 1e6:>9.2f} {n.bytes_received / 1e6:>9.2f} "
            f"{'-' if math.isnan(age) else _duration(age) + ' ago':>10}"
        )
    summary = mean_figures(nodes, metrics)
    if summary:
        lines.append(summary)
    return "\n".join(lines)


def mean_figures(nodes: Sequence[Progress], metrics: Sequence[Metric]) -> str:
    """`mean test accuracy over 8 nodes: 0.8123` (with a task's further figures after a comma) over the nodes
    evaluated so far; empty if none is."""
    headline, *others = metrics
    evaluated = [n for n in nodes if not math.isnan(headline.of(n))]
    if not evaluated:
        return ""
    mean = mean_measured(map(headline.of, evaluated))
    text = f"mean {headline.name} over {len(evaluated)} nodes: {headline.text(mean)}"
    return text + "".join(f", {metric.name} {metric.text(mean_measured(map(metric.of, evaluated)))}"
                          for metric in others)


class Trouble(enum.IntEnum):
    """An edge's state in `coordinator edges`, worst first."""

    STALLED = 0
    FAILING = 1
    SUSPECT = 2
    STALE = 3
    OK = 4


@dataclass(frozen=True)
class EdgeRow:
    """One edge of a node as `coordinator edges` shows it; ages are counted to the time of the call."""

    src: str
    rank: int
    edge: EdgeCounters
    last_message_s: float  # since the last message; for an edge that never had one, since the node started
    in_flight_s: float
    interval_s: float  # the edge's expected time between messages
    trouble: Trouble
    staleness_s: float = math.nan  # how far the neighbour is behind, in seconds of the node's steps

    @property
    def failures(self) -> dict[str, int]:
        """The edge's failed calls by reason (its flow-control skips are no calls: `skips`)."""
        return {reason: count for reason, count in self.edge.failure_reasons.items() if reason != IN_FLIGHT}

    @property
    def skips(self) -> int:
        """Sends not made because the edge's previous exchange was still in flight (flow control)."""
        return self.edge.failure_reasons.get(IN_FLIGHT, 0)


def edge_rows(nodes: Sequence[Progress], now: float, interval_steps: int = 1) -> list[EdgeRow]:
    """Every edge of the running nodes, worst first (stalled, failing, stale, ok; then the oldest last message).
    An edge's expected interval is its mean time between messages so far, or, before it has one, `interval_steps`
    steps of the node (the job's interval K) at the node's step rate. Finished nodes' edges are not judged."""
    rows = []
    for node in nodes:
        lag = max(0.0, now - node.time) if node.time else 0.0  # the report's age: the node's figures are that old
        steps = node.local_steps or node.step
        rate = steps / node.elapsed_s if node.elapsed_s > 0 and steps > 0 else math.nan
        for edge in node.edges:
            age = edge.last_message_age_s if not math.isnan(edge.last_message_age_s) else node.elapsed_s
            interval = edge.message_interval_s if not math.isnan(edge.message_interval_s) else interval_steps / rate
            row = EdgeRow(node.node, node.rank, edge, age + lag, edge.in_flight_s + lag if edge.in_flight_s else 0.0,
                          interval, Trouble.OK, edge.staleness_steps / rate)
            rows.append(row if node.finished else _judged(row, lag))
    return sorted(rows, key=lambda r: (r.trouble, -r.last_message_s, r.src, r.edge.peer))


def _judged(row: EdgeRow, lag: float) -> EdgeRow:
    edge = row.edge
    threshold = max(STALL_INTERVALS * row.interval_s, STALL_MIN_S) if not math.isnan(row.interval_s) else STALL_MIN_S
    if row.last_message_s > threshold:
        trouble = Trouble.STALLED
    elif edge.last_failure_age_s + lag <= FAILING_WINDOW_S:  # NaN (never failed) compares False
        trouble = Trouble.FAILING
    elif outlying_share(edge) >= SUSPECT_SHARE:  # NaN (no robust rule, nothing received) compares False
        trouble = Trouble.SUSPECT
    elif row.staleness_s > max(STALE_INTERVALS * row.interval_s, STALE_MIN_S):  # NaN (unknown) compares False
        trouble = Trouble.STALE
    else:
        return row
    return dataclasses.replace(row, trouble=trouble)


def waits_on(nodes: Sequence[Progress], rows: Sequence[EdgeRow]) -> list[str]:
    """What a job that does not move waits on: its stalled edges, and each node that waits with what for."""
    lines = [f"edge {r.src} -> {r.edge.peer} is stalled: no message for {_duration(r.last_message_s)}"
             + (f", a call in flight for {_duration(r.in_flight_s)}" if r.in_flight_s else "")
             for r in rows if r.trouble is Trouble.STALLED]
    lines += [f"rank {n.rank} ({n.node}) waits for {n.waiting_for}" for n in nodes if n.waiting_for and not n.finished]
    return lines


def _edges_as_of(status: pb.JobStatusReply, now: float | None) -> float:
    """The time a job's edges are judged at: now while it runs, its end once it ended (its last known edges)."""
    if status.ended_unix:
        return status.ended_unix
    return time.time() if now is None else now


def outlying_share(edge: EdgeCounters) -> float:
    """The edge's suspicion score: the share of the neighbour's contributions so far that the node's robust rule
    found outlying or refused (NaN: none judged)."""
    if not edge.robust_clipped and not edge.robust_outlying:
        return 0.0 if edge.judged_contributions() else math.nan
    return min(1.0, edge.robust_outlying / max(1, edge.judged_contributions()))


def _reasons(reasons: Mapping[str, int]) -> str:
    return ",".join(f"{reason}:{count}" for reason, count in sorted(reasons.items())) or "-"


def edges_text(status: pb.JobStatusReply, interval_steps: int = 1, now: float | None = None) -> str:
    """`coordinator edges` of a job: a row per edge of its nodes, worst first, and what it waits on; an ended job's
    as its nodes last reported them, judged at its end."""
    now = _edges_as_of(status, now)
    nodes = progress_of(status)
    rows = edge_rows(nodes, now, interval_steps)
    ended = " (their last report, at the job's end)" if status.ended_unix and rows else ""
    lines = [f"job {status.job_id} ({status.name}): {state_name(status.state)}, {len(rows)} edges{ended}"]
    if not rows:
        lines.append("no edge reported" + ("" if status.state == pb.JOB_RUNNING else " (a job's edges are known while "
                                           "it runs and, until the coordinator restarts, for its newest ended jobs)"))
        return "\n".join(lines)
    lines.append(f"{'trouble':<8} {'src':<14} {'dst':<14} {'last msg':>9} {'in flight':>9} {'sent':>7} "
                 f"{'recv':>7} {'MB out':>8} {'MB in':>8} {'stale':>6} {'distance':>9} {'outlying':>8} {'skips':>6}  "
                 "failures")
    for r in rows:
        e = r.edge
        lines.append(
            f"{r.trouble.name.lower():<8} {r.src:<14} {e.peer:<14} {_fmt(r.last_message_s, '{:.1f} s'):>9} "
            f"{_fmt(r.in_flight_s, '{:.1f} s') if r.in_flight_s else '-':>9} {e.messages_sent:>7} "
            f"{e.messages_received:>7} {e.bytes_sent / 1e6:>8.2f} {e.bytes_received / 1e6:>8.2f} "
            f"{_fmt(e.staleness_steps, '{:.0f}'):>6} {_fmt(e.consensus_distance, '{:.4g}'):>9} "
            f"{_fmt(outlying_share(e), '{:.0%}') if e.robust_clipped or e.robust_outlying else '-':>8} {r.skips:>6}  "
            f"{_reasons(r.failures)}"
        )
    waits = waits_on(nodes, rows)
    if waits:
        lines.append("waits on: " + "; ".join(waits))
    lines += suspicion_lines(status)
    return "\n".join(lines)


def edges_json(status: pb.JobStatusReply, interval_steps: int = 1, now: float | None = None) -> dict:
    """`coordinator edges --json`: the same rows and waits; unknown numbers are null."""
    now = _edges_as_of(status, now)
    nodes = progress_of(status)
    rows = edge_rows(nodes, now, interval_steps)

    def number(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {
        "job_id": status.job_id, "name": status.name, "state": json_state(status.state),
        "edges": [
            {"src": r.src, "rank": r.rank, "dst": r.edge.peer, "trouble": r.trouble.name.lower(),
             "last_message_s": number(r.last_message_s), "in_flight_s": r.in_flight_s,
             "interval_s": number(r.interval_s), "messages_sent": r.edge.messages_sent,
             "messages_received": r.edge.messages_received, "bytes_sent": r.edge.bytes_sent,
             "bytes_received": r.edge.bytes_received, "failures": r.failures, "skips": r.skips,
             "staleness_steps": number(r.edge.staleness_steps), "staleness_s": number(r.staleness_s),
             "consensus_distance": number(r.edge.consensus_distance), "robust_clipped": r.edge.robust_clipped,
             "robust_outlying": r.edge.robust_outlying, "robust_judged": r.edge.judged_contributions(),
             "outlying_share": number(outlying_share(r.edge))}
            for r in rows
        ],
        "waits_on": waits_on(nodes, rows),
        "suspected": [{"rank": n.rank, "node": n.node_id, "suspicion": number(n.suspicion),
                       "quarantined": n.quarantined} for n in status.nodes if n.suspected or n.quarantined],
    }
