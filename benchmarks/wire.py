"""Benchmark: tensors streamed between two processes on 127.0.0.1, the peer service against gloo; and the cost of
exchanges in a training step.

    .venv/bin/python benchmarks/wire.py [--sizes-mb 1 44 400] [--repeats 10] [--chunk-bytes 1048576]
                                        [--step-model cnn] [--steps 96] [--skip-steps]
                                        [--link-gbit 10]

Measures, in one run (the targets and the figures: docs/results.md, "Wire"):
1. transfers, for each tensor size (1 MB, 44 MB, 400 MB of fp32 by default): four processes live side by side,
   and the measurements take turns, repeat by repeat, so that whatever else the machine does weighs on all
   of them alike:
   - the real peer service: a server process serves `PeerServicer` (the agent's servicer with lanes on, its
     gRPC options, registration and thread pool size); a client process calls `PeerClient.push` (one way: the
     server validates and decodes the stream into its own buffer, then replies) with the job encoding raw,
     fp16 and bf16, `PeerClient.exchange` (the server answers with a tensor of the same size), and `push` to a
     second server that offers no lanes (payload in gRPC chunk frames: the fallback, and the agent's path until
     it passes `lane_host`), and `push` raw to a third server under mutual TLS with sealed lanes (AES-256-GCM
     records, the key granted over the TLS channel; certificates of a fresh cluster CA, made by that server in a
     temporary directory);
   - torch.distributed gloo send/recv of the same fp32 tensor between two other processes;
   - the CPU time of each transfer, sender's and receiver's processes together (time.process_time);
   - the peer server's peak extra memory during each transfer: its RSS high-water mark (VmHWM, reset before
     each transfer through /proc/self/clear_refs), less its resident size before the first transfer. Buffers
     the receiver keeps for the next message (its receive pool) count.
2. the training step: two agent-like processes, each serving peers (lanes on) and training ECL-ISVR
   (pdmm-isvr; DSGD where it is not registered) with K = 8 local steps between two exchanges on their edge, on
   the CNN, its exchanges in a thread pool as in nodeagent/agent/dispatch.py; blocks of 16 steps with exchanges and
   without take turns, both nodes in the same block at once, and the medians of the blocks' wall time per step
   are compared (a block with exchanges lasts until its last exchange has completed).
3. the encodings on a link of `--link-gbit` Gbit/s (default 10): Push raw, fp16 and bf16, Push raw under mutual
   TLS with sealed lanes and gloo of the 44 MB tensor again, in a private network namespace (`unshare --user
   --map-root-user --net`, nothing outside it is touched) whose loopback is shaped with a tc token bucket (tbf). On
   this machine kind loopback is bound by the two cores, not by a wire: every byte costs a kernel copy on each
   side, and converting to and from fp16 costs about what halving the bytes saves there. On a link slower than the
   processors, as between machines, the conversion runs in the shadow of the sending and halving the bytes halves
   the time. Skipped, with the reason, where namespaces or tc are not available.
Rates: payload bytes per second (1 GB = 1e9 bytes), and parameters per second for the encodings. It prints the
figures and whether each target is met (Push under mutual TLS with sealed lanes against gloo's plaintext rate:
>= 0.5 on loopback, >= 0.9 on the shaped link); it asserts nothing.

Only the standard library is imported at module level, and torch and grpc in the children: VmHWM is the child's
own, but where /proc/self/clear_refs cannot be written the figure falls back to `ru_maxrss` over the whole
stage, which a child started with "spawn" inherits from its parent (Linux keeps the replaced address space's
peak across exec), so the parent must stay small for it to mean anything.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeagent.security.tls import Transport

MIB = 1 << 20
MAX_CHUNK_BYTES = 64 << 20  # jobspec.WireSpec.chunk_bytes allows at most this; GRPC_OPTIONS is sized for it
CALL_TIMEOUT_S = 120.0  # one RPC, one gloo operation: far above what a 400 MB transfer takes on loopback
STAGE_TIMEOUT_S = 600.0  # one whole stage; a hung child is killed after it
TENSOR_NAME = "w"
JOB_ID = "bench"
ENCODINGS = ("raw", "fp16", "bf16")


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # numel of each fp32 tensor
    repeats: int
    warmup: int
    chunk_bytes: int
    step_model: str
    step_batch: int
    steps: int
    step_algorithm: str
    skip_steps: bool
    link_gbit: float


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


def proc_status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- transfers


def make_certificates(directory: str) -> None:
    """A fresh cluster CA and the credentials directories of nodes "server" and "client" under `directory`."""
    from pathlib import Path

    from nodeagent.security import pki
    from nodeagent.security.tls import Credentials, TlsDir

    ca_key, ca = pki.create_ca()
    for name in ("server", "client"):
        key = pki.new_private_key()
        cert = pki.issue(ca_key, ca, key.public_key(), pki.Role.NODE, name)
        TlsDir(Path(directory) / name).save(
            Credentials(pki.certificate_pem(ca), pki.certificate_pem(cert), pki.private_key_pem(key)))


def tls_transport(directory: str, name: str) -> Transport:
    from pathlib import Path

    from nodeagent.security.tls import TlsDir, Transport

    return Transport(TlsDir(Path(directory) / name))


def peer_server(conn: Connection, numel: int, chunk: int, lanes: bool, tls_dir: str | None) -> None:
    """Serve PeerServicer as rank 1 of a two-rank job; answer "reset", "peak" and "stop" on `conn`. With `tls_dir`
    it serves gRPC and lanes under mutual TLS, with certificates it makes there first."""
    from concurrent import futures

    import grpc
    import torch

    from nodeagent.algorithms.base import Snapshot
    from nodeagent.metrics import Metrics
    from nodeagent.rpc import GRPC_OPTIONS
    from nodeagent.runtime.peer_service import PeerServicer, ServingState, add_peer_servicer, serve_promptly
    from nodeagent.wire.errors import WireError
    from nodeagent.wire.message import Encoding, Kind, TensorSpec

    torch.set_num_threads(1)
    serve_promptly()  # as the agent does
    spec = TensorSpec(TENSOR_NAME, torch.float32, (numel,))

    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender != 0 or kind != Kind.PARAMS:
            raise WireError("not_neighbor", f"only PARAMS from rank 0 are accepted, not {kind.name} from {sender}")
        return [spec]

    # Exchange replies with this tensor; ones() touches its pages so they are in the baseline RSS already.
    served = Snapshot(rank=1, clock=0, loss=0.0, served={(None, Kind.PARAMS): {TENSOR_NAME: torch.ones(numel)}})
    state = ServingState(
        job_id=JOB_ID, node_id="server", rank=1, algorithm_name="bench", names={0: "client", 1: "server"},
        expected=expected, snapshot=lambda: served, inbox=DiscardingInbox(), encoding=Encoding.RAW,
        chunk_bytes=chunk, max_message_bytes=max(1 << 30, 4 * numel),
    )
    # The agent's own server setup (nodeagent/agent/daemon.py): a 16-thread pool, GRPC_OPTIONS, the generated
    # registration; lanes on the host it listens on, or none.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer"), options=GRPC_OPTIONS)
    transport = None
    if tls_dir is not None:
        make_certificates(tls_dir)
        transport = tls_transport(tls_dir, "server")
    servicer = PeerServicer(lambda: state, Metrics(), "bench", lane_host="127.0.0.1" if lanes else None,
                            secure=transport is not None)
    add_peer_servicer(servicer, server)
    port = transport.bind(server, "127.0.0.1:0") if transport else server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("cannot listen on 127.0.0.1")
    server.start()
    baseline = proc_status_bytes("VmRSS")
    conn.send(("ready", port, baseline if baseline is not None else maxrss_bytes()))
    resettable = reset_peak()
    cpu_start = time.process_time()
    try:
        while True:
            command = conn.recv()
            if command == "reset":
                cpu_start = time.process_time()
                conn.send(("reset", resettable and reset_peak()))
            elif command == "peak":
                peak = proc_status_bytes("VmHWM") if resettable else None
                conn.send(("peak", peak if peak is not None else maxrss_bytes(), time.process_time() - cpu_start))
            elif command == "stop":
                conn.send(("stopped",))
                return
    finally:
        servicer.close()
        server.stop(grace=1.0)


def peer_client(conn: Connection, ports: tuple[int, int, int], numel: int, chunk: int, tls_dir: str) -> None:
    """Run the asked transfers one at a time and send back each one's seconds."""
    import grpc
    import torch

    from nodeagent.algorithms.base import Snapshot
    from nodeagent.metrics import Metrics
    from nodeagent.runtime.peer_service import PeerClient, ServingState, serve_promptly
    from nodeagent.wire.errors import WireError
    from nodeagent.wire.message import Encoding, Kind, Message, TensorSpec

    torch.set_num_threads(1)
    serve_promptly()  # as the agent does
    spec = TensorSpec(TENSOR_NAME, torch.float32, (numel,))
    message = Message(Kind.PARAMS, 0, 1, {TENSOR_NAME: torch.randn(numel)})

    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender != 1 or kind != Kind.PARAMS:
            raise WireError("wrong_sender", f"only PARAMS from rank 1 are accepted, not {kind.name} from {sender}")
        return [spec]

    def state(encoding: str) -> ServingState:
        return ServingState(
            job_id=JOB_ID, node_id="client", rank=0, algorithm_name="bench", names={0: "client", 1: "server"},
            expected=expected, snapshot=lambda: Snapshot(rank=0, clock=0, loss=0.0, served={}), inbox=queue.Queue(),
            encoding=Encoding.from_name(encoding), chunk_bytes=chunk, max_message_bytes=max(1 << 30, 4 * numel),
        )

    states = {encoding: state(encoding) for encoding in ENCODINGS}
    # The agent's client, to a server that offers lanes, to one that does not (it falls back to frames), and to
    # one under mutual TLS (its lanes sealed).
    laned = PeerClient(f"127.0.0.1:{ports[0]}")
    framed = PeerClient(f"127.0.0.1:{ports[1]}")
    secure = PeerClient(f"127.0.0.1:{ports[2]}", transport=tls_transport(tls_dir, "client"), server_name="server")
    for client in (laned, framed, secure):
        grpc.channel_ready_future(client.channel).result(timeout=CALL_TIMEOUT_S)
    metrics = Metrics()
    conn.send(("ready",))
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        what, encoding = command
        started = time.perf_counter()
        cpu_start = time.process_time()
        if what == "push":
            laned.push(states[encoding], message, CALL_TIMEOUT_S, metrics)
        elif what == "push-frames":
            framed.push(states[encoding], message, CALL_TIMEOUT_S, metrics)
        elif what == "push-tls":
            secure.push(states[encoding], message, CALL_TIMEOUT_S, metrics)
        elif what in ("exchange", "exchange-tls"):
            client = laned if what == "exchange" else secure
            answer = client.exchange(states[encoding], message, CALL_TIMEOUT_S, metrics)
            if answer.payload_bytes != 4 * numel:
                raise RuntimeError(f"exchange answered {answer.payload_bytes} bytes, expected {4 * numel}")
            del answer
        conn.send(("seconds", time.perf_counter() - started, time.process_time() - cpu_start))
    def kept(client: PeerClient) -> list:
        """The client's lanes kept open: payload lanes idle, and its direct lanes (the calls' own)."""
        return [lane for lanes in client._idle.values() for lane in lanes] + list(client._direct.values())

    lanes_used = bool(kept(laned)) and not kept(framed)
    # How many lanes a Push under TLS used, and whether they were sealed.
    secure_lanes = kept(secure)
    sealed = bool(secure_lanes) and all(lane.sealed for lane in secure_lanes)
    for client in (laned, framed, secure):
        client.close()
    conn.send(("stopped", lanes_used, sealed, len(secure_lanes)))


