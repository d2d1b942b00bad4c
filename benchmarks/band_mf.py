"""Benchmark: resolving BandMF strategies (time, loss vs BLT and identity) and Poisson PLD accounting.

Run with opake's interpreter from the repository root:

    .venv/bin/python benchmarks/band_mf.py           # all contexts
    .venv/bin/python benchmarks/band_mf.py --quick   # tiny contexts (n = 200, 8 bands; 500 compositions), seconds

For each context the resolve caches are cleared and one cold
``band_mf_strategy(bands, error="max").resolve(...)`` is timed on one thread (target: bands up to
1000 at n = 10^4 under 10 s on one core). sqrt(max loss) is compared with the BLT of the same
context (``blt_strategy(max_buffers=10)``) and the identity (DP-SGD): ratios below 1 mean BandMF
is better. A second table times ``poisson(...)`` PLD accounting at the default grid (target:
10^4 compositions under 2 s). The tables are also written to benchmarks/out/band_mf.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits

from opake.dpftrl.accounting import mf_gaussian, poisson
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.strategies.band_mf import _resolve_band_mf
from opake.dpftrl.strategies.strategy import _resolve_blt

OUT = Path(__file__).resolve().parent / "out"

CONTEXTS = [  # (n_steps, min_sep, max_participations, bands)
    (1000, 1, 1, 100),
    (1000, 100, None, 100),
    (2000, 200, 5, 200),
    (10_000, 1, 1, 100),
    (10_000, 1, 1, 1000),
    (10_000, 1000, None, 1000),
    (10_000, 500, 5, 1000),
]
ACCOUNTING = [  # (strategy name, bands, noise_multiplier, sample_rate, n_steps)
    ("identity", 1, 1.0, 0.01, 10_000),
    ("BandMF", 10, 3.0, 0.01, 10_000),
    ("BandMF", 100, 5.0, 0.05, 10_000),
]
QUICK_CONTEXTS = [(200, 1, 1, 8), (200, 20, None, 8)]
QUICK_ACCOUNTING = [("identity", 1, 1.0, 0.05, 500), ("BandMF", 4, 3.0, 0.05, 500)]


def resolve_table(quick: bool) -> list[dict]:
    rows = []
    for n, b, k, bands in QUICK_CONTEXTS if quick else CONTEXTS:
        _resolve_band_mf.cache_clear()
        start = time.perf_counter()
        band = band_mf_strategy(bands).resolve(n, b, k)
        seconds = time.perf_counter() - start
        blt = blt_strategy(max_buffers=10).resolve(n, b, k)
        ident = identity_strategy().resolve(n, b, k)
        rows.append({
            "n_steps": n, "min_sep": b, "max_participations": k, "bands": bands, "seconds": seconds,
            "sqrt_loss": math.sqrt(band.max_loss), "vs_blt": math.sqrt(band.max_loss / blt.max_loss),
            "vs_identity": math.sqrt(band.max_loss / ident.max_loss), "blt_buffers": blt.num_buffers,
        })
        r = rows[-1]
        print(f"{n:>6} {b:>5} {str(k):>5} {bands:>5} {seconds:>8.2f} {r['sqrt_loss']:>10.4f} "
              f"{r['vs_blt']:>8.4f} {r['vs_identity']:>8.4f} {r['blt_buffers']:>4}", flush=True)
    return rows


def accounting_table(quick: bool = False) -> list[dict]:
    rows = []
    for name, bands, sigma, q, n in QUICK_ACCOUNTING if quick else ACCOUNTING:
        strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands)
        strategy.resolve(n, bands, math.ceil(n / bands))  # resolve outside the timing
        start = time.perf_counter()
        result = poisson(mf_gaussian(sigma, strategy), q, n)
        eps = result.epsilon_at(1e-5)
        seconds = time.perf_counter() - start
        rows.append({"strategy": name, "bands": bands, "noise_multiplier": sigma, "sample_rate": q, "n_steps": n,
                     "compositions": result.compositions, "epsilon": eps, "seconds": seconds})
        print(f"{name:>8} {bands:>5} {sigma:>5} {q:>6} {n:>6} {result.compositions:>6} {eps:>9.4f} {seconds:>7.2f}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny contexts (seconds): a smoke test of both tables")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        print("BandMF resolve (one thread; ratios are sqrt(max loss) over BLT / identity, < 1 is better)")
        print(f"{'n':>6} {'b':>5} {'k':>5} {'bands':>5} {'seconds':>8} {'sqrt_loss':>10} {'vs_BLT':>8} "
              f"{'vs_id':>8} {'B':>4}")
        resolve = resolve_table(args.quick)
        _resolve_blt.cache_clear()
        print("\npoisson PLD accounting (default grid 1e-4, delta = 1e-5)")
        print(f"{'strategy':>8} {'bands':>5} {'sigma':>5} {'q':>6} {'n':>6} {'comps':>6} {'epsilon':>9} {'seconds':>7}")
        accounting = accounting_table(args.quick)
    OUT.mkdir(exist_ok=True)
    tables = json.dumps({"resolve": resolve, "accounting": accounting}, indent=1)
    (OUT / ("band_mf_quick.json" if args.quick else "band_mf.json")).write_text(tables)


if __name__ == "__main__":
    main()
