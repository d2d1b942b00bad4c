"""Samplers: the stated participation holds for every generated schedule, balls-in-bins and
cyclic structure, Poisson inclusion rate, add/remove neighbours (one example more moves no other
example, exactly and in distribution, with the old fixed-size sampler as the negative control),
determinism, agreement with the accountant."""

import dataclasses
import math
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from opake.dpftrl.accounting import balls_in_bins, mf_gaussian
from opake.dpftrl.noise import identity_strategy
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, collate_allowing_empty
from opake.dpftrl.sampling import _uniform_below
from end_to_end_support import LegacyFixedSizeSampler
from opake.random import key


def _appearances(sampler, n_steps):
    """For every example, the steps whose batch holds it (read from the batches only)."""
    steps = defaultdict(list)
    for step in range(n_steps):
        batch = sampler.batch(step)
        assert batch.dtype == torch.int64 and batch.dim() == 1
        values = batch.tolist()
        assert values == sorted(set(values)), "indices must be sorted and distinct"
        assert all(0 <= index < sampler.num_examples for index in values)
        for index in values:
            steps[index].append(step)
    return steps


def _assert_respects(appearances, participation: Participation):
    for index, steps in appearances.items():
        assert len(steps) <= participation.max_participations, (index, steps)
        gaps = np.diff(steps)
        assert (gaps >= participation.min_sep).all(), (index, steps)


# --- the guarantee, for every generated schedule ------------------------------------------------


@given(num_examples=st.integers(1, 40), seed=st.integers(0, 2**32), data=st.data())
def test_balls_in_bins_schedule_respects_its_participation(num_examples, seed, data):
    num_bins = data.draw(st.integers(1, num_examples))
    n_steps = data.draw(st.integers(num_bins, 4 * num_bins + 3))
    sampler = BallsInBinsSampler(num_examples, num_bins, key(seed))
    participation = sampler.participation(n_steps)
    assert participation == Participation(n_steps, num_bins, math.ceil(n_steps / num_bins))
    appearances = _appearances(sampler, n_steps)
    _assert_respects(appearances, participation)
    # Every example is in exactly one bin: over one cycle the batches partition the examples.
    cycle = [sampler.batch(step).tolist() for step in range(num_bins)]
    assert sorted(index for batch in cycle for index in batch) == list(range(num_examples))
    # Bins are served cyclically: an example appears at every step of its residue class.
    for index, steps in appearances.items():
        assert steps == list(range(steps[0], n_steps, num_bins))


@given(num_examples=st.integers(1, 40), seed=st.integers(0, 2**32), data=st.data())
def test_cyclic_poisson_schedule_respects_its_participation(num_examples, seed, data):
    num_groups = data.draw(st.integers(1, num_examples))
    sample_rate = data.draw(st.sampled_from([0.05, 0.5, 0.9, 1.0]))
    n_steps = data.draw(st.integers(num_groups, 4 * num_groups + 3))
    sampler = CyclicPoissonSampler(num_examples, num_groups, sample_rate, key(seed))
    participation = sampler.participation(n_steps)
    assert participation == Participation(n_steps, num_groups, math.ceil(n_steps / num_groups))
    _assert_respects(_appearances(sampler, n_steps), participation)
    groups = [sampler.group(step).tolist() for step in range(num_groups)]
    assert sorted(index for group in groups for index in group) == list(range(num_examples))
    for step in range(n_steps):
        assert set(sampler.batch(step).tolist()) <= set(groups[step % num_groups])
    if sample_rate == 1.0:
        assert all(sampler.batch(step).tolist() == groups[step % num_groups] for step in range(n_steps))


# --- structure and statistics ------------------------------------------------------------------


def test_cyclic_poisson_inclusion_rate():
    # 400 steps over groups of 500: T = 200_000 Bernoulli(q) draws. Hoeffding:
    # P(|rate - q| >= eps) <= 2 exp(-2 T eps^2) = 1e-7 for eps below (false-failure < 1e-6).
    num_examples, num_groups, rate, n_steps = 2000, 4, 0.3, 400
    sampler = CyclicPoissonSampler(num_examples, num_groups, rate, key(7))
    trials = included = 0
    for step in range(n_steps):
        trials += len(sampler.group(step))
        included += len(sampler.batch(step))
    eps = math.sqrt(math.log(2 / 1e-7) / (2 * trials))
    assert trials == 200_000
    assert abs(included / trials - rate) < eps
    assert sampler.expected_batch_size == pytest.approx(150.0)


