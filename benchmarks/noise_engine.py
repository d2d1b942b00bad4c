"""Seconds per noise step of mf_gaussian_noise against a floor measured in the same run.

For each configuration (d parameters as one tensor or spread over 200 tensors, B buffers) a
fresh worker process builds the engine for a hand-made float32-exact BLT with B buffers (so the
benchmark does not depend on the optimizer) and times, interleaved, best of ``--repeats``:

- floor: ``torch.randn`` of d values into a preallocated tensor plus one fused read/write pass
  over a (B, d) buffer (``S.add_(z)``): the least any correlated-noise step must do;
- keyed floor ("keyed draws + BLT update"): what any step of *this* engine's contract must do
  at least, written as plainly as possible, with no checks, no pytree and no per-tensor output:
  the keyed draws (one ``BlockSampler.fill`` per noise block of the layout, into one
  preallocated d-vector: the noise is a pure function of key, step, parameter path and element
  index, so each block's generator is seeded from its own derivation; with 200 tensors that is
  200 derivations and 200 short ``normal_`` calls where the floor makes one long one), one BLT
  update of the (B, d) buffer by the engine's streaming inverse (a matrix-vector product and a
  broadcast multiply-add: two passes, where the floor's single ``add_`` is no BLT step), and
  ``gradient + scale * x`` on one flat float32 gradient (the step returns noised gradients),
  the last two cut into the same cache-sized stretches as the engine's (``columns_per_advance``;
  one stretch with several threads or on a GPU) and with the step's BLT scalars computed
  beforehand. The floor column above is kept as it was; this one says how far the engine is
  from its own unavoidable work, the per-tensor keyed draws included, and what is left is the
  engine's checks (structure, shapes, NaN/inf: one more pass over the gradients), its
  per-tensor outputs and adds, and its bookkeeping;
- opake: one ``noise_fn(clipped, state)`` call on float32 gradients.

The three are timed in turn in each repeat (``--clock wall``: ``time.perf_counter``, the
default; ``--clock cpu``: the thread's CPU time, which on a loaded machine leaves out the time
the process waits for a core), best of ``--repeats`` each; the ratios divide the bests.

It also reports the step's peak extra memory: the peak of torch's live allocations during one
step (from the profiler's record of allocations and releases), in units of one float32
d-vector; the returned output is part of it. It is measured while the caller still holds the
previous output, the case where the step must allocate; the timed steps drop their outputs,
as a training loop does, and on CPU the engine then writes into the last one again. When the peer environments exist, the same configuration runs
through ``benchmarks/peers/*.py`` in them: the PyPI opake-dpftrl 0.16.1 (/work/peer-opake) and
jax-privacy (/work/peer-jaxp), with the same BLT parameters; by default only for the
single-tensor configurations (``--peers all`` for all, ``--peers none`` for none).

Threads: by default every process uses one intra-op thread (``--threads 1``), because on a
small shared machine multi-threaded timings measure the scheduler more than the code; pass
``--threads 0`` to keep each library's default.

On a GPU (``--device cuda``) the same table is measured on the device: the floor is
``torch.randn`` on the device plus the same fused pass, every timing is bracketed by
``torch.cuda.synchronize()``, extra memory is the rise of ``torch.cuda.max_memory_allocated``
during one step, and the peers are not run (their environments are CPU-only).

    python benchmarks/noise_engine.py                  # d = 1e6 and 1e7, 1 and 200 tensors, B = 4, 8
    python benchmarks/noise_engine.py --sizes 1000000  # d = 1e6 only
    python benchmarks/noise_engine.py --quick          # d = 1e5, 1 and 20 tensors, B = 4, 3 repeats, no peers (seconds)
    python benchmarks/noise_engine.py --device cuda    # on a GPU

The peers' interpreters: $OPAKE_PEER_OPAKE and $OPAKE_PEER_JAXP (virtual environments), else
/work/peer-opake and /work/peer-jaxp; a peer that is not there is reported as not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _peer_python(variable: str, default: str) -> Path:
    return Path(os.environ.get(variable) or default) / "bin" / "python"


PEERS = {
    "opake-pypi": (_peer_python("OPAKE_PEER_OPAKE", "/work/peer-opake"), ROOT / "peers" / "opake_pypi_noise.py"),
    "jax-privacy": (_peer_python("OPAKE_PEER_JAXP", "/work/peer-jaxp"), ROOT / "peers" / "jaxp_noise.py"),
}


def blt_parameters(buffers: int):
    """Float32-exact BLT: omega_i = 2**-(i+2) (sum < 1/2), 1 - theta_i = 2**-(3i+1)."""
    omega = [2.0 ** -(i + 2) for i in range(buffers)]
    one_minus_theta = [2.0 ** -(3 * i + 1) for i in range(buffers)]
    return omega, one_minus_theta


def _peak_allocated_bytes(function) -> int:
    """Peak of torch's live allocations while ``function`` runs, from the profiler's ordered
    record of every allocation and release (torch's CPU allocator is invisible to tracemalloc,
    and the resident set also counts allocator caching and the kernel's page reclaim)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _peak_cuda_bytes(function) -> int:
    """Rise of the CUDA caching allocator's peak of live allocations while ``function`` runs."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    function()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def worker(elements: int, tensors: int, buffers: int, repeats: int, threads: int, device: str = "cpu",
           clock: str = "wall") -> dict:
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from opake.dpftrl.noise import mf_gaussian_noise
    from opake.dpftrl.noise.engine.correlated_noise import columns_per_advance
    from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler
    from opake.dpftrl.noise.engine.streaming import BufferedInverse
    from opake.dpftrl.strategies.strategy import Mechanism
    from opake.dpftrl.participation import Participation
    from opake.random import key
    from opake.types import clipped

    omega, one_minus_theta = blt_parameters(buffers)

    class FixedBLT:
        def resolve(self, n_steps, min_sep=1, max_participations=None):
            return Mechanism(
                recipe=self, participation=Participation(n_steps, min_sep, max_participations),
                theta=1.0 - np.array(one_minus_theta), omega=np.array(omega), sensitivity=1.0,
                max_loss=0.0, mean_loss=0.0,
            )

    per_tensor = elements // tensors
    sizes = [per_tensor] * tensors
    sizes[-1] += elements - per_tensor * tensors
    template = {f"p{i:04d}": torch.empty(size, device=device) for i, size in enumerate(sizes)}
    noise_fn, state = mf_gaussian_noise(template, FixedBLT(), n_steps=10_000, noise_multiplier=1.0, key=key(0))
    grads = clipped({name: torch.ones(t.shape, device=device) for name, t in template.items()}, 1.0)
    del template
    floor_normals = torch.empty(elements, device=device)
    floor_buffers = torch.zeros(buffers, elements, device=device)
    generator = torch.Generator(device=device).manual_seed(0)

    def floor():
        torch.randn(elements, generator=generator, out=floor_normals)
        floor_buffers.add_(floor_normals)

    # The keyed floor (module doc): the layout's keyed block draws into one d-vector, one BLT
    # update of the whole buffer, one flat gradient + scale * x.
    sampler = BlockSampler(key(0), torch.device(device))
    draws = []
    keyed_normals = torch.empty(elements, device=device)
    for slot in noise_fn.layout.leaves:
        for block in slot.blocks:
            begin = slot.offset + block * BLOCK_ELEMENTS
            stop = min(begin + BLOCK_ELEMENTS, slot.offset + slot.numel)
            draws.append((keyed_normals[begin:stop], slot.code, block))
    inverse = BufferedInverse(tuple(omega), tuple(one_minus_theta))
    step_coefficients = inverse.at_step(inverse.coefficients(torch.float32, torch.device(device)), 1)
    keyed_buffers = torch.zeros(buffers, elements, device=device)
    flat_gradient = torch.ones(elements, device=device)
    keyed_step = iter(range(1, 2**62))

    chunk = columns_per_advance(torch.device(device)) or elements
    stretches = list(zip(keyed_normals.split(chunk), keyed_buffers.split(chunk, 1), flat_gradient.split(chunk)))

    def keyed_floor():
        step = next(keyed_step)
        for view, code, block in draws:
            sampler.fill(view, step, code, block)
        for x, columns, gradient in stretches:  # cache-blocked as the engine is (one stretch if not)
            inverse.advance(x, columns, step_coefficients)
            torch.add(gradient, x, alpha=1.0, out=x)

    floor()
    keyed_floor()
    noisy, state = noise_fn(grads, state)  # warm-up
    del noisy
    now = time.thread_time if clock == "cpu" else time.perf_counter
    best_floor = best_keyed = best_engine = float("inf")
    for _ in range(repeats):
        sync()
        start = now()
        floor()
        sync()
        best_floor = min(best_floor, now() - start)
        start = now()
        keyed_floor()
        sync()
        best_keyed = min(best_keyed, now() - start)
        start = now()
        noisy, state = noise_fn(grads, state)
        sync()
        best_engine = min(best_engine, now() - start)
        del noisy
    # Memory is measured while the previous output is still held, so the step must allocate its
    # output (the timed loop drops each output, and on CPU the engine then reuses it).
    held, state = noise_fn(grads, state)
    kept = []
    measure = _peak_cuda_bytes if cuda else _peak_allocated_bytes
    extra = measure(lambda: kept.append(noise_fn(grads, state))) / (4 * elements)
    del held
    return {"floor": best_floor, "keyed": best_keyed, "engine": best_engine, "extra_vectors": extra}


def run_worker(args, elements, tensors, buffers) -> dict:
    if args.quick:  # a smoke test: in this process (the real runs each take a fresh one, for clean memory peaks)
        return worker(elements, tensors, buffers, repeats=args.repeats, threads=args.threads, device=args.device,
                      clock=args.clock)
    command = [sys.executable, __file__, "--worker", str(elements), str(tensors), str(buffers),
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--device", args.device,
               "--clock", args.clock]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if completed.returncode != 0:
        raise RuntimeError(f"worker failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run_peer(name, args, elements, tensors, buffers):
    python, script = PEERS[name]
    if not python.exists():
        return None, "peer not installed"
    omega, one_minus_theta = blt_parameters(buffers)
    command = [str(python), str(script), "--elements", str(elements), "--tensors", str(tensors),
               "--omega", ",".join(map(repr, omega)), "--one-minus-theta", ",".join(map(repr, one_minus_theta)),
               "--repeats", str(args.peer_repeats), "--threads", str(args.threads)]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
        result = json.loads(completed.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        return None, f"failed ({type(exc).__name__})"
    if "error" in result:
        return None, result["error"][:60]
    return result["seconds"], ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="d = 1e5 as 1 and 20 tensors, B = 4, 3 repeats, no peers: a smoke test (seconds)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="d values (default 1e6 1e7)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per configuration (default 9, --quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: library default)")
    parser.add_argument("--peers", choices=("none", "single", "all"), default="single",
                        help="run the peers for single-tensor configurations (default), all, or none; "
                             "jax-privacy compiles 200-tensor models for about a minute")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda; peers run on CPU only")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time with the wall clock (default) or the thread's CPU time")
    parser.add_argument("--worker", nargs=3, type=int, metavar=("D", "TENSORS", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.quick else 9)
    args.peer_repeats = 3
    if args.worker:
        print(json.dumps(worker(*args.worker, repeats=args.repeats, threads=args.threads, device=args.device,
                                clock=args.clock)))
        return

    sizes = args.sizes or ([10**5] if args.quick else [10**6, 10**7])
    tensor_counts, buffer_counts = ((1, 20), (4,)) if args.quick else ((1, 200), (4, 8))
    peers = [] if args.peers == "none" or args.quick or args.device != "cpu" else list(PEERS)
    header = (f"{'d':>9} {'tensors':>7} {'B':>2} | {'floor ms':>9} {'opake ms':>9} {'ratio':>6} {'keyed ms':>9} "
              f"{'/keyed':>6} {'extra mem':>9}")
    for name in peers:
        header += f" | {name + ' ms':>16} {'ours/peer':>9}"
    print(f"device: {args.device}; threads per process: {args.threads or 'library default'}; "
          f"best of {args.repeats} steps ({args.clock} clock); load average {os.getloadavg()[0]:.1f}")
    print("ratio: opake / floor (randn + one pass over the buffers); /keyed: opake / keyed floor "
          "(keyed draws + BLT update + gradient add)")
    print("extra mem: peak torch allocations during a step, in float32 d-vectors (target <= 1)")
    print(header)
    print("-" * len(header))
    notes = set()
    for elements in sizes:
        for tensors in tensor_counts:
            for buffers in buffer_counts:
                result = run_worker(args, elements, tensors, buffers)
                ratio = result["engine"] / result["floor"]
                keyed_ratio = result["engine"] / result["keyed"]
                line = (f"{elements:>9.0e} {tensors:>7} {buffers:>2} | {1e3 * result['floor']:>9.2f} "
                        f"{1e3 * result['engine']:>9.2f} {ratio:>6.2f} {1e3 * result['keyed']:>9.2f} "
                        f"{keyed_ratio:>6.2f} {result['extra_vectors']:>9.2f}")
                for name in peers:
                    if args.peers == "single" and tensors != 1:
                        line += f" | {'(--peers all)':>16} {'':>9}"
                        continue
                    seconds, note = run_peer(name, args, elements, tensors, buffers)
                    if seconds is None:
                        notes.add(f"{name}: {note}")
                        line += f" | {'-':>16} {'-':>9}"
                    else:
                        line += f" | {1e3 * seconds:>16.1f} {result['engine'] / seconds:>9.2f}"
                print(line, flush=True)
    for note in sorted(notes):
        print(note)


if __name__ == "__main__":
    main()
