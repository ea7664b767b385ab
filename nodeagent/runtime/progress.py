"""A node's progress in a job: the one record that agents report, the coordinator stores and shows, the simulator
returns and every run writes to its metrics log; and the byte counters it is built from.

Its protobuf forms are in nodeagent.runtime.messages. NaN means "not measured yet" (no evaluation so far); the log
writes it as null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.runtime.jsonlines import JsonLinesLog

LOG_FILE = "metrics.jsonl"


# The failure reason of a send the runtime did not make (one exchange per edge in flight, flow control): no call was
# made, so it says nothing about the peer; `coordinator edges` counts these skips apart from failures.
IN_FLIGHT = "in_flight"


@dataclass(frozen=True)
class MemberJudgement:
    """One member's rows of a collective's all-gathers, as this node's robust rule judged them (issue 28)."""

    rank: int  # the member's rank in the job
    seen: int
    clipped: int  # clipped, trimmed or refused
    outlying: int  # outlying or refused: what the coordinator's suspicion of the member counts


@dataclass(frozen=True)
class EdgeCounters:
    """One edge's counters of a node in a job: the peer is a node id, SERVER_NAME or "allreduce".

    Times are ages at the record's `time` (seconds before it), so they mean the same on the agent's clock and the
    simulator's virtual one; NaN: never (no message yet, no failure yet, not known)."""

    peer: str
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0  # calls to the peer that completed
    failures: int = 0  # calls to the peer that failed
    messages_sent: int = 0  # transmissions to the peer handed to the transport, retries included
    messages_received: int = 0  # the peer's messages: its own sends, and the replies to this node's calls
    last_message_age_s: float = math.nan  # since the last message received from the peer or call to it completed
    message_interval_s: float = math.nan  # the mean time between two of those messages so far
    in_flight_s: float = 0.0  # how long the exchange or pull in flight to the peer has been (0: none)
    failure_reasons: Mapping[str, int] = field(default_factory=dict)  # failures by reason, in_flight skips too
    last_failure_age_s: float = math.nan  # since the last failed call (in_flight skips are not calls)
    staleness_steps: float = math.nan  # this node's clock minus the clock of the peer's last message
    consensus_distance: float = math.nan  # ||w - the copy of the peer's w|| where the algorithm keeps one
    robust_clipped: int = 0  # the peer's contributions this node's robust rule clipped or refused (nodeagent.robust)
    robust_outlying: int = 0  # of them, those outlying or refused: the coordinator's suspicion is built from these
    judged: tuple[MemberJudgement, ...] = ()  # the all-reduce's edge of a robust job: each member's gathered rows
    robust_judged: int = 0  # the peer's contributions this node's robust rule judged or refused

    def judged_contributions(self) -> int:
        """The denominator of the peer's outlying share: the contributions judged, or the messages received where
        the node does not count them (an agent from before robust_judged; a message may carry no contribution, or
        one replaced before it was judged)."""
        return self.robust_judged or self.messages_received


@dataclass(frozen=True)
class Progress:
    job: str
    rank: int
    node: str  # the node's id (agents) or name (simulated nodes)
    step: int = 0
    loss: float = math.nan  # of the last local minibatch
    test_accuracy: float = math.nan  # at the last evaluation
    test_loss: float = math.nan
    elapsed_s: float = 0.0  # since the node started the job
    finished: bool = False
    bytes_sent: int = 0  # payload bytes of this job only, counted where they were sent and received
    bytes_received: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    exchanges: int = 0
    exchange_failures: int = 0
    time: float = 0.0  # when it was recorded: Unix time at the coordinator, virtual seconds in the simulator
    edges: tuple[EdgeCounters, ...] = ()  # per peer, sorted by peer
    local_steps: int = 0  # local steps taken here (`step` counts the job's steps: ESync's are rounds)
    waiting_for: str = ""  # while the node waits to go on: what for (Algorithm.waiting_for()), else empty
    test_perplexity: float = math.nan  # language models: exp(test_loss) at the last evaluation


@dataclass(frozen=True)
class Metric:
    """A figure of an evaluation that status, follow, the report and the simulator show: its column heading, its
    name in prose and in a word, the field of Progress that holds it, and its format."""

    heading: str
    name: str
    word: str
    field: str
    pattern: str = "{:.4f}"

    def of(self, progress: Progress) -> float:
        return getattr(progress, self.field)

    def text(self, value: float) -> str:
        return "-" if math.isnan(value) else self.pattern.format(value)