def gloo_peer(conn: Connection, rank: int, port: int, numel: int) -> None:
    """Rank 0 sends the tensor to rank 1 with torch.distributed gloo on each "go"; both send back their time."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only; don't let gloo resolve the host name
    timeout = timedelta(seconds=CALL_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    try:
        # The receiver reuses one buffer, as a training job on gloo would (the peer service's receiver reuses
        # its pooled buffer once the previous message is no longer held).
        tensor = torch.randn(numel) if rank == 0 else torch.zeros(numel)
        conn.send(("ready",))
        while conn.recv() == "go":
            # Both sides leave the barrier together (to within a loopback round trip, tens of microseconds
            # against milliseconds), then each times its own half; the parent takes the later finish.
            dist.barrier()
            started = time.perf_counter()
            cpu_start = time.process_time()
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)
            conn.send(("seconds", time.perf_counter() - started, time.process_time() - cpu_start))
        conn.send(("stopped",))
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


METHODS = [
    ("push", "raw"), ("push", "fp16"), ("push", "bf16"), ("exchange", "raw"), ("push-frames", "raw"),
    ("push-tls", "raw"), ("gloo", "raw"),
]
SERVER_OF = {"push-frames": 1, "push-tls": 2, "exchange-tls": 2}  # which peer server a method calls (else 0: plaintext
# with lanes)


@dataclass
class SizeResult:
    numel: int
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu_seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # sender's plus receiver's
    extra_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # peak extra receiver memory per method
    per_transfer: bool = True  # False: one high-water mark over all transfers (no clear_refs here)
    lanes_used: bool = False
    sealed: bool = False  # the lanes of the Push under TLS were sealed
    sealed_lanes: int = 0

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def measure_size(
    context: mp.context.SpawnContext, config: Config, numel: int, methods: list[tuple[str, str]] = METHODS
) -> SizeResult:
    result = SizeResult(numel)
    repeats = config.repeats if numel * 4 < 200e6 else max(3, config.repeats // 3)
    with Stage(context) as stage, tempfile.TemporaryDirectory(prefix="wire-bench-tls-") as tls_dir:
        # One server with lanes, one without, one under TLS: the frames path's allocations (gRPC's buffers,
        # Python's heap) are its own and do not raise the other's high-water mark.
        servers, ports, baselines = [], [], []
        for lanes, tls in ((True, False), (False, False), (True, True)):
            servers.append(stage.start(peer_server, numel, config.chunk_bytes, lanes, tls_dir if tls else None))
            _, port, baseline = stage.receive(servers[-1], "peer server start")
            ports.append(port)
            baselines.append(baseline)
        client = stage.start(peer_client, tuple(ports), numel, config.chunk_bytes, tls_dir)
        gloo_port = free_port()
        gloo = [stage.start(gloo_peer, rank, gloo_port, numel) for rank in (0, 1)]
        for conn, what in ((client, "peer client"), (gloo[0], "gloo rank 0"), (gloo[1], "gloo rank 1")):
            stage.receive(conn, f"{what} start")
        for repeat in range(config.warmup + repeats):
            for method in methods:
                if method[0] == "gloo":
                    for conn in gloo:
                        conn.send("go")
                    replies = [stage.receive(conn, "gloo send/recv") for conn in gloo]
                    seconds = max(reply[1] for reply in replies)
                    cpu = sum(reply[2] for reply in replies)
                else:
                    which = SERVER_OF.get(method[0], 0)
                    server = servers[which]
                    server.send("reset")
                    result.per_transfer = stage.receive(server, "server peak reset")[1] and result.per_transfer
                    client.send(method)
                    _, seconds, cpu = stage.receive(client, f"peer {method[0]} {method[1]}")
                    server.send("peak")
                    _, peak, server_cpu = stage.receive(server, "server peak")
                    cpu += server_cpu
                    result.extra_bytes[method] = max(result.extra_bytes.get(method, 0), peak - baselines[which])
                if repeat >= config.warmup:
                    result.seconds.setdefault(method, []).append(seconds)
                    result.cpu_seconds.setdefault(method, []).append(cpu)
        if not result.per_transfer:  # one high-water mark per server over all its transfers
            for which in range(len(servers)):
                group = [m for m in result.extra_bytes if SERVER_OF.get(m[0], 0) == which]
                if group:
                    overall = max(result.extra_bytes[m] for m in group)
                    result.extra_bytes.update(dict.fromkeys(group, overall))
        client.send(("stop",))
        _, result.lanes_used, result.sealed, result.sealed_lanes = stage.receive(client, "peer client stop")
        for conn in gloo:
            conn.send("stop")
            stage.receive(conn, "gloo stop")
        for server in servers:
            server.send("stop")
            stage.receive(server, "peer server stop")
    return result


# ---------------------------------------------------------------------------------------- training step


def step_agent(conn: Connection, rank: int, ports: list[int], config: Config) -> None:
    """One agent-like node: serves peers, trains DSGD on random batches, exchanges in a thread pool. It runs
    blocks of steps as the parent says, with or without exchanges, and reports each block's seconds per step."""
    from concurrent import futures

    import grpc
    import torch

    from nodeagent.algorithms import REGISTRY, Neighbor, NodeContext, build_algorithm
    from nodeagent.jobspec import AlgorithmSpec, ModelSpec
    from nodeagent.metrics import Metrics
    from nodeagent.rpc import GRPC_OPTIONS
    from nodeagent.runtime.peer_service import PeerClient, PeerServicer, ServingState, add_peer_servicer
    from nodeagent.training.models import build_model
    from nodeagent.wire.message import Encoding

    torch.set_num_threads(1)
    name = config.step_algorithm
    if name == "auto":  # ECL-ISVR where it is registered, else DSGD
        name = "pdmm-isvr" if "pdmm-isvr" in REGISTRY else "dsgd"
    if name not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(REGISTRY)}")
    peer = 1 - rank
    torch.manual_seed(0)
    model = build_model(ModelSpec(name=config.step_model))
    spec = AlgorithmSpec(name=name, interval=8)
    # The edge's two phases half a round apart, as a seeded topology would give them.
    neighbor = Neighbor(rank=peer, sign=1 if rank == 0 else -1, phase=4 * rank, weight=0.5, peer_phase=4 * peer)
    algorithm = build_algorithm(model, NodeContext(rank, 2, (neighbor,), spec, self_weight=0.5, seed=0))
    inbox: queue.Queue = queue.Queue()
    metrics = Metrics()
    state = ServingState(
        job_id=JOB_ID, node_id=f"n{rank}", rank=rank, algorithm_name=spec.name, names={0: "n0", 1: "n1"},
        expected=algorithm.expected, snapshot=algorithm.snapshot, inbox=inbox, encoding=Encoding.RAW,
        chunk_bytes=config.chunk_bytes, max_message_bytes=1 << 30,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer"), options=GRPC_OPTIONS)
    servicer = PeerServicer(lambda: state, metrics, "bench", lane_host="127.0.0.1")
    add_peer_servicer(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{ports[rank]}")
    server.start()
    client = PeerClient(f"127.0.0.1:{ports[peer]}")
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="exchange")
    in_flight: set[int] = set()
    failures = 0

    def run_exchange(send) -> None:
        nonlocal failures
        try:
            inbox.put(client.exchange(state, send.message, CALL_TIMEOUT_S, metrics))
        except Exception:
            failures += 1
        finally:
            in_flight.discard(send.peer)

    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(config.step_batch, 1, 28, 28, generator=generator),
         torch.randint(0, 10, (config.step_batch,), generator=generator))
        for _ in range(8)
    ]
    conn.send(("ready", name))
    step = 0
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        _, steps, exchange = command
        started = time.perf_counter()
        for _ in range(steps):
            while True:
                try:
                    algorithm.receive(inbox.get_nowait())
                except queue.Empty:
                    break
            inputs, targets = batches[step % len(batches)]
            step += 1
            algorithm.step(inputs, targets)
            for send in algorithm.sends():
                if exchange and send.peer not in in_flight and send.message is not None:
                    in_flight.add(send.peer)
                    pool.submit(run_exchange, send)
        while in_flight:  # the block's exchanges count in full, their tails included
            time.sleep(0.0005)
        conn.send(("block", (time.perf_counter() - started) / steps))
    pool.shutdown(wait=True)
    exchanges = int(metrics.registry.get_sample_value(
        "peertrain_exchange_seconds_count", {"src": f"n{rank}", "dst": f"n{peer}"}) or 0)
    conn.send(("done", exchanges, failures))
    conn.recv()  # the other node may still exchange with this one until both are done
    client.close()
    servicer.close()
    server.stop(grace=1.0)


