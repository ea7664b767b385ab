"""A CUDA device faked for machines without one, as torch 2.11 and NVML described an H100: torch.cuda's memory
counters and device properties, and a pynvml module (nvidia-ml-py's) that knows the card by its UUID."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

GiB = 2**30
# torch's properties of the card (its UUID without NVML's "GPU-" prefix).
CARD = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_017_493_504,
                       uuid="d5b1c6ba-fd15-de58-8f52-cae7a4bbff97")


def fake_cuda(monkeypatch: pytest.MonkeyPatch, index: int) -> dict[str, int]:
    """torch.cuda on a machine whose cuda:`index` is CARD. The memory counters answer from the returned dict (bytes by
    counter: allocated, reserved, peak), for that device only."""
    counters = {"allocated": 3 * GiB, "reserved": 4 * GiB, "peak": 6 * GiB}

    def counter(name: str):
        def read(device: torch.device | int | None = None) -> int:
            assert torch.device(device) == torch.device("cuda", index), f"asked about {device}"
            return counters[name]
        return read

    monkeypatch.setattr(torch.cuda, "memory_allocated", counter("allocated"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", counter("reserved"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter("peak"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: CARD)
    return counters


def fake_pynvml(monkeypatch: pytest.MonkeyPatch, utilization_percent: int,
                uuid: str = f"GPU-{CARD.uuid}") -> types.ModuleType:
    """Install a pynvml module that knows one device, by UUID, busy `utilization_percent` of the time until its `lost`
    is set (then NVML fails as for a GPU that fell off the bus)."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def handle_by_uuid(asked: str) -> str:
        if asked != uuid:
            raise NVMLError("Not Found")
        return "handle"

    def utilization_rates(handle: str) -> SimpleNamespace:
        if module.lost:
            raise NVMLError("GPU is lost")
        return SimpleNamespace(gpu=utilization_percent, memory=0)

    module.NVMLError = NVMLError
    module.lost = False
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByUUID = handle_by_uuid
    module.nvmlDeviceGetUtilizationRates = utilization_rates
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """As where nvidia-ml-py is not installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
