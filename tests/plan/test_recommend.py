"""Cluster sizing: tokens per step is chosen per cluster size within a bound, and the 405B example
sizes a 16k-GPU cluster at a realistic MFU."""

import pytest

from dtorch.errors import ConfigError
from dtorch.plan.profiles import get_profile
from dtorch.plan.recommend import default_max_batch_tokens, format_recommendation, recommend


def test_default_bound_follows_the_token_budget_within_published_batches():
    assert default_max_batch_tokens(15e12) == 2**24  # Llama 3 405B: 16M tokens per step
    assert default_max_batch_tokens(2e12) == 2**22  # Llama 2: 4M tokens per step
    assert default_max_batch_tokens(1e9) == 2**22
    assert default_max_batch_tokens(1e15) == 2**24


def test_tokens_per_step_grows_with_the_cluster_within_the_bound():
    prof = get_profile("llama3-8b", 4096)
    rec = recommend(prof, "h100", tokens=1e12, max_nodes=32, max_batch_tokens=8 * 2**20)
    steps = [o.tokens_per_step for o in rec.options if o.estimate is not None]
    assert len(steps) >= 4
    assert all(s <= 8 * 2**20 for s in steps)
    assert steps == sorted(steps) and steps[-1] > steps[0]
    # every option's batch is what its plan takes
    for o in rec.options:
        if o.plan is not None:
            assert o.tokens_per_step == o.plan.dp * o.plan.local_batch() * prof.seq_len


def test_a_tight_bound_makes_the_batch_the_limit_and_says_so():
    prof = get_profile("llama3-8b", 4096)
    rec = recommend(prof, "h100", tokens=1e12, max_nodes=16, max_batch_tokens=2**18)
    bound = [o for o in rec.options if o.batch_bound]
    assert bound, "64 sequences cannot keep 128 GPUs busy"
    assert any("limits scaling" in n for n in rec.notes)
    assert "batch-bound" in format_recommendation(rec)
    # a larger bound lifts per-GPU throughput where the small one was binding
    loose = recommend(prof, "h100", tokens=1e12, max_nodes=16, max_batch_tokens=2**22)
    big = max(bound, key=lambda o: o.gpus)
    same = next(o for o in loose.options if o.gpus == big.gpus)
    assert same.estimate.tokens_per_s_per_gpu > big.estimate.tokens_per_s_per_gpu


def test_fixed_global_batch_is_kept_for_every_size():
    prof = get_profile("llama3-8b", 4096)
    rec = recommend(prof, "h100", global_batch=256, tokens=1e11, max_nodes=4)
    assert {o.tokens_per_step for o in rec.options if o.plan} == {256 * 4096}


def test_405b_on_15t_tokens_in_60_days_fits_16k_h100s_at_llama3_like_mfu():
    prof = get_profile("llama3-405b", 4096)
    rec = recommend(prof, "h100", tokens=15e12, deadline_s=60 * 86400)
    c = rec.chosen
    assert c is not None and c.gpus <= 16384
    assert c.estimate.mfu >= 0.35
    assert c.tokens_per_step and c.tokens_per_step <= 2**24
    # sizes that cannot meet the deadline even at peak efficiency are ruled out without a search
    assert rec.searches <= 3
    assert "tokens per step" in format_recommendation(rec)


def test_bad_batch_bounds_are_refused():
    prof = get_profile("llama3-8b", 4096)
    with pytest.raises(ConfigError, match="global-batch"):
        recommend(prof, "h100", global_batch=256, max_batch_tokens=2**22, tokens=1e11)
    with pytest.raises(ConfigError, match="one sequence"):
        recommend(prof, "h100", max_batch_tokens=100, tokens=1e11)


def test_cli_bounds_the_batch_and_reports_tokens_per_step(capsys):
    import json

    from dtorch.cli import main

    rc = main(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--recommend", "--device-type", "h100",
               "--tokens", "100B", "--max-nodes", "4", "--max-batch-tokens", "2M", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_batch_tokens"] == 2**21 and doc["chosen_tokens_per_step"] <= 2**21
    assert all(o["tokens_per_step"] <= 2**21 for o in doc["options"] if o["plan"])
    assert main(["plan", "--model", "llama3-8b", "--recommend", "--device-type", "h100", "--tokens", "1T",
                 "--global-batch", "256", "--max-batch-tokens", "2M"]) == 2


def test_an_impossible_deadline_still_answers_with_the_fastest_size():
    prof = get_profile("llama3-405b", 4096)
    rec = recommend(prof, "h100", tokens=15e12, deadline_s=10 * 86400, max_nodes=256)
    assert rec.searches == 1 and rec.chosen is rec.options[-1] and rec.chosen.gpus == 2048
    assert "meets the deadline" in rec.reason and rec.chosen.time_to_train_s > 10 * 86400
