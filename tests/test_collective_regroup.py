"""The all-reduce takes a lost rank back: three processes average step by step through the agent's Collective;
one dies abruptly mid-job and comes back from an older state; every rank ends at the last step with the same
parameters, and the restarted one took up the others' state, not its own."""

from __future__ import annotations

import multiprocessing
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from nodeagent.metrics import Metrics
from nodeagent.runtime.progress import Traffic
from nodeagent.wire.message import Kind, Message

pytestmark = pytest.mark.slow

WORLD = 3
STEPS = 12
DIES_AT = 6  # the victim's first run ends before the all-reduce of this step
RESTARTS_AT = 2  # ... and its second starts here, as from an old checkpoint


class Member:
    """A node of the collective family reduced to its state: w, and the step it is at."""

    def __init__(self, rank: int, clock: int):
        self.rank, self.clock = rank, clock
        self.w = torch.full((4,), float(rank))

    def group_state(self) -> Message:
        return Message(Kind.PARAMS, self.rank, -1, {"w": self.w.clone()}, clock=self.clock)


def run_rank(port: int, rank: int, start: int, dies_at: int | None, results) -> None:
    from nodeagent.agent.collective import Collective

    member = Member(rank, start)
    collective = Collective("127.0.0.1", port, "secret", rank, WORLD, 5.0, Metrics(), "job", f"node{rank}", Traffic(),
                            member=member, stop=threading.Event(), regroup_s=60.0)
    took_up = []
    while member.clock < STEPS:
        if member.clock == dies_at:
            os._exit(0)  # as kill -9: no goodbye to the group
        gradient = Message(Kind.GRADIENT, rank, -1, {"g": torch.full((4,), float(rank + member.clock))},
                           clock=member.clock)
        answer = collective.mean(gradient)
        if answer.kind == Kind.PARAMS:
            took_up.append((member.clock, answer.clock))
            member.w, member.clock = answer.tensors["w"].clone(), answer.clock
        else:
            assert answer.clock == member.clock
            member.w -= answer.tensors["g"]
            member.clock += 1
    collective.close()
    results.put((rank, member.w.tolist(), took_up))


def test_a_rank_killed_and_restarted_rejoins_the_all_reduce_at_the_others_step():
    master = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=run_rank, args=(master.port, rank, 0, DIES_AT if rank == 2 else None, results))
             for rank in range(WORLD)]
    for process in ranks:
        process.start()
    try:
        ranks[2].join(timeout=120)
        assert ranks[2].exitcode == 0
        restarted = spawn.Process(target=run_rank, args=(master.port, 2, RESTARTS_AT, None, results))
        restarted.start()
        ranks.append(restarted)
        finished = {}
        for _ in range(WORLD):
            rank, w, took_up = results.get(timeout=120)
            finished[rank] = (w, took_up)
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    # Without the loss, w = rank - sum over steps of the mean gradient (1 + t); all ranks end identical.
    assert finished[0][0] == finished[1][0] == finished[2][0]
    # The survivors were at step 6 when the group broke, the restarted rank at 2: all took the job up at 6.
    assert finished[0][1] == [(DIES_AT, DIES_AT)] and finished[1][1] == [(DIES_AT, DIES_AT)]
    assert finished[2][1] == [(RESTARTS_AT, DIES_AT)]
    mean_gradients = sum(1.0 + t for t in range(STEPS))
    assert finished[0][0] == pytest.approx([0.0 - mean_gradients] * 4)
