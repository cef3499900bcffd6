"""The global sampler: a pure function of the step, the same sequence at any data-parallel size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtorch.errors import ConfigError
from dtorch.train.sampler import GlobalSampler


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    global_batch=st.integers(1, 48),
    seed=st.integers(0, 2**31),
    step=st.integers(0, 500),
    data=st.data(),
)
def test_union_over_dp_ranks_is_the_global_batch_in_order(num_samples, global_batch, seed, step, data):
    s = GlobalSampler(num_samples, global_batch, seed)
    dp = data.draw(st.sampled_from(_divisors(global_batch)))
    joined = [i for r in range(dp) for i in s.local_indices(step, r, dp)]
    assert joined == s.global_indices(step)
    assert len(joined) == global_batch
    assert all(0 <= i < num_samples for i in joined)


@settings(max_examples=40, deadline=None)
@given(num_samples=st.integers(1, 100), seed=st.integers(0, 1000), steps=st.integers(1, 30))
def test_resume_at_another_dp_size_consumes_the_same_sequence(num_samples, seed, steps):
    gb = 12
    uninterrupted = [GlobalSampler(num_samples, gb, seed).global_indices(t) for t in range(steps)]
    # Run at dp=4 until a "crash" half way, resume at dp=3 from a fresh sampler (state = the step).
    crash = steps // 2
    a, b = GlobalSampler(num_samples, gb, seed), GlobalSampler(num_samples, gb, seed)
    seen = [[i for r in range(4) for i in a.local_indices(t, r, 4)] for t in range(crash)]
    seen += [[i for r in range(3) for i in b.local_indices(t, r, 3)] for t in range(crash, steps)]
    assert seen == uninterrupted


@settings(max_examples=30, deadline=None)
@given(num_samples=st.integers(1, 60), global_batch=st.integers(1, 25), seed=st.integers(0, 99))
def test_every_epoch_is_a_permutation_without_repeats(num_samples, global_batch, seed):
    s = GlobalSampler(num_samples, global_batch, seed)
    stream = [i for t in range((3 * num_samples) // global_batch + 1) for i in s.global_indices(t)]
    for e in range(len(stream) // num_samples):
        assert sorted(stream[e * num_samples : (e + 1) * num_samples]) == list(range(num_samples))


def test_epochs_are_reshuffled_and_seeds_differ():
    s = GlobalSampler(1000, 100, seed=1)
    assert s.permutation(0).tolist() != s.permutation(1).tolist()
    assert GlobalSampler(1000, 100, seed=2).global_indices(0) != s.global_indices(0)
    assert s.epoch_of(9) == 0 and s.epoch_of(10) == 1


def test_dp_size_that_does_not_divide_the_global_batch_names_the_fix():
    with pytest.raises(ConfigError) as e:
        GlobalSampler(100, 12, 0).local_indices(0, 0, 5)
    assert e.value.field == "dp_size" and "[1, 2, 3, 4, 6, 12]" in e.value.fix


def test_resuming_with_another_dataset_size_is_refused():
    s = GlobalSampler(100, 8, 3)
    GlobalSampler(100, 16, 3).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError):
        GlobalSampler(101, 8, 3).load_state_dict(s.state_dict())
