"""A job's events: what happened to it and on its nodes, in the words of the node or the coordinator.

Agents forward their job events (started, resumed, rejoined, quorum changes, failed, finished) and their log lines
of WARNING and above to the coordinator, which stamps them and appends them to `events.jsonl` in the job's run
directory; the coordinator adds its own (submitted, running, topology changed, stopped, failed, finished). The
simulator writes the same file with virtual times. `coordinator logs JOB` shows it and `coordinator report` marks
it on the plots.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nodeagent.rpc import plain_text
from nodeagent.runtime.jsonlines import JsonLinesLog

EVENTS_FILE = "events.jsonl"
MAX_MESSAGE_CHARS = 2000  # of one event's text: a node's words are cut there before they are stored or shown

# The kinds of event. A node's log line is LOG; the others are the job's lifecycle.
SUBMITTED = "submitted"
STARTED = "started"
RESUMED = "resumed"
REJOINED = "rejoined"
FAILED = "failed"
FINISHED = "finished"
STOPPED = "stopped"
TOPOLOGY = "topology"
READY = "ready"  # a node built its part and waits for the start barrier
RELEASED = "released"  # every rank was ready: the coordinator released the start barrier
JOINED = "joined"  # an agent joined a running elastic job (the coordinator's event, and the node's)
LEFT = "left"  # a member left a running elastic job (the coordinator's event)
QUORUM = "quorum"  # an all-reduce quorum formed (members lost or back), or a step aborted
SUSPECTED = "suspected"  # a member's contributions are persistently outlying, or no longer (the coordinator's)
QUARANTINED = "quarantined"  # a member's contributions are dropped from the job, or taken again (the coordinator's)
LOG = "log"
KINDS = (SUBMITTED, STARTED, READY, RELEASED, RESUMED, REJOINED, JOINED, LEFT, FAILED, FINISHED, STOPPED, TOPOLOGY,
         QUORUM, SUSPECTED, QUARANTINED, LOG)
NODE_KINDS = (STARTED, READY, RESUMED, REJOINED, JOINED, FAILED, FINISHED, QUORUM, LOG)  # what an agent may report
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
READ_BYTES = 256 * 1024  # of the log, read at most per call of read_events


@dataclass(frozen=True)
class Event:
    time: float  # Unix time at the coordinator; virtual seconds in the simulator
    job: str
    kind: str  # one of KINDS
    message: str
    level: str = "INFO"  # one of LEVELS
    rank: int = -1  # the node's rank in the job; -1: the job as a whole (the coordinator's events)
    node: str = ""  # the node's id (agents) or name (simulated nodes); empty for the coordinator's events
    step: int = -1  # the node's step when it happened; -1: unknown

    def line(self) -> str:
        """The event as a person reads it (`coordinator logs`)."""
        stamp = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time)) if self.time > 1e9
                 else f"t={self.time:9.2f}s")
        where = f"rank {self.rank} ({self.node})" if self.rank >= 0 else "coordinator"
        at = f" step {self.step}" if self.step >= 0 else ""
        return f"{stamp} {self.level:<7} {where}{at} [{self.kind}] {self.message}"


def bounded(text: str) -> str:
    """Words for an event, cut to MAX_MESSAGE_CHARS, on one line and plain (nodeagent.rpc.plain_text): no node's
    event can move the terminal of `coordinator logs`."""
    cleaned = plain_text(text[:MAX_MESSAGE_CHARS])
    return cleaned if len(text) <= MAX_MESSAGE_CHARS else cleaned + " [cut]"


class EventLog(JsonLinesLog):
    """`events.jsonl` in a run directory: one JSON object per event, appended (thread-safe)."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / EVENTS_FILE)

    def append(self, event: Event) -> None:
        self.append_object(asdict(event))


def level_at_least(level: str, minimum: str) -> bool:
    """Whether `level` is `minimum` or above (an empty minimum admits all)."""
    return not minimum or LEVELS.index(level) >= LEVELS.index(minimum)


def read_events(run_dir: str | Path, offset: int = 0, max_bytes: int | None = None) -> tuple[list[Event], int]:
    """The events of a run from byte `offset` of its log (0: all; at most `max_bytes` of it), and the offset after
    the last whole line read (to read on from there). A run without events has none; a line being written is left
    for the next read, and one that cannot be read is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    try:
        with open(path, "rb") as source:
            source.seek(offset)
            data = source.read(-1 if max_bytes is None else max_bytes)
    except FileNotFoundError:
        return [], offset
    events = []
    end = data.rfind(b"\n") + 1
    for raw in data[:end].splitlines():
        try:
            events.append(Event(**json.loads(raw)))
        except (ValueError, TypeError):
            continue  # an empty or torn line (a crash while writing), or an offset inside a line
    return events, offset + end


