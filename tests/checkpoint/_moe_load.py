"""The rank side of tests/checkpoint/test_hf_moe_weights.py's expert-parallel load (kept apart from
the test module so that spawned ranks do not import transformers)."""

from __future__ import annotations

import torch

SEQ, VOCAB = 16, 128


def ep_worker(directory: str, rank: int) -> dict:
    from dtorch.checkpoint.hf_weights import HFWeights, load_model_config
    from dtorch.models import build_from_config
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    _, cfg = load_model_config(directory)
    weights = HFWeights(directory)
    pm = parallelize(lambda: build_from_config(cfg), Plan(dp_shard=2, ep=2), loss_fn=next_token, seq_len=SEQ,
                     weights=weights)
    (model,) = pm.model_parts
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits = model.eval()(tokens)
    return {"logits": logits.tolist(), "bytes_read": weights.bytes_read}
