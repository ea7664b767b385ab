"""Moving tensor bytes between a tensor's memory and the wire, chunk by chunk, without whole-tensor copies.

Sending (`Source`): a CPU tensor that travels in its own dtype is read straight from its memory. Anything else
(a conversion to fp16/bf16, a CUDA tensor) goes through a small ring of staging buffers of one chunk each: the
conversion (on the CPU, in a helper thread) or the device-to-host copy (on a GPU, into pinned buffers on a side
stream) of the chunks ahead is in flight while chunk n is sent, and a buffer is refilled only once its bytes
have been sent.

Receiving (`Sink`): bytes go straight into the destination tensor when it is a CPU tensor of the wire dtype;
otherwise into the ring's current staging buffer, which, once full, is converted into the destination (on the
CPU in the helper thread; on a GPU by an asynchronous host-to-device copy from pinned memory on a side stream)
while the next chunk is received. A staging buffer is refilled only after its copy completed: a CUDA event, or
the helper thread's future. `finish` waits for the copies still in flight.

The same classes serve CPU and CUDA tensors; without a GPU only the CPU branches run. Transfers of one chunk
convert inline (there is nothing to overlap).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import all_finite
from nodeagent.wire.pool import BufferPool

RING = 3  # staging buffers per transfer: one being filled or sent, the others in flight
# Conversions run on at least this many bytes at a time, however small the frames: fewer calls, and the same
# vectorised conversion as a whole-tensor one (torch's scalar and vector paths differ in NaN payloads).
STAGE_MIN_BYTES = 64 << 10
# A slice of received values checked while it is in cache (DirectSink). A multiple of a sealed lane's record
# (lane.RECORD_BYTES, 1 MiB): a slice smaller than a record costs each record an extra copy out of scratch.
FINITE_CHECK_BYTES = 4 << 20
# A GPU's copies go through a deeper ring of larger pinned buffers: each copy and its event cost a fixed few
# microseconds, and the copy engine moves 4 MiB in under 0.1 ms. Measured on an H100 (docs/results.md, "GPU"):
# a 44 MB Push CUDA to CUDA at 1.08x the CPU Push with 3 buffers of 1 MiB, 1.44x with 4 of 4 MiB.
CUDA_RING = 4
CUDA_STAGE_BYTES = 4 << 20

# Conversions of CPU chunks run in these threads, overlapping the socket I/O of the thread that streams (both
# release the GIL); shared by every stream of the process, a conversion never waits on anything but memory.
# CPU_OVERLAP False converts inline, in one buffer. On 2 cores the two measured alike (44 MB in fp16: 11.4-14.6 ms
# against 11.8-17.1 ms, within the noise); overlap is kept for machines with cores to spare.
CPU_OVERLAP = True
_CONVERTER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="wire-convert")

# CPU staging buffers are reused across transfers: allocating and freeing a few 1 MiB buffers per transfer in
# several threads leaves each thread's malloc arena holding them (tens of MB of resident memory after a while).
_STAGING = BufferPool(per_size=16, max_bytes=32 << 20)
_POOLED_MIN = 256 << 10


def host_buffer(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """A uint8 staging buffer: pinned ones come from torch's caching host allocator, large CPU ones from a
    process-wide pool, small ones fresh."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes >= _POOLED_MIN:
        return torch.from_numpy(_STAGING.take(nbytes))
    return torch.empty(nbytes, dtype=torch.uint8)


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _stage_size(buffer_bytes: int, itemsize: int, nbytes: int) -> int:
    """Staging buffer size: a whole number of elements, at least one, at most what the tensor needs."""
    size = max(itemsize, buffer_bytes - buffer_bytes % itemsize)
    return max(itemsize, min(size, nbytes))


class Source:
    """The wire bytes of one tensor, produced piece by piece. A piece stays valid until the next is asked for."""

    nbytes: int
    itemsize: int = 1  # a part of the bytes starts and ends on a multiple of this

    def pieces(self, limit: int | None) -> Iterator[memoryview]:
        raise NotImplementedError

    def part(self, start: int, stop: int) -> Source:
        """Bytes [start, stop) of this source, as a source of their own (independent staging)."""
        raise NotImplementedError


