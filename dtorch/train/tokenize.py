"""Text corpora to packed token files, with a Hugging Face tokenizer given by path.

    data = text_dataset("corpus.jsonl", tokenizer="tokenizer.json", seq_len=2048)

Inputs (files or directories, searched recursively in sorted path order):

- ``.txt`` / ``.md``: each file is one document;
- ``.jsonl``: one document per line, its ``"text"`` field;
- ``.parquet``: one document per row of the ``text`` column (needs ``pyarrow``).

Documents are tokenised in that order (the `tokenizers` package; no special tokens added), each
followed by the tokenizer's end-of-text token when it has one, and packed back to back into one
token stream. The stream is cached once under ``$DTORCH_CACHE/text`` (default
``~/.cache/dtorch/text``), keyed by the SHA-256 of the inputs' bytes and of the tokenizer file:
``<key>.tokens`` (uint16, or uint32 for vocabularies over 65536) and ``<key>.docs`` (int64 start
offset of every document). Concurrent processes (the ranks of one job) take a file lock, so one
tokenises and the others wait and reuse it. Samples are the `TokenFile` windows of the stream, so
the sampler's order (and its resize-proof permutation) is unchanged; `PackedText.boundaries(i)`
and `positions(i)` give where documents start inside a sample, for attention masks or position
resets.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dtorch.errors import ConfigError
from dtorch.train.data import TokenFile, _atomic_write, cache_dir

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def tokenizer_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError("tokenizer", str(path), "no tokenizer.json there; pass the tokenizer.json of a "
                          "Hugging Face tokenizer (or the directory holding it)")
    return p


class Tokenizer:
    """A `tokenizers` tokenizer read from tokenizer.json: encode/decode and its vocabulary size."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise ConfigError("tokenizer", str(path), "install the `tokenizers` package (pip install tokenizers)") from None
        self.path = tokenizer_file(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - the library's message is the useful part
            raise ConfigError("tokenizer", str(self.path), f"not a readable tokenizer.json ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = next((self._tok.token_to_id(t) for t in EOS_CANDIDATES if self._tok.token_to_id(t) is not None),
                           None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self._tok.decode([int(i) for i in values])


def input_files(paths: str | os.PathLike | list) -> list[Path]:
    """The corpus files of `paths` (files or directories), in a deterministic order."""
    items = paths if isinstance(paths, (list, tuple)) else [paths]
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES),
                           key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise ConfigError("data", str(p), f"no {', '.join(SUFFIXES)} files in this directory")
            out += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ConfigError("data", str(p), f"unknown corpus format; use {', '.join(SUFFIXES)} files "
                                  "(or a pre-tokenised token file without --tokenizer)")
            out.append(p)
        else:
            raise ConfigError("data", str(p), "no such file or directory")
    return out


def documents(files: list[Path]) -> Iterator[str]:
    """Every document of `files`, in order."""
    for f in files:
        if f.suffix in TEXT_SUFFIXES:
            yield f.read_text(encoding="utf-8", errors="replace")
        elif f.suffix == ".jsonl":
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        raise ConfigError("data", f"{f}:{n}", "not a JSON line; each line must be {\"text\": ...}") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise ConfigError("data", f"{f}:{n}", "each JSON line needs a string field \"text\"")
                    yield rec["text"]
        else:
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ConfigError("data", str(f), "reading Parquet needs pyarrow (pip install pyarrow)") from None
            table = pq.read_table(f, columns=["text"])
            for batch in table.to_batches():
                yield from (t for t in batch.column(0).to_pylist() if t is not None)


def cache_key(files: list[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(b"dtorch-text-v1\0")
    for f in [tokenizer.path, *files]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def build_token_cache(paths, tokenizer: Tokenizer, directory: Path | None = None) -> tuple[Path, Path, str]:
    """(tokens file, document starts file, dtype), tokenising only if the cache has no entry."""
    files = input_files(paths)
    directory = Path(directory) if directory is not None else cache_dir() / "text"
    directory.mkdir(parents=True, exist_ok=True)
    key = cache_key(files, tokenizer)
    dtype = "uint16" if tokenizer.vocab_size <= 65536 else "uint32"
    tokens_path, docs_path = directory / f"{key}.tokens", directory / f"{key}.docs"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process tokenises; the others wait, then reuse
        if not (tokens_path.is_file() and docs_path.is_file()):
            stream: list[np.ndarray] = []
            starts: list[int] = []
            total, batch = 0, []

            def flush() -> None:
                nonlocal total
                for ids in tokenizer.encode_batch(batch):
                    if tokenizer.eos_id is not None:
                        ids = [*ids, tokenizer.eos_id]
                    if not ids:
                        continue
                    starts.append(total)
                    stream.append(np.asarray(ids, dtype=np.int64))
                    total += len(ids)
                batch.clear()

            for doc in documents(files):
                batch.append(doc)
                if len(batch) >= 256:
                    flush()
            flush()
            if total == 0:
                raise ConfigError("data", [str(f) for f in files], "the corpus holds no text")
            tokens = np.concatenate(stream)
            TokenFile.write(tokens_path.with_suffix(".tokens.part"), tokens, dtype=dtype)
            _atomic_write(docs_path, np.asarray(starts, dtype="<i8").tobytes())
            os.replace(tokens_path.with_suffix(".tokens.part"), tokens_path)  # last: its presence means complete
    return tokens_path, docs_path, dtype


class PackedText(TokenFile):
    """A packed, tokenised corpus: `TokenFile` samples plus the document boundaries."""

    def __init__(self, tokens_path: Path, docs_path: Path, seq_len: int, dtype: str, vocab_size: int):
        super().__init__(tokens_path, seq_len, dtype=dtype, vocab_size=vocab_size)
        self.doc_starts = np.fromfile(docs_path, dtype="<i8")

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts)

    def documents_of(self, index: int) -> list[int]:
        """Ids of the documents whose tokens sample `index`'s input holds, in order."""
        start = (index % len(self)) * self.seq_len
        lo = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        hi = int(np.searchsorted(self.doc_starts, start + self.seq_len, side="left"))
        return list(range(max(lo, 0), hi))

    def boundaries(self, index: int) -> torch.Tensor:
        """Positions (0..seq_len-1) inside sample `index`'s input where a new document starts."""
        start = (index % len(self)) * self.seq_len
        lo, hi = np.searchsorted(self.doc_starts, [start, start + self.seq_len], side="left")
        return torch.from_numpy(self.doc_starts[lo:hi] - start)

    def positions(self, index: int) -> torch.Tensor:
        """Position ids of sample `index`'s input: each token's offset in its own document."""
        at = (index % len(self)) * self.seq_len + np.arange(self.seq_len)
        doc = np.searchsorted(self.doc_starts, at, side="right") - 1
        return torch.from_numpy(at - self.doc_starts[np.maximum(doc, 0)])


def text_dataset(paths, tokenizer: str | os.PathLike | Tokenizer, seq_len: int,
                 cache: str | os.PathLike | None = None) -> PackedText:
    """A `PackedText` of `paths` tokenised with `tokenizer` (a tokenizer.json path), cached."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    tokens, docs, dtype = build_token_cache(paths, tok, Path(cache) if cache is not None else None)
    ds = PackedText(tokens, docs, seq_len, dtype, tok.vocab_size)
    ds.tokenizer = tok
    return ds
