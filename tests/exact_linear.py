"""The small exact problem of the push-sum style tests (SGP, AD-PSGD): a float64 linear model, its batches, and a
loss whose gradient is exactly zero, so that steps leave the model alone and only the mixing moves it (the spec
requires lr > 0).
Also a race of nodes that step whenever they may while their messages arrive in random order."""

import random

import torch
from torch import nn


class ZeroLoss(nn.Module):
    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.sum() * 0.0


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2, dtype=torch.float64)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=generator, dtype=torch.float64), torch.randint(0, 2, (8,), generator=generator)


def race(nodes, batch, deliver, ticks: int = 1500, seed: int = 0) -> list[int]:
    """Nodes step whenever they may (rank 0 first when several may) and messages arrive in random order, each
    handed to `deliver(message)`; returns how many rounds each message was ahead of its receiver on arrival."""
    rng = random.Random(seed)
    in_transit = []
    leads = []
    for tick in range(ticks):
        ready = [node for node in nodes if node.ready()]
        if ready and rng.random() < 0.5:
            node = min(ready, key=lambda node: (node.context.rank != 0, rng.random()))
            node.step(*batch(tick % 7))
            in_transit += [send.message for send in node.sends()]
        elif in_transit:
            message = in_transit.pop(rng.randrange(len(in_transit)))
            leads.append(message.clock - nodes[message.receiver].clock)
            deliver(message)
    return leads
