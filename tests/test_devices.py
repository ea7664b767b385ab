"""A node lives on one device: `--device` names it (cpu, cuda, cuda:N, auto); its model, its algorithm's state, its
batches and its evaluation are there; checkpoints move between devices; reduced precision trains with fp32
master weights. Each test runs on the CPU always, and on CUDA where a device is present (marked `cuda`)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from devices import DEVICES

from coordinator.simulate import build_nodes, simulate
from nodeagent.agent.checkpoint import restore_checkpoint, save_checkpoint
from nodeagent.agent.runner import failure_of
from nodeagent.algorithms.base import LossScale
from nodeagent.jobspec import parse_job_spec
from nodeagent.training import device as device_module
from nodeagent.training.data import load_dataset
from nodeagent.training.device import DeviceError, resolve_device
from nodeagent.training.loop import BatchStream

pytestmark = pytest.mark.integration


def small_job(fashion_mnist_dir: Path, algorithm: dict, **extra) -> dict:
    return {
        "name": "device", "nodes": 2, "steps": 20, "eval_every": 10, "seed": 4,
        "algorithm": {"lr": 0.05, **algorithm},
        "model": {"name": "cnn"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 16, "train_limit": 400,
                 "test_limit": 200},
        "topology": {"kind": "ring"},
        **extra,
    }


# -- naming a device ----------------------------------------------------------------------------------------------


def test_a_device_name_resolves_or_is_refused_in_one_line():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("gpu", "cuda:x", "cpu:1", "cuda:1:2", ""):
        with pytest.raises(DeviceError, match="unknown device"):
            resolve_device(name)
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, or the first where there is none
    with pytest.raises(DeviceError) as refused:
        resolve_device(missing)
    assert "\n" not in str(refused.value) and missing in str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_an_agent_asked_for_a_gpu_it_lacks_exits_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nodeagent.cli", "serve", "--device", "cuda", "--insecure",
                           "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"nodeagent: --device cuda asked for, but no CUDA device is available (torch {torch.__version__}, built for "
        f"CUDA {torch.version.cuda or 'none'})"]


# -- the node on its device ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("algorithm", [{"name": "pdmm-isvr"}, {"name": "dsgd", "mode": "sync", "momentum": 0.9},
                                       {"name": "diloco", "options": {"inner_steps": 5, "precision": "int8"}}],
                         ids=["pdmm-isvr", "dsgd-sync", "diloco-int8"])
def test_a_node_keeps_its_model_state_batches_and_evaluation_on_its_device(fashion_mnist_dir, device_name,
                                                                           algorithm):
    device = torch.device(device_name)
    spec = parse_job_spec(small_job(fashion_mnist_dir, algorithm))
    result = simulate(spec, device=device)
    assert result.mesh.finished
    for sim in result.mesh.nodes:
        node = sim.node
        tensors = [value for value in vars(node.algorithm).values() if isinstance(value, torch.Tensor)]
        tensors += [t for value in vars(node.algorithm).values() if isinstance(value, dict)
                    for t in value.values() if isinstance(t, torch.Tensor)]
        assert tensors and {t.device.type for t in tensors} == {device.type}
        assert all(p.device.type == device.type for p in node.algorithm.model.parameters())
        images, labels = node.batches.next()
        assert images.device.type == labels.device.type == device.type
        assert 0.0 <= node.evaluate().accuracy <= 1.0


@pytest.mark.parametrize("device_name", DEVICES)
def test_batches_are_the_same_samples_in_the_same_order_on_every_device_and_path(fashion_mnist_dir, monkeypatch,
                                                                                device_name):
    device = torch.device(device_name)
    train = load_dataset("fashion-mnist", fashion_mnist_dir, "train", 600)
    shard = np.arange(0, 600, 3)
    on_cpu = BatchStream(train, shard, 32, seed=9)
    uploaded = BatchStream(train, shard, 32, seed=9, device=device)
    monkeypatch.setattr(device_module, "DATA_ON_DEVICE_FRACTION", 0.0)  # too large for the device: copied over
    copied = BatchStream(train, shard, 32, seed=9, device=device)
    for _ in range(15):  # past an epoch's end
        expected_images, expected_labels = on_cpu.next()
        for stream in (uploaded, copied):
            images, labels = stream.next()
            assert torch.allclose(images.cpu(), expected_images, rtol=0, atol=1e-6)
            assert torch.equal(labels.cpu(), expected_labels)


# -- checkpoints move between devices ----------------------------------------------------------------------------


@pytest.mark.parametrize("restored_on", DEVICES)
@pytest.mark.parametrize("saved_on", DEVICES)
def test_a_checkpoint_resumes_on_another_device(fashion_mnist_dir, tmp_path, saved_on, restored_on):
    spec = parse_job_spec(small_job(fashion_mnist_dir, {"name": "diloco", "options": {"inner_steps": 5}}))
    saved = simulate(spec, device=torch.device(saved_on)).mesh.nodes[0].node.algorithm
    path = tmp_path / "rank0.pt"
    save_checkpoint(path, saved)
    fresh = build_nodes(spec, device=torch.device(restored_on))[0].algorithm
    assert restore_checkpoint(path, fresh)
    assert fresh.clock == saved.clock == spec.steps
    for name in ("w", "global_w", "outer_momentum", "adam_m", "adam_v"):
        mine, theirs = getattr(fresh, name), getattr(saved, name)
        assert mine.device.type == restored_on and torch.equal(mine.cpu(), theirs.cpu()), name


# -- the simulator on a device --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_name", DEVICES)
def test_the_simulator_gives_the_cpus_results_on_any_device(fashion_mnist_dir, device_name):
    # The logistic model: a GPU's convolutions may run in TF32 (torch's default for cuDNN), a tenth of the bits.
    spec = parse_job_spec(small_job(fashion_mnist_dir, {"name": "dsgd", "mode": "sync"}, model={"name": "logistic"}))
    on_cpu = simulate(spec).mesh
    on_device = simulate(spec, device=torch.device(device_name)).mesh
    assert on_device.now == on_cpu.now  # the same virtual clock
    for cpu, other in zip(on_cpu.nodes, on_device.nodes, strict=True):
        assert torch.allclose(other.node.algorithm.w.cpu(), cpu.node.algorithm.w, rtol=0, atol=1e-4)
        assert abs(other.driver.accuracy - cpu.driver.accuracy) <= 0.01


# -- mixed precision ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_name", DEVICES)
def test_bf16_trains_with_fp32_master_weights(fashion_mnist_dir, device_name):
    # The logistic model: the master weights and the autocast are the claim, and bf16 convolutions are slow on a CPU.
    spec = parse_job_spec(small_job(fashion_mnist_dir, {"name": "dsgd"}, training={"precision": "bf16"}, steps=40,
                                    model={"name": "logistic"}))
    result = simulate(spec, device=torch.device(device_name))
    for sim in result.mesh.nodes:
        assert sim.node.algorithm.w.dtype == torch.float32
        assert math.isfinite(sim.driver.progress().loss)
        assert sim.driver.accuracy > 0.3


def test_fp16_needs_a_cuda_device(fashion_mnist_dir, tmp_path):
    job = small_job(fashion_mnist_dir, {"name": "dsgd"}, training={"precision": "fp16"})
    spec = parse_job_spec(job)
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        build_nodes(spec, device=torch.device("cpu"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "simulate", str(path), "--device", "cpu",
                           "--runs", str(tmp_path / "runs")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "training.precision fp16 needs a CUDA device" in done.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fp16_trains_on_a_gpu_with_a_loss_scale(fashion_mnist_dir):
    spec = parse_job_spec(small_job(fashion_mnist_dir, {"name": "dsgd"}, training={"precision": "fp16"}, steps=40))
    result = simulate(spec, device=torch.device("cuda"))
    for sim in result.mesh.nodes:
        assert sim.node.algorithm.w.dtype == torch.float32
        assert sim.node.algorithm.loss_scale is not None
        assert sim.driver.accuracy > 0.3


def test_the_loss_scale_halves_on_an_overflow_and_grows_after_finite_steps():
    scale = LossScale()
    scale.update(finite=False)
    assert scale.scale == LossScale.INITIAL / 2
    for _ in range(LossScale.GROWTH_INTERVAL - 1):
        scale.update(finite=True)
    assert scale.scale == LossScale.INITIAL / 2
    scale.update(finite=True)
    assert scale.scale == LossScale.INITIAL


# -- failures on the device -----------------------------------------------------------------------------------------


def test_out_of_device_memory_fails_the_job_saying_what_asked_for_it(fashion_mnist_dir):
    spec = parse_job_spec(small_job(fashion_mnist_dir, {"name": "dsgd"}))
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nmore detail")
    assert failure_of(error, spec, torch.device("cuda", 1)) == (
        "CUDA out of memory: CUDA out of memory. Tried to allocate 20.00 GiB. (model cnn, batch 16, device cuda:1)")
    assert failure_of(ValueError("bad"), spec, torch.device("cpu")) == "ValueError: bad"