def test_balls_in_bins_assignment_is_uniform():
    # 20_000 examples in 4 bins; each bin's share is an average of 20_000 indicators, so by
    # Hoeffding and a union bound over 4 bins the false-failure probability is < 1e-7.
    sampler = BallsInBinsSampler(20_000, 4, key(11))
    sizes = [len(sampler.batch(step)) for step in range(4)]
    eps = math.sqrt(math.log(2 * 4 / 1e-7) / (2 * 20_000))
    assert sum(sizes) == 20_000
    assert all(abs(size / 20_000 - 0.25) < eps for size in sizes)
    assert sampler.expected_batch_size == 5000.0


def test_balls_in_bins_follows_the_documented_derivation():
    # Bins are little-endian 64-bit words of key.derive_bytes(domain, (name, b, chunk)) mod b;
    # with b a power of two no word is rejected, so this reconstructs the assignment directly.
    # The number of examples takes no part in the derivation (example i's bin depends on i only).
    num_examples, num_bins, seed = 50, 8, 5
    words = np.frombuffer(
        key(seed).derive_bytes("opake.dpftrl.sampling", ("balls_in_bins", num_bins, 0), 8 * num_examples),
        dtype="<u8",
    )
    bins = words % num_bins
    sampler = BallsInBinsSampler(num_examples, num_bins, key(seed))
    for step in range(num_bins):
        assert sampler.batch(step).tolist() == np.flatnonzero(bins == step).tolist()


def test_uniform_below_rejection_path():
    # bound = 2**63 + 1: about half of all 64-bit words are rejected and redrawn.
    bound = 2**63 + 1
    values = _uniform_below(key(1), ("test",), 4000, bound)
    assert values.dtype == np.int64 and values.min() >= 0 and (values < bound).all()
    assert np.array_equal(values, _uniform_below(key(1), ("test",), 4000, bound))
    # Hoeffding on P(value < 2**62) ~ 1/2: false failure < 1e-7.
    eps = math.sqrt(math.log(2 / 1e-7) / (2 * 4000))
    assert abs((values < 2**62).mean() - 0.5) < eps


# --- add/remove neighbours: one example more moves no other example ------------------------------


def test_the_fixed_size_sampler_is_gone_with_the_reason():
    with pytest.raises(ImportError, match=r"BMinSepSampler was removed.*twice the sensitivity.*BallsInBinsSampler"):
        from opake.dpftrl.sampling import BMinSepSampler  # noqa: F401


@pytest.mark.parametrize("make", [
    lambda n, k: BallsInBinsSampler(n, 5, k),
    lambda n, k: CyclicPoissonSampler(n, 5, 0.4, k),
])
@pytest.mark.parametrize("num_examples", [5, 64, 1000])
def test_an_appended_example_leaves_every_other_examples_steps_unchanged(make, num_examples):
    """Coupling: with the same key, the run on N + 1 examples serves examples 0..N-1 at exactly
    the steps the run on N examples serves them; the new example only adds its own steps."""
    n_steps = 23
    before = _appearances(make(num_examples, key(9)), n_steps)
    after = _appearances(make(num_examples + 1, key(9)), n_steps)
    assert {index: steps for index, steps in after.items() if index < num_examples} == dict(before)


def _pattern_counts(make, num_examples: int, n_steps: int, keys: int, seed: str):
    """How often each (steps of example 0, is example 1 in the same batches) pattern occurs over
    ``keys`` independent keys: the joint participation of two fixed examples."""
    counts = defaultdict(int)
    root = key(2024).fold_in(seed)
    for index in range(keys):
        appearances = _appearances(make(num_examples, root.fold_in(index)), n_steps)
        counts[(tuple(appearances.get(0, ())), appearances.get(0, ()) == appearances.get(1, ()))] += 1
    return counts


def _homogeneity_p_value(make, num_examples: int, n_steps: int, keys: int = 3000) -> float:
    """Chi-square test that examples 0 and 1 have the same joint participation distribution in
    runs on N and on N + 1 examples (independent keys for the two)."""
    small = _pattern_counts(make, num_examples, n_steps, keys, "N")
    large = _pattern_counts(make, num_examples + 1, n_steps, keys, "N+1")
    patterns = sorted(set(small) | set(large))
    table = np.array([[small[p] for p in patterns], [large[p] for p in patterns]])
    if table.shape[1] == 1:
        return 1.0
    return stats.chi2_contingency(table).pvalue


