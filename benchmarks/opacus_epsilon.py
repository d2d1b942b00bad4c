"""Opacus scripts through opake.torch.PrivacyEngine: their epsilon, and what a target epsilon chooses.

    python benchmarks/opacus_epsilon.py            # Opacus' example defaults (about a minute)
    python benchmarks/opacus_epsilon.py --quick    # tiny settings, in one process (tests/benchmarks/test_opacus_epsilon.py)

Part 1, the noise-multiplier form. For the defaults of Opacus' own examples (data set size N,
batch size B, epochs E, noise multiplier sigma; delta 1e-5) it prints the epsilon the adapter
reports for the whole run (``PrivacyEngine().make_private(..., noise_multiplier=sigma,
epochs=E)`` on a stand-in model and N stand-in examples: DP-SGD with Poisson sampling at
q = B / N, E * (N // B) steps, priced by a PLD), an independent RDP figure (dp_accounting's
RdpAccountant for the same q and steps), and Opacus' PRV accountant (its default), called in its
own environment (``../peer-opacus``: ``python3 -m venv ../peer-opacus && ../peer-opacus/bin/pip
install torch==2.13.0 opacus``) through ``peers/opacus_accountant.py``, twice: for the same q
and steps as the adapter, and for what Opacus' script runs (q = 1 / ceil(N / B),
E * ceil(N / B) steps). The ratios are the adapter's epsilon over those two.

Part 2, the target-epsilon form. ``make_private_with_epsilon`` at a few budgets for the MNIST
and CIFAR-10 settings, with each example's optimizer (SGD; CIFAR-10's has momentum 0.9): the
mechanism chosen (``opake.planner.choice``), its noise multiplier, and the planning time (the
choice and the plan, the seconds a script waits in ``make_private_with_epsilon``), each row in a
fresh process, so that no strategy resolution is reused from an earlier row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import dp_accounting
import torch
from dp_accounting.rdp import RdpAccountant
from torch import nn

from opake.torch import PrivacyEngine

ROOT = Path(__file__).resolve().parent
PEER = Path(os.environ.get("OPAKE_PEER_OPACUS") or ROOT.parent.parent / "peer-opacus")  # its environment
PEER = PEER / "bin" / "python" if PEER.is_dir() else PEER  # (or its interpreter)
DELTA = 1e-5
# (name, N, B, E, sigma, the example's SGD momentum): Opacus' examples' defaults
SETTINGS = [("MNIST", 60000, 64, 10, 1.0, 0.0), ("CIFAR-10", 50000, 2000, 90, 1.5, 0.9),
            ("char-LSTM", 16059, 800, 10, 1.0, 0.0), ("IMDB", 25000, 64, 10, 0.56, 0.0)]
QUICK = [("tiny-a", 1000, 50, 2, 1.0, 0.0), ("tiny-b", 600, 32, 3, 1.5, 0.9)]
BUDGETS, QUICK_BUDGETS = (1.0, 3.0, 8.0), (3.0,)


def _engine_run(n, batch, epochs, momentum, **call):
    """A PrivacyEngine call on a stand-in model and N stand-in examples; (engine, seconds)."""
    model = nn.Linear(1, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(n, 1)), batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    engine = PrivacyEngine()
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "noise_multiplier" in call:
            engine.make_private(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0,
                                epochs=epochs, target_delta=DELTA, progress=False, **call)
        else:
            engine.make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=loader,
                                             max_grad_norm=1.0, epochs=epochs, target_delta=DELTA, progress=False,
                                             **call)
    return engine, time.perf_counter() - started


def _rdp(sigma, rate, steps):
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(DELTA)


def _opacus(queries):
    """Opacus' PRV and RDP epsilons for (sigma, rate, steps, delta) queries, or None without Opacus."""
    if not PEER.exists():
        return None, None
    done = subprocess.run([str(PEER), str(ROOT / "peers" / "opacus_accountant.py"), json.dumps(queries)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"(Opacus peer failed: {done.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None, None
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["results"], answer["version"]


def noise_multiplier_table(settings) -> None:
    rows, queries = [], []
    for name, n, batch, epochs, sigma, momentum in settings:
        engine, seconds = _engine_run(n, batch, epochs, momentum, noise_multiplier=sigma)
        plan = engine.private.plan
        steps_per_epoch = math.ceil(n / batch)
        rows.append((name, n, batch, epochs, sigma, plan, seconds, _rdp(sigma, plan.sample_rate, plan.n_steps)))
        queries += [[sigma, plan.sample_rate, plan.n_steps, DELTA], [sigma, 1 / steps_per_epoch, epochs * steps_per_epoch, DELTA]]
    peer, version = _opacus(queries)
    print(f"Part 1: make_private(noise_multiplier=sigma) through opake.torch.PrivacyEngine, delta {DELTA:g}"
          + (f"; Opacus {version} (PRV, its default accountant)" if version else "; Opacus not installed"))
    print("| example (N, B, E, sigma) | adapter: q, steps | adapter epsilon (PLD) | dp_accounting RDP, same q, steps "
          "| Opacus PRV, same q, steps | ratio | Opacus' script: q, steps | Opacus PRV | ratio | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for index, (name, n, batch, epochs, sigma, plan, seconds, rdp) in enumerate(rows):
        same = peer[2 * index]["prv"] if peer else math.nan
        script = peer[2 * index + 1]["prv"] if peer else math.nan
        steps_per_epoch = math.ceil(n / batch)
        print(f"| {name} ({n}, {batch}, {epochs}, {sigma:g}) | {plan.sample_rate:.5g}, {plan.n_steps} "
              f"| {plan.epsilon:.3f} | {rdp:.3f} | {same:.3f} | {plan.epsilon / same:.3f} "
              f"| {1 / steps_per_epoch:.5g}, {epochs * steps_per_epoch} | {script:.3f} | {plan.epsilon / script:.3f} "
              f"| {seconds:.2f} |")


def target_epsilon_table(settings, budgets, fresh: bool = True) -> None:
    print(f"\nPart 2: make_private_with_epsilon(target_epsilon=...) through opake.torch.PrivacyEngine, delta {DELTA:g}"
          + (" (each row planned in a fresh process)" if fresh else " (in this process)"))
    print("| example (N, B, E), optimizer | target epsilon | chosen | noise mult. | epsilon | worst-step noise "
          "| runner-up | planning s |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in settings:
        name, n, batch, epochs, _, momentum = setting
        for budget in budgets:
            if fresh:
                done = subprocess.run([sys.executable, __file__, "--choose", json.dumps([list(setting), budget])],
                                      capture_output=True, text=True, timeout=600, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                row = _chosen(setting, budget)
            optimizer = f"SGD momentum {momentum:g}" if momentum else "SGD"
            print(f"| {name} ({n}, {batch}, {epochs}), {optimizer} | {budget:g} | {row['chosen']} "
                  f"| {row['sigma']:.4g} | {row['epsilon']:.4f} | {row['error']:.4g} | {row['runner_up']} "
                  f"| {row['seconds']:.2f} |")


def _chosen(setting, budget) -> dict:
    """One row of part 2: what make_private_with_epsilon chose, and the seconds it took."""
    _, n, batch, epochs, _, momentum = setting
    engine, seconds = _engine_run(n, batch, epochs, momentum, target_epsilon=budget)
    choice = engine.choice
    others = sorted((c for c in choice.candidates if c is not choice.chosen), key=lambda c: c.error)
    runner = f"{others[0].name} ({others[0].error:.4g})" if others else "-"
    return {"chosen": choice.chosen.name, "sigma": choice.noise_multiplier, "epsilon": engine.private.epsilon,
            "error": choice.chosen.error, "runner_up": runner, "seconds": seconds}


def _choose(argument: str) -> None:
    """One row of part 2, printed as JSON (run in its own process by target_epsilon_table)."""
    setting, budget = json.loads(argument)
    print(json.dumps(_chosen(setting, budget)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, one budget (seconds)")
    parser.add_argument("--choose", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.choose:
        return _choose(args.choose)
    settings = QUICK if args.quick else SETTINGS
    noise_multiplier_table(settings)
    if args.quick:
        target_epsilon_table(settings, QUICK_BUDGETS, fresh=False)
    else:
        target_epsilon_table(settings[:2], BUDGETS)


if __name__ == "__main__":
    main()
