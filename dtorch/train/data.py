"""Datasets and batching: token files, a default corpus present on every machine, and batches of any items.

A token dataset is map-style: ``dataset[i] -> (input, target)``, two int64 tensors of
``seq_len`` tokens where ``target`` is ``input`` shifted by one. Sample ``i`` of a `TokenFile`
is the window ``tokens[i * seq_len : i * seq_len + seq_len + 1]`` (windows overlap by the one
token that is both the last target and the next first input).

The default corpus is byte-level (vocabulary 256): the Python standard library's own sources
(code, docstrings and comments), read in a deterministic sorted order and capped in size. It needs
no download; it is cached under ``$DTORCH_CACHE`` (default ``~/.cache/dtorch``), built atomically.

Batching (`batch_for`) is not limited to tokens: any map-style dataset whose items are tensors,
tuples or dicts of tensors is collated (`stack`, or the user's collate) and split into model input
and target by one rule (`split_batch`; docs/models.md).
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
    from dtorch import env

    return Path(env.current().cache_dir or Path.home() / ".cache" / "dtorch")


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
TARGET_KEYS = ("labels", "label", "target", "targets")
"""Keys of a dict item that hold the target (the first present wins); the other keys are the model's
keyword arguments."""


def stack(items: Sequence[Any]) -> Any:
    """The default collate: stack the items' tensors along a new dim 0, recursing into tuples,
    lists and dicts (numbers and numpy arrays become tensors; None stays None). Raises ConfigError
    naming the shapes when the items of a batch differ."""
    first = items[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: stack([it[k] for it in items]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(stack([it[i] for it in items]) for i in range(len(first)))
    if not isinstance(first, (torch.Tensor, np.ndarray, int, float, bool, np.number)):
        raise ConfigError("data", f"an item holding {type(first).__name__}",
                          "a dataset item must be a tensor, a tuple or a dict of tensors (or numbers); "
                          "tokenize text first, or pass collate= to build tensors yourself")
    tensors = [torch.as_tensor(it) for it in items]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ConfigError("data", sorted(shapes), "all samples of a batch must have one shape; "
                          "pass collate= (a function from a list of items to a batch) to pad or pack them")
    return torch.stack(tensors)


def _is_tokens(t: Any, dim: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == dim and not t.is_floating_point()
            and not t.is_complex() and t.dtype != torch.bool)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(model input, target) of a collated batch, by the rules of docs/models.md:

    - a tensor [b, seq_len+1] of integers: a token window, (tokens[:, :-1], tokens[:, 1:]);
    - another tensor: the input, no target (None);
    - a tuple / list: (x, y) -> x and y; (x,) -> x, no target; (x1, ..., xk, y) -> the positional
      arguments (x1, ..., xk) and y;
    - a dict: {"input_ids": window} alone -> a token window; {"input_ids", "labels"} alone -> input
      and labels; otherwise the target is the first of TARGET_KEYS present (None if none) and the
      remaining keys are the model's keyword arguments.
    Token ids (integer input and target of one shape [b, s]) become int64."""
    if isinstance(batch, dict):
        keys = set(batch)
        if keys == {"input_ids"} and _is_tokens(batch["input_ids"], 2):
            batch = batch["input_ids"]
        elif keys == {"input_ids", "labels"}:
            return _tokens(batch["input_ids"], batch["labels"])
        else:
            key = next((k for k in TARGET_KEYS if k in batch), None)
            return {k: v for k, v in batch.items() if k != key}, (batch[key] if key else None)
    if isinstance(batch, torch.Tensor):
        if _is_tokens(batch, 2):
            return batch[:, :-1].long(), batch[:, 1:].long()
        return batch, None
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return _tokens(batch[0], batch[1])
        if len(batch) > 2:
            return tuple(batch[:-1]), batch[-1]
    raise ConfigError("data", f"a batch of type {type(batch).__name__}",
                      "a dataset item must be a tensor, a tuple (input, target) or a dict of tensors")


def _tokens(x: Any, y: Any) -> tuple[Any, Any]:
    if _is_tokens(x, 2) and _is_tokens(y, 2) and x.shape == y.shape:
        return x.long(), y.long()  # (token files store uint8/uint16: embeddings index with int64)
    return x, y


def batch_for(dataset: Any, indices: Sequence[int], collate: Any = None) -> tuple[Any, Any]:
    """Gather samples `indices` of a map-style dataset, collate them (`collate(list of items) ->
    batch`, default `stack`) and split the batch into (model input, target) (`split_batch`).
    Token data gives int64 [b, s] input and labels."""
    if not indices:
        raise ConfigError("indices", list(indices), "a batch needs at least one sample index")
    items = [dataset[int(i)] for i in indices]
    return split_batch((collate or stack)(items))


def is_token_data(dataset: Any, collate: Any = None) -> bool:
    """Whether the dataset's items are token sequences (the model input is an integer [b, s]
    tensor): then `seq_len` is the sequence length; for any other data a sample counts as one
    "token" in throughput and cost figures."""
    from dtorch.model.outputs import is_token_input

    if dataset is None:
        return True
    return is_token_input(batch_for(dataset, [0], collate)[0])
