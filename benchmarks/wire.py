"""Benchmark: one fp32 tensor streamed between two processes on 127.0.0.1, peer service against gloo.

    .venv/bin/python benchmarks/wire.py [--size-mb 44] [--repeats 20] [--chunk-bytes 1048576 ...] [--profile]

Measures, in one run (TARGETS.md, "System performance"):
1. the real peer service: a server process serves `PeerServicer` (the agent's servicer, its gRPC options and
   thread pool size); a client process streams the tensor with `Push` (one way: the server decodes it into its
   own buffer, then replies) and with `Exchange` (the server answers with a tensor of the same size);
2. torch.distributed gloo send/recv of the same tensor between two other processes;
3. the receiver's peak extra memory for `Push` (RSS high-water mark of the server process).
Rates are payload bytes per second, 1 GB = 1e9 bytes. It prints today's figures and whether the target is met;
it asserts nothing.

Only the standard library is imported at module level, on purpose: a child started with "spawn" inherits its
parent's RSS high-water mark in `ru_maxrss` (Linux keeps the replaced address space's peak across exec), so the
parent must stay small for the server's figure to mean anything. torch and grpc are imported in the children.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

MIB = 1 << 20
MAX_CHUNK_BYTES = 64 << 20  # jobspec.WireSpec.chunk_bytes allows at most this; GRPC_OPTIONS is sized for it
CALL_TIMEOUT_S = 60.0  # one RPC, one gloo operation: far above what a 44 MB transfer takes on loopback
STAGE_TIMEOUT_S = 240.0  # one whole stage (start, warm-up, repeats); a hung child is killed after it
TENSOR_NAME = "w"
JOB_ID = "bench"


@dataclass(frozen=True)
class Config:
    numel: int
    repeats: int
    warmup: int
    chunk_sizes: tuple[int, ...]
    profile: bool

    @property
    def nbytes(self) -> int:
        return self.numel * 4  # float32


class DiscardingInbox(queue.Queue):
    """The server's inbox. Nothing trains here, so a received message is dropped at once: what stays counted
    is the transport's own memory, not a backlog of messages that a training thread would have absorbed."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        del item, block, timeout


