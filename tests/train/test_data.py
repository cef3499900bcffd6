"""Token datasets: memory-mapped windows, the default stdlib corpus, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtorch.errors import ConfigError
from dtorch.train import data as D


def test_token_file_windows_are_shifted_targets(tmp_path):
    path = D.TokenFile.write(tmp_path / "t.bin", np.arange(70000, 70000 + 33), dtype="uint32")
    ds = D.TokenFile(path, seq_len=8, dtype="uint32")
    assert len(ds) == 4
    x, y = ds[3]
    assert x.dtype == torch.int64 and x.tolist() == list(range(70024, 70032))
    assert y.tolist() == list(range(70025, 70033))
    with pytest.raises(IndexError):
        ds[4]


def test_token_file_rejects_tokens_too_wide_for_the_dtype(tmp_path):
    with pytest.raises(ConfigError) as e:
        D.TokenFile.write(tmp_path / "t.bin", [1, 70000], dtype="uint16")
    assert e.value.field == "dtype"


def test_default_corpus_is_built_once_deterministically_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("DTORCH_CACHE", str(tmp_path))
    ds = D.default_corpus(seq_len=64, max_bytes=200_000)
    assert ds.vocab_size == 256 and len(ds) == (200_000 - 1) // 64
    assert list(tmp_path.iterdir()) == [ds.path]  # no temp file left behind
    first = ds.path.read_bytes()
    assert first == D.build_stdlib_corpus(200_000)  # the same bytes when rebuilt
    assert D.ByteTokenizer().decode(ds.window(0)[:8]) == first[:8].decode()
    assert b"def " in first


def test_batch_for_accepts_token_files_and_plain_map_datasets(tmp_path):
    ds = D.TokenFile(D.TokenFile.write(tmp_path / "t.bin", range(100), "uint16"), seq_len=4)
    x, y = D.batch_for(ds, [0, 2])
    assert x.shape == (2, 4) and x[1].tolist() == [8, 9, 10, 11] and y[1].tolist() == [9, 10, 11, 12]
    windows = [torch.arange(i, i + 5) for i in range(10)]
    x2, y2 = D.batch_for(windows, [3])
    assert x2.tolist() == [[3, 4, 5, 6]] and y2.tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ConfigError):
        D.batch_for([{"text": "no tokens"}], [0])


def test_items_split_into_model_input_and_target_by_the_documented_rule():
    img = torch.zeros(3, 4, 4)
    # (x, y): any dtype and shape, no cast
    x, y = D.batch_for([(img, 3), (img + 1, 4)], [0, 1])
    assert x.shape == (2, 3, 4, 4) and x.dtype == torch.float32 and y.tolist() == [3, 4]
    # a dict: the target key out, the rest keyword arguments
    x, y = D.batch_for([{"pixel_values": img, "mask": torch.ones(2), "label": 1}] * 2, [0, 1])
    assert set(x) == {"pixel_values", "mask"} and y.tolist() == [1, 1]
    # (x1, x2, y): positional arguments and the target; (x,) and a float tensor: no target
    x, y = D.batch_for([(img, torch.ones(2), 0.5)], [0])
    assert isinstance(x, tuple) and len(x) == 2 and y.tolist() == [0.5]
    assert D.batch_for([(img,)], [0])[1] is None and D.batch_for([img], [0])[1] is None
    # token pairs of a narrow dtype become int64
    x, y = D.batch_for([(torch.arange(4, dtype=torch.int32), torch.arange(1, 5, dtype=torch.int32))], [0])
    assert x.dtype == y.dtype == torch.int64
    assert D.is_token_data([torch.arange(5)]) and not D.is_token_data([(img, 1)])


def test_samples_of_different_shapes_need_a_collate():
    items = [(torch.zeros(3), 0), (torch.zeros(5), 1)]
    with pytest.raises(ConfigError, match="collate"):
        D.batch_for(items, [0, 1])

    def pad(batch):
        width = max(len(x) for x, _ in batch)
        return (torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x, _ in batch]),
                torch.tensor([y for _, y in batch]))

    x, y = D.batch_for(items, [0, 1], collate=pad)
    assert x.shape == (2, 5) and y.tolist() == [0, 1]
