"""The devices a test that trains or moves tensors runs on: the CPU always, CUDA where torch sees a device. The CUDA
half is marked `cuda`: `make test-gpu` (pytest -m cuda) runs it alone on a GPU machine."""

import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]
