"""Receive buffers that outlive one stream, so that a steady exchange does not fault in fresh pages every time.

A freshly allocated 44 MB buffer costs about 20 ms of page faults on first touch here, twice what the whole
transfer takes on loopback. A pool keeps buffers and hands one out again only when nothing made from it is
alive any more: the tensors a decoder builds from a pooled buffer hold a reference to its numpy array (through
`torch.from_numpy`), so the array's reference count says whether an algorithm still keeps any of them. An
algorithm that keeps a received tensor keeps its buffer; the pool then allocates another one.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

ALIGN = 64  # tensors inside one arena start at multiples of this


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class BufferPool:
    """Byte arenas by size, reused once free. Thread-safe; at most `per_size` kept per size, and at most
    `max_bytes` in all (a buffer that would exceed either is allocated and simply not kept)."""

    def __init__(self, per_size: int = 3, max_bytes: int = 4 << 30):
        self.per_size = per_size
        self.max_bytes = max_bytes
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    # The pool's list holds one reference, getrefcount's argument another: a free buffer has exactly these two.
    _FREE_REFS = 2

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes` that nothing else uses. Its content is undefined."""
        with self._lock:
            kept = self._buffers.setdefault(nbytes, [])
            for buffer in kept:
                if sys.getrefcount(buffer) == self._FREE_REFS + 1:  # + 1: the loop variable
                    return buffer
            buffer = torch.empty(nbytes, dtype=torch.uint8).numpy()
            if len(kept) < self.per_size and self._kept + nbytes <= self.max_bytes:
                kept.append(buffer)
                self._kept += nbytes
            return buffer

    @property
    def kept_bytes(self) -> int:
        return self._kept

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
            self._kept = 0
