"""Independent reference: the BLT authors' implementation (jax-privacy), cached.

benchmarks/peer_cache/jax_privacy_blt.json holds, for each context, the parameters that
jax-privacy's optimizer returned and the sensitivity and errors that jax-privacy itself
computed for them (O(n) routes, its own code; see benchmarks/peers/jaxp_blt.py). Here opake's
closed forms must reproduce those numbers for the same parameters, and opake's optimizer must
do at least as well as the reference for the same context and buffer budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from opake.dpftrl.strategies import blt, blt_strategy
from opake.dpftrl.participation import Participation

CACHE = Path(__file__).resolve().parents[3] / "benchmarks" / "peer_cache" / "jax_privacy_blt.json"
CONTEXTS = json.loads(CACHE.read_text())["contexts"] if CACHE.exists() else {}
ENTRIES = [pytest.param(entry, id=name) for name, entry in CONTEXTS.items() if "theta" in entry]


@pytest.mark.parametrize("entry", ENTRIES)
def test_closed_forms_reproduce_the_reference_values(entry):
    params = blt.BLTParams(entry["theta"], entry["omega"])
    ctx = Participation(entry["n"], entry["min_sep"], entry["max_participations"])
    assert blt.minsep_sensitivity_squared(params, ctx) == pytest.approx(entry["sensitivity_squared"], rel=1e-12)
    # the reference sums n float64 terms; at n = 1e6 its own rounding is ~1e-8
    rel = 1e-12 * max(1.0, entry["n"] / 100.0)
    assert blt.max_error(params, entry["n"]) == pytest.approx(entry["max_error"], rel=rel)
    assert blt.mean_error(params, entry["n"]) == pytest.approx(entry["mean_error"], rel=rel)


@pytest.mark.parametrize("entry", ENTRIES)
def test_optimizer_is_no_worse_than_the_reference(entry):
    mech = blt_strategy(max_buffers=entry["max_buffers"], error=entry["error"]).resolve(
        entry["n"], entry["min_sep"], entry["max_participations"]
    )
    ours = mech.max_loss if entry["error"] == "max" else mech.mean_loss
    assert math.sqrt(ours) <= math.sqrt(entry["loss"]) * (1 + 1e-6)


def test_reference_cache_is_present():
    assert len(ENTRIES) >= 5, f"expected cached reference contexts in {CACHE}"
