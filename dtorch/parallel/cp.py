"""Context parallelism: rejected with a reason (torch 2.13, this executor).

`torch.distributed.tensor.experimental.context_parallel` shards the sequence and runs ring
attention by intercepting the flash / efficient / cuDNN SDPA ops, which exist on CUDA only. On CPU
SDPA lowers to `aten._scaled_dot_product_flash_attention_for_cpu`, and torch 2.13 has no sharding
rule for it: a 2-rank gloo run raises "Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered." (measured), so the CPU path cannot be
tested and the one-code-path rule forbids a CUDA-only feature. Context parallelism also needs the
models' RoPE tables indexed by global position on each sequence shard (the reference models slice
them by the local length). Until both are solved a plan with cp > 1 is refused up front.
"""

from __future__ import annotations

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan


def check_cp(plan: Plan) -> None:
    if plan.cp > 1:
        raise ConfigError(
            "cp", plan.cp,
            "context parallelism is not supported by this executor yet (torch 2.13 ring attention "
            "runs only on CUDA SDPA kernels and the models do not declare position buffers); use cp=1 "
            "and put the degree into dp_shard or tp",
        )
