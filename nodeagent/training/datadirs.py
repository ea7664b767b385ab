"""Where this machine keeps each dataset: an agent's map from a dataset's kind or name to its directory.

A job names its data by kind (`data.dataset`: fashion-mnist, cifar10, npy, ...) and by a directory
(`data.data_dir`), which is a path on the machine of whoever wrote the job. An agent finds the job's data on its own
machine, the first of:

1. `--data-dir NAME=DIR`, NAME the last part of the job's data.data_dir (`imagenette` for `/srv/imagenette`): one
   dataset of a kind that has many (npy, image-folder, text, tokens);
2. `--data-dir KIND=DIR`, KIND the job's data.dataset;
3. `--data-root ROOT`: ROOT/NAME, else ROOT/KIND, whichever exists;
4. a bare `--data-dir DIR` (the old form) if it exists: DIR for every job, whatever its dataset;
5. the job's own data.data_dir.

A mapping (1 or 2) is final: a mapped directory that is missing fails the job, it is not looked for elsewhere. The
others are tried in order, the first that exists is used.

The environment variable PEERTRAIN_DATA_DIR takes the same entries as `--data-dir`, separated by commas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.jobspec import DataSpec


class DataDirsError(ValueError):
    """A `--data-dir` entry that cannot be read; the message names it."""


@dataclass(frozen=True)
class DataDirs:
    by_dataset: dict[str, str] = field(default_factory=dict)  # a dataset's kind or name -> its directory here
    root: str | None = None  # one directory per dataset kind or name under it
    every_dataset: str | None = None  # the old bare --data-dir: used for every job

    @classmethod
    def parse(cls, entries: list[str], root: str | None = None) -> DataDirs:
        """The entries of `--data-dir` (KEY=DIR, or one bare DIR) and the `--data-root`."""
        by_dataset: dict[str, str] = {}
        every: str | None = None
        for entry in entries:
            key, equals, directory = entry.partition("=")
            if not equals:
                if every is not None and every != entry:
                    raise DataDirsError(f"--data-dir {entry!r}: a second directory for every dataset (the first: "
                                        f"{every!r}); name the dataset: --data-dir KIND=DIR")
                every = entry
                continue
            key, directory = key.strip(), directory.strip()
            if not key or "/" in key or not directory:
                raise DataDirsError(f"--data-dir {entry!r}: expected KIND=DIR or NAME=DIR (a dataset kind such as "
                                    "fashion-mnist or cifar10, or the last part of a job's data.data_dir)")
            if by_dataset.get(key, directory) != directory:
                raise DataDirsError(f"--data-dir {entry!r}: {key} is mapped to {by_dataset[key]!r} already")
            by_dataset[key] = directory
        return cls(by_dataset, root or None, every)

    @classmethod
    def from_text(cls, text: str, root: str | None = None) -> DataDirs:
        """PEERTRAIN_DATA_DIR's comma-separated entries."""
        return cls.parse([entry.strip() for entry in text.split(",") if entry.strip()], root)

    def candidates(self, data: DataSpec) -> list[str]:
        """The directories this agent would look in for the job's data, in order (see the module): a mapping of
        its name or kind is the only one; otherwise the first of the others that exists is used."""
        name = Path(data.data_dir).name
        for key in (name, data.dataset):
            if key and key in self.by_dataset:
                return [self.by_dataset[key]]
        found: list[str] = []
        if self.root is not None:
            found.extend(str(Path(self.root) / key) for key in dict.fromkeys(filter(None, (name, data.dataset))))
        if self.every_dataset is not None:
            found.append(self.every_dataset)
        found.append(data.data_dir)
        return list(dict.fromkeys(found))

    def directory_for(self, data: DataSpec) -> str:
        """The job's data directory on this machine: the first candidate that exists, else the first (whose
        absence the loader reports)."""
        tried = self.candidates(data)
        return next((d for d in tried if Path(d).expanduser().exists()), tried[0])

    def describe(self) -> str:
        """What this agent maps, for its log."""
        parts = [f"{key}={directory}" for key, directory in sorted(self.by_dataset.items())]
        if self.root is not None:
            parts.append(f"root {self.root}")
        if self.every_dataset is not None:
            parts.append(f"{self.every_dataset} for every dataset")
        return ", ".join(parts) or "each job's own data.data_dir"
