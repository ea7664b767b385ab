"""The model file: what `coordinator export` and `coordinator simulate --export` write, what `coordinator report
--model` evaluates, and what a job's `model.init` starts from.

The file is `torch.save({"state_dict": ..., "manifest": ...})`, loadable with `torch.load(path, weights_only=True)`:
`state_dict` is the model's own (the keys of `model.state_dict()`, each tensor shaped as the module holds it),
`manifest` a dictionary of plain values whose `format` is FORMAT (coordinator.export.manifest_of says what else it
holds). Nothing in it is code: it is read with weights_only, never unpickled.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = "peertrain-model/1"
# A model.init file may hold the model's tensors (parameters and buffers) and a manifest, which is small; a file
# many times the model's size is not one, and is refused before it is read.
MANIFEST_ALLOWANCE_BYTES = 1 << 20


class ModelFileError(ValueError):
    """A file that is not a model file, or whose model does not fit; the message says which and why."""


def write_model_file(path: Path, state_dict: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
    """The file, written whole and renamed into place (a file cut short is never left under its name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        torch.save({"state_dict": {name: t.detach().cpu() for name, t in state_dict.items()}, "manifest": manifest},
                   tmp)
    os.replace(tmp.name, path)


def load_model_file(path: Path, max_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state_dict and manifest of a model file (weights only: nothing in it is code). `max_bytes` refuses a
    larger file before reading it."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read it: {error.strerror}") from None
    if max_bytes is not None and size > max_bytes:
        raise ModelFileError(f"{path}: {size} bytes, more than the job's model can fill ({max_bytes}): not its "
                             "model file")
    try:
        with warnings.catch_warnings():  # a file of another pickle protocol: refused below, not warned of
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        # The loader's message can quote the file's bytes: only its kind is shown.
        raise ModelFileError(f"{path}: not a model file `coordinator export` wrote ({type(error).__name__})") \
            from None
    if not isinstance(saved, dict) or not isinstance(saved.get("manifest"), dict) or \
            saved["manifest"].get("format") != FORMAT or not isinstance(saved.get("state_dict"), dict):
        raise ModelFileError(f"{path}: not a model file `coordinator export` wrote (no {FORMAT} manifest)")
    return saved["state_dict"], saved["manifest"]


def load_parameters(model: nn.Module, path: Path) -> None:
    """Copies the trainable parameters of the model file at `path` into `model`, after checking that the file holds
    exactly `model`'s parameters, each of its shape (its buffers, which no algorithm trains or exchanges, stay
    `model`'s own, as an export writes them). ModelFileError naming the first difference."""
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    own = model.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in own.values())
    state_dict, _manifest = load_model_file(path, 2 * model_bytes + MANIFEST_ALLOWANCE_BYTES)
    for names, what in (([n for n in parameters if n not in state_dict], "it has no"),
                        ([n for n in state_dict if n not in own], "the job's has no")):
        if names:
            raise ModelFileError(f"{path}: its model is not the job's: {what} {names[0]!r}"
                                 + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""))
    for name, parameter in parameters.items():
        saved = state_dict[name]
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(parameter.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ModelFileError(f"{path}: its model is not the job's: {name!r} is {shape}, the job's "
                                 f"{tuple(parameter.shape)}")
        if saved.is_floating_point() and not torch.isfinite(saved).all():
            raise ModelFileError(f"{path}: {name!r} holds values that are not finite")
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(state_dict[name])
