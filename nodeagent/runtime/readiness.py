"""What a node reports when it is ready to start a job: the description of its data.

Every rank of a job draws its shard from the same training set and is tested on the same test set, so every rank
must describe the same data; the coordinator checks that, keeps the description with the job, and builds the
parameter server's model from it. A description from the network is bounded here before anything uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from nodeagent._proto import coordinator_pb2 as pb

MAX_INPUT_DIMS = 4
MAX_INPUT_SIDE = 65_536
MAX_INPUT_VALUES = 1 << 24  # of one sample
MAX_CLASSES = 100_000
MAX_SAMPLES = 10**10


@dataclass(frozen=True)
class DataDescription:
    input_shape: tuple[int, ...]  # one sample's
    num_classes: int
    train_samples: int  # in the training set the shards are drawn from
    test_samples: int  # 0: the node is not evaluated

    def problem(self) -> str | None:
        """What is out of bounds, naming the field (None: nothing)."""
        shape = self.input_shape
        if not 1 <= len(shape) <= MAX_INPUT_DIMS:
            return f"data.input_shape: {len(shape)} dimensions; 1 to {MAX_INPUT_DIMS}"
        if any(not 1 <= side <= MAX_INPUT_SIDE for side in shape):
            return f"data.input_shape: every size must be in 1..{MAX_INPUT_SIDE}, got {list(shape)}"
        if math.prod(shape) > MAX_INPUT_VALUES:
            return f"data.input_shape: {list(shape)} holds more than {MAX_INPUT_VALUES} values"
        if not 1 <= self.num_classes <= MAX_CLASSES:
            return f"data.num_classes: {self.num_classes} is not in 1..{MAX_CLASSES}"
        if not 1 <= self.train_samples <= MAX_SAMPLES:
            return f"data.train_samples: {self.train_samples} is not in 1..{MAX_SAMPLES}"
        if not 0 <= self.test_samples <= MAX_SAMPLES:
            return f"data.test_samples: {self.test_samples} is not in 0..{MAX_SAMPLES}"
        return None

    def differences(self, other: DataDescription) -> list[str]:
        """Each field in which `other` differs, as 'field this vs other'."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{name} {_shown(mine[name])} vs {_shown(theirs[name])}" for name in mine if mine[name] != theirs[name]]

    def __str__(self) -> str:
        return (f"input {'x'.join(map(str, self.input_shape))}, {self.num_classes} classes, {self.train_samples} train "
                f"and {self.test_samples} test samples")

    def to_proto(self) -> pb.DataDescription:
        return pb.DataDescription(input_shape=self.input_shape, num_classes=self.num_classes,
                                  train_samples=self.train_samples, test_samples=self.test_samples)

    @classmethod
    def from_proto(cls, message: pb.DataDescription) -> DataDescription:
        """The description a node sent; call `problem()` before using it. Only the shape's first MAX_INPUT_DIMS + 1
        sizes are read (enough to say that it has too many)."""
        return cls(tuple(message.input_shape[:MAX_INPUT_DIMS + 1]), message.num_classes, message.train_samples,
                   message.test_samples)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DataDescription:
        fields = json.loads(text)
        return cls(tuple(fields["input_shape"]), fields["num_classes"], fields["train_samples"],
                   fields["test_samples"])


def _shown(value: object) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
