"""Does DP-AdamBC's noise correction help? AdamW against DPAdamW at the same epsilon.

    .venv/bin/python benchmarks/adam_noise_correction.py            # about 25 minutes, one core
    .venv/bin/python benchmarks/adam_noise_correction.py --quick    # seconds: one seed, one setting each,
                                                                    # 2 epochs, noise multiplier 3 (not calibrated)

The task of ``opake demo`` (src/opake/demo.py): scikit-learn's bundled digits, one fixed split
(1200 training, 300 validation, 297 test images), the 64-32-10 tanh network, batch 40, 20 epochs
(600 steps), epsilon 3 at delta 1e-5, clipping norm 1, every mechanism calibrated by its own
proven accountant. Two mechanisms: a BLT on balls in bins, unamplified (``make_private``'s BLT),
whose per-step noise variance grows with t, and DP-SGD with Poisson sampling (PLD), the setting
of the paper, whose variance is constant. Two optimizers through ``make_private``:
``torch.optim.AdamW`` as it is (``noise_correction=False``), the same AdamW as ``make_private``
steps it by default (its second moment corrected for the noise, floored at the noise's own
variance), and ``opake.torch.DPAdamW`` with a constant floor (the paper's form), no weight decay,
betas (0.9, 0.999).

Tuning, the same grid for both: the learning rate from 3e-6 to 1 (1, 3, 10, ...) and the
setting that bounds the denominator, AdamW's eps from (1e-8, 1e-3, 1e-2, 0.1) and DPAdamW's
variance floor gamma' from (1e-9, 1e-6, 1e-4, 1e-2) (gamma' plays eps^2's part). The grids grew
three times, each time after a run whose choices, or whose best learning rate at some eps or
floor, lay on an edge (first: learning rates 1e-4 .. 3e-2, eps up to 1e-2, floors up to 1e-4;
then 3e-4 .. 0.1; then 1e-5 .. 1). The largest eps and floor remain chosen for the BLT: both
tend to SGD with momentum as they grow (the denominator becomes a constant), which is what this
task prefers. ``--reuse`` takes the configurations already in the JSON output from there (the
runs are deterministic: same seeds, one thread).
Each optimizer's pair is chosen by mean validation accuracy over the seeds; the table gives the
test accuracy of that choice, mean +- standard deviation and min..max over the seeds (a seed
changes the initialization, the batches and the noise, not the split).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opake.demo import _accuracy, _data, _module  # noqa: E402  (the demo's task, unchanged)
from opake.dpftrl.noise import blt_strategy, identity_strategy  # noqa: E402
from opake.random import key  # noqa: E402
from opake.torch import DPAdamW, make_private  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "adam_noise_correction.json"
MECHANISMS = {
    "BLT, balls in bins (rigorous)": dict(strategy=blt_strategy(), sampling="balls_in_bins", amplification=False),
    "DP-SGD, Poisson (PLD)": dict(strategy=identity_strategy(), sampling="poisson"),
}
LEARNING_RATES = (3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
ADAMW_EPS = (1e-8, 1e-3, 1e-2, 1e-1)
FLOORS = (1e-9, 1e-6, 1e-4, 1e-2)


def optimizers(quick: bool):
    """(name, setting name, settings, build(parameters, lr, setting), make_private options)."""
    lrs = (1e-2,) if quick else LEARNING_RATES
    adamw = lambda parameters, lr, eps: torch.optim.AdamW(parameters, lr=lr, eps=eps, weight_decay=0.0)  # noqa: E731
    eps_grid = list(itertools.product(lrs, (1e-8,) if quick else ADAMW_EPS))
    return (
        ("AdamW", "eps", eps_grid, adamw, dict(noise_correction=False)),
        # make_private's default for an AdamW: the second moment corrected, floored at the noise's variance
        ("AdamW corrected (default)", "eps", eps_grid, adamw, {}),
        ("DPAdamW", "floor", list(itertools.product((1e-3,) if quick else lrs, (1e-6,) if quick else FLOORS)),
         lambda parameters, lr, floor: DPAdamW(parameters, lr=lr, variance_floor=floor, weight_decay=0.0), {}),
    )


def train(mechanism: dict, build, lr, setting, seed, data, epochs, noise_multiplier, options=None):
    train_set, valid, test = data
    module = _module(32, seed)
    budget = dict(target_epsilon=3.0) if noise_multiplier is None else dict(noise_multiplier=noise_multiplier)
    private = make_private(module=module, optimizer=build(module.parameters(), lr, setting),
                           dataset=torch.utils.data.TensorDataset(*train_set), batch_size=40, epochs=epochs,
                           target_delta=1e-5, max_grad_norm=1.0, key=key(seed), **mechanism, **budget,
                           **(options or {}))
    for _ in range(epochs):
        for x, y in private.data_loader:
            private.optimizer.zero_grad()
            if len(y):
                torch.nn.functional.cross_entropy(module(x), y).backward()
            private.optimizer.step()
    params = {"w1": module[0].weight.detach().T, "b1": module[0].bias.detach(),
              "w2": module[2].weight.detach().T, "b2": module[2].bias.detach()}
    return _accuracy(params, valid), _accuracy(params, test), private


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, one setting per optimizer, 2 epochs")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 3 4 (quick: 0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="take configurations already in the JSON output")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2, 3, 4])
    epochs = 2 if args.quick else 20
    data = _data()
    out_file = OUT.with_name(OUT.stem + ("_quick" if args.quick else "") + ".json")
    done = {}
    if args.reuse and out_file.exists():
        for row in json.loads(out_file.read_text()).get("grid", []):
            done[(row["mechanism"], row["optimizer"], row["lr"], row["setting"], tuple(row["seeds"]))] = row
    started = time.perf_counter()
    rows, everything = [], []
    for mechanism_name, mechanism in MECHANISMS.items():
        noise_multiplier = 3.0 if args.quick else None  # None: calibrated to epsilon 3 by the first run
        epsilon = None
        for name, setting_name, settings, build, options in optimizers(args.quick):
            best = None
            for lr, setting in settings:
                reused = done.get((mechanism_name, name, lr, f"{setting_name} {setting:g}", tuple(seeds)))
                if reused is not None and (noise_multiplier is None or reused["noise_multiplier"] == noise_multiplier):
                    noise_multiplier, epsilon = reused["noise_multiplier"], reused["epsilon"]
                    everything.append(reused)
                    if best is None or reused["validation"] > best["validation"]:
                        best = reused
                    continue
                validation, tests = [], []
                for seed in seeds:
                    valid_accuracy, test_accuracy, private = train(mechanism, build, lr, setting, seed, data, epochs,
                                                                   noise_multiplier, options)
                    noise_multiplier, epsilon = private.noise_multiplier, private.epsilon
                    validation.append(valid_accuracy)
                    tests.append(test_accuracy)
                candidate = dict(mechanism=mechanism_name, optimizer=name, lr=lr, setting=f"{setting_name} {setting:g}",
                                 noise_multiplier=noise_multiplier, epsilon=epsilon, seeds=seeds,
                                 validation=statistics.fmean(validation), tests=tests)
                everything.append(candidate)
                if best is None or candidate["validation"] > best["validation"]:
                    best = candidate
            rows.append(best)
    elapsed = time.perf_counter() - started
    budget = "noise multiplier 3 (--quick)" if args.quick else "epsilon 3 (delta 1e-5)"
    print(f"digits, batch 40, {epochs} epochs, {budget}, seeds {seeds}; {elapsed:.0f} s\n")
    print("| mechanism | optimizer | noise mult. | epsilon | lr | setting | val acc | test acc, mean +- std "
          "| min..max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        tests = row["tests"]
        spread = statistics.stdev(tests) if len(tests) > 1 else 0.0
        print(f"| {row['mechanism']} | {row['optimizer']} | {row['noise_multiplier']:.3f} | {row['epsilon']:.3f} | "
              f"{row['lr']:g} | {row['setting']} | {row['validation']:.3f} | {statistics.fmean(tests):.3f} +- "
              f"{spread:.3f} | {min(tests):.3f}..{max(tests):.3f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps({"chosen": rows, "grid": everything}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
