"""A job's checkpoint on an agent: the algorithm's state_dict, written whole and renamed over the last one.

Checkpoints are device-neutral: tensors are written from host memory and restored onto the device the algorithm
computes on, so a job checkpointed on a GPU resumes on a CPU agent and the other way round."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from nodeagent.algorithms import Algorithm

log = logging.getLogger("nodeagent")


def checkpoint_path(state_dir: Path, job_id: str, rank: int) -> Path:
    return state_dir / "checkpoints" / f"{job_id}-rank{rank}.pt"


def save_checkpoint(path: Path, algorithm: Algorithm) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {name: value.cpu() if isinstance(value, torch.Tensor) else value
             for name, value in algorithm.state_dict().items()}
    torch.save(state, tmp)
    os.replace(tmp, path)


def restore_checkpoint(path: Path, algorithm: Algorithm) -> bool:
    """Resume `algorithm` from `path` if there is a checkpoint that fits it; whether it did."""
    if not path.exists():
        return False
    device = algorithm.w.device
    state = {name: value.to(device) if isinstance(value, torch.Tensor) else value
             for name, value in torch.load(path, map_location="cpu", weights_only=True).items()}
    try:
        algorithm.load_state_dict(state)
    except (KeyError, ValueError) as error:
        log.warning("checkpoint %s does not fit (%s); starting afresh", path, error)
        return False
    return True
