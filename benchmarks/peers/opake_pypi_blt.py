"""Resolve one BLT with opake 0.16.1 from PyPI and print its figures as one JSON line.

Runs INSIDE the PyPI-opake peer environment (its package name collides with ours):

    ../peer-opake/bin/python benchmarks/peers/opake_pypi_blt.py \
        N MIN_SEP MAX_PARTICIPATIONS|None ERROR MAX_BUFFERS

Its recipe ``blt_strategy(max_buffers=...)`` has no ``resolve``: the L-BFGS optimization runs
lazily (and is cached) the first time a method such as ``coefficients(n_steps=..., min_sep=...,
max_participations=...)`` sees a context, so that first call is what is timed. The recipe
always optimizes the max error; ERROR must be "max". The loss is computed with the package's
own Toeplitz helpers (min-sep sensitivity of C, per-query errors from C^{-1}).
"""

from __future__ import annotations

import json
import sys
import time


def _int_or_none(text: str):
    return None if text.strip().lower() in ("none", "") else int(text)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    n, min_sep = int(argv[0]), int(argv[1])
    max_participations = _int_or_none(argv[2])
    error, max_buffers = argv[3], int(argv[4])
    if error != "max":
        print(json.dumps({"unsupported": "opake 0.16.1's blt_strategy optimizes max error only"}))
        return 0

    from importlib.metadata import version

    import torch
    from opake.api.dpftrl.noise import _blt_math, _toeplitz
    from opake.dpftrl.noise import blt_strategy

    torch.set_num_threads(1)
    ctx = dict(n_steps=n, min_sep=min_sep, max_participations=max_participations)
    strategy = blt_strategy(max_buffers=max_buffers)
    start = time.perf_counter()
    coefs = strategy.coefficients(**ctx)
    seconds = time.perf_counter() - start

    blt = strategy._blt(**ctx)  # cached by the call above
    coefs = coefs.to(torch.float64)
    noising = _blt_math.toeplitz_coefs(_blt_math.inverse(blt), n).to(torch.float64)
    sens2 = float(_toeplitz.minsep_sensitivity_squared(coefs, min_sep, max_participations, n=n))
    errors = _toeplitz.per_query_error(noising_coef=noising, n=n)
    max_error, mean_error = float(errors.max()), float(errors.mean())

    print(json.dumps({
        "n": n, "min_sep": min_sep, "max_participations": max_participations,
        "error": error, "max_buffers": max_buffers,
        "theta": [float(x) for x in blt.buf_decay.to(torch.float64)],
        "omega": [float(x) for x in blt.output_scale.to(torch.float64)],
        "num_buffers": int(blt.buf_decay.shape[0]),
        "sensitivity_squared": sens2,
        "max_error": max_error,
        "mean_error": mean_error,
        "loss": sens2 * max_error,
        "seconds": seconds,
        "opake_pypi_version": version("opake-dpftrl"),
        "torch_version": torch.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
