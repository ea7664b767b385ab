"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.jobspec import DEFAULT_DATA_DIR

_IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    """The directory of the Fashion-MNIST IDX files: $PEERTRAIN_DATA_DIR, else Debian's location."""
    directory = Path(os.environ.get("PEERTRAIN_DATA_DIR") or DEFAULT_DATA_DIR)
    missing = [
        stem for stem in _IDX_STEMS if not (directory / stem).is_file() and not (directory / f"{stem}.gz").is_file()
    ]
    if missing:  # the learning tests need the real data: missing data fails them rather than hiding them
        pytest.fail(
            f"Fashion-MNIST is not in {directory} (missing {', '.join(missing)}): install the Debian package "
            "dataset-fashion-mnist (make data) or set PEERTRAIN_DATA_DIR to a directory holding the IDX files"
        )
    return directory
