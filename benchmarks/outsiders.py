"""Benchmark: what one misbehaving identity and an outsider on the network cost honest work (issue 21;
docs/operations.md, "Limits under abuse" and "The all-reduce rendezvous").

    .venv/bin/python benchmarks/outsiders.py flood [--calls 2000] [--window 3]
    .venv/bin/python benchmarks/outsiders.py gloo [--window 30]

`flood`: a coordinator in this process under mutual TLS with its server's pool and per-identity limit; an honest
node beats as fast as it can for `--window` seconds, alone, then while one node holds `--calls` Register calls at
once on 8 connections, each making the coordinator probe a tarpit (an address that accepts and never answers) for
a second; then the same flood with the per-identity limit lifted. Prints the honest node's heartbeats per second,
its slowest heartbeat, and how the flood's calls were answered.

`gloo`: two ranks of the agent's Collective in two processes, meeting at the coordinator's rendezvous store (served
here without the membership check, which the coordinator adds), rank 0 1.5 s late to each gloo group; an outsider
on this host watches rank 1's listening ports and connects to each new one at once, claiming gloo pair sequence
numbers 0..63 (gloo matches a connection to its pair by one). Prints each rank's steps, the means that were not the
true mean, and the groups dropped, with and without the outsider. Asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from concurrent import futures
from datetime import timedelta
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hostile import listening_ports  # the security tests' port scan: the same outsider

import coordinator.service
from coordinator.ca import ClusterCA
from coordinator.ps_service import add_coordinator_servicer
from coordinator.rendezvous import Rendezvous
from coordinator.service import SERVER_THREADS, CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.metrics import Metrics
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir, Transport

LATE_S = 1.5  # how late rank 0 forms each gloo group (below the step timeout, or the group could never form)
STEP_TIMEOUT_S = 3.0


# -- flood ---------------------------------------------------------------------------------------------------------


def node_stub(address: str, ca: ClusterCA, root: Path, name: str, separate: bool = False
              ) -> coordinator_pb2_grpc.CoordinatorStub:
    directory = TlsDir(root / name)
    if not directory.complete():
        ca.issue_files(directory, Role.NODE, name)
    options = [("grpc.use_local_subchannel_pool", int(separate))]
    return coordinator_pb2_grpc.CoordinatorStub(Transport(directory).channel(address, options=options))


def heartbeats(stub: coordinator_pb2_grpc.CoordinatorStub, window_s: float) -> tuple[float, float]:
    """Heartbeats per second one node gets answered, back to back, and its slowest."""
    count, slowest, deadline = 0, 0.0, time.monotonic() + window_s
    while time.monotonic() < deadline:
        started = time.monotonic()
        stub.Heartbeat(pb.HeartbeatRequest(), timeout=30)
        slowest = max(slowest, time.monotonic() - started)
        count += 1
    return count / window_s, slowest


def flood_once(calls: int, window_s: float, limit: int) -> None:
    coordinator.service.MAX_CALLS_PER_IDENTITY = limit
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        ca = ClusterCA.init(root / "state")
        tls = TlsDir(root / "state" / "tls")
        ca.coordinator_credentials(tls)
        service = CoordinatorService(CoordinatorConfig(state_dir=root / "state"), Metrics(), ca=ca,
                                     transport=Transport(tls))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_THREADS),
                             interceptors=[service.authorizer()])
        add_coordinator_servicer(service, server)
        address = f"127.0.0.1:{Transport(tls).bind(server, '127.0.0.1:0')}"
        server.start()
        service.start()
        tarpits = [socket.create_server(("127.0.0.1", 0), backlog=4096) for _ in range(2)]
        try:
            honest = node_stub(address, ca, root, "honest")
            honest.Register(pb.RegisterRequest(peer_address="127.0.0.1:7001"), timeout=10)
            alone = heartbeats(honest, window_s)
            mallory = [node_stub(address, ca, root, "mallory", separate=True) for _ in range(8)]
            pits = [f"127.0.0.1:{tarpit.getsockname()[1]}" for tarpit in tarpits]
            mallory[0].Register(pb.RegisterRequest(peer_address=pits[0]), timeout=10)
            flood = [mallory[i % 8].Register.future(pb.RegisterRequest(peer_address=pits[(i + 1) % 2]), timeout=120)
                     for i in range(calls)]
            during = heartbeats(honest, window_s)
            answers: dict[str, int] = {}
            for call in flood:
                answers[call.code().name] = answers.get(call.code().name, 0) + 1
        finally:
            for tarpit in tarpits:
                tarpit.close()
            server.stop(grace=None)
            service.stop()
    print(f"per-identity limit {limit}: honest heartbeats {alone[0]:.0f}/s alone (slowest {alone[1] * 1000:.0f} ms), "
          f"{during[0]:.1f}/s during {calls} flooding Register calls (slowest {during[1] * 1000:.0f} ms); "
          f"the flood's answers {answers}", flush=True)


# -- gloo ----------------------------------------------------------------------------------------------------------


class OpenRendezvous(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.job, _ = Rendezvous().store("job", 2)

    def Rendezvous(self, request, context):
        return self.job.answer(request)


def rank_main(port: int, rank: int, stop, results) -> None:
    import torch

    from nodeagent.agent.collective import Collective, GroupLost, QuorumOptions
    from nodeagent.agent.rendezvous import CoordinatorStore
    from nodeagent.runtime.progress import Traffic
    from nodeagent.wire.message import Kind, Message

    class Member:
        clock = 0

        def group_state(self) -> Message:
            return Message(Kind.PARAMS, rank, -1, {"w": torch.zeros(2)}, clock=self.clock)

        def round_applied(self) -> bool:
            return False

    member, told = Member(), []
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    collective = Collective(CoordinatorStore(lambda: stub, "job", f"n{rank}", timedelta(seconds=STEP_TIMEOUT_S)),
                            rank, 2, Metrics(), "job", f"n{rank}", Traffic(), member=member, stop=stop,
                            options=QuorumOptions(STEP_TIMEOUT_S, join_s=0.5, min_members=2, wait_s=600),
                            announce=lambda message, level, step: told.append(message), gloo_host="127.0.0.1")
    if rank == 0:
        form = collective.groups

        def late(number, members, index):
            time.sleep(LATE_S)
            return form(number, members, index)

        collective.groups = late
    results.put(("pid", rank, os.getpid()))
    steps = wrong = 0
    while not stop.is_set():
        gradient = Message(Kind.GRADIENT, rank, -1, {"g": torch.full((2,), float(rank + member.clock))},
                           clock=member.clock)
        try:
            answer = collective.mean(gradient)
        except GroupLost:
            break
        if answer.kind == Kind.PARAMS:
            member.clock = answer.clock
            continue
        wrong += answer.tensors["g"].tolist() != [0.5 + member.clock] * 2
        member.clock += 1
        steps += 1
    dropped = sum("failed" in line for line in told)
    results.put(("done", rank, steps, wrong, dropped))
    results.close()
    results.join_thread()
    os._exit(0)


def gloo_once(window_s: float, outsider: bool) -> None:
    servicer = OpenRendezvous()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    ranks = [spawn.Process(target=rank_main, args=(port, rank, stop, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    pids = {}
    while len(pids) < 2:
        _, rank, pid = results.get(timeout=120)
        pids[rank] = pid
    seen, connections, held = listening_ports(pids[1]), 0, []
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        if outsider:
            for gloo_port in listening_ports(pids[1]) - seen:
                seen.add(gloo_port)
                for sequence in range(64):
                    try:
                        connection = socket.create_connection(("127.0.0.1", gloo_port), timeout=1)
                        connection.sendall(sequence.to_bytes(8, "little"))
                    except OSError:
                        continue
                    held.append(connection)
                    connections += 1
        time.sleep(0.002)
    stop.set()
    done = sorted(results.get(timeout=120)[1:] for _ in range(2))
    for process in ranks:
        process.join(timeout=30)
    server.stop(grace=None)
    for connection in held:
        connection.close()
    what = f"an outsider's {connections} connections to gloo ports" if outsider else "no outsider"
    print(f"{window_s:.0f} s, rank 0 {LATE_S:g} s late to each group, {what}: "
          + "; ".join(f"rank {rank}: {steps} steps, {wrong} wrong means, {dropped} groups dropped"
                      for rank, steps, wrong, dropped in done), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["flood", "gloo"])
    parser.add_argument("--calls", type=int, default=2000, help="flood: Register calls held at once (default 2000)")
    parser.add_argument("--window", type=float, help="seconds measured (default: flood 3, gloo 30)")
    args = parser.parse_args()
    if args.what == "flood":
        for limit in (coordinator.service.MAX_CALLS_PER_IDENTITY, 10**9):
            flood_once(args.calls, args.window or 3.0, limit)
    else:
        for outsider in (False, True):
            gloo_once(args.window or 30.0, outsider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
