"""Pipeline parallelism for models DTorch did not write, cut between their blocks as they are.

A hand-written GPT (blocks in an nn.ModuleList `h`, its own names; untied, and tied: each end
stage holds one name of the shared weight, kept in sync) and an MLP regressor
(an nn.Sequential of identical residual blocks, MSE loss on float features) train 5 AdamW steps
under pp=2 at world 2, one stage per rank and two stages per rank (the interleaved schedule, whose
middle stages receive and send), with per-step losses within 1e-5 relative of one process training
the same model on the same batches. A model whose head reads a value from before the blocks
cannot be cut: PP is refused, with the same one line from the profiler and from the executor.
One group of 2 gloo processes runs every case.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _pipeline_models as models  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

REL = 1e-5
CASES = {
    "gpt_zero_bubble": dict(model="gpt", pp=2, schedule="zero_bubble", num_microbatches=2, microbatch_size=2),
    "gpt_interleaved": dict(model="gpt", pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=2,
                            microbatch_size=2),
    "mlp_gpipe": dict(model="mlp", pp=2, schedule="gpipe", num_microbatches=2, microbatch_size=2),
    # the head shares the embedding's weight: one copy on each end stage, kept in sync (ties.py)
    "gpt_tied_1f1b": dict(model="gpt_tied", pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2),
}


@cache
def _results() -> dict:
    out = run_group(2, list(CASES.items()), models.train_parallel)
    return dict(zip(CASES, out))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_any_model_trains_under_pipeline_like_one_process(name):
    ranks = _results()[name]
    for r in ranks:
        assert "error" not in r, r["error"]
    ref = models.train_single(CASES[name]["model"])
    got = ranks[0]["losses"]
    assert ranks[1]["losses"] == got  # the loss is the last stage's, shared with every rank
    for a, b in zip(got, ref):
        assert abs(a - b) <= REL * abs(b), (name, got, ref)


def test_model_that_cannot_be_cut_is_refused_with_one_reason():
    from dtorch.model.profiler import profile_module
    from dtorch.parallel import parallelize

    prof = profile_module(models.hand_gpt_skip, models.SEQ, dtype=torch.float32)
    assert "a skip around the blocks" in prof.pipeline_reason and "'h.3'" in prof.pipeline_reason
    plan = Plan(pp=2, schedule="gpipe", num_microbatches=2)
    with pytest.raises(ConfigError) as err:  # no process group: refused before one exists
        parallelize(models.hand_gpt_skip, plan, loss_fn=next_token, seq_len=models.SEQ)
    assert err.value.field == "pp" and prof.pipeline_reason in err.value.fix
    assert profile_module(models.hand_gpt, models.SEQ, dtype=torch.float32).pipeline_reason == ""


def test_stages_keep_the_whole_model_parameter_names():
    from dtorch.model.split import split_layout
    from dtorch.parallel.pipeline import split_stage

    with torch.device("meta"):
        net = models.hand_gpt()
    layout = split_layout(net, (torch.zeros(2, models.SEQ, dtype=torch.long),))
    assert layout.first == ("wte.weight", "wpe.weight")
    assert layout.last == ("ln_f.weight", "ln_f.bias", "lm_head.weight")
    plan = Plan(pp=2, schedule="gpipe", num_microbatches=2)
    names = [{n for n, _ in split_stage(net, plan, s, layout).named_parameters()} for s in range(2)]
    assert names[0] | names[1] == {n for n, _ in net.named_parameters()} and not names[0] & names[1]
    assert "wte.weight" in names[0] and "lm_head.weight" in names[1] and "h.3.ln_1.weight" in names[1]


def test_split_refuses_blocks_that_do_not_run_in_sequence():
    from dtorch.model.split import pipeline_reason

    class Parallel(models.HandGPT):  # every block reads the embedding, not the previous block
        def forward(self, idx):
            emb = self.wte(idx)
            return self.lm_head(sum(block(emb) for block in self.h))

    with torch.device("meta"):
        net = Parallel()
    reason = pipeline_reason(net, (torch.zeros(1, models.SEQ, dtype=torch.long),))
    assert "block 'h.1' does not take the output of block 'h.0'" in reason


def test_a_tie_is_cut_by_name_and_refused_when_one_name_is_used_at_both_ends():
    from dtorch.model.split import pipeline_reason, split_layout

    tokens = (torch.zeros(1, models.SEQ, dtype=torch.long),)
    with torch.device("meta"):
        tied = models.hand_gpt_tied()
    layout = split_layout(tied, tokens)  # wte.weight is lm_head.weight: used by wte, then by lm_head
    assert "wte.weight" in layout.first and "lm_head.weight" in layout.last

    class ReusesEmbedding(models.HandGPT):  # the head multiplies by the embedding's own weight
        def forward(self, idx):
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)

    with torch.device("meta"):
        reuse = ReusesEmbedding()
    reason = pipeline_reason(reuse, tokens)
    assert "'wte.weight' is used both before the first block and after the last" in reason
    assert "tied input/output embeddings across pipeline stages" in reason


def test_a_raw_transformers_llama_can_be_cut_as_written():
    """RoPE's cos/sin, computed once before the blocks and viewed inside each, depend on no
    parameter: a view inside block 0 must not make them block 0's (nor a mask built with new_zeros
    from the embedding's output the embedding's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dtorch.model.split import split_layout

    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2))
    layout = split_layout(hf, (torch.zeros(1, models.SEQ, dtype=torch.long),))
    assert layout.block_path == "model.layers" and layout.first == ("model.embed_tokens.weight",)
    assert set(layout.last) == {"model.norm.weight", "lm_head.weight"}


def test_a_second_block_output_is_dropped_at_a_stage_boundary_only_when_nothing_reads_it():
    """A block that returns (hidden, a tensor of its own) (BLOOM returns its attention probabilities)
    is cut when the model reads only the hidden states; a model that keeps the second tensor (as
    output_attentions=True would) is refused, naming it."""
    from dtorch.model.split import pipeline_reason, split_layout

    tokens = (torch.zeros(1, models.SEQ, dtype=torch.long),)

    class Pair(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            y = self.block(x)
            return y, y.mean(-1)  # a second tensor nothing needs for the next block

    class Drops(models.HandGPT):
        def __init__(self, keep: bool = False):
            super().__init__()
            self.h = torch.nn.ModuleList(Pair(b) for b in self.h)
            self.keep = keep

        def forward(self, idx):
            x, kept = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)), []
            for block in self.h:
                x, extra = block(x)
                kept.append(extra)
            logits = self.lm_head(self.ln_f(x))
            return logits + torch.stack(kept).sum() if self.keep else logits

    with torch.device("meta"):
        drops, keeps = Drops(), Drops(keep=True)
    assert split_layout(drops, tokens).block_output_arity == 2
    reason = pipeline_reason(keeps, tokens)
    assert "reads element 1 of block 'h.0''s output" in reason, reason
