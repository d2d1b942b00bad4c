"""The demo runs end to end on the real path (clipping -> sampler -> noise -> SGD) and reports
privacy values that meet its budget."""

from __future__ import annotations

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

from opake.demo import DemoSettings, run_demo  # noqa: E402


def test_demo_small_run_meets_its_budget():
    settings = DemoSettings(epsilon=2.0, epochs=2, learning_rates=(0.1,))
    participation, results = run_demo(settings, progress_bar=False)
    assert participation.n_steps == 60 and participation.min_sep == 30
    assert participation.max_participations == 2
    names = [r.method for r in results]
    assert names == ["BLT", "DP-SGD", "non-private"]
    for r in results[:2]:
        assert r.epsilon <= 2.0 and r.noise_multiplier > 0
    assert results[2].epsilon is None
    for r in results:
        assert 0.0 <= r.test_accuracy <= 1.0
    # non-private training on digits learns something even in 60 steps
    assert results[2].test_accuracy > 0.5