def run_child(body: Callable[..., None], conn: Connection, *args: Any) -> None:
    """A child process's entry point: run `body`; on failure, send its traceback back through `conn`."""
    try:
        body(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def peer_server(conn: Connection, config: Config, chunk: int) -> None:
    """Serve PeerServicer as rank 1 of a two-rank job; answer "rss" and "stop" commands on `conn`."""
    import cProfile
    import io
    import pstats
    from concurrent import futures

    import grpc
    import torch

    from nodeagent._proto import peer_pb2_grpc
    from nodeagent.algorithms.base import Snapshot
    from nodeagent.mesh.grpc import GRPC_OPTIONS, PeerServicer, ServingState
    from nodeagent.metrics import Metrics
    from nodeagent.wire.codec import WireError
    from nodeagent.wire.message import Encoding, Kind, TensorSpec

    torch.set_num_threads(1)
    spec = TensorSpec(TENSOR_NAME, torch.float32, (config.numel,))

    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender != 0 or kind != Kind.PARAMS:
            raise WireError("not_neighbor", f"only PARAMS from rank 0 are accepted, not {kind.name} from {sender}")
        return [spec]

    # Exchange replies with this tensor; ones() touches its pages so they are in the baseline RSS already.
    served = Snapshot(rank=1, clock=0, loss=0.0, served={(None, Kind.PARAMS): {TENSOR_NAME: torch.ones(config.numel)}})
    state = ServingState(
        job_id=JOB_ID, node_id="server", rank=1, algorithm_name="bench", names={0: "client", 1: "server"},
        expected=expected, snapshot=lambda: served, inbox=DiscardingInbox(), encoding=Encoding.RAW,
        chunk_bytes=chunk, max_message_bytes=max(1 << 30, config.nbytes),
    )
    profiler = cProfile.Profile()

    class ProfiledServicer(PeerServicer):
        """Profiles Push in the handler thread (cProfile only sees the thread that enables it)."""

        def Push(self, request_iterator, context):
            profiler.enable()
            try:
                return super().Push(request_iterator, context)
            finally:
                profiler.disable()

    servicer_type = ProfiledServicer if config.profile else PeerServicer
    # The agent's own server setup (nodeagent/agent.py): a 16-thread pool and GRPC_OPTIONS.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer"), options=GRPC_OPTIONS)
    peer_pb2_grpc.add_PeerServicer_to_server(servicer_type(lambda: state, Metrics(), "bench"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("cannot listen on 127.0.0.1")
    server.start()
    conn.send(("ready", port, maxrss_bytes()))
    try:
        while True:
            command = conn.recv()
            if command == "rss":
                conn.send(("rss", maxrss_bytes()))
            elif command == "stop":
                report = ""
                if config.profile:
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
                    report = out.getvalue()
                conn.send(("stopped", report))
                return
    finally:
        server.stop(grace=1.0)


def peer_client(conn: Connection, port: int, config: Config, chunk: int) -> None:
    """Push the tensor, then (when asked) Exchange it; send back the timings (seconds)."""
    import grpc
    import torch

    from nodeagent.algorithms.base import Snapshot
    from nodeagent.mesh.grpc import PeerClient, ServingState
    from nodeagent.metrics import Metrics
    from nodeagent.wire.codec import WireError, encode
    from nodeagent.wire.message import Encoding, Kind, Message, TensorSpec

    torch.set_num_threads(1)
    spec = TensorSpec(TENSOR_NAME, torch.float32, (config.numel,))
    message = Message(Kind.PARAMS, 0, 1, {TENSOR_NAME: torch.randn(config.numel)})
    client = PeerClient(f"127.0.0.1:{port}")  # the agent's client channel, with GRPC_OPTIONS
    grpc.channel_ready_future(client.channel).result(timeout=CALL_TIMEOUT_S)
    samples = []
    for i in range(config.warmup + config.repeats):
        started = time.perf_counter()
        # encode() is lazy: the frames are built while gRPC sends them, so encoding is inside the timing, as it
        # is for an agent. The reply comes once the server has decoded the whole stream into its own buffer.
        frames = encode(message, job_id=JOB_ID, sender_id="client", chunk_bytes=chunk)
        reply = client.stub.Push(frames, timeout=CALL_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        if reply.bytes_received != config.nbytes:
            raise RuntimeError(f"server received {reply.bytes_received} bytes, sent {config.nbytes}")
        if i >= config.warmup:
            samples.append(elapsed)
    conn.send(("timings", samples))
    if conn.recv() != "exchange":  # the parent reads the server's RSS between Push and Exchange
        return

    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender != 1 or kind != Kind.PARAMS:
            raise WireError("wrong_sender", f"only PARAMS from rank 1 are accepted, not {kind.name} from {sender}")
        return [spec]

    # PeerClient.exchange is the agent's own path: encode, stream, decode and validate the reply.
    own = ServingState(
        job_id=JOB_ID, node_id="client", rank=0, algorithm_name="bench", names={0: "client", 1: "server"},
        expected=expected, snapshot=lambda: Snapshot(rank=0, clock=0, loss=0.0, served={}), inbox=queue.Queue(),
        encoding=Encoding.RAW, chunk_bytes=chunk, max_message_bytes=max(1 << 30, config.nbytes),
    )
    metrics = Metrics()
    samples = []
    for i in range(config.warmup + config.repeats):
        started = time.perf_counter()
        answer = client.exchange(own, message, CALL_TIMEOUT_S, metrics)
        elapsed = time.perf_counter() - started
        if answer.payload_bytes != config.nbytes:
            raise RuntimeError(f"exchange answered {answer.payload_bytes} bytes, expected {config.nbytes}")
        if i >= config.warmup:
            samples.append(elapsed)
    client.close()
    conn.send(("timings", samples))


def gloo_peer(conn: Connection, rank: int, port: int, config: Config) -> None:
    """Rank 0 sends the tensor to rank 1 with torch.distributed gloo; both send back their timings."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only; don't let gloo resolve the host name
    address = f"tcp://127.0.0.1:{port}"
    timeout = timedelta(seconds=CALL_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timeout)
    try:
        # The receiver reuses one buffer, as a training job on gloo would. The peer service's decoder allocates a
        # fresh one per stream by design (it hands tensors over only once a stream is complete), and pays the page
        # faults of that allocation inside its timing: part of what this comparison is meant to show.
        tensor = torch.randn(config.numel) if rank == 0 else torch.empty(config.numel)
        samples = []
        for i in range(config.warmup + config.repeats):
            # Both sides leave the barrier together (to within a loopback round trip, tens of microseconds
            # against tens of milliseconds), then each times its own half; the parent takes the later finish.
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)
            elapsed = time.perf_counter() - started
            if i >= config.warmup:
                samples.append(elapsed)
        conn.send(("timings", samples))
    finally:
        dist.destroy_process_group()


class Stage:
    """Child processes of one measurement; every one of them is killed when the stage ends, however it ends."""

    def __init__(self, context: mp.context.SpawnContext):
        self.context = context
        self.children: list[tuple[BaseProcess, Connection]] = []
        self.deadline = time.monotonic() + STAGE_TIMEOUT_S

    def start(self, body: Callable[..., None], *args: Any) -> Connection:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=run_child, args=(body, theirs, *args), daemon=True)
        process.start()
        theirs.close()
        self.children.append((process, ours))
        return ours

    def receive(self, conn: Connection, what: str) -> tuple[Any, ...]:
        """The next message from a child; raises if it failed, died or passed the stage's deadline."""
        process = next(p for p, c in self.children if c is conn)
        while not conn.poll(0.2):
            if not process.is_alive() and not conn.poll(0):
                raise RuntimeError(f"{what}: the child process exited with code {process.exitcode}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{what}: no answer within {STAGE_TIMEOUT_S:.0f} s")
        reply = conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"{what} failed in the child process:\n{reply[1]}")
        return reply

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # After a success the children are finishing on their own; after a failure nothing waits for them.
        grace = 0.1 if exc_type is not None else max(0.1, min(5.0, self.deadline - time.monotonic()))
        for process, conn in self.children:
            process.join(timeout=grace)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
            conn.close()


def free_port() -> int:
    """A port nothing listens on now (gloo's rendezvous needs a number up front; the race is harmless here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class PeerResult:
    chunk: int
    push: list[float]
    exchange: list[float]
    push_extra_bytes: int  # the server's RSS high-water mark after the Push runs, less the one before them
    exchange_extra_bytes: int  # the same after the Exchange runs too
    profile: str


def measure_peer_service(context: mp.context.SpawnContext, config: Config, chunk: int) -> PeerResult:
    """One fresh server per chunk size: a high-water mark cannot be reset, so each needs its own process."""
    with Stage(context) as stage:
        server = stage.start(peer_server, config, chunk)
        _, port, baseline = stage.receive(server, "peer server start")
        client = stage.start(peer_client, port, config, chunk)
        _, push = stage.receive(client, "peer client Push")
        server.send("rss")
        _, after_push = stage.receive(server, "server RSS")
        client.send("exchange")
        _, exchange = stage.receive(client, "peer client Exchange")
        server.send("rss")
        _, after_exchange = stage.receive(server, "server RSS")
        server.send("stop")
        _, profile = stage.receive(server, "peer server stop")
    return PeerResult(chunk, push, exchange, after_push - baseline, after_exchange - baseline, profile)


def measure_gloo(context: mp.context.SpawnContext, config: Config) -> list[float]:
    port = free_port()
    with Stage(context) as stage:
        sender = stage.start(gloo_peer, 0, port, config)
        receiver = stage.start(gloo_peer, 1, port, config)
        _, sent = stage.receive(sender, "gloo sender")
        _, received = stage.receive(receiver, "gloo receiver")
    # The transfer is over when both sides are: the later of the two finishes, repeat by repeat.
    return [max(s, r) for s, r in zip(sent, received, strict=True)]


def rates(nbytes: int, samples: list[float]) -> tuple[float, float]:
    """Best and median rate in GB/s (1e9 bytes)."""
    return nbytes / min(samples) / 1e9, nbytes / statistics.median(samples) / 1e9


def chunk_label(chunk: int) -> str:
    return f"{chunk // MIB} MiB" if chunk % MIB == 0 else f"{chunk} B"


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        description="Stream one fp32 tensor between two processes on 127.0.0.1: the peer service (Push, Exchange) "
        "against torch.distributed gloo send/recv. Prints GB/s (1e9 bytes) and the receiver's peak extra memory."
    )
    parser.add_argument("--size-mb", type=float, default=44.0, help="tensor size in MB of 1e6 bytes (default 44)")
    parser.add_argument("--repeats", type=int, default=20, help="timed transfers per method (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed transfers first (default 2)")
    parser.add_argument(
        "--chunk-bytes", type=int, nargs="+", default=[MIB],
        help="chunk size(s) of the peer-service frames, each measured with its own server process "
        "(default 1048576, the job spec's default)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the server's Push handler and print it")
    args = parser.parse_args(argv)
    numel = int(args.size_mb * 1e6 / 4)
    if numel < 1:
        parser.error("--size-mb must give at least one float32")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    for chunk in args.chunk_bytes:
        if not 1 <= chunk <= MAX_CHUNK_BYTES:
            parser.error(f"--chunk-bytes must be between 1 and {MAX_CHUNK_BYTES} (gRPC's frame limit)")
    return Config(numel, args.repeats, args.warmup, tuple(args.chunk_bytes), args.profile)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    context = mp.get_context("spawn")
    nbytes = config.nbytes
    size = f"{nbytes / 1e6:.1f} MB"
    print(
        f"wire benchmark: one fp32 tensor of {size} ({config.numel:,} elements), two processes on 127.0.0.1, "
        f"{config.repeats} timed repeats after {config.warmup} warm-up, {os.cpu_count()} CPUs",
        flush=True,
    )
    started = time.monotonic()
    # The peer service first, while this process is still small (see the docstring).
    peers = [measure_peer_service(context, config, chunk) for chunk in config.chunk_sizes]
    gloo = measure_gloo(context, config)

    rows = []
    for peer in peers:
        chunks = f"{chunk_label(peer.chunk)} chunks"
        rows.append((f"peer service Push (one way), {chunks}", size, *rates(nbytes, peer.push)))
        rows.append((f"peer service Exchange (both ways), {chunks}", f"2 x {size}", *rates(2 * nbytes, peer.exchange)))
    rows.append(("torch.distributed gloo send/recv (one way)", size, *rates(nbytes, gloo)))
    print()
    print(f"{'method':<52} {'size':>12} {'best GB/s':>10} {'median GB/s':>12}")
    for method, label, best, median in rows:
        print(f"{method:<52} {label:>12} {best:>10.3f} {median:>12.3f}")

    gloo_best, gloo_median = rates(nbytes, gloo)
    print()
    for peer in peers:
        push_best, push_median = rates(nbytes, peer.push)
        ratio = push_median / gloo_median
        verdict = "target met" if ratio >= 1.0 else "below target"
        print(
            f"peer service Push / gloo, {chunk_label(peer.chunk)} chunks: {ratio:.2f} on medians, "
            f"{push_best / gloo_best:.2f} on bests -> {verdict} (TARGETS.md: >= 1.0)"
        )
    for peer in peers:
        for what, extra in (("Push", peer.push_extra_bytes), ("Push + Exchange", peer.exchange_extra_bytes)):
            multiple = extra / nbytes
            memory_verdict = "target met" if multiple <= 2.0 else "above target"
            print(
                f"receiver peak extra RSS, {what}, {chunk_label(peer.chunk)} chunks: {extra / 1e6:.1f} MB "
                f"= {multiple:.2f}x the tensor -> {memory_verdict} (TARGETS.md: <= 2x)"
            )
    print(f"(took {time.monotonic() - started:.1f} s)")
    for peer in peers:
        if peer.profile:
            print(f"\ncProfile of the server's Push handler thread, {chunk_label(peer.chunk)} chunks, by own time")
            print("(gRPC deserializes each frame in its own polling thread, which this does not see):")
            print(peer.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
