"""A synchronous job's step rate while one identity holds 20 streams open on a node (the trust issue's target: the
job keeps at least half its rate).

A local cluster of 4 agents under mutual TLS runs synchronous DSGD on a ring. The rate of agent-0 (local steps per
second, from its /metrics) is measured for a window undisturbed, then while an attacker keeps 20 Exchange streams
open on agent-0, re-opening each as soon as it ends:
- `intruder`: a node certificate of the cluster that is not in the job; its streams send nothing (held until the
  idle timeout ends them);
- `stolen neighbour`: the certificate of agent-0's neighbour on the ring, as if its key were stolen; its streams
  send a valid manifest, then one payload byte a second (held until the minimum rate ends them). The honest
  neighbour shares that identity's stream limit with the attacker.
The attacking code speaks gRPC with the generated proto modules only.

    .venv/bin/python benchmarks/abuse.py [--window 20] [--streams 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import yaml

from coordinator.ca import ClusterCA
from coordinator.cluster import LocalCluster
from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.jobspec import DEFAULT_DATA_DIR
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir

TARGET_RATIO = 0.5
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8}


def local_steps(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("peertrain_local_steps_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def rate(metrics_address: str, window_s: float) -> float:
    first, started = local_steps(metrics_address), time.monotonic()
    time.sleep(window_s)
    return (local_steps(metrics_address) - first) / (time.monotonic() - started)


def channel(address: str, directory: Path, server_name: str) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials((directory / "ca.crt").read_bytes(),
                                               (directory / "tls.key").read_bytes(),
                                               (directory / "tls.crt").read_bytes())
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", server_name)])


class Attack:
    """`streams` Exchange calls on the victim, each re-opened when it ends, until `stop`."""

    def __init__(self, stub: peer_pb2_grpc.PeerStub, frames, streams: int):
        self.stub, self.frames, self.stop = stub, frames, threading.Event()
        self.ended: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(streams)]

    def _hold(self) -> None:
        while not self.stop.is_set():
            try:
                for _ in self.stub.Exchange(self.frames(self.stop), timeout=120):
                    pass
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            self.ended[code] = self.ended.get(code, 0) + 1
            self.stop.wait(0.05)

    def __enter__(self) -> Attack:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def silent(stop: threading.Event) -> Iterator[wire_pb2.Frame]:
    stop.wait(60)
    return
    yield


def trickle_after(manifest: wire_pb2.Manifest):
    def frames(stop: threading.Event) -> Iterator[wire_pb2.Frame]:
        yield wire_pb2.Frame(manifest=manifest)
        while not stop.wait(1.0):
            yield wire_pb2.Frame(chunk=b"\0")
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0, help="seconds each rate is measured over")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root_name, \
            LocalCluster(root=Path(root_name), agents=4, data_dir=args.data_dir, log_level="WARNING") as cluster:
        root = Path(root_name)
        cluster.submit(yaml.safe_dump({
            "name": "abuse", "nodes": 4, "steps": 1_000_000, "eval_every": 1_000_000, "seed": 0,
            "algorithm": {"name": "dsgd", "mode": "sync", "lr": 0.02},
            "model": {"name": "logistic"},
            "data": {"data_dir": args.data_dir, "split": "iid", "batch_size": 32, "train_limit": 8000,
                     "test_limit": 200},
            "topology": {"kind": "ring"},
        }))
        nodes = {n.name: n for n in cluster.nodes()}
        victim = nodes["agent-0"]
        deadline = time.monotonic() + 60
        while local_steps(victim.metrics_address) < 50:
            if time.monotonic() > deadline:
                raise SystemExit("the job did not start stepping within 60 s")
            time.sleep(0.5)
        intruder_dir = root / "intruder"
        ClusterCA.load(root / "coordinator").issue_files(TlsDir(intruder_dir), Role.NODE, "intruder")
        # On the ring, the node one rank on is a neighbour of agent-0.
        neighbour = next(n for n in nodes.values() if n.rank == (victim.rank + 1) % 4)
        stolen_dir = cluster.state_dir(int(neighbour.name.removeprefix("agent-"))) / "tls"
        description = peer_pb2_grpc.PeerStub(channel(victim.peer_address, stolen_dir, "agent-0")).Describe(
            peer_pb2.DescribeRequest(), timeout=10)
        headers = []
        for tensor in description.served_tensors:
            kind, _, name = tensor.name.partition("/")
            if kind == "params":
                count = 1
                for size in tensor.shape:
                    count *= size
                headers.append(wire_pb2.TensorHeader(name=name, dtype=tensor.dtype, shape=tensor.shape,
                                                     byte_length=count * DTYPE_BYTES[tensor.dtype]))
        manifest = wire_pb2.Manifest(job_id=victim.job_id, sender_id=neighbour.name, sender_rank=neighbour.rank,
                                     receiver_rank=victim.rank, kind=wire_pb2.KIND_PARAMS, clock=0, tensors=headers)

        baseline = rate(victim.metrics_address, args.window)
        print(f"undisturbed: {baseline:.1f} steps/s on agent-0 (synchronous DSGD, ring of 4, mutual TLS)")
        cases = [
            ("intruder", peer_pb2_grpc.PeerStub(channel(victim.peer_address, intruder_dir, "agent-0")), silent),
            ("stolen neighbour", peer_pb2_grpc.PeerStub(channel(victim.peer_address, stolen_dir, "agent-0")),
             trickle_after(manifest)),
        ]
        for label, stub, frames in cases:
            with Attack(stub, frames, args.streams) as attack:
                time.sleep(2.0)
                attacked = rate(victim.metrics_address, args.window)
            ratio = attacked / baseline if baseline else 0.0
            verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
            ended = ", ".join(f"{code} {count}" for code, count in sorted(attack.ended.items()))
            print(f"{label:<17} {args.streams} streams held: {attacked:.1f} steps/s = {ratio:.2f}x undisturbed "
                  f"(target >= {TARGET_RATIO}): {verdict}; attacker's calls ended: {ended}")
            time.sleep(2.0)


if __name__ == "__main__":
    main()
