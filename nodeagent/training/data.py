"""A job's training and test data, from files in any directory, in one of six kinds.

- fashion-mnist, mnist: the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte,
  t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte), plain or with a `.gz` suffix. Debian's package
  `dataset-fashion-mnist` puts Fashion-MNIST in /usr/share/datasets/fashion-mnist.
- cifar10, cifar100: the binary distribution (cifar-10-binary.tar.gz: data_batch_1.bin .. data_batch_5.bin and
  test_batch.bin; cifar-100-binary.tar.gz: train.bin and test.bin, whose fine labels are used), in the directory
  or in the distribution's own subdirectory of it. The python distribution is refused: it is pickled.
- npy: train_x.npy, train_y.npy, test_x.npy, test_y.npy; x of any sample shape, uint8 (pixels, scaled by 1/255)
  or floating; y integers 0..C-1. Loaded without pickles.
- image-folder: DIR/train/<class>/<image> and DIR/test/<class>/<image>, as torchvision's ImageFolder (class index:
  the sorted class directory names); every image of one size; read with Pillow.

The input shape and class count come from the files (describe_dataset reads only headers and labels). Samples stay
as stored (uint8 pixels memory-mapped where the format allows it) and are normalised per minibatch: the four named
kinds with their published per-channel mean and standard deviation, npy and image-folder with those of their
training set (exact integer sums for pixels, so every node computes the same). Samples of three or more dimensions
are channel-first. torchvision is not needed.

A process loads each dataset once, however many nodes use it, and keeps it between jobs: the cache is keyed by the
kind, the resolved directory, the split and every file's size and modification time, so a changed file is re-read.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from nodeagent.jobspec import DEFAULT_DATA_DIR, DatasetKind
from nodeagent.training.device import fits_on_device

__all__ = [
    "DATASET_KINDS", "DEFAULT_DATA_DIR", "DataError", "Dataset", "DatasetInfo", "DeviceCopy", "Normalisation",
    "describe_dataset",
    "load_dataset", "read_idx",
]

DATASET_KINDS: tuple[str, ...] = get_args(DatasetKind)
Split = Literal["train", "test"]


class DataError(Exception):
    """A dataset file that is missing, unreadable or not what it should be; the message names the file."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset's files hold, read from their headers: the model is shaped from it. Small and plain, so that
    it can travel (an agent's description of its data)."""

    input_shape: tuple[int, ...]  # of one sample
    num_classes: int
    train_samples: int
    test_samples: int

    def __str__(self) -> str:
        return (f"input {'x'.join(map(str, self.input_shape))}, {self.num_classes} classes, {self.train_samples} "
                f"training and {self.test_samples} test samples")


@dataclass(frozen=True)
class Normalisation:
    """The input transform every node applies, identically: x / divisor, then per channel (x - mean) / std."""

    divisor: float  # 255 for uint8 pixels, 1 for floating samples
    mean: tuple[float, ...]  # one per channel
    std: tuple[float, ...]

    def _mean_std_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and standard deviation as tensors on `device`, made once per device: a copy from host memory
        at every minibatch would make each step wait for the GPU to finish the ones queued before it."""
        made = self.__dict__.setdefault("_mean_std", {})
        if device not in made:
            made[device] = (torch.tensor(self.mean, dtype=torch.float32, device=device),
                            torch.tensor(self.std, dtype=torch.float32, device=device))
        return made[device]

    def apply(self, samples: np.ndarray) -> torch.Tensor:
        """The normalised float32 copy of `samples` (N, *shape); `samples` is never written. Pixels (uint8) are
        looked up in `_pixel_table`, in one pass: the same values as the arithmetic, which is per element."""
        if samples.dtype == np.uint8:
            table = self._pixel_table()
            if len(self.mean) == 1:
                return torch.from_numpy(table[0].take(samples))  # take: a flat gather, faster than indexing
            channels = np.arange(len(self.mean)).reshape((len(self.mean),) + (1,) * (samples.ndim - 2))
            return torch.from_numpy(table[channels, samples])
        return self.apply_tensor(torch.from_numpy(np.array(samples, dtype=np.float32)))

    def _pixel_table(self) -> np.ndarray:
        """(channels, 256) float32: every pixel value of every channel normalised by `apply_tensor`, made once. A
        minibatch of pixels normalised through it costs one gather instead of a conversion and three passes."""
        made = self.__dict__.get("_table")
        if made is None:
            channels = len(self.mean)
            pixels = torch.arange(256, dtype=torch.float32).reshape(256, 1, 1).repeat(1, channels, 1)
            made = self.__dict__["_table"] = self.apply_tensor(pixels).reshape(256, channels).T.contiguous().numpy()
        return made

    def apply_tensor(self, images: torch.Tensor) -> torch.Tensor:
        """`images` (N, *shape), float32 samples that this call may overwrite, normalised in place on their own
        device."""
        if self.divisor != 1:
            images.div_(self.divisor)
        mean, std = self._mean_std_on(images.device)
        if len(self.mean) > 1:  # channel-first: (C, 1, ..., 1) broadcasts over the sample's other axes
            shape = (len(self.mean),) + (1,) * (images.dim() - 2)
            mean, std = mean.reshape(shape), std.reshape(shape)
        return images.sub_(mean).div_(std)


@dataclass(frozen=True)
class Dataset:
    """Samples and labels ready to be indexed by minibatch.

    The arrays may be shared with other Dataset objects loaded from the same files in this process, and memory-mapped
    read-only (see load_dataset): never modify them in place.
    """

    samples: np.ndarray  # (N, *info.input_shape) as stored: uint8 pixels or float32, not normalised
    labels: torch.Tensor  # (N,) int64, in 0..info.num_classes - 1
    info: DatasetInfo  # of the files (N may be less: a limit)
    normalisation: Normalisation

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.info.input_shape

    def images(self, which: np.ndarray | slice) -> torch.Tensor:
        """The samples `which` (indices or a slice), normalised: float32 (B, *input_shape)."""
        chosen = self.samples[which] if isinstance(which, slice) else self.samples.take(which, axis=0)
        return self.normalisation.apply(chosen)

    def batch(self, which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `which` (indices): normalised images and their labels."""
        return self.images(which), self.labels.index_select(0, torch.from_numpy(which))

    @cached_property
    def normalised(self) -> torch.Tensor:
        """Every sample normalised, computed once and kept: evaluation reads the whole test set again and again (each
        simulated node, each evaluation), and normalising it costs more than a small model's forward pass."""
        return self.normalisation.apply(self.samples)

    def on(self, device: torch.device) -> DeviceCopy | None:
        """This data set uploaded to `device` once (samples as stored, labels), shared by every node of the process
        on that device; None on the CPU, or where it would take more than its share of the device's memory
        (DATA_ON_DEVICE_FRACTION): minibatches are then copied over one by one."""
        if device.type == "cpu" or not fits_on_device(self.samples.nbytes + self.labels.nbytes, device):
            return None
        copies = self.__dict__.setdefault("_device_copies", {})
        if device not in copies:
            # torch.tensor copies (memory-mapped samples are read-only; from_numpy would warn of sharing them).
            copies[device] = DeviceCopy(torch.tensor(self.samples, device=device), self.labels.to(device),
                                        self.normalisation)
        return copies[device]


@dataclass(frozen=True)
class DeviceCopy:
    """A data set held on a GPU: samples as stored (uint8 pixels take a quarter of their float32 size), normalised
    per minibatch there."""

    samples: torch.Tensor
    labels: torch.Tensor
    normalisation: Normalisation

    def images(self, which: torch.Tensor | slice) -> torch.Tensor:
        """The samples `which` (indices on this device, or a slice), normalised: float32 (B, *input_shape)."""
        chosen = self.samples[which] if isinstance(which, slice) else self.samples.index_select(0, which)
        return self.normalisation.apply_tensor(chosen.to(torch.float32, copy=True))

    def batch(self, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `which` (indices on this device): normalised images and their labels."""
        return self.images(which), self.labels.index_select(0, which)


def _published(mean: tuple[float, ...], std: tuple[float, ...]) -> Normalisation:
    return Normalisation(255.0, mean, std)


# The published per-channel mean and standard deviation of each named dataset's training pixels in [0, 1]: fixed,
# so that every node and the test set see the same transform whatever part of the data they hold.
PUBLISHED_NORMALISATION: dict[str, Normalisation] = {
    "fashion-mnist": _published((0.2860,), (0.3530,)),
    "mnist": _published((0.1307,), (0.3081,)),
    "cifar10": _published((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _published((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

# (sample shape, classes) that a kind's format fixes: its readers check the files against them.
FIXED_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "fashion-mnist": ((1, 28, 28), 10),
    "mnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
}


# -- IDX (fashion-mnist, mnist) ---------------------------------------------------------------------------------------

_IDX_PREFIX = {"train": "train", "test": "t10k"}
# IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
_IDX_UBYTE = 0x08


def _idx_header(path: Path, raw: bytes, ndim: int) -> tuple[int, ...]:
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path}: truncated header ({len(raw)} bytes)")
    zero, dtype, found_ndim = struct.unpack_from(">HBB", raw)
    if zero != 0 or dtype != _IDX_UBYTE or found_ndim != ndim:
        raise DataError(
            f"{path}: bad magic number 0x{raw[:4].hex()}, expected 0x0000{_IDX_UBYTE:02x}{ndim:02x} "
            f"(IDX, unsigned bytes, {ndim} dimensions)"
        )
    return struct.unpack_from(f">{ndim}I", raw, 4)


def _read_header_bytes(path: Path, size: int) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as file:
                return file.read(size)
        with path.open("rb") as file:
            return file.read(size)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read: {error}") from None


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Reads one IDX file of unsigned bytes with `ndim` dimensions: memory-mapped read-only, or decompressed once
    into memory when its name ends in .gz."""
    header_size = 4 + 4 * ndim
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(path.read_bytes())
        except (OSError, EOFError, zlib.error) as error:
            raise DataError(f"{path}: cannot read: {error}") from None
        size = len(raw)
    else:
        raw = _read_header_bytes(path, header_size)
        size = path.stat().st_size
    shape = _idx_header(path, raw, ndim)
    expected = header_size + int(np.prod(shape))
    if size != expected:
        raise DataError(f"{path}: {size} bytes, but its header {shape} says {expected}")
    if path.suffix == ".gz":
        # frombuffer views the bytes without copying them.
        return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)
    if expected == header_size:  # nothing to map
        return np.zeros(shape, np.uint8)
    return np.asarray(np.memmap(path, dtype=np.uint8, mode="r", offset=header_size, shape=shape))


def _idx_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{stem} (or {stem}.gz) not found in {directory}. Install the Debian package 'dataset-fashion-mnist' "
        f"(sudo apt-get install dataset-fashion-mnist, files in {DEFAULT_DATA_DIR}), or put the four IDX "
        f"files of Fashion-MNIST or MNIST in a directory and map it on the agent: --data-dir fashion-mnist=DIR "
        f"(or mnist=DIR), or put it under its --data-root"
    )


