"""Models DTorch did not write, with their data and loss: the any-model matrix's cases.

Each case is a `Case(name, factory, dataset, loss, ...)`: a zero-argument factory returning a plain
nn.Module (hand-written here with its own names, or a `transformers` class built from a tiny
config: no download), a map-style dataset of the kind its user would have, and the loss the user
would write. `plain_loop(case, steps, global_batch)` is the reference every plan is held to: one
process, the model built after `torch.manual_seed(seed)`, AdamW, the same samples in the same order
(`dtorch.train.sampler.GlobalSampler`), the mean loss of the whole global batch.

Nothing here imports DTorch's executor: the models know nothing of parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
SEQ = 16
LR = 3e-3


# ---- hand-written models -------------------------------------------------------------------------
class NanoAttention(nn.Module):
    """nanoGPT's causal self-attention: q, k and v from ONE fused projection `c_attn`."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, d))


class NanoBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = NanoAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style GPT whose output head is tied to its token embedding (`wte`)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, heads: int = 4, layers: int = 4, block: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.h = nn.ModuleList(NanoBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ResBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn1 = nn.GroupNorm(4, ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn2 = nn.GroupNorm(4, ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallCNN(nn.Module):
    """A CNN classifier: a stem, an nn.Sequential of identical residual blocks, a pooled linear head."""

    def __init__(self, classes: int = 10, ch: int = 16, depth: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.body = nn.Sequential(*(ResBlock(ch) for _ in range(depth)))
        self.fc = nn.Linear(ch, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.body(F.relu(self.stem(images)))
        return self.fc(x.mean(dim=(2, 3)))


class ViTAttention(nn.Module):
    """timm-style attention: one fused `qkv` projection, no mask (a ViT attends everywhere)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ViTAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """A vision transformer: patch embedding (a strided conv), a class token, learned positions,
    an encoder of the user's own blocks, a classification head."""

    def __init__(self, classes: int = 10, image: int = 16, patch: int = 4, dim: int = 64, heads: int = 4,
                 depth: int = 4):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.encoder["layers"]:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


class _ScaledTanh(torch.autograd.Function):
    """A custom autograd.Function (its own backward), as users write for fused or odd ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        return grad * (ctx.scale - y * y / ctx.scale), None


class BranchBlock(nn.Module):
    """Picks one of two sub-networks by its input: a data-dependent branch, so in a given step some
    parameters get no gradient on some ranks."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        branch = self.left if float(x.detach().mean()) > 0 else self.right
        return x + _ScaledTanh.apply(branch(h), 2.0)


class BranchyNet(nn.Module):
    def __init__(self, features: int = 16, dim: int = 32, depth: int = 4, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.stack = nn.ModuleList(BranchBlock(dim) for _ in range(depth))
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.stack:
            h = blk(h)
        return self.out(h)


def mlp_regressor(features: int = 8, width: int = 32) -> nn.Module:
    """A plain MLP regressor (nn.Sequential of Linear/ReLU), trained with MSE."""
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


# ---- data ------------------------------------------------------------------------------------------
class TokenWindows(torch.utils.data.Dataset):
    """`n` random 1-D int64 windows of SEQ+1 tokens (the token-window convention)."""

    def __init__(self, n: int = 64, vocab: int = VOCAB, seed: int = 1):
        self.tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class Pairs(torch.utils.data.Dataset):
    """(input, target) tuples of any dtype and shape."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


def images(n: int = 64, classes: int = 10, seed: int = 2) -> Pairs:
    g = torch.Generator().manual_seed(seed)
    return Pairs(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, classes, (n,), generator=g))


def features(n: int = 64, dim: int = 16, classes: int | None = None, seed: int = 3) -> Pairs:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) + torch.randn(n, 1, generator=g)  # per-sample offsets: both branches
    if classes is not None:
        return Pairs(x, torch.randint(0, classes, (n,), generator=g))
    return Pairs(x, (x.sum(dim=1, keepdim=True) / math.sqrt(dim)).sin())


# ---- losses (what the user would write) ----------------------------------------------------------------
def lm_loss(logits: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target)


# ---- transformers models from tiny configs -----------------------------------------------------------
HF_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 bos_token_id=0, eos_token_id=1, pad_token_id=0)
HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 64}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 4}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "olmo2": ("Olmo2Config", {}),
    # no adapter understands these: they run their own forward (BLOOM with its head tied, ALiBi and an
    # embedding norm; OPT's and GPT-BigCode's learned positions; MPT's ALiBi; Falcon; GPT-J)
    "bloom": ("BloomConfig", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.0, "attention_dropout": 0.0}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "mpt": ("MptConfig", {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 64}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "gptj": ("GPTJConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "rotary_dim": 8,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
}


def hf_factory(arch: str, attn: str = "sdpa", **overrides: Any) -> Callable[[], nn.Module]:
    """A zero-argument factory of `AutoModelForCausalLM.from_config` for a tiny config of `arch`."""

    def build() -> nn.Module:
        import transformers

        cls_name, extra = HF_CONFIGS[arch]
        cfg = getattr(transformers, cls_name)(**{**HF_COMMON, **extra, **overrides})
        cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
        kernel = attn if attn != "sdpa" or getattr(cls, "_supports_sdpa", False) else "eager"  # (BLOOM, MPT)
        cfg._attn_implementation = kernel
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=kernel)

    build.__name__ = f"hf_{arch}_{attn}"
    return build


# ---- the matrix ----------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    factory: Callable[[], nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    kind: str = "lm"
    """"lm" (token windows: input = window[:-1], target = window[1:]) or "pairs" ((input, target))."""
    tags: set[str] = field(default_factory=set)
    batch_dependent: bool = False
    """The output for one sample depends on the others in its batch: the reference accumulates over
    the micro-batches each plan runs (`plain_loop(microbatch=...)`)."""


def cases() -> list[Case]:
    """Every case of the matrix: the hand-written models, then each transformers architecture."""
    out = [
        Case("nanogpt-tied", NanoGPT, TokenWindows, lm_loss, "lm", {"tied", "fused-qkv"}),
        Case("cnn", SmallCNN, images, classification_loss, "pairs", {"vision"}),
        Case("vit", TinyViT, images, classification_loss, "pairs", {"vision", "fused-qkv"}),
        Case("branchy", BranchyNet, lambda: features(classes=4), classification_loss, "pairs",
             {"branch", "autograd-function"}, batch_dependent=True),
        Case("mlp-regressor", mlp_regressor, lambda: features(dim=8), mse_loss, "pairs", {"regression"}),
    ]
    out += [Case(f"hf-{arch}", hf_factory(arch), TokenWindows, lm_loss, "lm", {"transformers"})
            for arch in HF_CONFIGS]
    return out


def split(case: Case, item: Any) -> tuple[Any, torch.Tensor]:
    """(input, target) of one sample, as the plain loop reads it."""
    if case.kind == "lm":
        return item[:-1], item[1:]
    return item


def plain_loop(case: Case, steps: int, global_batch: int, seed: int = 0, microbatch: int | None = None) -> list[float]:
    """Per-step losses of the reference: one process, the user's own model, data and AdamW.

    `microbatch`: accumulate gradients over consecutive chunks of that many samples (the mean of the
    chunks' mean losses) instead of one forward of the whole global batch. A model whose output for a
    sample depends on the rest of its batch (BranchyNet picks its branch by the batch mean) is then
    compared on the batches it really sees under a plan with that micro-batch size."""
    from dtorch.train.sampler import GlobalSampler

    torch.manual_seed(seed)
    model = case.factory()
    data = case.dataset()
    sampler = GlobalSampler(len(data), global_batch, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    chunk = microbatch or global_batch
    losses = []
    for step in range(steps):
        pairs = [split(case, data[i]) for i in sampler.global_indices(step)]
        total = 0.0
        for lo in range(0, global_batch, chunk):
            x = torch.stack([p[0] for p in pairs[lo:lo + chunk]])
            y = torch.stack([p[1] for p in pairs[lo:lo + chunk]])
            loss = case.loss(model(x), y) / (global_batch // chunk)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses
