"""A job's checkpoint on an agent: the algorithm's state_dict, written whole and renamed over the last one."""

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
    torch.save(algorithm.state_dict(), tmp)
    os.replace(tmp, path)


def restore_checkpoint(path: Path, algorithm: Algorithm) -> bool:
    """Resume `algorithm` from `path` if there is a checkpoint that fits it; whether it did."""
    if not path.exists():
        return False
    state = torch.load(path, weights_only=True)
    try:
        algorithm.load_state_dict(state)
    except (KeyError, ValueError) as error:
        log.warning("checkpoint %s does not fit (%s); starting afresh", path, error)
        return False
    return True
