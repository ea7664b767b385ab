"""The users' own data: CIFAR-10/100 binary files, NumPy arrays and image folders, written here; their shapes and
classes come from the files, and every malformed file is a DataError naming it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from datafiles import learnable, write_cifar10, write_cifar100, write_image_folder, write_npy
from test_data import is_mapped

from nodeagent.jobspec import parse_job_spec
from nodeagent.training.data import DataError, DatasetInfo, describe_dataset, load_dataset
from nodeagent.training.models import initial_model

pytestmark = pytest.mark.unit

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def pixels(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, 3, 32, 32), dtype=np.uint8)


def cifar10_dir(directory: Path, train: int = 12, test: int = 4) -> tuple[np.ndarray, np.ndarray]:
    x, y = pixels(train), np.arange(train) % 10
    write_cifar10(directory, (x, y), (pixels(test, 1), np.arange(test) % 10))
    return x, y


# -- CIFAR ------------------------------------------------------------------------------------------------------------


def test_cifar10_binary_files_are_read_in_order_and_normalised_per_channel(tmp_path: Path) -> None:
    x, y = cifar10_dir(tmp_path)
    train = load_dataset("cifar10", tmp_path, "train")
    assert train.info == DatasetInfo((3, 32, 32), 10, 12, 4) == describe_dataset("cifar10", tmp_path)
    assert np.array_equal(train.samples, x) and train.labels.tolist() == y.tolist()  # batches 1..5 in order
    mean = torch.tensor(CIFAR10_MEAN).reshape(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).reshape(3, 1, 1)
    torch.testing.assert_close(train.images(np.array([3, 0])), (torch.from_numpy(x[[3, 0]]).float() / 255 - mean) / std)
    assert is_mapped(load_dataset("cifar10", tmp_path, "test").samples)


def test_cifar10_is_found_in_the_distributions_subdirectory(tmp_path: Path) -> None:
    cifar10_dir(tmp_path / "cifar-10-batches-bin")
    assert len(load_dataset("cifar10", tmp_path, "test")) == 4


def test_cifar100_uses_the_fine_labels_of_100_classes(tmp_path: Path) -> None:
    fine = np.array([99, 0, 57, 3])
    write_cifar100(tmp_path / "cifar-100-binary", (pixels(4), fine), (pixels(2, 1), np.array([1, 2])))
    train = load_dataset("cifar100", tmp_path, "train")
    assert train.labels.tolist() == [99, 0, 57, 3]
    assert train.info == DatasetInfo((3, 32, 32), 100, 4, 2)
    assert is_mapped(train.samples)


def test_a_truncated_record_names_the_file(tmp_path: Path) -> None:
    cifar10_dir(tmp_path)
    batch = tmp_path / "data_batch_3.bin"
    batch.write_bytes(batch.read_bytes()[:-5])
    with pytest.raises(DataError, match=r"data_batch_3\.bin: \d+ bytes is not a whole number of 3073-byte records"):
        load_dataset("cifar10", tmp_path, "train")


def test_a_label_outside_the_classes_names_the_file_and_sample(tmp_path: Path) -> None:
    write_cifar10(tmp_path, (pixels(10), np.arange(10) % 10), (pixels(2), np.array([4, 10])))
    with pytest.raises(DataError, match=r"test_batch\.bin: label 10 \(sample 1\) is not in 0\.\.9"):
        load_dataset("cifar10", tmp_path, "test")


def test_a_missing_batch_is_named(tmp_path: Path) -> None:
    cifar10_dir(tmp_path)
    (tmp_path / "data_batch_5.bin").unlink()
    with pytest.raises(DataError, match=r"data_batch_5\.bin: not found"):
        load_dataset("cifar10", tmp_path, "train")


def test_the_pickled_python_distribution_is_refused_unread(tmp_path: Path) -> None:
    python_dir = tmp_path / "cifar-10-batches-py"
    python_dir.mkdir()

    class Exploding:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (python_dir / "data_batch_1").write_bytes(pickle.dumps(Exploding()))
    with pytest.raises(DataError, match=r"pickles.*binary version"):
        load_dataset("cifar10", tmp_path, "train")
    assert not (tmp_path / "pwned").exists()


# -- NumPy arrays -----------------------------------------------------------------------------------------------------


def test_npy_pixels_of_any_shape_with_classes_from_the_labels(tmp_path: Path) -> None:
    x, y = learnable(40, (2, 5, 3), classes=3, seed=0)
    test_y = np.array([0, 4, 1])  # the highest label may be in the test set only
    write_npy(tmp_path, (x, y.astype(np.uint8)), (x[:3], test_y))
    train = load_dataset("npy", tmp_path, "train")
    assert train.info == DatasetInfo((2, 5, 3), 5, 40, 3)
    assert is_mapped(train.samples)
    # Normalised with the training set's own per-channel mean and standard deviation.
    images = train.images(slice(None))
    assert images.shape == (40, 2, 5, 3)
    torch.testing.assert_close(images.mean(dim=(0, 2, 3)), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(images.std(dim=(0, 2, 3), unbiased=False), torch.ones(2), atol=1e-4, rtol=0)
    assert load_dataset("npy", tmp_path, "test").labels.tolist() == [0, 4, 1]


def test_npy_floating_features_are_taken_as_they_are_then_standardised(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(1000.0, 2.0, size=(50, 7))  # float64, far from 0
    write_npy(tmp_path, (x, np.arange(50) % 2), (x[:5], np.arange(5) % 2))
    train = load_dataset("npy", tmp_path, "train")
    assert train.info == DatasetInfo((7,), 2, 50, 5)
    expected = (x - x.mean()) / x.std()
    torch.testing.assert_close(train.images(slice(None)), torch.from_numpy(expected).float(), atol=1e-4, rtol=0)


def npy_case(tmp_path: Path, case: str) -> str:
    """Writes a valid npy directory with one defect; returns what the error must say."""
    x, y = learnable(10, (4,), classes=2, seed=0)
    train, test = [x, y], [x[:4], y[:4]]
    if case == "lengths":
        train[1] = y[:9]
        expect = r"train_y\.npy: 9 labels for 10 samples in .*train_x\.npy"
    elif case == "shapes":
        test[0] = np.zeros((4, 5), np.uint8)
        expect = "training samples are 4 but test samples 5"
    elif case == "float labels":
        train[1] = y.astype(np.float32)
        expect = r"train_y\.npy: labels must be integers, not float32"
    elif case == "negative label":
        test[1] = np.array([0, -1, 1, 0])
        expect = r"test_y\.npy: label -1 is negative"
    elif case == "nan":
        train[0] = x.astype(np.float32)
        train[0][7, 2] = np.nan
        expect = r"train_x\.npy: sample 7 holds NaN"
    elif case == "integer samples":
        train[0] = x.astype(np.int32)
        expect = r"train_x\.npy: samples must be uint8 pixels or floating point, not int32"
    elif case == "pickled":
        train[0] = np.array([{"a": 1}] * 10, dtype=object)
        expect = r"train_x\.npy: not a readable \.npy file without pickles"
    elif case == "truncated":
        expect = r"test_x\.npy: not a readable \.npy file"
    else:  # missing
        expect = r"test_y\.npy: not found"
    write_npy(tmp_path, tuple(train), tuple(test))
    if case == "truncated":
        path = tmp_path / "test_x.npy"
        path.write_bytes(path.read_bytes()[:-3])
    if case == "missing":
        (tmp_path / "test_y.npy").unlink()
    return expect


@pytest.mark.parametrize("case", ["lengths", "shapes", "float labels", "negative label", "nan", "integer samples",
                                  "pickled", "truncated", "missing"])
def test_malformed_npy_files_are_named(tmp_path: Path, case: str) -> None:
    expect = npy_case(tmp_path, case)
    with pytest.raises(DataError, match=expect):
        load_dataset("npy", tmp_path, "train")
        load_dataset("npy", tmp_path, "test")


# -- image folders ----------------------------------------------------------------------------------------------------


def colour(value: int, size: tuple[int, int] = (5, 6)) -> np.ndarray:
    image = np.zeros((*size, 3), np.uint8)
    image[..., 0], image[..., 1], image[..., 2] = value, 255 - value, 7
    return image


def test_image_folder_classes_are_the_sorted_directory_names(tmp_path: Path) -> None:
    write_image_folder(tmp_path, "train", {"cat": [colour(10), colour(20)], "ant": [colour(30)], "bee": [colour(40)]})
    write_image_folder(tmp_path, "test", {"cat": [colour(50)], "ant": [colour(60)]})
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image: ignored, as by torchvision")
    train = load_dataset("image-folder", tmp_path, "train")
    assert train.info == DatasetInfo((3, 5, 6), 3, 4, 2)  # (channels, height, width)
    assert train.labels.tolist() == [0, 1, 2, 2]  # ant, bee, cat, cat
    assert train.samples[0].tolist() == colour(30).transpose(2, 0, 1).tolist()
    assert load_dataset("image-folder", tmp_path, "test").labels.tolist() == [0, 2]


def test_grey_image_folder_has_one_channel(tmp_path: Path) -> None:
    grey = [np.full((4, 4), value, np.uint8) for value in (0, 100, 200)]
    write_image_folder(tmp_path, "train", {"a": grey[:2], "b": grey[2:]})
    write_image_folder(tmp_path, "test", {"b": grey[:1]})
    train = load_dataset("image-folder", tmp_path, "train")
    assert train.info.input_shape == (1, 4, 4) and train.samples[:, 0, 0, 0].tolist() == [0, 100, 200]


def test_an_image_of_another_size_is_named(tmp_path: Path) -> None:
    write_image_folder(tmp_path, "train", {"a": [colour(1)], "b": [colour(2)]})
    write_image_folder(tmp_path, "test", {"b": [colour(3), colour(4, size=(6, 6))]})
    with pytest.raises(DataError, match=r"test/b/1\.png: 6x6 pixels, but .*train/a/0\.png is 6x5"):
        describe_dataset("image-folder", tmp_path)


def test_a_broken_image_or_an_unknown_test_class_is_named(tmp_path: Path) -> None:
    write_image_folder(tmp_path, "train", {"a": [colour(1)], "b": [colour(2)]})
    write_image_folder(tmp_path, "test", {"b": [colour(3)]})
    (tmp_path / "train" / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"train/b/broken\.png: not a readable image"):
        load_dataset("image-folder", tmp_path, "train")
    (tmp_path / "train" / "b" / "broken.png").unlink()
    write_image_folder(tmp_path, "test", {"c": [colour(3)]})
    with pytest.raises(DataError, match=r"test/c: class 'c' is not among train/'s classes"):
        load_dataset("image-folder", tmp_path, "test")


# -- shapes, the cache, the model -------------------------------------------------------------------------------------


def test_a_dataset_is_loaded_once_and_again_when_a_file_changes(tmp_path: Path) -> None:
    x, y = learnable(10, (3, 4), classes=2, seed=0)
    write_npy(tmp_path, (x, y), (x[:2], y[:2]))
    first = load_dataset("npy", tmp_path, "train")
    assert load_dataset("npy", str(tmp_path) + "/.", "train").samples is first.samples  # same files, same arrays
    write_npy(tmp_path, (255 - x, y), (x[:2], y[:2]))
    again = load_dataset("npy", tmp_path, "train")
    assert again.samples is not first.samples and np.array_equal(again.samples, 255 - x)


def test_the_model_is_shaped_by_the_data(tmp_path: Path) -> None:
    spec = parse_job_spec({"name": "shape", "nodes": 2, "steps": 1, "model": {"name": "cnn"},
                           "data": {"dataset": "cifar100", "data_dir": str(tmp_path)}})
    model = initial_model(spec, DatasetInfo((3, 32, 32), 100, 1, 1))
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


def test_a_directory_that_does_not_exist_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path / 'nowhere'}: no such directory"):
        describe_dataset("cifar10", tmp_path / "nowhere")
