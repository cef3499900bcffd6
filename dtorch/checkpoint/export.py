"""Export a (verified) DCP checkpoint to one consolidated safetensors file, or (`export_hf_dir`)
to a Hugging Face model directory, streamed one shard file at a time (hf_weights.export_hf).

The full state dict is read in this process (every shard of every rank, resharded to whole
tensors by DCP's empty-state-dict planner, the same path as `dcp_to_torch_save`), flattened to
dotted names and written with `safetensors.torch.save_file`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from dtorch.checkpoint import files as F
from dtorch.checkpoint.safe import SafeFileSystemReader
from dtorch.errors import ConfigError


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> None:
    if isinstance(obj, torch.Tensor):
        # safetensors refuses views and shared storage: give each name its own contiguous copy.
        tensors[prefix] = obj.detach().to("cpu").contiguous().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), tensors, objects)
    else:
        objects[prefix] = obj


def load_full_state_dict(directory: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as whole (unsharded) CPU tensors and plain values.
    Call only on a verified directory; `.metadata` is unpickled with an allow-list."""
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=SafeFileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def export_safetensors(directory: Path, out: Path, *, keys: list[str] | None = None) -> Path:
    """Consolidate verified checkpoint `directory` into safetensors file `out` (written
    atomically); `keys` restricts the export to those top-level entries."""
    manifest = F.read_manifest(directory)
    sd = load_full_state_dict(directory)
    if keys:
        unknown = [k for k in keys if k not in sd]
        if unknown:
            raise ConfigError("keys", unknown, f"the checkpoint holds {sorted(sd)}")
        sd = {k: sd[k] for k in keys}
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    _flatten(sd, "", tensors, objects)
    metadata = {
        "dtorch.step": str(manifest.step),
        "dtorch.extra": json.dumps(manifest.extra, default=str),
        "dtorch.objects": json.dumps(objects, default=str),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    F.fsync_file(tmp)
    os.replace(tmp, out)
    F.fsync_dir(out.parent)
    return out


RUN_MODEL = "model.json"
"""Written into a run's checkpoint directory by `dtorch train`: the DTorch model spec it trained, so
that `dtorch ckpt export --hf` needs no `--model`."""


def save_run_model(checkpoint_dir: str | os.PathLike, spec: str) -> None:
    """Keep the model spec a run trains next to its checkpoints (replaced atomically)."""
    from dtorch import trust

    d = Path(checkpoint_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    trust.replace_file(d / RUN_MODEL, (json.dumps({"model": spec}) + "\n").encode())


def run_model(checkpoint_dir: str | os.PathLike) -> str | None:
    """The model spec `save_run_model` kept for the run, None when there is none."""
    try:
        return str(json.loads((Path(checkpoint_dir) / RUN_MODEL).read_text())["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_hf_dir(mgr, step: int | None, out: str | os.PathLike, *, model: str | None = None,
                  config: str | os.PathLike | None = None, dtype: str | None = None,
                  shard_bytes: int | None = None, tokenizer: str | os.PathLike | None = None) -> Path:
    """Write checkpoint `step` (default: the newest) of `mgr`'s run as a Hugging Face directory.
    The architecture comes from `config` (a Hugging Face directory or config.json), else the
    config.json of the directory the run started from (saved next to its checkpoints), else the
    DTorch model spec `model`, else the spec `dtorch train` recorded (`RUN_MODEL`). The tokenizer files and generation_config.json are copied beside the
    weights from `tokenizer`, else the `config` directory, else those the run kept from the
    directory it started from (`hf_weights.export_hf_files`), where there are any."""
    from dtorch.checkpoint import hf_weights as H

    if step is not None and not any(i.step == step for i in mgr.list()):
        raise ConfigError("step", step, "no such committed checkpoint; see dtorch ckpt ls")
    src = mgr.verified(step)  # default: the newest checkpoint that verifies, as training resumes from
    base = None
    if config is not None:
        p = Path(config)
        base = H.read_config(p) if p.is_dir() else json.loads(p.read_text())
    elif (mgr.root / H.RUN_CONFIG).is_file():
        base = json.loads((mgr.root / H.RUN_CONFIG).read_text())
    if base is not None:
        family, cfg = H.model_type(base), H.dtorch_config(base)
    elif (model := model or run_model(mgr.root)) is not None:  # given, else the spec the run recorded
        from dtorch.models import model_config

        cfg, family = model_config(model), None
    else:
        raise ConfigError("model", None, "this run recorded no model: pass --model SPEC (the run's model) "
                          "or --config HF_DIR")
    written = H.export_hf(src, Path(out), cfg, family=family, base_config=base, dtype=dtype,
                          max_shard_bytes=shard_bytes or H.DEFAULT_SHARD_BYTES)
    H.export_hf_files(written, [tokenizer, config, mgr.root / H.RUN_FILES])
    return written
