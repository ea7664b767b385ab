"""Where a node computes: the device named by `--device` (cpu, cuda, cuda:N, auto), checked once, and what it is.

A node lives on one device: its model, its algorithm's state, its batches and its evaluation
(nodeagent.training.job). Everything here works without a GPU: `auto` is then the CPU, and a CUDA device asked for
is refused in one line (DeviceError) before anything is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = [
    "DATA_ON_DEVICE_FRACTION",
    "DeviceError",
    "DeviceInfo",
    "describe_device",
    "device_memory",
    "fits_on_device",
    "resolve_device",
]

# A data set is uploaded to a GPU once, whole, when it takes at most this share of the device's memory; larger ones
# stay in host memory and each minibatch is copied over (pinned, non-blocking, one batch ahead).
DATA_ON_DEVICE_FRACTION = 0.25

_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d{1,3}))?$")


class DeviceError(ValueError):
    """A device that this machine does not have or that is not a device name; the message says which, in one line."""


def resolve_device(choice: str) -> torch.device:
    """The device `choice` names: `cpu`, `cuda` (the current CUDA device), `cuda:N`, or `auto` (cuda where torch
    sees one, else cpu). DeviceError for a name that is not one, or a CUDA device this machine lacks."""
    match = _DEVICE.match(choice.strip().lower())
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise DeviceError(f"unknown device {choice[:40]!r}: expected cpu, cuda, cuda:N or auto")
    kind, index = match.group(1), match.group(2)
    if kind == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {choice} asked for, but no CUDA device is available (torch {torch.__version__}, "
                          f"built for CUDA {torch.version.cuda or 'none'})")
    count = torch.cuda.device_count()
    number = int(index) if index is not None else torch.cuda.current_device()
    if number >= count:
        raise DeviceError(f"--device {choice} asked for, but this machine has {count} CUDA device(s): cuda:0.."
                          f"cuda:{count - 1}")
    return torch.device("cuda", number)


@dataclass(frozen=True)
class DeviceInfo:
    """What an agent tells of its device at registration (`coordinator nodes` shows it: coordinator.display)."""

    device: str  # cpu, cuda:0, ...
    name: str  # the card's name, or "cpu"
    memory_bytes: int  # the device's total memory; 0 for the CPU


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo(str(device), "cpu", 0)
    properties = torch.cuda.get_device_properties(device)
    return DeviceInfo(str(device), properties.name, int(properties.total_memory))


def device_memory(device: torch.device) -> int:
    """Total memory of a CUDA device in bytes; 0 for the CPU (whose memory is not budgeted here)."""
    return describe_device(device).memory_bytes


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` of data should live on `device` for the whole job: always on the CPU; on a GPU when it
    takes at most DATA_ON_DEVICE_FRACTION of its memory."""
    if device.type == "cpu":
        return True
    return nbytes <= DATA_ON_DEVICE_FRACTION * device_memory(device)
