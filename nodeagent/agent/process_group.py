"""The process group a quorum's collectives run on, behind a small interface so that the collective
(nodeagent.agent.collective) runs on gloo in the agent and on in-memory fakes in tests.

Every call blocks until this member has its answer, and raises RuntimeError when the collective failed here (a
member lost, or not answering within the group's timeout). `close()` drops the group: its pairs close, which fails
any other member's call still on it, as gloo does when a process goes away.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class ProcessGroup(Protocol):
    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (in host memory) over the group's members, in place."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor` (of the same shape and dtype everywhere), in the group's rank order."""

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """`tensor` becomes the group rank `source`'s, in place."""

    def close(self) -> None: ...


# A quorum's group: (quorum number, its members' job ranks in group order, this member's index) -> its group.
GroupFactory = Callable[[int, tuple[int, ...], int], ProcessGroup]


class GlooGroup:
    """A gloo group of one quorum, over the job's rendezvous store (the group's keys under `q/<number>/pg/`)."""

    def __init__(self, store: dist.Store, number: int, size: int, index: int, timeout: timedelta, host: str):
        options: dist.ProcessGroupGloo._Options | timedelta = timeout  # a timeout alone: gloo's default device
        if host:  # a device of its own for each group, as gloo's default: none outlives its group
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore(f"q/{number}/pg/", store), index, size, options)
        self.size = size

    def _live(self) -> dist.ProcessGroupGloo:
        if self.group is None:
            raise RuntimeError("the group was dropped")
        return self.group

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._live().allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        self._live().allgather([gathered], [tensor]).wait()
        return gathered

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        self._live().broadcast(tensor, source).wait()

    def close(self) -> None:
        self.group = None  # its last reference: gloo closes the pairs


def gloo_groups(store: dist.Store, timeout: timedelta, host: str) -> GroupFactory:
    """Gloo groups over `store`, each collective within `timeout`; `host`: the address the other members reach this
    rank's pairs at ('' : gloo's default, the machine's hostname)."""

    def form(number: int, members: tuple[int, ...], index: int) -> ProcessGroup:
        return GlooGroup(store, number, len(members), index, timeout, host)

    return form
