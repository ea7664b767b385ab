"""The metrics log of a run: one JSON object per line, written by the coordinator for real runs and by the
simulator (with virtual time) for simulated ones, and read by reports and tests."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "metrics.jsonl"


@dataclass(frozen=True)
class ProgressRecord:
    time: float  # seconds: wall clock (Unix) for real runs, virtual time for simulated ones
    job: str
    rank: int
    node: str
    step: int
    loss: float | None
    test_accuracy: float | None
    test_loss: float | None
    elapsed_s: float
    finished: bool
    bytes_sent: int
    bytes_received: int
    compute_s: float
    wait_s: float
    exchanges: int
    exchange_failures: int


def optional(value: float) -> float | None:
    """NaN (not measured yet) is written as null."""
    return None if math.isnan(value) else value


class RunLog:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / FILE_NAME
        self._lock = threading.Lock()

    def append(self, record: ProgressRecord) -> None:
        line = json.dumps(asdict(record)) + "\n"
        with self._lock, open(self.path, "a") as out:
            out.write(line)


def read_run_log(run_dir: str | Path) -> list[ProgressRecord]:
    path = Path(run_dir) / FILE_NAME
    return [ProgressRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
