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
    act_bytes_float32_per_token_block: dict[str, float] = field(default_factory=dict)
    """Of `act_bytes_per_token_block`, by policy, the bytes that are float32 in a 16-bit run: what the
    model keeps in float32 whatever its compute dtype (an explicit upcast such as transformers'
    RMSNorm's, softmax statistics, a math attention kernel's float32 scores and softmax). At a
    compute dtype of b bytes a block keeps these plus the rest x b / 2. Measured profiles only;
    empty: every byte follows the compute dtype."""
    act_bytes_float32_per_token_head: float = 0.0
    """Of `act_bytes_per_token_head`, the bytes that are float32 in a 16-bit run (the loss's
    log-probabilities, ...); measured profiles only."""
    act_bytes_per_token_before_blocks: float = 0.0
    """Of `act_bytes_per_token_head`, the floating-point tensors the model saves before its first
    block (a conv stem's input; a language model's token ids are counted with the head): held by
    the first pipeline stage through its blocks' backward. Measured profiles only."""
    act_bytes_per_token_last_block_output: float = 0.0
    """Of `act_bytes_per_token_head`, the last block's output where that block's own last op keeps
    it (a block ending in a ReLU, whose output the next block also keeps as its input: counted once
    per block, so left over for the last); every pipeline stage keeps the output of its own last
    block this way. Measured profiles only. The rest of the head's bytes (after the blocks: final norm, logits, loss) is
    freed before the blocks' backward."""
    backward_working_bytes_per_token_block: float = 0.0
    """The most bytes one block's backward holds beyond its saved activations, net of those it has
    freed by then (the gradients of its activations at its fullest moment; without weight gradients
    and without the gradient of its output, which stands in for the freed output), per token at
    16-bit activations without TP: measured by running the block's backward on the fake tensors.
    Measured profiles only; 0: unknown (`memory.block_working_set` then prices it by family)."""
    act_bytes_tp_split_per_token_block: dict[str, float] = field(default_factory=dict)
    """Of `act_bytes_per_token_block`, by policy, the bytes tensor parallelism splits over its ranks
    (heads and hidden units between column- and row-wise linears: q/k/v, attention scores and
    statistics, the feed-forward's hidden activations), measured as a TP rank runs the block; the
    rest each rank keeps whole (without SP). Measured profiles with TP roles only; empty: unknown."""
    act_bytes_float32_tp_split_per_token_block: dict[str, float] = field(default_factory=dict)
    """Of `act_bytes_tp_split_per_token_block`, the bytes that are float32 in a 16-bit run."""
    composite_norms_measured: bool = False
    """The block's RMSNorms are the model's own modules (transformers' LlamaRMSNorm), measured as
    their composite operators run on any device; False: nn.RMSNorm, counted as the fused kernel keeps
    it (input + float32 statistics), or no RMSNorm."""
    tp_roles: dict[str, str] = field(default_factory=dict)
    """Module path (relative to a block, or top level) -> role: 'colwise', 'rowwise', 'embedding',
    'output', 'norm', 'attention'."""
    tied_embeddings: bool = False
    # ---- added by the model room (all optional, backwards compatible) -------------------------
    block_path: str = "layers"
    """Module path of the container of repeated blocks (e.g. 'layers', 'model.layers'); block-relative
    keys of `tp_roles` apply under f'{block_path}.{i}.'."""
    tp_roles_reason: str = ""
    """Why `tp_roles` is empty (roles could not be derived), else ''."""
    pipeline_reason: str = ""
    """Why this model's blocks cannot be cut into pipeline stages, else '' (pipeline parallelism
    applies). Read by the pipeline strategy's `unsupported(profile)`."""
    context_reason: str = ""
    """Why context parallelism cannot apply to this model (no token sequence input, no
    scaled-dot-product attention found, ...), else ''."""
    input_kind: str = "tokens"
    """What one sample's model input is: 'tokens' (an integer sequence: seq_len matters) or
    'other' (images, features: seq_len is not a dimension of the model)."""
    source: str = "analytic"
    """'analytic' (formulas from the config) or 'measured' (meta/fake-tensor profiler)."""
    flops_convention: str = "6N+12lhs"
    """6 x matmul params (embeddings excluded, output head included) + attention 12*h*s per block per
    token over the full s^2 (causal mask not halved), as torchtitan reports MFU."""
    max_seq_len: int = 0
    """Longest sequence the model accepts (learned positions / RoPE table); 0 if unknown."""
    unfused_attention: bool = False
    """The attention core runs unfused (QK^T, softmax, dropout and PV as separate kernels, the a*s^2
    scores in memory: Megatron-LM before flash attention, a hand-written or transformers' eager
    attention); False: a fused (flash) kernel, as SDPA runs. Measured profiles: the block saved
    [batch, heads, s, s] or [batch x heads, s, s] tensors (`act_bytes_per_token_block_scores`)."""
    act_bytes_per_token_block_scores: float = 0.0
    """Of `act_bytes_per_token_block['none']`, the unfused attention's s x s tensors (scores,
    softmax, dropout mask), per token at 16-bit; measured profiles only (analytic: Korthikanti's 5as)."""
    attention_dropout: bool = False
    """A scaled-dot-product-attention call of the measured run asked for dropout: measured on a CPU
    (`profile_module(fused_attention=False)`) it ran the math kernel and its activations hold the
    s x s scores, which a GPU's fused kernel does not keep (`fused_attention=True` measures that).
    Measured profiles only."""
    ops_per_block: int = 0
    """Operators one block's forward dispatches in eager mode (aten ops, any batch size); the cost
    model's host-overhead term counts backward and recompute from it. 0 if unknown."""
    ops_head: int = 0
    """Forward operators outside the blocks: embeddings, final norm, output head and the loss."""
    tensors_per_block: int = 0
    """Parameter tensors of one block (a non-foreach optimizer dispatches ops per tensor)."""
    tensors_other: int = 0
    """Parameter tensors outside the blocks."""

    # ---- mixture of experts (all 0 for a dense model) ----------------------------------------
    num_experts: int = 0
    """Routed experts per MoE block; 0 for a dense model."""
    experts_per_token: int = 0
    """Routed experts each token is sent to (top-k)."""
    num_shared_experts: int = 0
    """Experts every token goes through (DeepSeek's shared expert)."""
    expert_hidden: int = 0
    """SwiGLU hidden width of one routed expert."""
    params_per_expert: int = 0
    """Parameters of one routed expert (w1, w2, w3)."""
    num_dense_layers: int = 0
    """Leading blocks with a dense feed-forward instead of experts (DeepSeek-V3: 3). They are
    counted in num_layers; their sizes are the *_dense_block fields, every other block is a MoE block
    described by the *_block fields."""
    params_per_dense_block: int = 0
    flops_per_token_dense_block: float = 0.0
    params_active: int = 0
    """Parameters one token is computed with (routed experts: only its top-k); 0 means params_total
    (a dense model)."""

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token for the whole model (6N + attention convention, see docs); for an
        MoE the N counts only the experts a token is routed to (active parameters)."""
        dense_fix = self.num_dense_layers * (self.flops_per_token_dense_block - self.flops_per_token_block)
        return self.num_layers * self.flops_per_token_block + dense_fix + self.flops_per_token_head

    @property
    def active_params(self) -> int:
        """Parameters used per token: params_total for a dense model, fewer for a mixture of experts."""
        return self.params_active or self.params_total

    @property
    def expert_params_total(self) -> int:
        """All routed-expert parameters (what expert parallelism shards): 0 for a dense model."""
        return (self.num_layers - self.num_dense_layers) * self.num_experts * self.params_per_expert

    def to_dict(self) -> dict:
        """JSON-serialisable dict of all fields."""
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelProfile:
        """Inverse of to_dict; unknown keys are ignored so that older readers accept newer profiles."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
