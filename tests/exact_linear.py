"""The small exact problem of the push-sum style tests (SGP, AD-PSGD): a float64 linear model, its batches, and a
loss whose gradient is exactly zero, so that steps leave the model alone and only the mixing moves it (the spec
requires lr > 0)."""

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