class BytesSource(Source):
    """Bytes that are already in host memory in their wire form (a contiguous CPU tensor, top-k arrays)."""

    def __init__(self, data: np.ndarray):
        self.data = data
        self.nbytes = data.size

    def part(self, start: int, stop: int) -> Source:
        return BytesSource(self.data[start:stop])

    def pieces(self, limit: int | None) -> Iterator[memoryview]:
        view = memoryview(self.data)
        if limit is None or limit >= self.nbytes:
            if self.nbytes:
                yield view
            return
        for start in range(0, self.nbytes, limit):
            yield view[start : start + limit]


class StagedSource(Source):
    """A tensor that needs converting to the wire dtype or copying off a GPU first, one staging buffer at a time."""

    def __init__(self, flat: torch.Tensor, wire_dtype: torch.dtype, buffer_bytes: int):
        self.flat = flat  # 1-D, contiguous, on its own device
        self.wire_dtype = wire_dtype
        self.itemsize = wire_dtype.itemsize
        self.nbytes = flat.numel() * self.itemsize
        self.buffer_bytes = buffer_bytes

    def part(self, start: int, stop: int) -> Source:
        if start % self.itemsize or stop % self.itemsize:
            raise ValueError(f"bytes [{start}, {stop}) split an element of {self.itemsize} bytes")
        flat = self.flat[start // self.itemsize : stop // self.itemsize]
        return StagedSource(flat, self.wire_dtype, self.buffer_bytes)

    def pieces(self, limit: int | None) -> Iterator[memoryview]:
        if self.nbytes == 0:
            return
        least = CUDA_STAGE_BYTES if self.flat.is_cuda else STAGE_MIN_BYTES
        size = _stage_size(max(self.buffer_bytes, least), self.itemsize, self.nbytes)
        step = size // self.itemsize
        ranges = [(start, min(start + step, self.flat.numel())) for start in range(0, self.flat.numel(), step)]
        filled = self._cuda(ranges, size) if self.flat.is_cuda else self._cpu(ranges, size)
        for view in filled:
            if limit is None or limit >= len(view):
                yield view
            else:
                for start in range(0, len(view), limit):
                    yield view[start : start + limit]

    def _cpu(self, ranges: list[tuple[int, int]], size: int) -> Iterator[memoryview]:
        count = min(RING if CPU_OVERLAP else 1, len(ranges))
        ring = [host_buffer(size) for _ in range(count)]
        views = [memoryview(buffer.numpy()) for buffer in ring]
        if count == 1:
            for start, stop in ranges:
                ring[0].view(self.wire_dtype)[: stop - start].copy_(self.flat[start:stop])
                yield views[0][: (stop - start) * self.itemsize]
            return
        pending: list[Future | None] = [None] * count

        def issue(index: int) -> None:
            start, stop = ranges[index]
            target = ring[index % count].view(self.wire_dtype)[: stop - start]
            pending[index % count] = _CONVERTER.submit(target.copy_, self.flat[start:stop])

        for index in range(count):
            issue(index)
        for index, (start, stop) in enumerate(ranges):
            slot = index % count
            done = pending[slot]
            assert done is not None
            done.result()
            yield views[slot][: (stop - start) * self.itemsize]
            # The consumer has sent this buffer: convert the chunk `count` places ahead into it.
            if index + count < len(ranges):
                issue(index + count)

    def _cuda(self, ranges: list[tuple[int, int]], size: int) -> Iterator[memoryview]:
        device = self.flat.device
        stream = torch.cuda.Stream(device)
        # The side stream reads what the producer's stream wrote, and the caching allocator must not hand the
        # tensor's memory out again before the side stream is done with it.
        stream.wait_stream(torch.cuda.current_stream(device))
        self.flat.record_stream(stream)
        count = min(CUDA_RING, len(ranges))
        ring = [host_buffer(size, pinned=True) for _ in range(count)]
        events: list[torch.cuda.Event | None] = [None] * count

        def issue(index: int) -> None:
            start, stop = ranges[index]
            slot = index % count
            with torch.cuda.stream(stream):
                ring[slot].view(self.wire_dtype)[: stop - start].copy_(self.flat[start:stop], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            events[slot] = event

        for index in range(count):
            issue(index)
        for index, (start, stop) in enumerate(ranges):
            slot = index % count
            event = events[slot]
            assert event is not None
            event.synchronize()
            yield memoryview(ring[slot].numpy())[: (stop - start) * self.itemsize]
            # The consumer has sent this buffer: refill it with the chunk `count` places ahead.
            if index + count < len(ranges):
                issue(index + count)


def source_for(tensor: torch.Tensor, wire_dtype: torch.dtype, buffer_bytes: int) -> Source:
    """How one tensor's wire bytes are produced: straight from its memory when it can be, else staged."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_cuda:
        flat = flat.cpu().contiguous()  # a no-op for contiguous CPU tensors; other devices copy once
        if wire_dtype == flat.dtype:
            return BytesSource(flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8))
    else:
        flat = flat.contiguous()
    return StagedSource(flat, wire_dtype, buffer_bytes)


ReadInto = Callable[[memoryview], None]  # fills the whole view from a lane, or raises


class Sink:
    """Where one tensor's wire bytes go on receipt."""

    nbytes: int
    filled: int = 0

    @property
    def remaining(self) -> int:
        return self.nbytes - self.filled

    def write(self, data: memoryview) -> None:
        """Take the next bytes (at most `remaining`)."""
        raise NotImplementedError

    def read_from(self, read_into: ReadInto, count: int) -> None:
        """Take the next `count` bytes from a lane."""
        raise NotImplementedError

    def finish(self) -> None:
        """All bytes are in: complete pending copies."""

    def part(self, start: int, stop: int) -> Sink:
        """A sink of its own for bytes [start, stop), which another thread may fill meanwhile; `start` and
        `stop` are whole elements of `itemsize`."""
        raise NotImplementedError

    itemsize: int = 1


class DirectSink(Sink):
    """Bytes straight into host memory (a CPU destination of the wire dtype, or a top-k staging array).

    With a floating `dtype` the values are checked finite as they land, a slice of FINITE_CHECK_BYTES at a time
    while it is in cache, rather than in a second pass over the whole tensor once it is complete (44 MB: 17-21 ms
    to decode with that pass, against 7 ms without a check); a non-finite value raises WireError ("non_finite",
    naming tensor `name`)."""

    def __init__(self, target: np.ndarray, dtype: torch.dtype | None = None, name: str = ""):
        self.target = target
        self.nbytes = target.size
        self.filled = 0
        self.dtype = dtype if dtype is not None and dtype.is_floating_point else None
        self.itemsize = dtype.itemsize if dtype is not None else 1
        self.name = name
        self.checked = 0  # bytes checked finite so far

    @property
    def checks_finite(self) -> bool:
        return self.dtype is not None

    def _check(self) -> None:
        """Check the whole elements filled since the last check."""
        if self.dtype is None:
            return
        end = self.filled - self.filled % self.itemsize
        if end > self.checked:
            values = torch.from_numpy(self.target[self.checked : end]).view(self.dtype)
            if not all_finite(values):
                raise WireError(Reason.NON_FINITE, f"tensor {self.name!r} has non-finite values")
            self.checked = end

    def write(self, data: memoryview) -> None:
        n = len(data)
        self.target[self.filled : self.filled + n] = np.frombuffer(data, np.uint8)
        self.filled += n
        self._check()

    def read_from(self, read_into: ReadInto, count: int) -> None:
        view = memoryview(self.target)
        step = FINITE_CHECK_BYTES if self.dtype is not None else count
        stop = self.filled + count
        while self.filled < stop:
            n = min(step, stop - self.filled)
            read_into(view[self.filled : self.filled + n])
            self.filled += n
            self._check()

    def part(self, start: int, stop: int) -> Sink:
        return DirectSink(self.target[start:stop], self.dtype, self.name)


class StagedSink(Sink):
    """Bytes into staging buffers, flushed into the destination (converted, or copied to a GPU) when full."""

    def __init__(self, dest: torch.Tensor, wire_dtype: torch.dtype, buffer_bytes: int):
        self.dest = dest  # 1-D, contiguous
        self.wire_dtype = wire_dtype
        self.itemsize = wire_dtype.itemsize
        self.nbytes = dest.numel() * self.itemsize
        self.filled = 0
        self.buffer_bytes = buffer_bytes
        self.cuda = dest.is_cuda
        least = CUDA_STAGE_BYTES if self.cuda else STAGE_MIN_BYTES
        self.size = _stage_size(max(buffer_bytes, least), self.itemsize, max(self.nbytes, self.itemsize))
        self.flushed = 0  # elements of dest written (or in flight)
        ring = CUDA_RING if self.cuda else RING if CPU_OVERLAP else 1
        self.count = max(1, min(ring, -(-self.nbytes // self.size)))
        self.slot = 0
        self.level = 0  # bytes in the current staging buffer
        # What last read each staging buffer and may still be running: a CUDA event, or a converter future.
        self.pending: list[torch.cuda.Event | Future | None] = [None] * self.count
        self.ring: list[torch.Tensor] = []  # allocated on first use: a sink split into parts never uses its own

    def _allocate(self) -> None:
        self.ring = [host_buffer(self.size, pinned=self.cuda) for _ in range(self.count)]
        self.views = [memoryview(buffer.numpy()) for buffer in self.ring]
        if self.cuda:
            self.stream = torch.cuda.Stream(self.dest.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.dest.device))
            self.dest.record_stream(self.stream)
            converted = self.wire_dtype != self.dest.dtype
            self.device_ring = [
                torch.empty(self.size, dtype=torch.uint8, device=self.dest.device) for _ in range(self.count)
            ] if converted else []

    def part(self, start: int, stop: int) -> Sink:
        if start % self.itemsize or stop % self.itemsize:
            raise ValueError(f"bytes [{start}, {stop}) split an element of {self.itemsize} bytes")
        return StagedSink(self.dest[start // self.itemsize : stop // self.itemsize], self.wire_dtype,
                          self.buffer_bytes)

    def _wait(self, slot: int) -> None:
        pending = self.pending[slot]
        if pending is not None:
            if isinstance(pending, Future):
                pending.result()
            else:
                pending.synchronize()
            self.pending[slot] = None

    def _buffer(self) -> memoryview:
        """The current staging buffer, once the copy that last read it has completed."""
        if not self.ring:
            self._allocate()
        self._wait(self.slot)
        return self.views[self.slot]

    def _flush(self) -> None:
        if self.level == 0:
            return
        elements = self.level // self.itemsize
        target = self.dest[self.flushed : self.flushed + elements]
        staged = self.ring[self.slot][: self.level]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if self.wire_dtype == self.dest.dtype:
                    target.copy_(staged.view(self.wire_dtype), non_blocking=True)
                else:  # copied over in the wire dtype (half the bytes), converted on the device
                    on_device = self.device_ring[self.slot][: self.level]
                    on_device.copy_(staged, non_blocking=True)
                    target.copy_(on_device.view(self.wire_dtype))
                event = torch.cuda.Event()
                event.record(self.stream)
            self.pending[self.slot] = event
        elif self.count > 1:
            self.pending[self.slot] = _CONVERTER.submit(target.copy_, staged.view(self.wire_dtype))
        else:
            target.copy_(staged.view(self.wire_dtype))
        self.slot = (self.slot + 1) % self.count
        self.flushed += elements
        self.level = 0

    def write(self, data: memoryview) -> None:
        offset = 0
        while offset < len(data):
            buffer = self._buffer()
            take = min(self.size - self.level, len(data) - offset)
            buffer[self.level : self.level + take] = data[offset : offset + take]
            self.level += take
            offset += take
            if self.level == self.size:
                self._flush()
        self.filled += len(data)

    def read_from(self, read_into: ReadInto, count: int) -> None:
        while count:
            buffer = self._buffer()
            take = min(self.size - self.level, count)
            read_into(buffer[self.level : self.level + take])
            self.level += take
            self.filled += take
            count -= take
            if self.level == self.size:
                self._flush()

    def finish(self) -> None:
        # The total is a whole number of elements (checked against the manifest), so nothing is left over.
        self._flush()
        for slot in range(self.count):
            self._wait(slot)
