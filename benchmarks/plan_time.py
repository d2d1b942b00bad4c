"""What the least-noise default costs at planning time: ``plan_privacy`` without a strategy
(the choice among the mechanisms proven for adaptive gradients, ``opake.planner.choice``) against
the same plan with a BLT named (the one mechanism the choice would otherwise replace).

    python benchmarks/plan_time.py            # a few data set sizes and budgets, and 1e6 steps (minutes)
    python benchmarks/plan_time.py --quick    # one tiny setting, both plans in this process (seconds)

Each plan runs in a fresh process (no strategy resolution or calibration reused from an earlier
row; the interpreter's start-up and imports are not counted), with one thread. A row: the
setting (examples N, batch B, epochs E, optimizer), the target epsilon (delta 1e-5), the
mechanism chosen, the seconds of ``plan_privacy`` with the BLT named and without a strategy, and
the difference: what a user waits more for the default; and the process CPU seconds of each (on a
shared machine the wall seconds grow with the load, the CPU seconds much less). The last rows are a million steps (a
million examples, batch 10, 10 epochs) at epsilon 8, where the default resolves BandMF with 2, 4
and 8 bands over the whole horizon (target: under 10 s). The machine's load average (1 minute)
is printed beside each row: on a shared machine the seconds grow with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch

DELTA = 1e-5
# (N, B, E, optimizer): one epoch of MNIST's size; twenty epochs of a small set; the text
# fine-tuning of benchmarks/quality.py (AdamW)
SETTINGS = [(60000, 256, 1, "sgd-momentum"), (1200, 40, 20, "sgd-momentum"), (1554, 64, 3, "adamw")]
BUDGETS = (1.0, 3.0, 8.0)
QUICK_SETTINGS, QUICK_BUDGETS = [(600, 32, 2, "sgd-momentum")], (3.0,)
# (setting, budget): a million steps, once with each optimizer
MILLION_STEPS = [((1_000_000, 10, 10, "sgd-momentum"), 8.0), ((1_000_000, 10, 10, "adamw"), 8.0)]


def _optimizer(name: str) -> torch.optim.Optimizer:
    parameters = torch.nn.Linear(2, 1).parameters()
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3)
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def plan_once(setting, budget: float, named: bool) -> dict:
    """One plan in this process: the seconds plan_privacy took and what it planned."""
    from opake.dpftrl.noise import blt_strategy
    from opake.random import key
    from opake.torch.planning import plan_privacy

    examples, batch, epochs, optimizer = setting
    options = dict(strategy=blt_strategy(), sampling="balls_in_bins") if named else {}
    # Built before the clock starts: torch's first optimizer imports torch._dynamo (seconds), a cost of
    # the user's own script, not of planning.
    optimizer = _optimizer(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShortRunWarning and the like: not what is measured
        started, started_cpu = time.perf_counter(), time.process_time()
        plan = plan_privacy(num_examples=examples, batch_size=batch, epochs=epochs, max_grad_norm=1.0, key=key(0),
                            target_epsilon=budget, target_delta=DELTA, optimizer=optimizer,
                            progress=False, **options)
        seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    chosen = plan.choice.chosen.name if plan.choice is not None else "BLT (named)"
    return {"seconds": seconds, "cpu": cpu, "chosen": chosen, "sigma": plan.noise_multiplier}


def _fresh(setting, budget: float, named: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps([list(setting), budget, named])],
                          capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny setting (seconds)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.one:
        setting, budget, named = json.loads(args.one)
        print(json.dumps(plan_once(setting, budget, named)))
        return 0
    settings, budgets = (QUICK_SETTINGS, QUICK_BUDGETS) if args.quick else (SETTINGS, BUDGETS)
    rows = [(setting, budget) for setting in settings for budget in budgets]
    if not args.quick:
        rows += MILLION_STEPS
    # --quick is a smoke test of the script: its two plans run here (no fresh interpreters to start)
    plan = (lambda setting, budget, named: plan_once(setting, budget, named)) if args.quick else _fresh
    where = "both plans in this process (--quick)" if args.quick else "each plan in a fresh process"
    print(f"plan_privacy with a BLT named vs without a strategy (the least-noise choice); delta {DELTA:g}; "
          f"{where}, one thread; torch {torch.__version__}")
    print("| N, B, E, optimizer | target epsilon | chosen | BLT named s | default s | default - named s "
          "| BLT named CPU s | default CPU s | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for setting, budget in rows:
        load = os.getloadavg()[0]
        named, default = plan(setting, budget, True), plan(setting, budget, False)
        extra = default["seconds"] - named["seconds"]
        worst = max(worst, extra)
        examples, batch, epochs, optimizer = setting
        print(f"| {examples}, {batch}, {epochs}, {optimizer} | {budget:g} | {default['chosen']} "
              f"| {named['seconds']:.2f} | {default['seconds']:.2f} | {extra:+.2f} | {named['cpu']:.2f} "
              f"| {default['cpu']:.2f} | {load:.1f} |", flush=True)
    print(f"largest extra time of the default: {worst:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