def _idx_files(kind: str, directory: Path, split: Split) -> list[Path]:
    prefix = _IDX_PREFIX[split]
    return [_idx_file(directory, f"{prefix}-images-idx3-ubyte"), _idx_file(directory, f"{prefix}-labels-idx1-ubyte")]


def _idx_count_and_shape(kind: str, directory: Path, split: Split) -> tuple[int, tuple[int, ...]]:
    image_path, label_path = _idx_files(kind, directory, split)
    count, rows, columns = _idx_header(image_path, _read_header_bytes(image_path, 16), 3)
    (labels,) = _idx_header(label_path, _read_header_bytes(label_path, 8), 1)
    if count != labels:
        raise DataError(f"{label_path}: {labels} labels for {count} images in {image_path}")
    expected = FIXED_SHAPES[kind][0]
    if (1, rows, columns) != expected:
        raise DataError(f"{image_path}: images are {rows}x{columns}, expected {expected[1]}x{expected[2]} ({kind})")
    return count, (1, rows, columns)


def _idx_read(kind: str, directory: Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    image_path, label_path = _idx_files(kind, directory, split)
    images = read_idx(image_path, 3)
    labels = read_idx(label_path, 1)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{label_path}: {labels.shape[0]} labels for {images.shape[0]} images in {image_path}")
    return images[:, np.newaxis], _checked_labels(label_path, labels, FIXED_SHAPES[kind][1])


# -- CIFAR-10 and CIFAR-100, binary distribution ----------------------------------------------------------------------

_CIFAR_PIXELS = ("pixels", np.uint8, (3, 32, 32))
_CIFAR_RECORDS = {  # the label used is the field called "label"
    "cifar10": np.dtype([("label", np.uint8), _CIFAR_PIXELS]),
    "cifar100": np.dtype([("coarse", np.uint8), ("label", np.uint8), _CIFAR_PIXELS]),
}
_CIFAR_FILES = {
    "cifar10": {"train": [f"data_batch_{n}.bin" for n in range(1, 6)], "test": ["test_batch.bin"]},
    "cifar100": {"train": ["train.bin"], "test": ["test.bin"]},
}
_CIFAR_SUBDIRECTORY = {"cifar10": "cifar-10-batches-bin", "cifar100": "cifar-100-binary"}
_CIFAR_PICKLED = {"cifar10": ("cifar-10-batches-py", "data_batch_1"), "cifar100": ("cifar-100-python", "train")}
_CIFAR_BINARY_URL = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
}


