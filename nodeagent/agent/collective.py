"""All-reduce for the collective family: torch.distributed (gloo), joined through the coordinator's rendezvous
when the first all-reduce is asked for."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nodeagent.algorithms.base import ALLREDUCE_RANK
from nodeagent.metrics import Metrics
from nodeagent.runtime.driver import ALLREDUCE_NAME
from nodeagent.runtime.progress import Traffic, ring_allreduce_bytes
from nodeagent.wire.message import Message


class Collective:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, metrics: Metrics,
                 job_id: str, node_id: str, traffic: Traffic):
        if port == 0:
            raise RuntimeError("the assignment names no rendezvous for this all-reduce job")
        self.host, self.port = host, port
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=max(timeout_s, 30.0))
        self.seconds = metrics.exchange_seconds.labels(job_id, node_id, ALLREDUCE_NAME)
        self.traffic = traffic
        self._joined = False

    def mean(self, message: Message) -> Message:
        """The mean of the message's tensors over every rank, as a message from ALLREDUCE_RANK."""
        if not self._joined:
            store = dist.TCPStore(self.host, self.port, self.world_size + 1, is_master=False, timeout=self.timeout)
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=self.timeout)
            self._joined = True
        started = time.perf_counter()
        tensors = message.tensors
        flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
        dist.all_reduce(flat)
        flat /= self.world_size
        out, offset = {}, 0
        for name, tensor in tensors.items():
            out[name] = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
            offset += tensor.numel()
        self.seconds.observe(time.perf_counter() - started)
        moved = ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world_size)
        self.traffic.add_sent(ALLREDUCE_RANK, moved)
        self.traffic.add_received(ALLREDUCE_RANK, moved)
        return Message(message.kind, ALLREDUCE_RANK, self.rank, out, clock=message.clock, loss=message.loss)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
