"""Striping: a stream's payload split into contiguous parts, one per lane, and the lanes' reads or writes run
together.

The payload is the stream's items (the tensors' wire bytes, or the receiver's buffers for them) back to back, so
the arithmetic here needs only their sizes in bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import TYPE_CHECKING

from nodeagent.wire.errors import WireError

if TYPE_CHECKING:
    from nodeagent.wire.decoder import LaneReader

SHARE_ALIGN = 64  # a payload split between lanes inside a tensor: at a multiple of this from the tensor's start


def split(sizes: Sequence[int], count: int) -> list[tuple[int, int]]:
    """The payload of items of `sizes` bytes split into at most `count` contiguous parts [start, stop) of about
    equal size, one per lane; a boundary inside an item falls on a multiple of SHARE_ALIGN bytes from the item's
    start (a whole element of any wire dtype)."""
    total = sum(sizes)
    if count <= 1 or total == 0:
        return [(0, total)]
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    bounds = [0]
    for index in range(1, count):
        target = total * index // count
        start = max(s for s, size in zip(starts, sizes, strict=True) if s <= target and size)
        bound = start + (target - start) // SHARE_ALIGN * SHARE_ALIGN
        if bound > bounds[-1]:
            bounds.append(bound)
    if total > bounds[-1]:
        bounds.append(total)
    return list(itertools.pairwise(bounds))


def overlaps(sizes: Sequence[int], start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """For each item of `sizes` bytes that payload bytes [start, stop) touch: its index, and the bytes [low, high)
    of it they cover, counted from the item's start."""
    offset = 0
    for index, size in enumerate(sizes):
        low, high = max(start, offset), min(stop, offset + size)
        if low < high:
            yield index, low - offset, high - offset
        offset += size


def run_on_lanes(tasks: Sequence[Callable[[], None]], lanes: Sequence[LaneReader], pool: futures.Executor) -> None:
    """Run one task per lane at once, the first in this thread and the others in `pool`. When one of several
    fails, every lane is aborted (the others stop waiting on their sockets), all tasks are waited for, and the first
    WireError is raised, else the first error. A single lane is left to the caller, which may still answer on it
    (a direct lane's refusal)."""
    pending = [pool.submit(task) for task in tasks[1:]]
    errors: list[BaseException] = []
    try:
        tasks[0]()
    except BaseException as error:
        errors.append(error)
    for future in pending:
        if errors:
            for lane in lanes:
                lane.abort()
        try:
            future.result()
        except BaseException as error:
            errors.append(error)
    if errors:
        if len(lanes) > 1:
            for lane in lanes:
                lane.abort()
        raise next((e for e in errors if isinstance(e, WireError)), errors[0])