def _cifar_directory(kind: str, directory: Path) -> Path:
    first = _CIFAR_FILES[kind]["train"][0]
    for candidate in (directory, directory / _CIFAR_SUBDIRECTORY[kind]):
        if (candidate / first).is_file():
            return candidate
    python_directory, python_file = _CIFAR_PICKLED[kind]
    for candidate in (directory, directory / python_directory):
        if (candidate / python_file).is_file():
            raise DataError(
                f"{candidate / python_file}: this is the python version of {kind}, whose files are pickles, which "
                f"peertrain never loads: use the binary version ({_CIFAR_BINARY_URL[kind]})"
            )
    raise DataError(
        f"{first} not found in {directory} nor in {directory / _CIFAR_SUBDIRECTORY[kind]}: unpack "
        f"{_CIFAR_BINARY_URL[kind]} and map its directory on the agent: --data-dir {kind}=DIR (or data.data_dir)"
    )


def _cifar_files(kind: str, directory: Path, split: Split) -> list[Path]:
    base = _cifar_directory(kind, directory)
    paths = [base / name for name in _CIFAR_FILES[kind][split]]
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: not found ({kind} needs {', '.join(_CIFAR_FILES[kind][split])} in {base})")
    return paths


def _cifar_records(kind: str, path: Path) -> int:
    size = path.stat().st_size
    record = _CIFAR_RECORDS[kind].itemsize
    if size == 0 or size % record:
        raise DataError(f"{path}: {size} bytes is not a whole number of {record}-byte records (truncated?)")
    return size // record