@pytest.mark.parametrize("make", [
    lambda n, k: BallsInBinsSampler(n, 2, k),
    lambda n, k: CyclicPoissonSampler(n, 2, 0.5, k),
], ids=["balls_in_bins", "cyclic_poisson"])
def test_one_more_example_leaves_the_others_participation_distribution_unchanged(make):
    """Add/remove adjacency needs every other example's participation to have the same law in the
    neighbouring run. False failure: 1e-6 (the chi-square test's level)."""
    assert _homogeneity_p_value(make, num_examples=4, n_steps=4) > 1e-6


def test_negative_control_the_fixed_size_sampler_moves_other_examples():
    """Batches of exactly 2 from 4 examples: with a fifth, one random example is never used, so
    example 0 is left out with probability 1/5 instead of 0 (about 600 of 3000 keys); the test
    must see it (p-value far below 1e-6)."""
    p_value = _homogeneity_p_value(
        lambda n, k: LegacyFixedSizeSampler(n, batch_size=2, min_sep=2, key=k), num_examples=4, n_steps=4)
    assert p_value < 1e-12


# --- determinism --------------------------------------------------------------------------------

_SAMPLERS = [
    lambda k: BallsInBinsSampler(30, 4, k),
    lambda k: CyclicPoissonSampler(30, 3, 0.5, k),
]


@pytest.mark.parametrize("make", _SAMPLERS)
def test_same_key_same_batches_different_key_different_batches(make):
    first, second, other = make(key(3)), make(key(3)), make(key(4))
    assert first == second and first != other
    batches = [first.batch(step).tolist() for step in range(12)]
    assert batches == [second.batch(step).tolist() for step in range(12)]
    assert batches == [first.batch(step).tolist() for step in range(12)]  # batch() is pure
    assert batches != [other.batch(step).tolist() for step in range(12)]
    assert first.batch(13).tolist() == [b.tolist() for b in first.steps(14)][13]


def test_batches_are_identical_in_another_process():
    script = (
        "from opake.random import key\n"
        "from opake.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler\n"
        "samplers = [BallsInBinsSampler(30, 4, key(3)), CyclicPoissonSampler(30, 3, 0.5, key(3))]\n"
        "print([[s.batch(t).tolist() for t in range(6)] for s in samplers])\n"
    )
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    here = [[make(key(3)).batch(t).tolist() for t in range(6)] for make in _SAMPLERS]
    assert output.strip() == str(here)


