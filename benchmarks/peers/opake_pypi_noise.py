"""Peer runner: one noise step of the PyPI opake-dpftrl package (0.16.1), timed.

Run with the peer's own interpreter (its package name collides with ours), e.g.
``/work/peer-opake/bin/python benchmarks/peers/opake_pypi_noise.py --elements 1000000 --tensors 1
--omega 0.2,0.1 --one-minus-theta 0.5,0.01``. It uses the BLT parameters given on the command
line instead of running the peer's optimizer, so both libraries stream the same mechanism.
Prints one JSON line: {"seconds": best step time, "repeats": ...} or {"error": ...}.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--omega", required=True)
    parser.add_argument("--one-minus-theta", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from opake.api.dpftrl.noise import _blt as peer_blt
        from opake.api.dpftrl.noise._blt_math import BufferedToeplitz
        from opake.dpftrl.noise import blt_strategy, mf_gaussian_noise
        from opake.random import key
        from opake.types import clipped

        omega = torch.tensor([float(v) for v in args.omega.split(",")], dtype=torch.float64)
        theta = 1.0 - torch.tensor([float(v) for v in args.one_minus_theta.split(",")], dtype=torch.float64)
        fixed = BufferedToeplitz(buf_decay=theta, output_scale=omega)
        # Same mechanism as opake's benchmark: bypass the peer's optimizer (minutes per call).
        peer_blt._blt_optimize_cached = lambda *unused, **unused_kw: fixed

        per_tensor = args.elements // args.tensors
        sizes = [per_tensor] * args.tensors
        sizes[-1] += args.elements - per_tensor * args.tensors
        template = {f"p{i:04d}": torch.zeros(size) for i, size in enumerate(sizes)}
        grads = clipped({name: torch.ones_like(t) for name, t in template.items()}, max_norm=1.0)
        noise_fn, state = mf_gaussian_noise(
            template, blt_strategy(max_buffers=len(omega)), n_steps=10_000, noise_multiplier=1.0, key=key(0),
        )
        out, state = noise_fn(grads, state)  # warm-up
        del out
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            out, state = noise_fn(grads, state)
            best = min(best, time.perf_counter() - start)
            del out
        print(json.dumps({"seconds": best, "repeats": args.repeats}))
    except Exception as exc:  # report, do not crash the benchmark that called us
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
