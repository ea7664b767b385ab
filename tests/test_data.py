"""Reading Fashion-MNIST / MNIST IDX files from any directory, plain or gzipped, and rejecting bad ones."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datafiles import write_idx

from nodeagent.training.data import (
    PUBLISHED_NORMALISATION,
    DataError,
    Dataset,
    DatasetInfo,
    Normalisation,
    describe_dataset,
    load_dataset,
    read_idx,
)

pytestmark = pytest.mark.integration

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def write_pair(directory: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    suffix = ".gz" if gz else ""
    write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


def is_mapped(array: np.ndarray) -> bool:
    """Whether the array's memory is a file mapping (somewhere down its chain of views)."""
    base = array
    while base is not None:
        if isinstance(base, np.memmap | mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


# Three 28x28 images: all black, all white, and one with a known gradient; labels as MNIST would have them.
TINY_IMAGES = np.stack(
    [
        np.zeros((28, 28), np.uint8),
        np.full((28, 28), 255, np.uint8),
        np.arange(28 * 28, dtype=np.int64).reshape(28, 28) % 256,
    ]
).astype(np.uint8)
TINY_LABELS = np.array([3, 0, 9], np.uint8)


def test_fashion_mnist_from_the_debian_directory(fashion_mnist_dir: Path) -> None:
    train = load_dataset("fashion-mnist", fashion_mnist_dir, "train")
    test = load_dataset("fashion-mnist", fashion_mnist_dir, "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.samples.shape == (60000, 1, 28, 28) and train.samples.dtype == np.uint8  # stored as read
    assert train.labels.dtype == torch.int64
    info = describe_dataset("fashion-mnist", fashion_mnist_dir)  # from the headers, without reading the images
    assert info == DatasetInfo((1, 28, 28), 10, 60000, 10000) == train.info == test.info
    # Fashion-MNIST is balanced; its first training image is an ankle boot (9), its first test one too.
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert train.labels[0].item() == 9 and test.labels[0].item() == 9
    # The fixed normalisation constants are those of this dataset: the training pixels come out standardised.
    images = train.images(slice(None))
    assert images.dtype == torch.float32 and images.shape == (60000, 1, 28, 28)
    assert abs(images.mean().item()) < 0.01
    assert abs(images.std().item() - 1.0) < 0.01


def test_limit_takes_the_first_samples_and_shares_memory(fashion_mnist_dir: Path) -> None:
    full = load_dataset("fashion-mnist", fashion_mnist_dir, "train")
    first = load_dataset("fashion-mnist", str(fashion_mnist_dir) + "/", "train", limit=500)
    assert len(first) == 500
    assert np.array_equal(first.samples, full.samples[:500]) and torch.equal(first.labels, full.labels[:500])
    # Many simulated nodes load the same files: they must get one decoded copy, not one each.
    assert np.shares_memory(first.samples, full.samples)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_any_directory_in_mnist_format(tmp_path: Path, gz: bool) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS, gz)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz)
    train = load_dataset("mnist", tmp_path, "train")
    test = load_dataset("mnist", tmp_path, "test")
    assert len(train) == 3 and len(test) == 2
    assert train.labels.tolist() == [3, 0, 9]
    expected = (torch.from_numpy(TINY_IMAGES).float() / 255 - MNIST_MEAN) / MNIST_STD
    torch.testing.assert_close(train.images(slice(None))[:, 0], expected)
    torch.testing.assert_close(test.images(np.array([0, 1]))[:, 0], expected[:2])
    # Plain files are memory-mapped, not read into memory; gzipped ones are decompressed once.
    assert is_mapped(train.samples) is not gz


def test_read_idx_returns_the_array_written(tmp_path: Path) -> None:
    path = tmp_path / "labels-idx1-ubyte.gz"
    write_idx(path, TINY_LABELS)
    assert read_idx(path, 1).tolist() == [3, 0, 9]


def test_missing_files_name_the_directory_the_package_and_the_option(tmp_path: Path) -> None:
    with pytest.raises(DataError) as caught:
        load_dataset("fashion-mnist", tmp_path, "train")
    message = str(caught.value)
    assert str(tmp_path) in message
    assert "dataset-fashion-mnist" in message and "--data-dir" in message


def test_corrupted_magic_number_names_the_file(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS, gz=False)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    raw = bytearray(images.read_bytes())
    raw[2] = 0x0D  # element type float instead of unsigned byte
    images.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train-images-idx3-ubyte: bad magic number"):
        load_dataset("mnist", tmp_path, "train")


def test_truncated_file_is_rejected(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS, gz=False)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: \d+ bytes, but its header"):
        load_dataset("mnist", tmp_path, "train")


def test_broken_gzip_is_rejected(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS, gz=True)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=True)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:20])
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz: cannot read"):
        load_dataset("mnist", tmp_path, "train")


def test_label_count_must_match_image_count(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS[:2], gz=False)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=False)
    with pytest.raises(DataError, match="2 labels for 3 images"):
        load_dataset("mnist", tmp_path, "train")


def test_labels_outside_the_ten_classes_are_rejected(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, np.array([3, 10, 0], np.uint8), gz=False)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=False)
    with pytest.raises(DataError, match="label 10"):
        load_dataset("mnist", tmp_path, "train")


def test_unknown_dataset_split_or_limit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        load_dataset("svhn", tmp_path, "train")
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        load_dataset("mnist", tmp_path, "valid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        load_dataset("mnist", tmp_path, "train", limit=0)


def test_dataset_reports_its_size_and_shape() -> None:
    dataset = Dataset(np.zeros((4, 3, 8, 8), np.uint8), torch.zeros(4, dtype=torch.int64),
                      DatasetInfo((3, 8, 8), 10, 4, 0), Normalisation(255.0, (0.5,) * 3, (0.25,) * 3))
    assert len(dataset) == 4 and dataset.input_shape == (3, 8, 8)
    assert torch.equal(dataset.images(slice(None)), torch.full((4, 3, 8, 8), -2.0))


def test_torchvision_is_never_needed(tmp_path: Path) -> None:
    write_pair(tmp_path, "train", TINY_IMAGES, TINY_LABELS, gz=True)
    write_pair(tmp_path, "t10k", TINY_IMAGES[:2], TINY_LABELS[:2], gz=True)
    # A None entry in sys.modules makes `import torchvision` fail, as on a machine without it.
    program = (
        "import sys; sys.modules['torchvision'] = None\n"
        "import nodeagent.training.loop, nodeagent.training.models, nodeagent.training.splits\n"
        "from nodeagent.training.data import load_dataset\n"
        f"assert len(load_dataset('mnist', {str(tmp_path)!r}, 'train')) == 3\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("kind", ["fashion-mnist", "cifar10"])
def test_pixels_are_normalised_bit_for_bit_as_the_arithmetic_does(kind: str) -> None:
    # Every pixel value of every channel, in a batch of odd shape: the table's lookup must give the same float32 bits
    # as converting and normalising them (the nodes' results must not change with the way a batch is made).
    normalisation = PUBLISHED_NORMALISATION[kind]
    channels = len(normalisation.mean)
    pixels = np.random.default_rng(0).integers(0, 256, size=(300, channels, 5, 7), dtype=np.uint8)
    pixels[:256, :, 0, 0] = np.arange(256, dtype=np.uint8)[:, None]
    looked_up = normalisation.apply(pixels)
    computed = normalisation.apply_tensor(torch.from_numpy(pixels.astype(np.float32)))
    assert looked_up.shape == (300, channels, 5, 7) and looked_up.dtype == torch.float32
    assert torch.equal(looked_up.view(torch.int32), computed.view(torch.int32))
