"""Peer runner: one noise step of jax-privacy's streaming matrix-factorization privatizer, timed.

Run with the peer's own interpreter, e.g. ``/work/peer-jaxp/bin/python
benchmarks/peers/jaxp_noise.py --elements 1000000 --tensors 1 --omega 0.2,0.1
--one-minus-theta 0.5,0.01``. The BLT is built in float32 from the given parameters (its
default is float64) and ``update`` is jitted with the noise state donated, so XLA may update
the buffers in place. Prints one JSON line: {"seconds": best step time} or {"error": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
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
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()
    try:
        import jax
        import jax.numpy as jnp
        from jax_privacy import noise_addition
        from jax_privacy.matrix_factorization import buffered_toeplitz

        omega = [float(v) for v in args.omega.split(",")]
        theta = [1.0 - float(v) for v in args.one_minus_theta.split(",")]
        blt = buffered_toeplitz.BufferedToeplitz.build(buf_decay=theta, output_scale=omega, dtype=jnp.float32)
        privatizer = noise_addition.matrix_factorization_privatizer(
            blt.inverse_as_streaming_matrix(), stddev=1.0, prng_key=jax.random.key(0)
        )
        per_tensor = args.elements // args.tensors
        sizes = [per_tensor] * args.tensors
        sizes[-1] += args.elements - per_tensor * args.tensors
        grads = {f"p{i:04d}": jnp.ones(size, dtype=jnp.float32) for i, size in enumerate(sizes)}
        state = privatizer.init(grads)
        update = jax.jit(privatizer.update, donate_argnums=(1,))
        out, state = update(grads, state)  # compile + warm-up
        jax.block_until_ready((out, state))
        del out
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            out, state = update(grads, state)
            jax.block_until_ready((out, state))
            best = min(best, time.perf_counter() - start)
            del out
        print(json.dumps({"seconds": best, "repeats": args.repeats}))
    except Exception as exc:  # report, do not crash the benchmark that called us
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
