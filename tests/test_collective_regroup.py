"""The all-reduce survives lost members: three processes average step by step through the agent's Collective, on
the coordinator's rendezvous store served by a gRPC server of the test's own, reached as agents reach it. A member
killed mid-job, or stopped, aborts the step on the others within the step timeout; they go on as a quorum of two;
the member that comes back (restarted from an old state, or continued) takes the others' state at a later step;
every step's mean is over the quorum that took it, and all ranks end bit-identical. (The store restarted mid-job, a
coordinator restart, is test_allreduce_faults.py's, on agents.)"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import pytest
import torch
from devices import DEVICES

from coordinator.rendezvous import Rendezvous
from coordinator.zygote import FORK_SERVER
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.metrics import Metrics
from nodeagent.runtime.progress import Traffic
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.cluster

WORLD = 3
STEPS = 80
STEP_S = 0.05  # each step's "compute", so that the test's faults land mid-job
STEP_TIMEOUT_S = 3.0
JOIN_S = 2.0
STALE = 99.0  # the value of a restarted rank's parameters, as from an old checkpoint


class Member:
    """A node of the collective family reduced to its state: w, and the step it is at."""

    def __init__(self, rank: int, clock: int, value: float, device: str):
        self.rank, self.clock = rank, clock
        self.w = torch.full((4,), value, device=device)

    def group_state(self) -> Message:
        return Message(Kind.PARAMS, self.rank, -1, {"w": self.w.clone()}, clock=self.clock)

    def round_applied(self) -> bool:
        return False  # the step moves with its mean


def run_rank(port: int, rank: int, start: int, value: float, dies_at: int | None, progress, go, results,
             device: str) -> None:
    from nodeagent.agent.collective import Collective, QuorumOptions
    from nodeagent.agent.rendezvous import CoordinatorStore

    torch.set_num_threads(1)
    member = Member(rank, start, value, device)
    options = QuorumOptions(step_timeout_s=STEP_TIMEOUT_S, join_s=JOIN_S, min_members=2, wait_s=60.0)
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    store = CoordinatorStore(lambda: stub, "job", f"node{rank}", timedelta(seconds=STEP_TIMEOUT_S))
    collective = Collective(store, rank, WORLD, Metrics(), "job", f"node{rank}", Traffic(),
                            member=member, stop=threading.Event(), options=options)
    took_up, committed, longest = [], [], 0.0
    quorums: list[tuple[int, ...]] = []  # the members of each all-reduce that completed, in order
    all_reduce = collective._all_reduce

    def recording(quorum, message, waiting):
        answer = all_reduce(quorum, message, waiting)
        quorums.append(quorum.members)
        return answer

    collective._all_reduce = recording
    progress[rank] = start
    go.wait()  # the job's ranks start together, however long their processes took to start
    while member.clock < STEPS:
        if member.clock == dies_at:
            os._exit(0)  # as kill -9, while the others are in the step's all-reduce
        time.sleep(STEP_S)
        progress[rank] = member.clock
        gradient = Message(Kind.GRADIENT, rank, -1,
                           {"g": torch.full((4,), float(rank + member.clock), device=device)}, clock=member.clock)
        started = time.monotonic()
        answer = collective.mean(gradient)
        longest = max(longest, time.monotonic() - started)
        if answer.kind == Kind.PARAMS:
            took_up.append((member.clock, answer.clock))
            member.w, member.clock = answer.tensors["w"].clone(), answer.clock
        else:
            assert answer.clock == member.clock and answer.tensors["g"].device == member.w.device
            committed.append((member.clock, quorums[-1]))
            member.w -= answer.tensors["g"]
            member.clock += 1
    progress[rank] = member.clock
    collective.hand_over()  # as a runner does: a rank back late takes the final state from the finished ones
    while min(progress) < STEPS:
        time.sleep(0.05)
    collective.close()
    results.put((rank, member.w.tolist(), took_up, committed, longest))


class Ranks:
    def __init__(self, server: RendezvousServer, device: str = "cpu"):
        self.port = server.port
        self.device = device  # where the members' state and gradients live (the all-reduce runs on host copies)
        self.context = FORK_SERVER  # each rank a fork of a process that imported torch, not a fresh interpreter
        self.results = self.context.Queue()
        self.progress = self.context.Array("i", [-1] * WORLD)
        self.go = self.context.Event()
        self.processes: list[multiprocessing.Process] = []

    def start(self, rank: int, start: int = 0, value: float = 0.0, dies_at: int | None = None):
        process = self.context.Process(target=run_rank, args=(self.port, rank, start, value, dies_at, self.progress,
                                                            self.go, self.results, self.device))
        process.start()
        self.processes.append(process)
        return process

    def start_with_rank_2_killed_at(self, step: int) -> None:
        """Start the job's ranks together; rank 2 exits as if killed when it reaches `step` (waited for)."""
        for rank in range(WORLD):
            self.start(rank, dies_at=step if rank == 2 else None)
        self.release()
        self.processes[2].join(timeout=120)
        assert self.processes[2].exitcode == 0

    def release(self) -> None:
        """Start the job's first ranks together, once every one is ready."""
        self.wait_step(0, 0)
        self.wait_step(1, 0)
        self.wait_step(2, 0)
        self.go.set()

    def wait_step(self, rank: int, step: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.progress[rank] < step:
            assert time.monotonic() < deadline, f"rank {rank} at step {self.progress[rank]}, not {step}"
            time.sleep(0.02)

    def finish(self, count: int = WORLD) -> dict[int, tuple]:
        finished = {}
        for _ in range(count):
            rank, *rest = self.results.get(timeout=180)
            finished[rank] = tuple(rest)
        return finished

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                # The fork server, not this process, reaps a rank: one that exits after the check is gone at once.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


class RendezvousServer(coordinator_pb2_grpc.CoordinatorServicer):
    """The coordinator's rendezvous store of job "job", served to every caller (who may call it is the service's
    to check: test_security_coordinator)."""

    def __init__(self) -> None:
        self.job, _ = Rendezvous().store("job", WORLD)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Rendezvous(self, request, context):
        return self.job.answer(request)

    def stop(self) -> None:
        self.job.close()
        self.server.stop(grace=None).wait()


def expected_w(committed: list[tuple[int, tuple[int, ...]]]) -> list[float]:
    """w after every committed step of a survivor: each step's mean over its quorum's members, in float32."""
    w = torch.zeros(4)
    for step, quorum in committed:
        w -= torch.full((4,), float(sum(rank + step for rank in quorum))) / len(quorum)
    return w.tolist()


def check_replicas(finished: dict[int, tuple]) -> None:
    weights = {rank: result[0] for rank, result in finished.items()}
    assert weights[0] == weights[1] == weights[2], weights
    # Ranks 0 and 1 never left: each went through every step of the job once, committing it or (where a member lost
    # within a step split them: some had its answer, the others not) taking the state of one that had it at the
    # next quorum. Every step was committed, with one quorum, and w is the sum of those steps' means.
    quorum_of: dict[int, tuple[int, ...]] = {}
    for rank in (0, 1):
        took_up, committed = finished[rank][1], finished[rank][2]
        steps = [step for step, _ in committed] + [step for at, taken in took_up for step in range(at, taken)]
        assert sorted(steps) == list(range(STEPS)), (rank, took_up)
        for step, quorum in committed:
            assert quorum_of.setdefault(step, quorum) == quorum, (step, rank)
    assert sorted(quorum_of) == list(range(STEPS))
    assert weights[0] == expected_w(sorted(quorum_of.items()))


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_member_is_dropped_and_when_restarted_takes_the_others_state(device):
    server = RendezvousServer()
    ranks = Ranks(server, device)
    try:
        ranks.start_with_rank_2_killed_at(20)
        ranks.wait_step(0, 40)  # the others went on without it
        ranks.start(2, start=5, value=STALE)  # back from an old checkpoint
        finished = ranks.finish()
    finally:
        ranks.close()
        server.stop()
    check_replicas(finished)
    sizes = {step: len(quorum) for step, quorum in finished[0][2] + finished[1][2]}
    assert sizes[19] == 3 and sizes[20] == 2 and sizes[40] == 2
    # The survivors aborted step 20 within the bound, and took nothing from anyone.
    for rank in (0, 1):
        assert finished[rank][1] == [] and finished[rank][3] < STEP_TIMEOUT_S + JOIN_S + 5.0
    # The restarted rank took the job up at the others' step, not at its checkpoint's.
    ((at, taken),) = finished[2][1]
    assert at == 5 and taken > 40


def test_a_stopped_member_is_dropped_within_the_step_timeout_and_takes_the_state_when_it_continues():
    server = RendezvousServer()
    ranks = Ranks(server)
    try:
        for rank in range(WORLD):
            ranks.start(rank)
        ranks.release()
        ranks.wait_step(2, 20)
        os.kill(ranks.processes[2].pid, signal.SIGSTOP)
        stopped_at = ranks.progress[2]
        ranks.wait_step(0, stopped_at + 20)  # the others go on without it
        os.kill(ranks.processes[2].pid, signal.SIGCONT)
        finished = ranks.finish()
    finally:
        ranks.close()
        server.stop()
    check_replicas(finished)
    for rank in (0, 1):
        assert finished[rank][3] < STEP_TIMEOUT_S + JOIN_S + 5.0, finished[rank][3]
    # The stopped rank's step was aborted; it came back behind the others and took their state.
    assert finished[2][1] and finished[2][1][0][1] > finished[2][1][0][0]
