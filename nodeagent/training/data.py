"""Fashion-MNIST and MNIST from their IDX files, plain or gzipped, in any directory.

Both datasets ship as the same four files (train-images-idx3-ubyte, train-labels-idx1-ubyte,
t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte), optionally with a `.gz` suffix. Debian's package
`dataset-fashion-mnist` puts them in /usr/share/datasets/fashion-mnist. torchvision is not needed.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from nodeagent.jobspec import DEFAULT_DATA_DIR

__all__ = ["DATASETS", "DEFAULT_DATA_DIR", "DataError", "Dataset", "DatasetInfo", "load_dataset", "read_idx"]


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset's samples are, known without reading it: the coordinator builds the initial model (for the
    parameter server) from this, and loading checks the files against it."""

    input_shape: tuple[int, ...]
    num_classes: int
    # Mean and standard deviation of the training pixels scaled to [0, 1]. They are fixed per dataset (not
    # computed from the shard) so that every node, and the test set, sees the same input transform.
    normalisation: tuple[float, float]


DATASETS: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo((1, 28, 28), 10, (0.2860, 0.3530)),
    "mnist": DatasetInfo((1, 28, 28), 10, (0.1307, 0.3081)),
}

_FILE_PREFIX = {"train": "train", "test": "t10k"}

# IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
_IDX_UBYTE = 0x08


class DataError(Exception):
    """A dataset file that is missing, unreadable or not what it should be; the message names the file."""


@dataclass(frozen=True)
class Dataset:
    """Images and labels held in memory, ready to be indexed by minibatch.

    The tensors may be shared with other Dataset objects loaded from the same files in this process (see
    load_dataset): never modify them in place.
    """

    images: torch.Tensor  # (N, *DatasetInfo.input_shape) float32, normalised: (x / 255 - mean) / std
    labels: torch.Tensor  # (N,) int64, in 0..DatasetInfo.num_classes - 1

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Reads one IDX file of unsigned bytes with `ndim` dimensions (gzipped when its name ends in .gz)."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read: {error}") from None
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path}: truncated header ({len(raw)} bytes)")
    zero, dtype, found_ndim = struct.unpack_from(">HBB", raw)
    if zero != 0 or dtype != _IDX_UBYTE or found_ndim != ndim:
        raise DataError(
            f"{path}: bad magic number 0x{raw[:4].hex()}, expected 0x0000{_IDX_UBYTE:02x}{ndim:02x} "
            f"(IDX, unsigned bytes, {ndim} dimensions)"
        )
    shape = struct.unpack_from(f">{ndim}I", raw, 4)
    expected = header_size + int(np.prod(shape))
    if len(raw) != expected:
        raise DataError(f"{path}: {len(raw)} bytes, but its header {shape} says {expected}")
    # frombuffer views the bytes without copying them: decoding 60,000 images costs nothing beyond gzip.
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)


def _find_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{stem} (or {stem}.gz) not found in {directory}. Install the Debian package 'dataset-fashion-mnist' "
        f"(sudo apt-get install dataset-fashion-mnist, files in {DEFAULT_DATA_DIR}), or put the four IDX "
        f"files of Fashion-MNIST or MNIST in a directory and pass it with --data-dir DIR "
        f"(or PEERTRAIN_DATA_DIR=DIR)"
    )


# Many simulated nodes in one process load the same files: decode them once, share the tensors.
@lru_cache(maxsize=8)
def _load_tensors(name: str, directory: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = _FILE_PREFIX[split]
    image_path = _find_file(directory, f"{prefix}-images-idx3-ubyte")
    label_path = _find_file(directory, f"{prefix}-labels-idx1-ubyte")
    info = DATASETS[name]
    images = read_idx(image_path, 3)
    labels = read_idx(label_path, 1)
    if (1, *images.shape[1:]) != info.input_shape:
        side = "x".join(map(str, info.input_shape[1:]))
        raise DataError(f"{image_path}: images are {images.shape[1]}x{images.shape[2]}, expected {side}")
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{label_path}: {labels.shape[0]} labels for {images.shape[0]} images in {image_path}")
    if labels.size and labels.max() >= info.num_classes:
        raise DataError(f"{label_path}: label {labels.max()} is not in 0..{info.num_classes - 1}")
    mean, std = info.normalisation
    # torch.tensor copies the read-only buffer once; the arithmetic then runs in place.
    image_tensor = torch.tensor(images).unsqueeze(1).to(torch.float32)
    image_tensor.div_(255.0).sub_(mean).div_(std)
    return image_tensor, torch.tensor(labels, dtype=torch.int64)


def load_dataset(name: str, data_dir: str | Path, split: Literal["train", "test"], limit: int | None = None) -> Dataset:
    """Loads the train or test split of `name` ('fashion-mnist' or 'mnist'), only its first `limit`
    samples when given. Raises DataError when a file is missing or malformed."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
    if split not in _FILE_PREFIX:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    images, labels = _load_tensors(name, Path(data_dir).expanduser().resolve(), split)
    # Slicing makes views: a limited dataset still shares memory with the cached one.
    return Dataset(images=images[:limit], labels=labels[:limit])
