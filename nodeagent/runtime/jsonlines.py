"""An append-only JSON-lines file, one object per line: a run's metrics log and its events log."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


class JsonLinesLog:
    """Appends one JSON object per line to `path` (thread-safe). Each append opens the file, writes its line and
    closes it again: a daemon keeps one log per job without holding a descriptor for each. Within `held_open`, the
    file stays open and each line is still written through as it comes (the simulator appends tens of thousands)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._held: TextIO | None = None

    def append_object(self, fields: dict) -> None:
        line = json.dumps(fields) + "\n"
        with self._lock:
            if self._held is not None:
                self._held.write(line)
                return
            with open(self.path, "a") as out:
                out.write(line)

    @contextmanager
    def held_open(self) -> Iterator[None]:
        with open(self.path, "a", buffering=1) as out:  # line-buffered: each record reaches the file at once
            with self._lock:
                self._held = out
            try:
                yield
            finally:
                with self._lock:
                    self._held = None
