"""A job's checkpoint on an agent: the algorithm's state_dict, written whole and renamed over the last one.

Checkpoints are device-neutral: tensors are written from host memory and restored onto the device the algorithm
computes on, so a job checkpointed on a GPU resumes on a CPU agent and the other way round.

Retention: a checkpoint serves a rank that restarts while its job runs. Once the job ended on this agent it serves
nothing (a job id is never run again, and each rank sent its final model to the coordinator as it finished, which is
what `coordinator export` reads): the agent deletes it then, except the checkpoints of the last `--keep-checkpoints`
jobs that ended here. A job that asks to keep its checkpoints (`checkpoint.keep`) writes them to
STATE_DIR/checkpoints/kept/, which the agent never cleans."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from nodeagent.algorithms import Algorithm

log = logging.getLogger("nodeagent")


CHECKPOINTS_DIR = "checkpoints"
KEPT_DIR = "kept"


def checkpoint_path(state_dir: Path, job_id: str, rank: int, keep: bool = False) -> Path:
    """Where a rank's checkpoint lives: under STATE_DIR/checkpoints, or its kept/ directory for a job that keeps its
    checkpoints (`checkpoint.keep`), which retention never touches."""
    directory = state_dir / CHECKPOINTS_DIR
    return (directory / KEPT_DIR if keep else directory) / f"{job_id}-rank{rank}.pt"


def _job_of(path: Path) -> str:
    return path.name.removesuffix(".pt").removesuffix(".tmp").rsplit("-rank", 1)[0]


def retire_checkpoints(state_dir: Path, keep_jobs: int = 0, running: str | None = None) -> list[Path]:
    """Delete the checkpoints of every job but `running` (this agent's job now, if any), except those of the
    `keep_jobs` jobs whose checkpoints were written last; called when a job ended here and on the first assignment
    after the agent started. The kept directory is left alone. Returns the files deleted."""
    directory = state_dir / CHECKPOINTS_DIR
    if not directory.is_dir():
        return []
    last_written: dict[str, float] = {}
    files: dict[str, list[Path]] = {}
    for path in [*directory.glob("*.pt"), *directory.glob("*.tmp")]:  # a .tmp: a write cut short by a crash
        job = _job_of(path)
        if job == running:
            continue
        try:
            written = path.stat().st_mtime
        except FileNotFoundError:
            continue
        last_written[job] = max(last_written.get(job, 0.0), written)
        files.setdefault(job, []).append(path)
    newest_first = sorted(last_written, key=last_written.__getitem__, reverse=True)
    deleted = []
    for job in newest_first[keep_jobs:]:
        for path in files[job]:
            path.unlink(missing_ok=True)
            deleted.append(path)
    return deleted


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
