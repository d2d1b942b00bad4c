"""Throughput and peak memory of the private training step against the non-private one.

For each model, in one process and interleaved (best of ``--repeats``), times one training step
``zero_grad(); loss.backward(); step()``:

- non-private: the plain model and optimizer (the floor);
- opake: the same model after ``opake.torch.make_private`` (per-example clipping in backward,
  correlated BLT noise in ``step``), on batches of the same size;
- Opacus (DP-SGD, ghost clipping where it has it), when a peer environment is installed at
  ``../peer-opacus`` (``python3 -m venv ../peer-opacus && ../peer-opacus/bin/pip install
  torch==2.13.0 opacus``): the same models through ``benchmarks/peers/opacus_step.py`` in that
  interpreter, never imported here.

It prints the DP/non-private throughput ratio (wall clock, and from process CPU time; targets
of issue 38: >= 0.8) and the peak of torch's live allocations during one step (<= 1.1x
non-private; issue 13's were 0.6 and 1.5x).

Models: the 2-conv CNN of issue 13 (28x28 inputs, 10 classes) and a small transformer (2
layers, d_model 128, 4 heads built from Linear layers, sequence 64, vocabulary 1000).

Batches: a private step releases only the plan's batches (``UnplannedBatchError`` otherwise), so
every step takes the next batch of ``run.run_data_loader()`` (balls in bins: sizes vary around
the batch size), and the non-private step of the same pair takes that same batch. Times are per
example times the nominal batch size (best of ``--repeats``), so both sides are measured on the
same examples and batch-size noise cancels; the memory peaks are of one step each on a planned
batch (``--quick``: batch 8 and 16, a 1-layer transformer of width 32 and sequence 16, 2 repeats,
no peer).
``--profile`` breaks both steps down by stage instead (forward, backward with the per-example
norms and clipped sums, noise, optimizer), each against its floor (``finetune_step.stage_profile``),
at the first batch size (``--batch``).
The models and data are ``lib/step_models.py``'s, which the peer imports too (it imports nothing of
opake's); a peer that fails prints its error under the table and the script exits 1.

    python benchmarks/training_step.py             # both models, batch 64 (time) and 256 (memory)
    python benchmarks/training_step.py --quick
    python benchmarks/training_step.py --profile [--batch 256]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_step import WARMUP, stage_profile  # noqa: E402
from noise_engine import _peak_allocated_bytes  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from step_models import SIZES, data as _data, loss as _loss, model as _model  # noqa: E402

from opake.dpftrl.noise import blt_strategy  # noqa: E402

ROOT = Path(__file__).resolve().parent


def _interpreter(variable: str, default: Path) -> Path:
    """The peer's python: ``$variable`` (its virtual environment, or its interpreter) or ``default``."""
    path = Path(os.environ.get(variable) or default)
    return path / "bin" / "python" if path.is_dir() else path


OPACUS = (_interpreter("OPAKE_PEER_OPACUS", ROOT.parent.parent / "peer-opacus"), ROOT / "peers" / "opacus_step.py")


class _PlannedPair:
    """The private run and a non-private copy of the same model; ``private_step`` takes the plan's
    next batch, ``plain_step`` the batch the private step took last (the same examples)."""

    def __init__(self, name: str, batch: int, steps: int, size: dict):
        from opake.random import key
        from opake.torch import make_private

        self.name, self.nominal = name, batch
        plain_model, model = _model(name, size), _model(name, size)
        self.plain_model, self.plain_optimizer = plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.01)
        dataset = _data(name, batch * 4, size)
        private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), dataset=dataset,
                               batch_size=batch, epochs=max(1, math.ceil(steps / 4)) + 1, noise_multiplier=1.0,
                               target_delta=1e-5, max_grad_norm=1.0, strategy=blt_strategy(), key=key(0))
        self.private, self.model, self.optimizer = private, private.module, private.optimizer
        self.batches = iter(private.run_data_loader())
        self.batch = None

    def private_step(self) -> int:
        self.batch = next(self.batches)
        x, y = self.batch
        self.optimizer.zero_grad()
        if len(y):  # a planned batch can be empty: its step releases noise only
            _loss(self.name, self.model, x, y).backward()
        self.optimizer.step()
        return len(y)

    def plain_step(self) -> int:
        x, y = self.batch
        self.plain_optimizer.zero_grad()
        if len(y):
            _loss(self.name, self.plain_model, x, y).backward()
        self.plain_optimizer.step()
        return len(y)


