"""User-level sampling: units (users) in bins or Poisson groups, each serving all its examples.

Add/remove adjacency on units: one more user (appended with all its examples) moves no other
user, neither exactly (same key) nor in law (independent keys, chi-square as for examples).
Negative control: example-level bins with users of several examples break the per-user
participation bound the accountant would price.
"""

from collections import defaultdict

import numpy as np
import pytest
from scipy import stats

from opake.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, PrivacyUnits, UnitSampler
from opake.random import key

# user u owns examples with ids u: three users of 1-3 examples, interleaved as data usually are
IDS = ["ann", "bob", "ann", "cy", "bob", "ann", "dee", "cy"]


def _unit_steps(sampler, n_steps):
    """For every unit, the steps whose batch holds its examples; checks that a unit is served whole."""
    steps = defaultdict(list)
    for step in range(n_steps):
        rows, owners = sampler.batch(step).tolist(), sampler.units_of_batch(step).tolist()
        assert len(rows) == len(owners) and len(set(rows)) == len(rows)
        for unit in sorted(set(owners)):
            assert sorted(r for r, o in zip(rows, owners) if o == unit) == sampler.units.examples(unit).tolist()
            steps[unit].append(step)
    return steps


MAKERS = {
    "balls_in_bins": lambda units, k: UnitSampler(BallsInBinsSampler(units.num_units, 2, k), units),
    "cyclic_poisson": lambda units, k: UnitSampler(CyclicPoissonSampler(units.num_units, 2, 0.5, k), units),
}


def test_units_are_numbered_by_first_appearance():
    units = PrivacyUnits.from_ids(IDS)
    assert units.unit_of_example.tolist() == [0, 1, 0, 2, 1, 0, 3, 2]
    assert units.num_units == 4 and units.examples(0).tolist() == [0, 2, 5]
    assert PrivacyUnits.from_ids([[1], [2], (1,)]).unit_of_example.tolist() == [0, 1, 0]  # read by value
    with pytest.raises(TypeError, match="hashable"):
        PrivacyUnits.from_ids([{"user": 1}, {"user": 2}])
    with pytest.raises(ValueError, match="no gap"):
        PrivacyUnits(np.array([0, 2]))


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_every_unit_respects_the_unit_samplers_participation(name):
    units = PrivacyUnits.from_ids(IDS)
    sampler = MAKERS[name](units, key(1))
    participation = sampler.participation(6)
    for steps in _unit_steps(sampler, 6).values():
        assert len(steps) <= participation.max_participations
        assert all(b - a >= participation.min_sep for a, b in zip(steps, steps[1:]))
    assert sampler.expected_batch_size == sampler.unit_sampler.expected_batch_size


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_appended_user_leaves_every_other_users_steps_unchanged(name):
    before = _unit_steps(MAKERS[name](PrivacyUnits.from_ids(IDS), key(4)), 9)
    after = _unit_steps(MAKERS[name](PrivacyUnits.from_ids(IDS + ["eve", "eve"]), key(4)), 9)
    assert {unit: steps for unit, steps in after.items() if unit < 4} == dict(before)


def _pattern_counts(make, ids, n_steps, keys, seed):
    counts = defaultdict(int)
    root = key(77).fold_in(seed)
    for index in range(keys):
        steps = _unit_steps(make(PrivacyUnits.from_ids(ids), root.fold_in(index)), n_steps)
        counts[(tuple(steps.get(0, ())), steps.get(0, ()) == steps.get(1, ()))] += 1
    return counts


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_one_more_user_leaves_the_others_participation_distribution_unchanged(name):
    """Users 0 and 1 have the same joint participation law with N and with N + 1 users
    (independent keys). False failure: 1e-6."""
    small = _pattern_counts(MAKERS[name], IDS[:5], 4, 1500, "N")
    large = _pattern_counts(MAKERS[name], IDS[:5] + ["zed"], 4, 1500, "N+1")
    patterns = sorted(set(small) | set(large))
    table = np.array([[small[p] for p in patterns], [large[p] for p in patterns]])
    assert stats.chi2_contingency(table).pvalue > 1e-6


def test_negative_control_example_level_bins_break_the_user_bound():
    """Bins over examples (not users): a user with three examples lands in up to three bins, so it
    participates up to three times an epoch, not once as user-level accounting would price."""
    units = PrivacyUnits.from_ids(IDS)
    worst = 0
    for index in range(50):
        sampler = BallsInBinsSampler(len(IDS), 3, key(5).fold_in(index))
        served = [step for step in range(3) if set(sampler.batch(step).tolist()) & set(units.examples(0).tolist())]
        worst = max(worst, len(served))
    assert worst > 1       # more than the one participation per epoch of UnitSampler
