"""Token datasets: memory-mapped token files and a default corpus present on every machine.

A token dataset is map-style: ``dataset[i] -> (input, target)``, two int64 tensors of
``seq_len`` tokens where ``target`` is ``input`` shifted by one. Sample ``i`` of a `TokenFile`
is the window ``tokens[i * seq_len : i * seq_len + seq_len + 1]`` (windows overlap by the one
token that is both the last target and the next first input).

The default corpus is byte-level (vocabulary 256): the Python standard library's own sources
(code, docstrings and comments), read in a deterministic sorted order and capped in size. It needs
no download; it is cached under ``$DTORCH_CACHE`` (default ``~/.cache/dtorch``), built atomically.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtorch.errors import ConfigError, choices

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024
BYTE_VOCAB = 256


class TokenFile(torch.utils.data.Dataset):
    """A flat file of little-endian unsigned tokens, memory-mapped (nothing is read up front).

    `dtype` is one of uint8 (byte vocabularies), uint16 (vocab <= 65536) or uint32.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: str = "uint16", vocab_size: int | None = None):
        if dtype not in TOKEN_DTYPES:
            raise ConfigError("dtype", dtype, choices(TOKEN_DTYPES))
        if int(seq_len) < 1:
            raise ConfigError("seq_len", seq_len, "use a positive sequence length")
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("path", str(path), "no such token file; write one with TokenFile.write(path, tokens)")
        self.dtype = dtype
        self.seq_len = int(seq_len)
        np_dtype = np.dtype(TOKEN_DTYPES[dtype]).newbyteorder("<")
        size = self.path.stat().st_size
        if size % np_dtype.itemsize:
            raise ConfigError("dtype", dtype, f"{path} holds {size} bytes, not a whole number of {dtype} tokens")
        self.num_tokens = size // np_dtype.itemsize
        if self.num_tokens < self.seq_len + 1:
            raise ConfigError(
                "seq_len", seq_len, f"{path} holds only {self.num_tokens} tokens; use seq_len < {self.num_tokens}"
            )
        self.tokens = np.memmap(self.path, dtype=np_dtype, mode="r")
        self.vocab_size = int(vocab_size) if vocab_size is not None else (256 if dtype == "uint8" else None)

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def window(self, index: int) -> torch.Tensor:
        """The `seq_len + 1` tokens of sample `index` as int64."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples of {self.path}")
        index %= n
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(int(index))
        return w[:-1], w[1:]

    @staticmethod
    def write(path: str | os.PathLike, tokens: Sequence[int] | np.ndarray | torch.Tensor, dtype: str = "uint16") -> Path:
        """Write `tokens` to `path` atomically (temp file + fsync + rename); returns the path."""
        if dtype not in TOKEN_DTYPES:
            raise ConfigError("dtype", dtype, choices(TOKEN_DTYPES))
        arr = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
        info = np.iinfo(TOKEN_DTYPES[dtype])
        if arr.size and (arr.min() < 0 or arr.max() > info.max):
            raise ConfigError("dtype", dtype, f"tokens span [{arr.min()}, {arr.max()}]; use a wider dtype")
        data = arr.astype(np.dtype(TOKEN_DTYPES[dtype]).newbyteorder("<")).tobytes()
        return _atomic_write(Path(path), data)


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)  # mkstemp makes 0600; a cache/token file is meant to be shared
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


# ---- the default corpus ------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where DTorch caches derived files: $DTORCH_CACHE, else ~/.cache/dtorch."""
    return Path(os.environ.get("DTORCH_CACHE") or Path.home() / ".cache" / "dtorch")


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    # Sort by the path relative to the stdlib root so that the order is the same on every machine.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The first `max_bytes` bytes of the stdlib's .py files, concatenated in sorted path order,
    each preceded by a ``# file: <relative path>`` line. Depends only on the Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in _stdlib_sources():
        try:
            body = path.read_bytes()
        except OSError:
            continue  # an unreadable file on some distribution: skip it, the order stays sorted
        out += f"# file: {path.relative_to(root).as_posix()}\n".encode() + body + b"\n\n"
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def default_corpus_path(max_bytes: int = DEFAULT_CORPUS_BYTES) -> Path:
    """The cached corpus file (built on first use): one byte per token."""
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}-{max_bytes}"
    path = cache_dir() / f"stdlib-corpus-{tag}.u8"
    if not path.is_file():
        data = build_stdlib_corpus(max_bytes)
        if len(data) < 2:
            raise ConfigError("corpus", str(path), "the Python standard library sources were not found")
        _atomic_write(path, data)  # concurrent builders write the same bytes; the last rename wins
    return path


def default_corpus(seq_len: int, max_bytes: int = DEFAULT_CORPUS_BYTES) -> TokenFile:
    """The byte-level (vocab 256) stdlib corpus as a `TokenFile` of `seq_len`-token samples."""
    return TokenFile(default_corpus_path(max_bytes), seq_len, dtype="uint8", vocab_size=BYTE_VOCAB)


def corpus_fingerprint(dataset: TokenFile) -> str:
    """SHA-256 of a token file's bytes, for recording in a checkpoint which data a run used."""
    h = hashlib.sha256()
    with open(dataset.path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ByteTokenizer:
    """Bytes are tokens: encode UTF-8 text to ids in [0, 256), decode back (invalid bytes replaced)."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(int(i) & 0xFF for i in values).decode("utf-8", errors="replace")


# ---- batching ----------------------------------------------------------------------------------
def _split_sample(sample: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(sample, dict):
        if "input_ids" in sample and "labels" in sample:
            return torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["labels"])
        if "input_ids" in sample:
            w = torch.as_tensor(sample["input_ids"])
            return w[:-1], w[1:]
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        return torch.as_tensor(sample[0]), torch.as_tensor(sample[1])
    elif isinstance(sample, (torch.Tensor, np.ndarray)) and np.ndim(sample) == 1:
        w = torch.as_tensor(sample)
        return w[:-1], w[1:]
    raise ConfigError(
        "data",
        f"sample {index} of type {type(sample).__name__}",
        "a dataset item must be (input, target), a 1-D tensor of seq_len+1 tokens, "
        "or a dict with 'input_ids' (and optionally 'labels')",
    )


def batch_for(dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather samples `indices` of a map-style dataset into (inputs, labels), int64 [b, s] each."""
    if not indices:
        raise ConfigError("indices", list(indices), "a batch needs at least one sample index")
    inputs, labels = [], []
    for i in indices:
        x, y = _split_sample(dataset[int(i)], int(i))
        inputs.append(x.long())
        labels.append(y.long())
    lengths = {t.shape for t in inputs} | {t.shape for t in labels}
    if len(lengths) != 1:
        raise ConfigError("data", sorted(str(s) for s in lengths), "all samples of a batch must have one length")
    return torch.stack(inputs), torch.stack(labels)
