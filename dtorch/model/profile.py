"""What the model is, for the planner: sizes, FLOPs, activation bytes and tensor-parallel roles.

A ModelProfile is pure data (JSON-serialisable). It is built from a model on the meta device /
under FakeTensorMode (`dtorch.model.profiler`) or analytically from hyper-parameters, never by
allocating real weights. Units: parameters (count), FLOPs, bytes. All per-token quantities are at
the profile's `seq_len` (attention cost grows with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelProfile:
    name: str
    family: str
    """'gpt' or 'llama' (or 'custom' for a user module)."""
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    params_total: int
    params_per_block: int
    params_embedding: int
    """Token (+ position) embedding parameters (on the first pipeline stage)."""
    params_head: int
    """Output head (+ final norm) parameters (on the last stage); 0 if tied to the embedding."""
    flops_per_token_block: float
    """Training FLOPs (forward + backward, no recompute) of one block per token at seq_len."""
    flops_per_token_head: float
    """Training FLOPs of embedding + output head per token."""
    act_bytes_per_token_block: dict[str, float] = field(default_factory=dict)
    """Activation bytes kept for backward per token per block, by AC policy ('none','selective','full'),
    at 16-bit activations without TP/SP; the cost model divides by tp where SP/TP shards them."""
    act_bytes_per_token_head: float = 0.0
    """Activation bytes of embedding/logits/loss per token (logits dominate: vocab * 4 bytes)."""
    tp_roles: dict[str, str] = field(default_factory=dict)
    """Module path (relative to a block, or top level) -> role: 'colwise', 'rowwise', 'embedding',
    'output', 'norm', 'attention'."""
    tied_embeddings: bool = False

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token for the whole model (6N + attention convention, see docs)."""
        return self.num_layers * self.flops_per_token_block + self.flops_per_token_head