def _cifar_count_and_shape(kind: str, directory: Path, split: Split) -> tuple[int, tuple[int, ...]]:
    return sum(_cifar_records(kind, path) for path in _cifar_files(kind, directory, split)), (3, 32, 32)


def _cifar_read(kind: str, directory: Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    samples, labels = [], []
    for path in _cifar_files(kind, directory, split):
        records = np.memmap(path, dtype=_CIFAR_RECORDS[kind], mode="r", shape=(_cifar_records(kind, path),))
        samples.append(np.asarray(records["pixels"]))
        labels.append(_checked_labels(path, np.asarray(records["label"]), FIXED_SHAPES[kind][1]))
    # One file stays mapped; CIFAR-10's five training batches are joined into memory (150 MB of pixels).
    return (samples[0] if len(samples) == 1 else np.concatenate(samples)), np.concatenate(labels)


# -- NumPy arrays -----------------------------------------------------------------------------------------------------

_NPY_FILES = {"train": ("train_x.npy", "train_y.npy"), "test": ("test_x.npy", "test_y.npy")}


def _npy_files(kind: str, directory: Path, split: Split) -> list[Path]:
    paths = [directory / name for name in _NPY_FILES[split]]
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: not found (npy data is train_x.npy, train_y.npy, test_x.npy and test_y.npy: "
                            f"samples and integer labels)")
    return paths


def _npy_load(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(f"{path}: not a readable .npy file without pickles: {error}") from None
    if not isinstance(array, np.ndarray):
        raise DataError(f"{path}: not a .npy array")
    return np.asarray(array)


def _npy_arrays(directory: Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    """The split's x and y, memory-mapped and checked but for x's values; y as int64."""
    x_path, y_path = _npy_files("npy", directory, split)
    x, y = _npy_load(x_path), _npy_load(y_path)
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise DataError(f"{x_path}: samples must be uint8 pixels or floating point, not {x.dtype}")
    if x.ndim < 2 or 0 in x.shape[1:]:
        raise DataError(f"{x_path}: shape {x.shape}: samples must have a non-empty shape (N, ...)")
    if y.ndim != 1:
        raise DataError(f"{y_path}: shape {y.shape}: labels must be one-dimensional (N,)")
    if y.dtype.kind not in "iu":
        raise DataError(f"{y_path}: labels must be integers, not {y.dtype}")
    if len(x) != len(y):
        raise DataError(f"{y_path}: {len(y)} labels for {len(x)} samples in {x_path}")
    if len(y) == 0:
        raise DataError(f"{x_path}: no samples")
    labels = y.astype(np.int64)
    if labels.min() < 0:
        raise DataError(f"{y_path}: label {labels.min()} is negative (labels are 0..C-1)")
    return x, labels


def _npy_count_and_shape(kind: str, directory: Path, split: Split) -> tuple[int, tuple[int, ...]]:
    x, _ = _npy_arrays(directory, split)
    return len(x), tuple(int(side) for side in x.shape[1:])


def _npy_classes(directory: Path) -> int:
    return 1 + max(int(_npy_arrays(directory, split)[1].max()) for split in ("train", "test"))


_CHUNK_SAMPLES = 4096  # scanned at a time when a whole array is checked or summed


def _npy_read(kind: str, directory: Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    x, labels = _npy_arrays(directory, split)
    if x.dtype.kind == "f":
        x_path = directory / _NPY_FILES[split][0]
        for start in range(0, len(x), _CHUNK_SAMPLES):
            chunk = x[start : start + _CHUNK_SAMPLES]
            finite = np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
            if not finite.all():
                sample = start + int(np.argmin(finite))
                raise DataError(f"{x_path}: sample {sample} holds NaN or an infinite value")
        if x.dtype != np.float32:  # what the models compute in; a float32 file stays mapped
            x = x.astype(np.float32)
    return x, labels


# -- image folder -----------------------------------------------------------------------------------------------------

# torchvision's ImageFolder extensions
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_GREY_MODES = ("1", "L", "I", "I;16", "F")


def _class_names(directory: Path) -> list[str]:
    train = directory / "train"
    if not train.is_dir():
        raise DataError(f"{train}: not found (image-folder data is train/<class>/<image> and test/<class>/<image>)")
    names = sorted(entry.name for entry in os.scandir(train) if entry.is_dir() and not entry.name.startswith("."))
    if not names:
        raise DataError(f"{train}: no class directories (train/<class>/<image>)")
    return names


def _image_files(kind: str, directory: Path, split: Split) -> list[Path]:
    return [path for path, _ in _labelled_images(directory, split)]


def _labelled_images(directory: Path, split: Split) -> list[tuple[Path, int]]:
    """Every image of the split and its class index, in torchvision's order: by class, then by path."""
    classes = _class_names(directory)
    root = directory / split
    if not root.is_dir():
        raise DataError(f"{root}: not found (image-folder data is train/<class>/<image> and test/<class>/<image>)")
    found = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise DataError(f"{root / unknown[0]}: class {unknown[0]!r} is not among train/'s classes")
    images = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            images += [(Path(folder) / file, label) for file in sorted(files)
                       if file.lower().endswith(_IMAGE_EXTENSIONS) and not file.startswith(".")]
    if not images:
        raise DataError(f"{root}: no images ({', '.join(_IMAGE_EXTENSIONS)}) in its class directories")
    return images


def _open_image(path: Path):  # -> PIL.Image.Image; imported here: only image folders need Pillow
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except (OSError, UnidentifiedImageError) as error:
        raise DataError(f"{path}: not a readable image: {error}") from None


def _image_folder_shape(directory: Path) -> tuple[int, ...]:
    """(C, H, W) of every image of both splits: 1 channel when all are grey, else 3; DataError naming an image whose
    size differs from the first's. Reads headers only."""
    first: tuple[Path, tuple[int, int]] | None = None
    channels = 1
    for split in ("train", "test"):
        for path, _ in _labelled_images(directory, split):
            with _open_image(path) as image:
                size, mode = image.size, image.mode
            if first is None:
                first = (path, size)
            elif size != first[1]:
                raise DataError(f"{path}: {size[0]}x{size[1]} pixels, but {first[0]} is {first[1][0]}x{first[1][1]}: "
                                "every image must have the same size")
            if mode not in _GREY_MODES:
                channels = 3
    assert first is not None  # _labelled_images found images
    width, height = first[1]
    return channels, height, width


def _image_folder_count_and_shape(kind: str, directory: Path, split: Split) -> tuple[int, tuple[int, ...]]:
    return len(_labelled_images(directory, split)), _image_folder_shape(directory)


def _image_folder_read(kind: str, directory: Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    channels, height, width = _image_folder_shape(directory)
    images = _labelled_images(directory, split)
    pixels = np.empty((len(images), channels, height, width), np.uint8)
    for index, (path, _) in enumerate(images):
        with _open_image(path) as image:
            try:
                array = np.asarray(image.convert("L" if channels == 1 else "RGB"))
            except (OSError, ValueError) as error:
                raise DataError(f"{path}: cannot decode: {error}") from None
        if array.shape[:2] != (height, width):
            raise DataError(f"{path}: {array.shape[1]}x{array.shape[0]} pixels, expected {width}x{height}")
        pixels[index] = array[np.newaxis] if channels == 1 else array.transpose(2, 0, 1)
    return pixels, np.array([label for _, label in images], np.int64)


# -- the kinds --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
    files: Callable[[str, Path, Split], list[Path]]  # the split's files (DataError when one is missing)
    count_and_shape: Callable[[str, Path, Split], tuple[int, tuple[int, ...]]]  # from headers
    read: Callable[[str, Path, Split], tuple[np.ndarray, np.ndarray]]  # samples and int64 labels, checked


_IDX = _Format(_idx_files, _idx_count_and_shape, _idx_read)
_CIFAR = _Format(_cifar_files, _cifar_count_and_shape, _cifar_read)
_FORMATS: dict[str, _Format] = {
    "fashion-mnist": _IDX, "mnist": _IDX, "cifar10": _CIFAR, "cifar100": _CIFAR,
    "npy": _Format(_npy_files, _npy_count_and_shape, _npy_read),
    "image-folder": _Format(_image_files, _image_folder_count_and_shape, _image_folder_read),
}


def _checked_labels(path: Path, labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = labels.astype(np.int64)
    if labels.size and labels.max() >= num_classes:
        record = int(np.argmax(labels >= num_classes))
        raise DataError(f"{path}: label {labels[record]} (sample {record}) is not in 0..{num_classes - 1}")
    return labels


FileIdentity = tuple[tuple[str, int, int], ...]  # (path, size, mtime in ns) of each file


def _identity(paths: list[Path]) -> FileIdentity:
    stats = [(str(path), path.stat()) for path in paths]
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)


def _resolved(kind: str, data_dir: str | Path) -> Path:
    if kind not in _FORMATS:
        raise ValueError(f"unknown dataset {kind!r}; known: {', '.join(DATASET_KINDS)}")
    directory = Path(data_dir).expanduser().resolve()
    if not directory.is_dir():
        raise DataError(f"{directory}: no such directory (the {kind} data's directory: data.data_dir, or an agent's "
                        f"--data-dir {kind}=DIR)")
    return directory


def _both_identities(kind: str, directory: Path) -> tuple[FileIdentity, FileIdentity]:
    files = _FORMATS[kind].files
    return _identity(files(kind, directory, "train")), _identity(files(kind, directory, "test"))


def describe_dataset(kind: str, data_dir: str | Path) -> DatasetInfo:
    """The input shape, class count and sample counts of the `kind` data in `data_dir`, from the files' headers (and
    the labels of npy data). Raises DataError naming a missing or malformed file, ValueError for an unknown kind."""
    directory = _resolved(kind, data_dir)
    return _describe(kind, directory, _both_identities(kind, directory))


@lru_cache(maxsize=16)
def _describe(kind: str, directory: Path, identities: tuple[FileIdentity, FileIdentity]) -> DatasetInfo:
    count_and_shape = _FORMATS[kind].count_and_shape
    train_samples, train_shape = count_and_shape(kind, directory, "train")
    test_samples, test_shape = count_and_shape(kind, directory, "test")
    if train_shape != test_shape:
        raise DataError(f"{directory}: training samples are {_shape_text(train_shape)} but test samples "
                        f"{_shape_text(test_shape)}")
    if kind in FIXED_SHAPES:
        num_classes = FIXED_SHAPES[kind][1]
    elif kind == "npy":
        num_classes = _npy_classes(directory)
    else:
        num_classes = len(_class_names(directory))
    return DatasetInfo(train_shape, num_classes, train_samples, test_samples)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


# Many simulated nodes in one process load the same files: read them once, share the arrays; an agent keeps them
# between jobs. The files' identity in the key makes a changed file a new entry.
@lru_cache(maxsize=8)
def _read(kind: str, directory: Path, split: Split, identity: FileIdentity) -> tuple[np.ndarray, torch.Tensor]:
    samples, labels = _FORMATS[kind].read(kind, directory, split)
    return samples, torch.from_numpy(labels)


@lru_cache(maxsize=8)
def _training_normalisation(kind: str, directory: Path, identity: FileIdentity) -> Normalisation:
    """Per-channel mean and standard deviation of the training samples (as the model sees them: pixels / 255)."""
    samples, _ = _read(kind, directory, "train", identity)
    channels = samples.shape[1] if samples.ndim >= 4 else 1
    count = len(samples) * samples[0].size // channels
    if samples.dtype == np.uint8:  # exact integer sums: the same on every machine
        sums = np.zeros(channels, np.int64)
        squares = np.zeros(channels, np.int64)
        for start in range(0, len(samples), _CHUNK_SAMPLES):
            chunk = samples[start : start + _CHUNK_SAMPLES].reshape(-1, channels, samples[0].size // channels)
            chunk = chunk.astype(np.int64)
            sums += chunk.sum(axis=(0, 2))
            squares += (chunk * chunk).sum(axis=(0, 2))
        mean = sums / count
        variance = squares / count - mean * mean
        divisor = 255.0
    else:  # two passes in float64, steady for values far from 0
        sums = np.zeros(channels)
        for start in range(0, len(samples), _CHUNK_SAMPLES):
            sums += samples[start : start + _CHUNK_SAMPLES].reshape(-1, channels, samples[0].size // channels) \
                .sum(axis=(0, 2), dtype=np.float64)
        mean = sums / count
        deviations = np.zeros(channels)
        for start in range(0, len(samples), _CHUNK_SAMPLES):
            chunk = samples[start : start + _CHUNK_SAMPLES].reshape(-1, channels, samples[0].size // channels)
            deviations += ((chunk - mean[:, None]) ** 2).sum(axis=(0, 2))
        variance = deviations / count
        divisor = 1.0
    std = np.sqrt(np.maximum(variance, 0.0)) / divisor
    # A constant channel carries nothing to scale: leave its spread alone rather than divide by zero.
    std = np.where(std > 0, std, 1.0)
    return Normalisation(divisor, tuple((mean / divisor).tolist()), tuple(std.tolist()))


def load_dataset(kind: str, data_dir: str | Path, split: Split, limit: int | None = None) -> Dataset:
    """Loads the train or test split of the `kind` data in `data_dir` (one of DATASET_KINDS), only its first `limit`
    samples when given. Raises DataError naming a missing or malformed file."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    directory = _resolved(kind, data_dir)
    identities = _both_identities(kind, directory)
    info = _describe(kind, directory, identities)
    train_identity, test_identity = identities
    samples, labels = _read(kind, directory, split, train_identity if split == "train" else test_identity)
    normalisation = PUBLISHED_NORMALISATION.get(kind) or _training_normalisation(kind, directory, train_identity)
    if limit is not None:  # slicing makes views: a limited dataset still shares memory with the cached one
        samples, labels = samples[:limit], labels[:limit]
    return Dataset(samples=samples, labels=labels, info=info, normalisation=normalisation)