def _best_alternating(pair: _PlannedPair, repeats: int) -> tuple[float, float, float, float]:
    """Best time per example times the nominal batch size of each side (plain, private), the
    private step taking a planned batch and the plain step the same batch right after, so that a
    burst of load elsewhere on the machine slows both sides of a ratio rather than one; with the
    ratio of the two sides' best process CPU times (less moved by other load) and the median of
    the per-batch wall ratios."""
    pair.private_step()  # warm-up (the private run's first step also checks the hooks' coverage)
    pair.plain_step()
    best, best_cpu, ratios = [math.inf, math.inf], [math.inf, math.inf], []
    for _ in range(repeats):
        wall = [0.0, 0.0]
        for index, step in enumerate((pair.private_step, pair.plain_step)):
            start, start_cpu = time.perf_counter(), time.process_time()
            examples = step()
            wall[index], cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if examples:
                best[index] = min(best[index], wall[index] / examples * pair.nominal)
                best_cpu[index] = min(best_cpu[index], cpu / examples * pair.nominal)
        if examples:
            ratios.append(wall[1] / wall[0])
    return best[1], best[0], best_cpu[1] / best_cpu[0], statistics.median(ratios)


class PeerFailed(RuntimeError):
    """The peer's script failed in its own environment: the row says so (never a silent "-")."""


def _opacus(name: str, batch: int, repeats: int, quick: bool):
    """(seconds, peak bytes) of Opacus' step in its own interpreter; None when no peer is installed;
    ``PeerFailed`` with the peer's last error line when it fails."""
    python, script = OPACUS
    if not python.exists():
        return None
    command = [str(python), str(script), name, str(batch), str(repeats)] + (["--quick"] if quick else [])
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT.parent)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerFailed(f"{python} {script.name} {name} {batch}: exit {out.returncode}: {last}")
    seconds, peak = out.stdout.split()[-2:]
    return float(seconds), int(peak)


def _peer_text(name: str, batch: int, repeats: int, quick: bool, plain_s: float, failures: list) -> str:
    if quick:
        return f"{'not run (--quick)':>24}"
    try:
        peer = _opacus(name, batch, repeats, quick)
    except PeerFailed as error:
        failures.append(str(error))
        return f"{'FAILED':>9} (see below)"
    if peer is None:
        return f"{'not installed':>24}"
    return f"{peer[0] * 1e3:>9.1f} {plain_s / peer[0]:>6.2f} {peer[1] / 2**20:>7.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats, no peer (seconds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="each step by stage against its floor, instead")
    parser.add_argument("--batch", type=int, default=None, help="--profile's batch size (default: the first)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = SIZES[args.quick]
    repeats = size["repeats"]
    if args.profile:
        batch = args.batch or size["batches"][0]
        for name in ("cnn", "transformer"):
            pair = _PlannedPair(name, batch, 2 * WARMUP + repeats + 2, size)
            stage_profile(f"{name}, batch {batch}, threads {args.threads}", pair.private, pair.model,
                          pair.plain_model, pair.plain_optimizer, lambda model, xy, n=name: _loss(n, model, *xy),
                          iter(pair.batches), batch, repeats)
        return 0
    print(f"threads {args.threads}; best of {repeats} (time per example x batch, on the plan's batches); "
          f"peak = torch's live allocations during one step; load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':<12} {'batch':>5} | {'plain ms':>8} {'opake ms':>8} {'ratio':>6} {'CPU':>5} {'median':>6} | "
          f"{'plain MiB':>9} {'opake MiB':>9} {'ratio':>6} | {'opacus ms':>9} {'ratio':>6} {'MiB':>7}")
    failures = []
    for name in ("cnn", "transformer"):
        for batch in size["batches"]:
            pair = _PlannedPair(name, batch, repeats + 4, size)
            plain_s, private_s, cpu_ratio, median_ratio = _best_alternating(pair, repeats)
            private_peak = _peak_allocated_bytes(pair.private_step)
            plain_peak = _peak_allocated_bytes(pair.plain_step)  # the same batch
            peer_text = _peer_text(name, batch, repeats, args.quick, plain_s, failures)
            print(f"{name:<12} {batch:>5} | {plain_s * 1e3:>8.1f} {private_s * 1e3:>8.1f} "
                  f"{plain_s / private_s:>6.2f} {cpu_ratio:>5.2f} {median_ratio:>6.2f} | "
                  f"{plain_peak / 2**20:>9.1f} {private_peak / 2**20:>9.1f} "
                  f"{private_peak / plain_peak:>6.2f} | {peer_text}")
    print("ratio = non-private time / DP time (throughput ratio, wall clock; CPU: the same from process CPU "
          "time; median: of the per-batch wall ratios); targets (issue 38): throughput ratio >= 0.8, memory "
          "ratio <= 1.1")
    for failure in failures:
        print(f"peer failed: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
