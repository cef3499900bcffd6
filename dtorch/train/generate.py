"""Sampling text from a trained causal language model (plain, single device)."""

from __future__ import annotations

import torch
from torch import nn

from dtorch.model.outputs import logits_of


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int | None = 40, context: int | None = None, seed: int = 0) -> torch.Tensor:
    """Extend `prompt` (1-D token ids) by `max_new_tokens` sampled tokens; returns the whole sequence.

    `context` crops the input to the model's maximum sequence length."""
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt.clone()
    model.eval()
    for _ in range(max_new_tokens):
        window = tokens[-context:] if context else tokens
        logits = logits_of(model(window[None]))[0, -1].float()  # a ModelOutput's .logits
        if temperature <= 0:
            nxt = logits.argmax()[None]
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt])
    return tokens
