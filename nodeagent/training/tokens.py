"""A language model's data: token sequences cut from text files or from a token file, no tokenizer needed.

- text: a directory of UTF-8 text files (every regular file below it, hidden ones left out, in sorted order) or one
  file. Tokens are the bytes of the text (a vocabulary of 256), so nothing is downloaded. The last
  `validation_fraction` of every file is its validation part, so that the validation set holds some of every
  document however the training parts are divided.
- tokens: the flat token files nanoGPT's prepare scripts write, train.bin and val.bin: unsigned integers
  (uint16, or uint32 for a vocabulary above 65,536) without a header, memory-mapped. The vocabulary size is an
  option (GPT-2's is 50,257), or the largest token + 1.

A sample is a window of sequence_length + 1 consecutive tokens of one file: the inputs are its first
sequence_length tokens, the targets the same shifted by one. Windows do not overlap and never cross from one file
into the next; each sample is labelled with its file (`groups`), which the by-file split divides the nodes by. A
limit (data.train_limit, data.test_limit) keeps that many samples spread evenly over the files, in order, so that
a limited validation set still holds some of every document.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from nodeagent.training.data import DataError, DatasetInfo
from nodeagent.training.device import fits_on_device

__all__ = ["TextOptions", "TokenDataset", "TokensOptions", "load_tokens"]

Split = Literal["train", "test"]
MAX_VOCABULARY = 100_000  # of a tokens file (nodeagent.runtime.readiness.MAX_CLASSES bounds what a node reports)
_SCAN_TOKENS = 1 << 24  # scanned at a time for the largest token


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    sequence_length: int = Field(64, ge=1, le=65_536, description="tokens in one sample (the model's context; "
                                 "gpt's context_length defaults to it)")


class TextOptions(_Options):
    validation_fraction: float = Field(0.1, gt=0, lt=1, description="the last part of every file held out for "
                                       "validation")


class TokensOptions(_Options):
    vocab_size: int | None = Field(None, ge=1, le=MAX_VOCABULARY, description="the vocabulary (GPT-2's: 50257); "
                                   "unset: the largest token of the files + 1")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="the token files' integers (nanoGPT writes "
                                                "uint16)")


@dataclass(frozen=True)
class TokenDataset:
    """The windows of a token stream: sample i is tokens[starts[i] : starts[i] + T + 1]. The tokens may be
    memory-mapped read-only and shared: never modify them."""

    tokens: np.ndarray  # 1-D unsigned integers, as stored
    starts: np.ndarray  # (N,) int64: the first token of each sample
    groups: np.ndarray  # (N,) int64: the source file of each sample
    info: DatasetInfo  # input_shape (T,), num_classes: the vocabulary

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def sequence_length(self) -> int:
        return self.info.input_shape[0]

    def batch(self, which: np.ndarray | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `which` (indices or a slice): inputs and targets, int64 (B, T) each."""
        positions = self.starts[which][:, np.newaxis] + np.arange(self.sequence_length + 1)
        windows = torch.from_numpy(self.tokens[positions].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def on(self, device: torch.device) -> TokenDeviceCopy | None:
        """The tokens uploaded to `device` once, shared by the process's nodes on it; None on the CPU or where they
        would take more than their share of its memory."""
        size = self.tokens.size * 4 + self.starts.nbytes
        if device.type == "cpu" or not fits_on_device(size, device):
            return None
        copies = self.__dict__.setdefault("_device_copies", {})
        if device not in copies:
            tokens = torch.from_numpy(self.tokens.astype(np.int32)).to(device)  # int32 holds every vocabulary here
            copies[device] = TokenDeviceCopy(tokens, torch.from_numpy(self.starts).to(device), self.sequence_length)
        return copies[device]


@dataclass(frozen=True)
class TokenDeviceCopy:
    tokens: torch.Tensor  # int32
    starts: torch.Tensor  # int64
    sequence_length: int

    def batch(self, which: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `which` (indices on this device, or a slice): inputs and targets, int64 (B, T) each."""
        starts = self.starts[which] if isinstance(which, slice) else self.starts.index_select(0, which)
        offsets = torch.arange(self.sequence_length + 1, device=starts.device)
        windows = self.tokens[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]


def _windows(lengths: list[int], sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The starts and files of the non-overlapping windows of T + 1 tokens within each of the concatenated files."""
    starts, groups = [], []
    offset = 0
    for index, length in enumerate(lengths):
        first = np.arange(offset, offset + length - sequence_length, sequence_length, dtype=np.int64)
        starts.append(first)
        groups.append(np.full(len(first), index, np.int64))
        offset += length
    return np.concatenate(starts), np.concatenate(groups)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for folder, directories, names in os.walk(path, followlinks=False):
        directories[:] = sorted(d for d in directories if not d.startswith("."))
        files += [Path(folder) / name for name in sorted(names) if not name.startswith(".")
                  and (Path(folder) / name).is_file()]
    if not files:
        raise DataError(f"{path}: no text files (text data is a directory of UTF-8 text files, or one file)")
    return sorted(files)


def _identity(paths: list[Path]) -> tuple[tuple[str, int, int], ...]:
    stats = [(str(path), path.stat()) for path in paths]
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)


@lru_cache(maxsize=4)
def _read_text(path: Path, identity: tuple[tuple[str, int, int], ...], options: TextOptions,
               split: Split) -> TokenDataset:
    parts: list[np.ndarray] = []
    for name, _, _ in identity:
        data = Path(name).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{name}: not UTF-8 text (byte {error.start}); text data holds only UTF-8 text "
                            "files") from None
        tokens = np.frombuffer(data, np.uint8)
        cut = len(tokens) - int(len(tokens) * options.validation_fraction)
        parts.append(tokens[:cut] if split == "train" else tokens[cut:])
    starts, groups = _windows([len(part) for part in parts], options.sequence_length)
    if len(starts) == 0:
        raise DataError(f"{path}: no file has {options.sequence_length + 1} bytes of text in its "
                        f"{'training' if split == 'train' else 'validation'} part (data.options.sequence_length, "
                        "validation_fraction)")
    return TokenDataset(np.concatenate(parts), starts, groups, DatasetInfo((options.sequence_length,), 256, 0, 0))


def _token_file(directory: Path, split: Split) -> Path:
    path = directory / ("train.bin" if split == "train" else "val.bin")
    if not path.is_file():
        raise DataError(f"{path}: not found (tokens data is train.bin and val.bin, flat token files as nanoGPT "
                        "writes them)")
    return path


@lru_cache(maxsize=4)
def _read_tokens(path: Path, identity: tuple[tuple[str, int, int], ...], options: TokensOptions) -> TokenDataset:
    dtype = np.dtype(options.dtype)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {options.dtype} tokens (data.options.dtype)")
    tokens = np.asarray(np.memmap(path, dtype=dtype, mode="r")) if size else np.zeros(0, dtype)
    largest = max((int(tokens[i : i + _SCAN_TOKENS].max()) for i in range(0, len(tokens), _SCAN_TOKENS)), default=0)
    if options.vocab_size is not None and largest >= options.vocab_size:
        raise DataError(f"{path}: token {largest} is not below data.options.vocab_size {options.vocab_size}")
    if largest >= MAX_VOCABULARY:
        raise DataError(f"{path}: token {largest}: a vocabulary may hold at most {MAX_VOCABULARY} tokens")
    starts, groups = _windows([len(tokens)], options.sequence_length)
    if len(starts) == 0:
        raise DataError(f"{path}: {len(tokens)} tokens, fewer than one sample of {options.sequence_length + 1} "
                        "(data.options.sequence_length)")
    return TokenDataset(tokens, starts, groups, DatasetInfo((options.sequence_length,), largest + 1, 0, 0))


def load_tokens(kind: str, data_dir: str | Path, split: Split, options: TextOptions | TokensOptions,
                limit: int | None = None) -> TokenDataset:
    """The train or test (validation) samples of the `kind` (text or tokens) data at `data_dir`, only `limit` of
    them spread evenly when given; its info describes both splits. DataError names a missing or malformed file."""
    path = Path(data_dir).expanduser().resolve()
    if kind == "text":
        if not path.exists():
            raise DataError(f"{path}: no such file or directory (the text data: data.data_dir, or an agent's "
                            "--data-dir NAME=FILE)")
        identity = _identity(_text_files(path))
        train, test = (_read_text(path, identity, options, split) for split in ("train", "test"))
        vocabulary = 256
    else:
        if not path.is_dir():
            raise DataError(f"{path}: no such directory (the tokens data: data.data_dir, or an agent's "
                            "--data-dir NAME=DIR)")
        assert isinstance(options, TokensOptions)
        train, test = (_read_tokens(file, _identity([file]), options)
                       for file in (_token_file(path, "train"), _token_file(path, "test")))
        vocabulary = options.vocab_size or max(train.info.num_classes, test.info.num_classes)
    chosen = train if split == "train" else test
    starts, groups = chosen.starts, chosen.groups
    if limit is not None and limit < len(starts):
        kept = np.linspace(0, len(starts) - 1, limit).round().astype(np.int64)  # distinct: limit < len(starts)
        starts, groups = starts[kept], groups[kept]
    info = DatasetInfo((options.sequence_length,), vocabulary, len(train), len(test))
    return TokenDataset(chosen.tokens, starts, groups, info)