@pytest.mark.parametrize("make", _SAMPLERS)
def test_samplers_are_immutable(make):
    sampler = make(key(0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampler.key = key(1)
    batch = sampler.batch(0)
    batch.fill_(-1)
    assert (sampler.batch(0) >= 0).all()


# --- agreement with the accountant --------------------------------------------------------------


@pytest.mark.parametrize("num_bins, n_steps", [(1, 3), (4, 10), (5, 5), (7, 30)])
def test_participation_matches_balls_in_bins_accounting(num_bins, n_steps):
    sampler = BallsInBinsSampler(40, num_bins, key(0))
    participation = sampler.participation(n_steps)
    for method in ("rigorous", "rdp"):
        process = balls_in_bins(mf_gaussian(1.0, identity_strategy()), num_bins=num_bins, n_steps=n_steps,
                                method=method)
        assert process.participation == participation
    rigorous = balls_in_bins(mf_gaussian(1.0, identity_strategy()), num_bins=num_bins, n_steps=n_steps,
                             method="rigorous")
    direct = mf_gaussian(1.0, identity_strategy(), **dataclasses.asdict(participation))
    assert direct.epsilon_at(1e-5) == rigorous.epsilon_at(1e-5)


@pytest.mark.parametrize(
    "sampler", [BallsInBinsSampler(40, 3, key(0)), CyclicPoissonSampler(40, 3, 0.2, key(0))]
)
def test_participation_is_accepted_by_mf_gaussian(sampler):
    participation = sampler.participation(20)
    process = mf_gaussian(1.0, identity_strategy(), **dataclasses.asdict(participation))
    assert process.participation == participation
    assert 0 < process.epsilon_at(1e-5) < math.inf


# --- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: BallsInBinsSampler(10, 2, 42), TypeError, r"key must be an opake.random.RngKey.*opake.random.key\(seed\)"),
        (lambda: CyclicPoissonSampler(10, 2, 0.5, np.random.default_rng(0)), TypeError, "RngKey"),
        (lambda: BallsInBinsSampler(0, 1, key(0)), ValueError, "num_examples must be >= 1"),
        (lambda: BallsInBinsSampler(10, 0, key(0)), ValueError, "num_bins must be >= 1"),
        (lambda: BallsInBinsSampler(10, 11, key(0)), ValueError, r"num_bins \(11\) must be <= num_examples \(10\)"),
        (lambda: BallsInBinsSampler(10.0, 2, key(0)), TypeError, "num_examples must be an integer"),
        (lambda: BallsInBinsSampler(10, True, key(0)), TypeError, "num_bins must be an integer"),
        (lambda: CyclicPoissonSampler(10, 11, 0.5, key(0)), ValueError, r"num_groups \(11\) must be <= num_examples"),
        (lambda: CyclicPoissonSampler(10, 2, 0.0, key(0)), ValueError, r"sample_rate must be in \(0, 1\]"),
        (lambda: CyclicPoissonSampler(10, 2, 1.5, key(0)), ValueError, r"sample_rate must be in \(0, 1\]"),
        (lambda: CyclicPoissonSampler(10, 2, float("nan"), key(0)), ValueError, "sample_rate must be in"),
        (lambda: CyclicPoissonSampler(10, 2, "0.5", key(0)), TypeError, "sample_rate must be a real number"),
    ],
)
def test_constructor_errors(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


@pytest.mark.parametrize("make", _SAMPLERS)
def test_step_and_horizon_errors(make):
    sampler = make(key(0))
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        sampler.participation(0)
    with pytest.raises(TypeError, match="n_steps must be an integer"):
        sampler.participation(10.0)
    with pytest.raises(ValueError, match=r"n_steps \(2\) must be >= min_sep \(\d\)"):
        sampler.participation(2)
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        sampler.steps(0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        sampler.batch(-1)
    with pytest.raises(TypeError, match="step must be an integer"):
        sampler.batch(1.0)


# --- torch.utils.data: the batches through a DataLoader ----------------------------------------


class _IndexedDataset(torch.utils.data.Dataset):
    """Example i is a dict holding i, so a batch tells which examples the loader served."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"index": index, "x": torch.full((2, 3), float(index))}


@pytest.mark.parametrize("make", _SAMPLERS)
def test_a_data_loader_serves_exactly_the_samplers_batches(make):
    sampler = make(key(5))
    loader = sampler.data_loader(_IndexedDataset(30), n_steps=12)
    assert len(loader) == 12
    served = [batch["index"].tolist() for batch in loader]
    assert served == [sampler.batch(step).tolist() for step in range(12)]
    assert served == [batch["index"].tolist() for batch in loader]  # a second epoch of the loader
    resumed = sampler.data_loader(_IndexedDataset(30), n_steps=12, start_step=7)
    assert [batch["index"].tolist() for batch in resumed] == served[7:]
    plain = torch.utils.data.DataLoader(_IndexedDataset(30), batch_sampler=sampler.batch_sampler(12),
                                        collate_fn=collate_allowing_empty({"index": 0, "x": torch.zeros(2, 3)}))
    assert [batch["index"].tolist() for batch in plain] == served


def test_an_empty_bin_is_collated_into_zero_length_tensors():
    # 3 examples in 3 bins: with this key bin 0 is empty (checked below), so step 0's batch is.
    sampler = BallsInBinsSampler(3, 3, key(1))
    empty_steps = [step for step in range(3) if sampler.batch(step).numel() == 0]
    assert empty_steps, "the key was chosen so that a bin is empty"
    dataset = torch.utils.data.TensorDataset(torch.randn(3, 4, 5), torch.arange(3))
    batches = list(sampler.data_loader(dataset, n_steps=3))
    for step in empty_steps:
        x, y = batches[step]
        assert x.shape == (0, 4, 5) and x.dtype == torch.float32 and y.shape == (0,) and y.dtype == torch.int64
    with pytest.raises(IndexError):  # why the collate exists: torch's own fails on an empty batch
        torch.utils.data.default_collate([])


def test_data_loader_refuses_what_would_change_the_priced_batches():
    sampler = BallsInBinsSampler(30, 4, key(0))
    with pytest.raises(ValueError, match=r"dataset has 31 examples.*num_examples=30"):
        sampler.data_loader(_IndexedDataset(31), n_steps=8)
    for option in ({"batch_size": 8}, {"shuffle": True}, {"drop_last": True}):
        with pytest.raises(TypeError, match=r"does not take.*participation the accountant priced"):
            sampler.data_loader(_IndexedDataset(30), n_steps=8, **option)
    with pytest.raises(ValueError, match=r"start_step \(9\) must be <= n_steps \(8\)"):
        sampler.batch_sampler(8, start_step=9)
    with pytest.raises(TypeError, match="collated leaves are all tensors"):
        collate_allowing_empty(("a string", 1))
