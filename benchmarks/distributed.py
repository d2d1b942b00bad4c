"""Distributed noise: per-step time and per-rank state memory for world sizes 1, 2, 4 (gloo, CPU).

d = 1e7 float32 parameters as 10 tensors of 1e6 (so whole-tensor ownership can balance),
B = 4 hand-made float32-exact BLT buffers, one thread per rank. For each world size, ranks run
``sharded_mf_gaussian_noise`` (ownership="tensors"); we report the median step time on rank
0, the share of it spent in the one all-gather (timed by wrapping the collective), and each
rank's buffer bytes. The single-process engine (``mf_gaussian_noise``) is the floor.

Run: .venv/bin/python benchmarks/distributed.py [--steps 4] [--worlds 1,2,4]
     .venv/bin/python benchmarks/distributed.py --quick    # d = 1e5 (10 tensors of 1e4), world 2, 2 steps
On a machine with fewer cores than ranks, ranks share cores: the step time then measures
oversubscription, not scaling; the memory column is exact regardless.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D_LEAVES, LEAF = 10, 10**6
OMEGA = (0.25, 0.125, 0.0625, 0.03125)
ONE_MINUS_THETA = (0.5, 2.0**-6, 2.0**-12, 2.0**-20)


def mechanism(n_steps: int):
    from opake.dpftrl.strategies.blt import BLTParams
    from opake.dpftrl.strategies.strategy import mechanism_from_blt
    from opake.dpftrl.participation import Participation

    params = BLTParams(theta=1.0 - np.asarray(ONE_MINUS_THETA), omega=np.asarray(OMEGA))
    return mechanism_from_blt(params, Participation(n_steps))


def template(leaf: int = LEAF):
    return {f"layer{i:02d}": torch.zeros(leaf) for i in range(D_LEAVES)}


def worker(rank: int, world_size: int, init_file: str, steps: int, out_file: str, leaf: int = LEAF):
    torch.set_num_threads(1)
    from opake.dpftrl.noise import sharded_mf_gaussian_noise
    from opake.dpftrl.noise.distributed import gathered
    from opake.random import key
    from opake.types import clipped

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)
    gather_times = []
    original = gathered._gather

    def timed_gather(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        gather_times.append(time.perf_counter() - start)
        return result

    gathered._gather = timed_gather
    noise_fn, state = sharded_mf_gaussian_noise(template(leaf), mechanism(steps + 1), n_steps=steps + 1,
                                                noise_multiplier=1.0, key=key(0))
    grads = clipped(template(leaf), 1.0)
    _, state = noise_fn(grads, state)  # warm-up
    gather_times.clear()
    step_times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _, state = noise_fn(grads, state)
        step_times.append(time.perf_counter() - start)
    memory = torch.tensor([state.buffers.numel() * state.buffers.element_size()], dtype=torch.int64)
    memories = [torch.zeros_like(memory) for _ in range(world_size)]
    dist.all_gather(memories, memory)
    if rank == 0:
        torch.save({"step": statistics.median(step_times), "gather": statistics.median(gather_times) if gather_times else 0.0,
                    "memory": [int(m) for m in memories]}, out_file)
    dist.destroy_process_group()


def floor(steps: int, leaf: int = LEAF) -> float:
    from opake.dpftrl.noise import mf_gaussian_noise
    from opake.random import key
    from opake.types import clipped

    torch.set_num_threads(1)
    noise_fn, state = mf_gaussian_noise(template(leaf), mechanism(steps + 1), n_steps=steps + 1,
                                        noise_multiplier=1.0, key=key(0))
    grads = clipped(template(leaf), 1.0)
    _, state = noise_fn(grads, state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, state = noise_fn(grads, state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; quick 2)")
    parser.add_argument("--worlds", default=None, help="world sizes (default 1,2,4; quick 2)")
    parser.add_argument("--quick", action="store_true", help="d = 1e5, world 2, 2 steps (seconds)")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 4)
    args.worlds = args.worlds or ("2" if args.quick else "1,2,4")
    leaf = LEAF // 100 if args.quick else LEAF
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    single = floor(args.steps, leaf)
    d, b = D_LEAVES * leaf, len(OMEGA)
    print(f"d = {d:.0e} float32, B = {b}, cores = {os.cpu_count()}, steps timed = {args.steps} (median)")
    print(f"single-process engine (floor): {single * 1e3:8.1f} ms/step, state {b * d * 4 / 2**20:7.1f} MiB")
    print(f"{'world':>5} {'ms/step':>9} {'x floor':>8} {'gather ms':>10} {'gather %':>9} "
          f"{'state MiB/rank (max)':>21} {'B*d*4/W MiB':>12}")
    with tempfile.TemporaryDirectory() as folder:
        for world_size in (int(w) for w in args.worlds.split(",")):
            out = os.path.join(folder, f"world{world_size}.pt")
            mp.spawn(worker, args=(world_size, os.path.join(folder, f"init{world_size}"), args.steps, out, leaf),
                     nprocs=world_size)
            result = torch.load(out)
            print(f"{world_size:>5} {result['step'] * 1e3:>9.1f} {result['step'] / single:>8.2f} "
                  f"{result['gather'] * 1e3:>10.1f} {100 * result['gather'] / result['step']:>8.1f}% "
                  f"{max(result['memory']) / 2**20:>21.1f} {b * d * 4 / world_size / 2**20:>12.1f}")


if __name__ == "__main__":
    main()