def measure_steps(
    context: mp.context.SpawnContext, config: Config
) -> tuple[str, list[float], list[float], int, int]:
    """Seconds per step of blocks with and without exchanges, taking turns (so that whatever else the machine
    does weighs on both alike); both nodes run each block together. Also: the algorithm, exchanges initiated,
    failures."""
    ports = [free_port(), free_port()]
    block = 2 * 8  # two rounds of K
    alone: list[float] = []
    together: list[float] = []
    with Stage(context) as stage:
        nodes = [stage.start(step_agent, rank, ports, config) for rank in (0, 1)]
        names = [stage.receive(conn, "step agent start")[1] for conn in nodes]
        name = names[0]
        for conn in nodes:  # warm-up
            conn.send(("block", block, True))
        for conn in nodes:
            stage.receive(conn, "step agent warm-up")
        for index in range(2 * max(1, config.steps // block)):
            exchange = index % 2 == 0
            for conn in nodes:
                conn.send(("block", block, exchange))
            seconds = statistics.mean(stage.receive(conn, "step agent block")[1] for conn in nodes)
            (together if exchange else alone).append(seconds)
        for conn in nodes:
            conn.send(("stop",))
        results = [stage.receive(conn, "step agent stop") for conn in nodes]
        for conn in nodes:
            conn.send("stop")
    return name, alone, together, sum(r[1] for r in results), sum(r[2] for r in results)


# ------------------------------------------------------------------------------------------ shaped link

LINK_SIZE = 11_000_000  # the 44 MB tensor
LINK_METHODS = [("push", "raw"), ("push", "fp16"), ("push", "bf16"), ("push-tls", "raw"), ("gloo", "raw")]
TLS_TARGETS = {"loopback": 0.5, "link": 0.9}  # Push under TLS (sealed lanes) over gloo's plaintext rate, at least


def shaped_link(config: Config) -> dict[tuple[str, str], list[float]] | str:
    """Seconds per transfer of LINK_METHODS on a loopback shaped to `config.link_gbit` in a private network
    namespace (this script again, with --in-shaped-namespace); or why it could not run."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    rate_bits = config.link_gbit * 1e9
    burst = max(1 << 20, int(rate_bits / 8 / 1000))  # a millisecond of the rate, and more than loopback's MTU
    inner = [sys.executable, os.path.abspath(__file__), "--in-shaped-namespace", "--repeats", str(config.repeats),
             "--warmup", str(config.warmup), "--chunk-bytes", str(config.chunk_bytes)]
    script = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {int(rate_bits)}bit burst {burst} "
              f"latency 100ms && exec {' '.join(inner)}")
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "sh", "-c", script],
                              capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"no result within {STAGE_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()
        return f"the namespace could not be set up or the run failed: {lines[-1]}"
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return {tuple(method.split("/")): values for method, values in seconds.items()}


def in_shaped_namespace(config: Config) -> int:
    """The transfers of `shaped_link`, run inside its namespace; prints their seconds as one JSON line."""
    result = measure_size(mp.get_context("spawn"), config, LINK_SIZE, LINK_METHODS)
    print(json.dumps({"/".join(method): values for method, values in result.seconds.items()}))
    return 0


# --------------------------------------------------------------------------------------------- report


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def size_label(nbytes: int) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} kB"


def parse_args(argv: list[str] | None) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(
        description="Stream fp32 tensors between two processes on 127.0.0.1: the peer service (Push raw/fp16/bf16, "
        "Exchange, Push over frames) against torch.distributed gloo send/recv, with the CPU time of each transfer; "
        "then the encodings again on a shaped link in a private network namespace; then a training step "
        "(ECL-ISVR, K = 8) with and without exchanges."
    )
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 44.0, 400.0],
                        help="tensor sizes in MB of 1e6 bytes (default 1 44 400)")
    parser.add_argument("--repeats", type=int, default=10, help="timed transfers per method and size (default 10; "
                        "a third of it, at least 3, for sizes of 200 MB and more)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--chunk-bytes", type=int, default=MIB,
                        help="the job's chunk size: gRPC frames, staging of conversions (default 1048576)")
    parser.add_argument("--step-model", default="cnn", help="model of the training-step stage (default cnn)")
    parser.add_argument("--step-batch", type=int, default=100, help="minibatch of the training-step stage")
    parser.add_argument("--steps", type=int, default=96,
                        help="timed steps per node and mode, in blocks of 16 (default 96)")
    parser.add_argument("--step-algorithm", default="auto",
                        help="algorithm of the training-step stage (default: pdmm-isvr, i.e. ECL-ISVR, where it is "
                        "registered, else dsgd)")
    parser.add_argument("--skip-steps", action="store_true", help="measure transfers only")
    parser.add_argument("--link-gbit", type=float, default=10.0,
                        help="rate of the shaped link of the encodings' second measurement, in Gbit/s (default 10; "
                        "0 skips it)")
    parser.add_argument("--in-shaped-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = tuple(int(mb * 1e6 / 4) for mb in args.sizes_mb)
    if min(sizes) < 1:
        parser.error("--sizes-mb must give at least one float32")
    if args.repeats < 1 or args.warmup < 0 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1 and --warmup at least 0")
    if not 1 <= args.chunk_bytes <= MAX_CHUNK_BYTES:
        parser.error(f"--chunk-bytes must be between 1 and {MAX_CHUNK_BYTES} (gRPC's frame limit)")
    if args.link_gbit < 0:
        parser.error("--link-gbit must be >= 0")
    config = Config(sizes, args.repeats, args.warmup, args.chunk_bytes, args.step_model, args.step_batch,
                    args.steps, args.step_algorithm, args.skip_steps, args.link_gbit)
    return config, args.in_shaped_namespace


def report_link(config: Config, link: dict[tuple[str, str], list[float]] | str) -> None:
    print(f"\nencodings on a {config.link_gbit:g} Gbit/s link (tbf on loopback in a private network namespace), "
          f"{size_label(4 * LINK_SIZE)}:")
    if isinstance(link, str):
        print(f"  skipped: {link}")
        return
    for method in LINK_METHODS:
        samples = link[method]
        print(f"  {method[0]:<8} {method[1]:<5} median {median(samples) * 1e3:8.2f} ms  "
              f"{4 * LINK_SIZE / median(samples) / 1e9:6.3f} GB/s  {LINK_SIZE / median(samples) / 1e6:6.0f} Mparam/s")
    raw = median(link[("push", "raw")])
    print(f"  peer Push raw / gloo = {median(link[('gloo', 'raw')]) / raw:.2f} on medians")
    print("  " + tls_verdict(link, "link"))
    for encoding in ("fp16", "bf16"):
        speedup = raw / median(link[("push", encoding)])
        verdict = "target met" if speedup >= 1.8 else "below target"
        print(f"  {encoding} / raw in parameters per second = {speedup:.2f} -> {verdict} (target: >= 1.8)")


def tls_verdict(seconds: dict[tuple[str, str], list[float]], where: str, goal: bool = True) -> str:
    """Push under TLS with sealed lanes against gloo's plaintext rate (with its target where it has one) and against
    plaintext Push."""
    tls = median(seconds[("push-tls", "raw")])
    ratio = median(seconds[("gloo", "raw")]) / tls
    target = TLS_TARGETS[where]
    verdict = f" -> {'target met' if ratio >= target else 'below target'} (>= {target})" if goal else ""
    return (f"peer Push raw, mutual TLS + sealed lanes / gloo (plaintext) = {ratio:.2f} on medians{verdict}; "
            f"/ plaintext Push = {median(seconds[('push', 'raw')]) / tls:.2f}")


def main(argv: list[str] | None = None) -> int:
    config, in_namespace = parse_args(argv)
    if in_namespace:
        return in_shaped_namespace(config)
    context = mp.get_context("spawn")
    print(
        f"wire benchmark: fp32 tensors of {', '.join(size_label(4 * n) for n in config.sizes)} between two processes "
        f"on 127.0.0.1, {config.repeats} timed repeats after {config.warmup} warm-up, chunks of "
        f"{config.chunk_bytes} bytes, {os.cpu_count()} CPUs",
        flush=True,
    )
    began = time.monotonic()
    # The transfers first, while this process is still small (see the docstring).
    results = [measure_size(context, config, numel) for numel in config.sizes]
    link = shaped_link(config) if config.link_gbit > 0 else None

    print()
    print(f"{'size':>7}  {'method':<64} {'median ms':>10} {'GB/s':>7} {'Mparam/s':>9} {'best GB/s':>10} "
          f"{'CPU ms':>7} {'recv extra':>11}")
    names = {
        ("push", "raw"): "peer Push, raw (lane)",
        ("push", "fp16"): "peer Push, fp16 on the wire (lane)",
        ("push", "bf16"): "peer Push, bf16 on the wire (lane)",
        ("exchange", "raw"): "peer Exchange, raw, both ways (lane)",
        ("push-frames", "raw"): "peer Push, raw, chunk frames (peer without lanes)",
        ("push-tls", "raw"): "peer Push, raw, mutual TLS (gRPC) + sealed lanes (AES-256-GCM)",
        ("gloo", "raw"): "torch.distributed gloo send/recv",
    }
    for result in results:
        for method in METHODS:
            samples = result.seconds[method]
            moved = result.nbytes * (2 if method[0] == "exchange" else 1)
            params = result.numel * (2 if method[0] == "exchange" else 1)
            print(
                f"{size_label(result.nbytes):>7}  {names[method]:<64} {median(samples) * 1e3:>10.2f} "
                f"{moved / median(samples) / 1e9:>7.3f} {params / median(samples) / 1e6:>9.0f} "
                f"{moved / min(samples) / 1e9:>10.3f} {median(result.cpu_seconds[method]) * 1e3:>7.1f} "
                + (f"{result.extra_bytes[method] / result.nbytes:>10.2f}x" if method in result.extra_bytes else "")
            )
        if not result.lanes_used:
            print(f"{'':>7}  (the client found no lane: the Push rows above went over frames)")
        sealing = "sealed, AES-256-GCM" if result.sealed else "NOT sealed"
        print(f"{'':>7}  (lanes beside TLS: {sealing}, {result.sealed_lanes} kept after the last Push under TLS)")
    print()
    for result in results:
        label = size_label(result.nbytes)
        raw = median(result.seconds[("push", "raw")])
        ratio = median(result.seconds[("gloo", "raw")]) / raw
        goal = result.nbytes == 44_000_000
        verdict = ("target met" if ratio >= 1.0 else "below target") + " (target: >= 1.0)" if goal else ""
        print(f"{label}: peer Push raw / gloo = {ratio:.2f} on medians {'-> ' + verdict if goal else ''}".rstrip())
        print(f"{label}: {tls_verdict(result.seconds, 'loopback', goal)}")
        for encoding in ("fp16", "bf16"):
            speedup = raw / median(result.seconds[("push", encoding)])
            verdict = "target met" if speedup >= 1.8 else "below target"
            print(f"{label}: {encoding} / raw in parameters per second = {speedup:.2f} -> {verdict} "
                  "(target: >= 1.8)")
        cpu = {encoding: median(result.cpu_seconds[("push", encoding)]) for encoding in ENCODINGS}
        cores = os.cpu_count() or 1
        # Sender and receiver share the machine's cores: a transfer takes at least its CPU time over their count.
        bounds = ", ".join(f"{encoding} {raw / (cpu[encoding] / cores):.2f}x" for encoding in ("fp16", "bf16"))
        print(f"{label}: CPU time of a Push, sender and receiver together: "
              + ", ".join(f"{encoding} {seconds * 1e3:.1f} ms" for encoding, seconds in cpu.items())
              + f"; on {cores} CPUs that bounds the rate over raw's to {bounds}")
        extra = result.extra_bytes[("push", "raw")]
        multiple = extra / result.nbytes
        scope = "in a raw Push" if result.per_transfer else "over all transfers (no per-transfer reset here)"
        big = result.nbytes >= 44_000_000
        verdict = ("target met" if multiple <= 2.0 else "above target") + " (target: <= 2x)"
        print(
            f"{label}: receiver peak extra memory {scope} = {extra / 1e6:.1f} MB = {multiple:.2f}x the tensor"
            + (f" -> {verdict}" if big else " (fixed costs of the process dominate a small tensor)")
        )
    if link is not None:
        report_link(config, link)
    if not config.skip_steps:
        name, alone_blocks, together_blocks, exchanges, failures = measure_steps(context, config)
        print(
            f"\ntraining step: 2 nodes, {name} K = 8, model {config.step_model}, batch {config.step_batch}, "
            f"{config.steps} timed steps per node and mode, one process and one thread each",
        )
        alone, together = median(alone_blocks), median(together_blocks)
        overhead = together / alone - 1
        verdict = "target met" if overhead <= 0.10 else "above target"
        print(f"step without exchanges: {alone * 1e3:.1f} ms; with exchanges: {together * 1e3:.1f} ms (medians of "
              f"{len(alone_blocks)} blocks of 16 steps each, taking turns; {exchanges} exchanges, {failures} failed)")
        print(f"exchange overhead of a training step = {overhead * 100:+.1f}% -> {verdict} (target: <= 10%)")
    print(f"(took {time.monotonic() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
