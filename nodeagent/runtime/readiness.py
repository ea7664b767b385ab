"""A node's ready report on the wire: the description of its data (nodeagent.training.data.DatasetInfo).

Every rank of a job draws its shard from the same training set and is tested on the same test set, so every rank
must describe the same data; the coordinator checks that, keeps the description with the job, and builds the
parameter server's model from it. A description from the network is bounded here before anything uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from nodeagent.runtime.messages import MAX_INPUT_DIMS
from nodeagent.training.data import DatasetInfo

MAX_INPUT_SIDE = 65_536
MAX_INPUT_VALUES = 1 << 24  # of one sample
MAX_CLASSES = 100_000
MAX_SAMPLES = 10**10


def data_problem(info: DatasetInfo) -> str | None:
    """What of a reported description is out of bounds, naming the field (None: nothing)."""
    shape = info.input_shape
    if not 1 <= len(shape) <= MAX_INPUT_DIMS:
        return f"data.input_shape: {len(shape)} dimensions; 1 to {MAX_INPUT_DIMS}"
    if any(not 1 <= side <= MAX_INPUT_SIDE for side in shape):
        return f"data.input_shape: every size must be in 1..{MAX_INPUT_SIDE}, got {list(shape)}"
    if math.prod(shape) > MAX_INPUT_VALUES:
        return f"data.input_shape: {list(shape)} holds more than {MAX_INPUT_VALUES} values"
    if not 1 <= info.num_classes <= MAX_CLASSES:
        return f"data.num_classes: {info.num_classes} is not in 1..{MAX_CLASSES}"
    if not 1 <= info.train_samples <= MAX_SAMPLES:
        return f"data.train_samples: {info.train_samples} is not in 1..{MAX_SAMPLES}"
    if not 0 <= info.test_samples <= MAX_SAMPLES:
        return f"data.test_samples: {info.test_samples} is not in 0..{MAX_SAMPLES}"
    return None


def data_differences(mine: DatasetInfo, theirs: DatasetInfo) -> list[str]:
    """Each field in which two descriptions differ, as 'field mine vs theirs'."""
    a, b = asdict(mine), asdict(theirs)
    return [f"{name} {_shown(a[name])} vs {_shown(b[name])}" for name in a if a[name] != b[name]]


def data_to_json(info: DatasetInfo) -> str:
    return json.dumps(asdict(info), sort_keys=True)


def data_from_json(text: str) -> DatasetInfo:
    fields = json.loads(text)
    return DatasetInfo(tuple(fields["input_shape"]), fields["num_classes"], fields["train_samples"],
                       fields["test_samples"])


def _shown(value: object) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
