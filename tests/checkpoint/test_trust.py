"""Nothing is run from, or trusted in, a checkpoint directory that was not verified: a crafted
`.metadata` behind a recomputed plain hash, directories of other users or open to all, garbage
LATEST pointers. Real files, real DCP, the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch

from dtorch.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning
from dtorch.checkpoint import files as F
from dtorch.cli import main as cli_main
from dtorch.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 3, generator=g)}, "meta": {"step": seed}}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(6, 3)}, "meta": {"step": -1}}


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forge(step_dir, marker) -> None:
    """What an attacker who can write the directory does: a pickle that runs a command as
    `.metadata`, then the manifest's file hash and its own SHA-256 recomputed (no key)."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    doc = json.loads((step_dir / F.MANIFEST).read_text())
    body = doc["manifest"]
    digest, size = F.sha256_file(step_dir / ".metadata")
    body["files"][".metadata"] = {"sha256": digest, "size": size}
    doc["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (step_dir / F.MANIFEST).write_text(json.dumps(doc))


def test_crafted_metadata_with_recomputed_hash_is_refused_by_verify_export_load_and_trust(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    marker = tmp_path / "PWNED"
    _forge(root / "step-00000002", marker)

    assert cli_main(["ckpt", "verify", str(root), "--step", "2"]) == 1
    assert "signature does not match" in capsys.readouterr().out
    assert cli_main(["ckpt", "export", str(root), str(tmp_path / "o.safetensors"), "--step", "2"]) == 2
    assert "signature does not match" in capsys.readouterr().err
    blank = _blank()
    with pytest.warns(CheckpointWarning, match="signature"):
        assert CheckpointManager(root).load_latest(blank) == 1  # falls back to the intact step 1
    assert torch.equal(blank["model"]["w"], _state(1)["model"]["w"])
    # Even a person who vouches for it (re-signs the manifest) cannot make it run code: the
    # allow-list unpickler refuses os.system before looking it up.
    assert cli_main(["ckpt", "trust", str(root), "--step", "2"]) == 0
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(root), "--step", "2"]) == 1
    assert "refused to unpickle posix.system" in capsys.readouterr().out
    with pytest.warns(CheckpointWarning, match="refused to unpickle"):
        assert CheckpointManager(root).load_latest(_blank()) == 1
    assert not marker.exists()


def test_unsigned_or_foreign_key_manifest_is_refused_until_trusted(tmp_path, monkeypatch, capsys):
    root = tmp_path / "run"
    CheckpointManager(root).save(3, _state(3))
    monkeypatch.setenv("DTORCH_KEY", "another-users-secret-key")
    assert not CheckpointManager(root).verify(3).ok
    assert cli_main(["ckpt", "trust", str(root)]) == 0
    assert CheckpointManager(root).verify(3).ok
    monkeypatch.delenv("DTORCH_KEY")
    assert "signed with another key" in CheckpointManager(root).verify(3).problems[0]


def test_key_file_open_to_others_is_refused(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("0123456789abcdef0123456789abcdef")
    key.chmod(0o644)
    monkeypatch.setenv("DTORCH_KEY_FILE", str(key))
    with pytest.raises(ConfigError, match="chmod 600"):
        CheckpointManager(tmp_path / "run").save(1, _state(1))


def test_directory_writable_by_all_or_owned_by_another_user_is_refused_unless_trusted(tmp_path, monkeypatch):
    root = tmp_path / "run"
    CheckpointManager(root).save(1, _state(1))
    root.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by every user.*DTORCH_TRUST="):
        CheckpointManager(root)
    monkeypatch.setenv("DTORCH_TRUST", str(root))
    assert CheckpointManager(root).verify(1).ok
    monkeypatch.delenv("DTORCH_TRUST")
    root.chmod(0o755)
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(root / "step-00000001", 65534, 65534)
    report = CheckpointManager(root).verify(1)
    assert not report.ok and "owned by uid 65534" in report.problems[0]
    with pytest.raises(CheckpointError, match="owned by uid 65534"):
        CheckpointManager(root).load_latest(_blank())


@pytest.mark.parametrize("garbage", ["binary", "directory", "dev_zero", "fifo"])
def test_garbage_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path, garbage, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, _state(s))
    (root / "step-00000003" / "__0_0.distcp").write_bytes(b"torn")
    latest = root / F.LATEST
    latest.unlink()
    if garbage == "binary":
        latest.write_bytes(b"\xff\xfe\x00step-\x80")
    elif garbage == "directory":
        latest.mkdir()
    elif garbage == "dev_zero":
        latest.symlink_to("/dev/zero")
    else:
        os.mkfifo(latest)
    assert CheckpointManager(root).latest_pointer() is None
    assert cli_main(["ckpt", "ls", str(root)]) == 0
    assert cli_main(["ckpt", "verify", str(root)]) == 1  # step 3 damaged, the others OK
    out = capsys.readouterr().out
    assert out.count(": OK") == 2
    blank = _blank()
    with pytest.warns(CheckpointWarning):
        assert CheckpointManager(root).load_latest(blank) == 2
    assert torch.equal(blank["model"]["w"], _state(2)["model"]["w"])
