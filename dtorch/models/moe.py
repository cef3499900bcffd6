"""Mixture-of-experts decoders in plain PyTorch: DeepSeek-V3, Qwen3-MoE and Mixtral style.

A Llama-style decoder (RoPE, RMSNorm, pre-norm residual blocks) whose feed-forward is a `MoE`:
a router scores every token against `n_experts` SwiGLU experts, each token goes to its `top_k`
best experts, their outputs are summed with the gate weights, and optional shared experts run on
every token (DeepSeek). The model knows nothing about parallelism; module names follow
dtorch.models.llama so that one tensor-parallel plan fits the attention of all three:

    tok_embeddings, layers["0".."n-1"].{attention_norm, attention, ffn_norm, feed_forward}, norm, output
    feed_forward (MoE blocks) = {router, experts.{w1,w2,w3} [n_experts, ...], shared_expert.{w1,w2,w3}}
    feed_forward (the first n_dense_layers blocks) = {w1, w2, w3}

Routing, step by step (`MoE.forward`), for T tokens:
  1. scores = softmax or sigmoid of router(x), float32 [T, n_experts];
  2. selection = scores (+ the auxiliary-loss-free `expert_bias`, selection only), restricted to
     the best `topk_groups` of `n_expert_groups` groups when group-limited; top_k of it;
  3. gate weights = the selected *scores* (not biased), renormalised if `norm_topk_prob`,
     times `route_scale`;
  4. the T*top_k (token, expert) assignments are sorted by expert (stable: token order inside an
     expert) and `experts` computes them expert by expert on contiguous slices;
  5. outputs times gate weights are added back to their tokens (index_add).
Dropless by default: every assignment is computed. With `capacity_factor` c, an expert keeps the
first ceil(c*T*top_k/n_experts) assignments in token order and drops the rest (a dropped
assignment adds nothing; the token keeps its residual and its other experts).

Balancing. `aux_loss_coef` > 0 adds DeepSeek-V3's sequence-wise balance loss; it enters the
backward pass through `_AddAuxLossGrad` (the forward value of the block is unchanged, the
gradient of the loss is injected), so any training loop that back-propagates the LM loss also
optimises it; `MoETransformer.aux_loss()` returns its value for logging. `bias_update_speed` > 0
enables auxiliary-loss-free balancing: forward counts the assignments per expert (training mode)
and `MoETransformer.update_expert_bias()`, called after each optimizer step, moves every expert's
bias by the speed toward equal load.

Hooks, None unless a tool installs them (like `core_attention` in dtorch.models.llama):
  GroupedExperts.dispatcher  expert parallelism (dtorch.parallel.expert) sends the sorted
                             assignments to the ranks that hold their experts and back;
  MoE.assignment_counts      the measuring profiler (fake tensors, whose routing cannot be read)
                             supplies per-expert counts; FLOPs are linear in them;
  MoETransformer.load_all_reduce  sums the expert-load counts over data-parallel ranks before
                             the bias update, so every rank moves the bias identically;
  MoE.sequence_all_reduce    context parallelism (dtorch.parallel.cp) sums each sequence's
                             balance-loss statistics over the ranks holding its other chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtorch.models import init
from dtorch.models.configs import MoEConfig
from dtorch.models.llama import Attention as _LlamaAttention
from dtorch.models.llama import apply_rope, decoder_forward, rope_tables

__all__ = ["MoE", "MoEConfig", "MoETransformer", "GroupedExperts"]


class GQAAttention(_LlamaAttention):
    """Llama's grouped-query attention with an explicit head_dim and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, config: MoEConfig):
        super().__init__(config)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        if self.core_attention is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = self.core_attention(q, k, v, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention in its training form (no weight absorption): queries
    through an optional low-rank bottleneck, keys and values from a shared compressed latent of
    kv_lora_rank, plus a qk_rope_head_dim RoPE part per query head and one shared by all keys."""

    core_attention = None
    """As dtorch.models.llama.Attention.core_attention."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        h, H = config.dim, config.n_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk = self.nope + self.rope
        if config.q_lora_rank:
            self.wq_a = nn.Linear(h, config.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(config.q_lora_rank, eps=config.norm_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(h, H * qk, bias=False)
        self.wkv_a = nn.Linear(h, config.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(config.kv_lora_rank, eps=config.norm_eps)
        self.wkv_b = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, h, bias=False)
        self.kv_lora_rank = config.kv_lora_rank

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)  # [b, s, 1, rope]: one RoPE key for all heads
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = q.shape[2]
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe.expand(b, s, heads, self.rope)], dim=-1).transpose(1, 2)
        # Fused attention kernels (flash) want one head width for q, k and v: values are zero-padded
        # to the query/key width and the padding is cut from the output (it stays exactly zero).
        qk = self.nope + self.rope
        v = F.pad(v, (0, qk - self.v_dim)).transpose(1, 2)
        if self.core_attention is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self.core_attention(q, k, v, enable_gqa=False)
        return self.wo(y[..., : self.v_dim].transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a dense block's feed-forward, and the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU experts stored as stacked weights w1/w3 [E, hidden, dim], w2 [E, dim, hidden]
    (the nn.Linear layout per expert), so that expert parallelism shards them along dim 0."""

    dispatcher = None
    """None: compute on this process. Expert parallelism installs a callable (module, x, counts) -> y
    with the same contract as `forward`, moving tokens to the ranks that hold their experts."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, dim]: assignments sorted by expert, counts[e] rows for expert e (sum = n) -> [n, dim]."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, counts)
        return self.compute(x, counts)

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts this module holds (len(counts) of them), one matmul chain per expert."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        assert len(counts) == w1.shape[0], (len(counts), w1.shape)
        outs = [F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
                for e, xe in enumerate(x.split(counts)) if counts[e]]
        if not outs:  # no token for any expert here (possible under EP): keep the input and the weights
            # in the graph, so that backward still runs the dispatch all-to-all that the other ranks
            # run and the weights get (zero) gradients like theirs
            return x.new_zeros(x.shape) + 0.0 * (x.sum() + w1.sum() + w2.sum() + w3.sum())
        return torch.cat(outs)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The locally held part of a weight (a sharded DTensor's shard; a plain tensor itself)."""
    return w.to_local() if hasattr(w, "to_local") else w


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, d(aux)/d(aux) = 1 flows into the auxiliary loss, so the loss is
    optimised as if added to the LM loss (the block's forward value is unchanged)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float = 1.0):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (+ shared experts) with top-k gating; see the module docstring for the steps."""

    aux_grad_scale = 1.0
    """Weight of the balance loss's injected gradient: a loop that divides each of m accumulated
    micro-batches' LM loss by m sets 1/m here (`dtorch.parallel.model.ParallelModel` does), so
    that the balance loss keeps its weight relative to the LM loss."""
    sequence_all_reduce = None
    """None: every sequence of the batch is whole on this rank. Context parallelism installs a
    callable(tensor) that sums a tensor in place over the cp ranks, which hold the other chunks of
    the same sequences: the balance loss then uses each whole sequence's statistics."""
    assignment_counts = None
    """None: per-expert assignment counts read from the routing (one host read). The measuring
    profiler installs a callable (num_assignments, num_experts) -> list[int]."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = GroupedExperts(config.n_experts, config.dim, config.expert_hidden)
        self.shared_expert = (SwiGLU(config.dim, config.n_shared_experts * config.expert_hidden)
                              if config.n_shared_experts else None)
        self.shared_expert_gate = (nn.Linear(config.dim, 1, bias=False)
                                   if config.n_shared_experts and config.shared_expert_gate else None)
        # Persistent: the auxiliary-loss-free bias is training state (checkpointed).
        self.register_buffer("expert_bias", torch.zeros(config.n_experts), persistent=True)
        # int64: exact counts, and left alone by model.to(bfloat16)
        self.register_buffer("expert_load", torch.zeros(config.n_experts, dtype=torch.int64), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None

    def route(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores float32 [T, E], chosen experts [T, k], gate weights float32 [T, k])."""
        c = self.config
        logits = self.router(xt).float()
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        choose = scores.detach()
        if c.bias_update_speed > 0:
            choose = choose + self.expert_bias
        if c.n_expert_groups > 1:
            grouped = choose.view(-1, c.n_expert_groups, c.n_experts // c.n_expert_groups)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, groups]
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(c.topk_groups, dim=-1).indices, True)
            choose = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        idx = choose.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if c.norm_topk_prob and c.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, idx, weights * c.route_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, h = x.shape
        xt = x.reshape(-1, h)
        scores, idx, weights = self.route(xt)
        flat = idx.reshape(-1)  # [T*k], token-major
        ones = torch.ones_like(flat)
        counts_t = torch.zeros(c.n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, ones)
        order = flat.argsort(stable=True)  # assignments sorted by expert, token order within one
        if self.assignment_counts is not None:
            counts = self.assignment_counts(flat.numel(), c.n_experts)
        else:
            counts = counts_t.tolist()
            if c.capacity_factor is not None:
                order, counts = self._apply_capacity(order, counts, flat.numel())
        token = order // c.top_k
        y = self.experts(xt[token], counts)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        # (under autocast the experts' matmuls return bfloat16: sum into the residual stream's dtype)
        out = torch.zeros_like(xt).index_add_(0, token, y.to(xt.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(xt)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(xt)) * shared
            out = out + shared
        out = out.view(b, s, h)
        if self.training and c.bias_update_speed > 0:
            with torch.no_grad():
                self.expert_load += counts_t
        self.last_aux_loss = None
        if self.training and c.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self.balance_loss(scores, idx, b, s)
            self.last_aux_loss = aux.detach()
            out = _AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out

    def _apply_capacity(self, order: torch.Tensor, counts: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
        c = self.config
        cap = math.ceil(c.capacity_factor * n / c.n_experts)
        pos = torch.cat([torch.arange(k, device=order.device) for k in counts])  # rank within its expert
        return order[pos < cap], [min(k, cap) for k in counts]

    def balance_loss(self, scores: torch.Tensor, idx: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss: per sequence, coef * sum_i f_i * P_i with
        f_i = E/(k*s) * (assignments to expert i) and P_i = mean over tokens of the normalised score,
        averaged over the b sequences."""
        c = self.config
        E, k = c.n_experts, c.top_k
        seq_idx = idx.view(b, s * k)
        f = torch.zeros(b, E, device=scores.device).scatter_add_(1, seq_idx, torch.ones_like(seq_idx, dtype=torch.float32))
        p = scores / scores.sum(-1, keepdim=True) if c.score_func == "sigmoid" else scores
        p_mean = p.view(b, s, E).mean(1)
        if self.sequence_all_reduce is None:
            return c.aux_loss_coef * (f * (E / (k * s)) * p_mean).sum(-1).mean()
        # Under context parallelism this rank holds s of the n*s tokens of each sequence (n cp ranks):
        # the counts and the score means are summed over the n ranks (one collective), so f and P
        # are the whole sequence's. The gradient goes through this rank's P only, as the mean over
        # its own tokens: the cp ranks' gradients are averaged (FSDP/DDP over dp_shard x cp), and
        # the mean over n ranks of a local mean over s tokens is the mean over the n*s tokens, as
        # for the LM loss. The value is the whole sequence's on every rank.
        stats = torch.stack((f, p_mean.detach()))
        self.sequence_all_reduce(stats)
        counts, p_sum = stats[0], stats[1]
        assignments = counts.sum(-1, keepdim=True)  # k*n*s per sequence (no host read of n)
        f_all = counts * (E / assignments)
        exact = c.aux_loss_coef * (f_all * p_sum * (k * s / assignments)).sum(-1).mean()
        local = c.aux_loss_coef * (f_all * p_mean).sum(-1).mean()
        return local + (exact - local).detach()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Move each expert's selection bias by bias_update_speed toward equal load (the counted load
        since the last call; `expert_load` must already be summed over data-parallel ranks)."""
        load = self.expert_load.double()
        self.expert_bias += self.config.bias_update_speed * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        self.expert_load.zero_()


class TransformerBlock(nn.Module):
    def __init__(self, config: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = MLAttention(config) if config.attention == "mla" else GQAAttention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = (SwiGLU(config.dim, config.ffn_hidden) if layer_id < config.n_dense_layers
                             else MoE(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class MoETransformer(nn.Module):
    """MoE decoder. forward(tokens LongTensor[b, s]) -> logits float[b, s, vocab_size]. Pipeline
    stages and context parallelism use the same conventions and hooks as dtorch.models.llama.Llama."""

    input_modules = ("tok_embeddings",)
    output_modules = ("norm", "output")
    token_positions = None
    """As Llama.token_positions."""
    load_all_reduce = None
    """None: expert loads are this process's. Data parallelism installs a callable(tensor) that sums
    a tensor in place over the ranks whose tokens this model routes."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        half = config.rope_dim // 2
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, half), persistent=False)
        self.init_weights()

    def moe_modules(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the buffers' current device and start the balancing state
        at zero (expert biases and loads: a model loaded from pretrained weights, which hold no such
        buffers, would otherwise keep `to_empty`'s garbage in them). Skipped on meta."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.config.rope_dim, self.config.max_seq_len, self.config.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
            for name, buf in self.named_buffers():
                if name.endswith(("expert_bias", "expert_load")) and not buf.is_meta:
                    buf.zero_()

    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic (re)initialisation, as Llama.init_weights: N(0, 0.02) by (seed, name, index),
        the residual projections (wo, w2 of experts and dense/shared SwiGLUs) N(0, 0.02/sqrt(2L)),
        norms 1, expert biases 0."""
        seed = 0 if seed is None else seed
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):  # q/k/v biases (qkv_bias), as Llama
                init.constant_(param, 0.0)
            elif name.endswith("norm.weight"):
                init.constant_(param, 1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                init.normal_(param, resid_std, seed, name)
            else:
                init.normal_(param, std, seed, name)
        for name, buf in self.named_buffers():
            if name.endswith(("expert_bias", "expert_load")) and not buf.is_meta:
                buf.zero_()
        self.init_buffers()

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the balance losses of the last training forward (0.0 if none): add it to the LM loss
        to log the objective that backward optimises."""
        losses = [m.last_aux_loss for m in self.moe_modules() if m.last_aux_loss is not None]
        return torch.stack(losses).sum() if losses else 0.0

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After an optimizer step: the auxiliary-loss-free bias update of every MoE block (no-op when
        bias_update_speed is 0). Loads are first summed over data-parallel ranks (`load_all_reduce`)."""
        if self.config.bias_update_speed <= 0:
            return
        for m in self.moe_modules():
            if self.load_all_reduce is not None:
                self.load_all_reduce(m.expert_load)
            m.update_bias()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return decoder_forward(self, tokens)
