"""Small datasets written by the tests themselves in each format nodeagent.training.data reads (nothing downloaded),
and learnable data to train on."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from nodeagent.training.data import DatasetInfo

# What the Fashion-MNIST files of Debian's dataset-fashion-mnist hold.
FASHION_MNIST = DatasetInfo((1, 28, 28), 10, 60_000, 10_000)

CIFAR10_TRAIN_FILES = [f"data_batch_{n}.bin" for n in range(1, 6)]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Writes an IDX file of unsigned bytes by hand (gzipped when the name ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def cifar_bytes(pixels: np.ndarray, labels: np.ndarray, coarse: np.ndarray | None = None) -> bytes:
    """Records of the binary distribution: [coarse label,] label, 3072 pixel bytes (channel, row, column)."""
    columns = [labels.astype(np.uint8)[:, None], pixels.astype(np.uint8).reshape(len(pixels), -1)]
    if coarse is not None:
        columns.insert(0, coarse.astype(np.uint8)[:, None])
    return np.concatenate(columns, axis=1).tobytes()


def write_cifar10(directory: Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> None:
    """CIFAR-10's six .bin files; the training samples are dealt out over the five batches in order."""
    directory.mkdir(parents=True, exist_ok=True)
    pixels, labels = train
    for name, part in zip(CIFAR10_TRAIN_FILES, np.array_split(np.arange(len(labels)), 5), strict=True):
        (directory / name).write_bytes(cifar_bytes(pixels[part], labels[part]))
    (directory / "test_batch.bin").write_bytes(cifar_bytes(*test))


def write_cifar100(directory: Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> None:
    """CIFAR-100's train.bin and test.bin; the coarse label is the fine one // 5, as a distractor."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (pixels, labels) in (("train.bin", train), ("test.bin", test)):
        (directory / name).write_bytes(cifar_bytes(pixels, labels, coarse=labels // 5))


def write_npy(directory: Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split, (x, y) in (("train", train), ("test", test)):
        np.save(directory / f"{split}_x.npy", x)
        np.save(directory / f"{split}_y.npy", y)


def write_image_folder(directory: Path, split: str, images: dict[str, list[np.ndarray]]) -> None:
    """DIR/split/<class>/<n>.png for each class's images (H, W) grey or (H, W, 3) colour, uint8."""
    from PIL import Image

    for name, arrays in images.items():
        folder = directory / split / name
        folder.mkdir(parents=True, exist_ok=True)
        for index, array in enumerate(arrays):
            Image.fromarray(array).save(folder / f"{index}.png")


def learnable(samples: int, shape: tuple[int, ...], classes: int, seed: int, spread: float = 40.0,
              centres_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 samples around one random mean image per class (the same means for the same `centres_seed`), and their
    labels: a linear model separates them well within a few dozen steps."""
    centres = np.random.default_rng(centres_seed).uniform(60, 195, size=(classes, *shape))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, samples)
    noisy = centres[labels] + rng.normal(0, spread, size=(samples, *shape))
    return np.clip(noisy, 0, 255).round().astype(np.uint8), labels.astype(np.int64)
