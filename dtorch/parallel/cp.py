"""Context parallelism: rejected with a reason (torch 2.13, this executor).

`torch.distributed.tensor.experimental.context_parallel` shards the sequence inside
scaled_dot_product_attention by ring attention. In torch 2.13 its ring kernels dispatch only the
flash / efficient / cuDNN SDPA ops, which exist on CUDA: on CPU SDPA takes the math path, which
the context-parallel dispatcher does not handle, so gloo runs cannot test it; and it requires
every buffer indexed by position (RoPE tables) to be sharded the same way, which the reference
models do not declare yet. Until both are solved a plan with cp > 1 is refused up front.
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