# What each task's evaluations fill (nodeagent.training.tasks), the headline first; every other figure of Progress
# stays NaN. Here, beside the record, so that the command line shows them without importing torch.
TASK_METRICS: dict[str, tuple[Metric, ...]] = {
    "classification": (Metric("test acc", "test accuracy", "accuracy", "test_accuracy"),),
    "language-model": (Metric("val ppl", "validation perplexity", "perplexity", "test_perplexity", "{:.3f}"),
                       Metric("val loss", "validation loss", "loss", "test_loss")),
}


def task_metrics(task: str) -> tuple[Metric, ...]:
    """The figures of a task's evaluations; those of classification for a task not named (an older coordinator)."""
    return TASK_METRICS.get(task or "classification", TASK_METRICS["classification"])


def figures_text(task: str, progress: Progress) -> str:
    """A node's last figures of its task in words: `test accuracy 0.8123`, `validation perplexity 5.210, ...`."""
    return ", ".join(f"{metric.name} {metric.text(metric.of(progress))}" for metric in task_metrics(task))


class Traffic:
    """Bytes a node sent to and received from each peer (by rank) in one job, added where they go out and come in
    (by network threads too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def add_sent(self, peer: int, count: int) -> None:
        with self._lock:
            self.sent[peer] = self.sent.get(peer, 0) + count

    def add_received(self, peer: int, count: int) -> None:
        with self._lock:
            self.received[peer] = self.received.get(peer, 0) + count

    def totals(self) -> tuple[int, int]:
        """Bytes sent and received over all peers."""
        with self._lock:
            return sum(self.sent.values()), sum(self.received.values())

    def snapshot(self) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes sent and received per peer, taken at one moment: a report's totals are the sums of its per-edge
        figures even while network threads keep counting."""
        with self._lock:
            return dict(self.sent), dict(self.received)


def ring_allreduce_bytes(payload: int, ranks: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of `payload` bytes: 2 (n - 1) / n of it. The
    collective's own library does not report its traffic, so both runtimes count this."""
    return round(2 * (ranks - 1) / ranks * payload)


def ring_allgather_bytes(payload: int, ranks: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-gather of `payload` bytes from every rank: its own and
    the n - 2 it forwards."""
    return (ranks - 1) * payload


# -- the metrics log of a run -------------------------------------------------------------------------------------


class RunLog(JsonLinesLog):
    """`metrics.jsonl` in a run directory: one JSON object per progress record, appended (thread-safe)."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / LOG_FILE)

    def append(self, progress: Progress) -> None:
        self.append_object(_plain(progress))


_PROGRESS_FIELDS = tuple(f.name for f in dataclasses.fields(Progress))
_EDGE_FIELDS = tuple(f.name for f in dataclasses.fields(EdgeCounters) if f.name != "judged")
_JUDGEMENT_FIELDS = tuple(f.name for f in dataclasses.fields(MemberJudgement))


def _plain(progress: Progress) -> dict:
    """A record as JSON takes it, NaN as null, edges as a list of objects. Written out field by field:
    `dataclasses.asdict` deep-copies every value, the most of a simulation's cost of its log at 10,000 nodes."""
    fields = {name: _nan_as_null(getattr(progress, name)) for name in _PROGRESS_FIELDS}
    fields["edges"] = [{**{name: _nan_as_null(getattr(edge, name)) for name in _EDGE_FIELDS},
                        "judged": [{name: getattr(judgement, name) for name in _JUDGEMENT_FIELDS}
                                   for judgement in edge.judged]}
                       for edge in progress.edges]
    return fields


def _nan_as_null(value: object) -> object:
    return None if isinstance(value, float) and math.isnan(value) else value


def _null_as_nan(fields: dict) -> dict:
    return {key: math.nan if value is None else value for key, value in fields.items()}


def _edge_of(fields: dict) -> EdgeCounters:
    judged = tuple(MemberJudgement(**judgement) for judgement in fields.pop("judged", ()))
    return EdgeCounters(**_null_as_nan(fields), judged=judged)


def read_run_log(run_dir: str | Path) -> list[Progress]:
    """The records of a run's metrics log; fields that older logs lack take their defaults, and a line being written
    (no newline yet) is left for a later read."""
    text = (Path(run_dir) / LOG_FILE).read_text()
    records = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        if line.strip():
            fields = json.loads(line)
            edges = tuple(_edge_of(edge) for edge in fields.pop("edges", ()))
            records.append(Progress(**_null_as_nan(fields), edges=edges))
    return records
