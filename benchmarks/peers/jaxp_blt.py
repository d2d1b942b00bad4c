"""Optimize one BLT with jax-privacy and print its figures as one JSON line.

Runs INSIDE the jax-privacy peer environment (never imported by opake):

    JAX_ENABLE_X64=1 ../peer-jaxp/bin/python benchmarks/peers/jaxp_blt.py \
        N MIN_SEP MAX_PARTICIPATIONS|None ERROR MAX_BUFFERS

The loss is computed with the peer's own functions: its min-sep sensitivity of the materialized
Toeplitz coefficients of C, and its per-query errors from the coefficients of C^{-1} (prefix-sum
workload). Only the optimize call is timed.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_ENABLE_X64", "1")


def _int_or_none(text: str):
    return None if text.strip().lower() in ("none", "") else int(text)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    n, min_sep = int(argv[0]), int(argv[1])
    max_participations = _int_or_none(argv[2])
    error, max_buffers = argv[3], int(argv[4])

    import jax
    import numpy as np
    from importlib.metadata import version
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

    jax.config.update("jax_enable_x64", True)

    start = time.perf_counter()
    blt = buffered_toeplitz.optimize(
        n=n, min_sep=min_sep, max_participations=max_participations,
        error=error, max_buffers=max_buffers,
    )
    jax.block_until_ready(blt.buf_decay)
    seconds = time.perf_counter() - start

    strategy_coefs = blt.toeplitz_coefs(n)
    noising_coefs = blt.inverse().toeplitz_coefs(n)
    sens2 = float(toeplitz.minsep_sensitivity_squared(
        strategy_coefs, min_sep=min_sep, max_participations=max_participations, n=n,
    ))
    errors = np.asarray(toeplitz.per_query_error(noising_coef=noising_coefs, n=n))
    max_error, mean_error = float(errors.max()), float(errors.mean())
    loss = sens2 * (max_error if error == "max" else mean_error)

    print(json.dumps({
        "n": n, "min_sep": min_sep, "max_participations": max_participations,
        "error": error, "max_buffers": max_buffers,
        "theta": [float(x) for x in np.asarray(blt.buf_decay, dtype=np.float64)],
        "omega": [float(x) for x in np.asarray(blt.output_scale, dtype=np.float64)],
        "num_buffers": int(np.asarray(blt.buf_decay).shape[0]),
        "sensitivity_squared": sens2,
        "max_error": max_error,
        "mean_error": mean_error,
        "loss": loss,
        "seconds": seconds,
        "jax_privacy_version": version("jax-privacy"),
        "jax_version": jax.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
