"""The ``opake`` command.

``opake demo``: train a small classifier on bundled data at the same epsilon with BLT (balls in
bins, unamplified and amplified), BandMF (cyclic Poisson), Poisson-subsampled DP-SGD and without
privacy, over several seeds (see ``opake.demo``).

``opake audit``: the demo's private training audited with canaries (``opake.audit.demo``): the
claimed epsilon beside the empirical lower bound of one-run audits, white-box and black-box, and
of a deliberately under-noised control run.

``opake plan``: resolve the strategies for a run's participation context, calibrate each to the
same (epsilon, delta) without amplification, and compare their errors. With no arguments it plans
the seed's multi-epoch example (5000 steps, each unit at most 5 times, at least 100 steps apart).

``opake plan --num-examples N --batch-size B --epochs E``: plan from a data set instead
(``opake.planner.plan_dataset``): the mechanisms ``make_private`` chooses among (Poisson DP-SGD as
Opacus runs it, BandMF, the BLT, DP-SGD on balls in bins), each with the sampler it runs with, its
accountant and its noise multiplier on the plan's grid, the one ``make_private`` takes marked; the
BLT's amplified bound (not proven for adaptive gradients) for reference.

Both plan modes report their stages (strategy resolves, calibration evaluations) on stderr when
it is a terminal; ``--progress`` forces the report on, ``--no-progress`` silences it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from opake.errors import InvalidArgumentError, MissingDependencyError

# Planning imports torch, scipy and dp_accounting (seconds): each command imports what it runs, so
# that `opake --help` answers at once.

_CONTEXT_DEFAULTS = {"n_steps": 5000, "min_sep": 100, "max_participations": 5}
_DATASET_OPTIONS = ("num_examples", "batch_size", "epochs")


class PlotExtraError(MissingDependencyError, ValueError):
    """``--plot`` without matplotlib installed (a ``ValueError`` too, as the command line reports those)."""


def _extra_strategies(args):
    from opake.dpftrl.noise import band_mf_strategy

    # As many bands as the separation (one participation per band window, Band23), at least
    # 4 floats per buffer of the BLT, at most the horizon.
    bands = min(args.n_steps, max(2, args.min_sep, 4 * args.max_buffers))
    return (("BandMF", band_mf_strategy(bands=bands)),)


def _plan(args) -> int:
    given_context = [name for name in _CONTEXT_DEFAULTS if getattr(args, name) is not None]
    given_dataset = [name for name in _DATASET_OPTIONS if getattr(args, name) is not None]
    if given_dataset:
        if given_context:
            raise InvalidArgumentError(
                f"{_options(given_context)} cannot be combined with {_options(given_dataset)}: "
                "a data set plan derives n_steps = epochs * (num_examples // batch_size), "
                "min_sep = num_examples // batch_size and max_participations = epochs; give either "
                "--num-examples, --batch-size and --epochs, or --n-steps, --min-sep and --max-participations"
            )
        missing = [name for name in _DATASET_OPTIONS if name not in given_dataset]
        if missing:
            raise InvalidArgumentError(
                f"a data set plan needs --num-examples, --batch-size and --epochs; missing: {_options(missing)}"
            )
        return _plan_dataset(args)
    for name, default in _CONTEXT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    start = time.perf_counter()
    from opake.planner import plan_run

    plan = plan_run(
        args.n_steps, args.min_sep, args.max_participations, args.epsilon, args.delta,
        max_buffers=args.max_buffers, error=args.error,
        extra_strategies=_extra_strategies(args), progress=args.progress,
    )
    seconds = time.perf_counter() - start
    ctx = plan.participation
    blt_row = plan.rows[0]
    report = {
        "context": {"n_steps": ctx.n_steps, "min_sep": ctx.min_sep,
                    "max_participations": ctx.max_participations,
                    "effective_participations": ctx.effective_participations},
        "budget": {"epsilon": plan.epsilon, "delta": plan.delta},
        "blt": {"theta": blt_row.mechanism.theta.tolist(), "omega": blt_row.mechanism.omega.tolist(),
                "one_minus_theta": blt_row.mechanism.one_minus_theta.tolist()},
        "strategies": [
            {"strategy": r.name, "noise_multiplier": r.noise_multiplier, "sensitivity": r.mechanism.sensitivity,
             "epsilon": r.epsilon, "rmse_max": r.rmse_max, "rmse_mean": r.rmse_mean,
             "state_bytes_per_parameter": r.state_bytes_per_parameter}
            for r in plan.rows
        ],
        "seconds": seconds,
    }
    if _write_plot_or_json(plan, report, args):
        return 0
    print(f"Run: n_steps={ctx.n_steps}, min_sep={ctx.min_sep}, max_participations={ctx.max_participations} "
          f"(k'={ctx.effective_participations}); budget epsilon={plan.epsilon:g}, delta={plan.delta:g}; "
          "no amplification")
    mech = blt_row.mechanism
    print(f"\nBLT ({mech.num_buffers} buffers, error={args.error}):")
    print(f"  {'i':>2} {'theta':>20} {'1 - theta':>12} {'omega':>12}")
    for i, (t, q, w) in enumerate(zip(mech.theta, mech.one_minus_theta, mech.omega)):
        print(f"  {i:>2} {t:>20.15f} {q:>12.5e} {w:>12.5e}")
    print("\nAt equal privacy (clip norm 1; RMSE of the prefix sums of the noise):")
    header = f"  {'strategy':<8} {'noise mult.':>11} {'sensitivity':>11} {'epsilon':>8} {'RMSE max':>9} {'RMSE mean':>9} {'state B/param':>13}"
    print(header)
    for r in plan.rows:
        print(f"  {r.name:<8} {r.noise_multiplier:>11.4f} {r.mechanism.sensitivity:>11.4f} {r.epsilon:>8.4f} "
              f"{r.rmse_max:>9.3f} {r.rmse_mean:>9.3f} {r.state_bytes_per_parameter:>13d}")
    dpsgd = plan.rows[-1]
    print(f"\nBLT's worst-step RMSE is {dpsgd.rmse_max / blt_row.rmse_max:.2f}x lower than DP-SGD's without "
          f"amplification (mean: {dpsgd.rmse_mean / blt_row.rmse_mean:.2f}x). Poisson-subsampled DP-SGD, as "
          f"Opacus runs it, can be much closer or better when the sampling rate is small; it is not in this "
          f"table: plan from a data set (--num-examples, --batch-size, --epochs) to compare with it. "
          f"Planned in {seconds:.2f} s.")
    if args.plot:
        print(f"Plot written to {args.plot}")
    return 0


def _options(names) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def _plan_dataset(args) -> int:
    start = time.perf_counter()
    from opake.planner import plan_dataset

    plan = plan_dataset(args.num_examples, args.batch_size, args.epochs, args.epsilon, args.delta,
                        max_buffers=args.max_buffers, error=args.error, progress=args.progress)
    seconds = time.perf_counter() - start
    run, choice = plan.dataset, plan.choice
    report = {
        "dataset": {"num_examples": run.num_examples, "batch_size": run.batch_size, "epochs": run.epochs,
                    "steps_per_epoch": run.num_bins, "n_steps": run.n_steps, "sample_rate": run.sample_rate},
        "budget": {"epsilon": plan.epsilon, "delta": plan.delta},
        "error": "RMSE of the prefix sums of the noise alone (clip norm 1, before dividing by the batch "
                 "size); the variance of Poisson batch sizes is not counted",
        "strategies": [
            {"strategy": r.name, "sampling": r.sampling, "accounting": r.accounting,
             "bands": getattr(r.mechanism, "bands", None),
             "blt_buffers": r.mechanism.num_buffers if r.name.startswith("BLT") else None,
             "noise_multiplier": r.noise_multiplier, "noise_multiplier_is_lower_bound": not r.calibrated,
             "epsilon": r.epsilon if r.calibrated else None, "delta": r.delta,
             "rmse_max": r.rmse_max, "rmse_mean": r.rmse_mean,
             "state_bytes_per_parameter": r.state_bytes_per_parameter, "chosen": r.chosen}
            for r in plan.rows
        ],
        "seconds": seconds,
        "make_private_default": {"chosen": choice.chosen.name, "sampling": choice.sampling,
                                 "accounting": choice.accounting, "noise_multiplier": choice.noise_multiplier,
                                 "epsilon": choice.epsilon, "reason": choice.reason,
                                 "step_noise": choice.chosen.step_noise, "adam_rate_scale": choice.adam_rate_scale},
    }
    if args.batch_advice:
        advice = choice.batch_advice(run.num_examples)
        report["batch_advice"] = {
            "mechanism": advice.mechanism,
            "settings": [{"batch_size": s.batch_size, "epochs": s.epochs, "n_steps": s.n_steps,
                          "noise_multiplier": s.noise_multiplier, "error": s.error,
                          "noise_per_example": s.noise_per_example} for s in advice.settings],
            "best": {"batch_size": advice.best.batch_size, "epochs": advice.best.epochs}}
    if _write_plot_or_json(plan, report, args):
        return 0
    print(f"Run: {run.num_examples} examples, batch size {run.batch_size}, {run.epochs} epochs = "
          f"{run.num_bins} steps per epoch, n_steps={run.n_steps}; budget epsilon={plan.epsilon:g}, "
          f"delta={plan.delta:g}")
    print("\nAt equal privacy (clip norm 1; RMSE of the prefix sums of the noise alone, before dividing "
          "by the batch size;\nevery row has expected batch size "
          f"{run.batch_size}; the variance of Poisson batch sizes is not counted):")
    print(f"  {'strategy':<15} {'noise mult.':>11} {'epsilon':>8} {'RMSE max':>9} {'RMSE mean':>9} {'state B/param':>13}")
    for r in plan.rows:
        bound = "" if r.calibrated else ">= "
        epsilon = f"{r.epsilon:>8.4f}" if r.calibrated else f"{'-':>8}"
        print(f"  {r.name:<15} {bound + format(r.noise_multiplier, '.4f'):>11} {epsilon} "
              f"{bound + format(r.rmse_max, '.3f'):>9} {r.rmse_mean:>9.3f} {r.state_bytes_per_parameter:>13d}"
              f"{'  <- make_private' if r.chosen else ''}")
    print("\nSamplers and accountants:")
    for r in plan.rows:
        print(f"  {r.name:<15} {r.sampling}; {r.accounting}")
    print(f"\nmake_private without a strategy takes {choice.chosen.name}: {choice.reason}. Ranked on the prefix "
          f"sums (plain SGD, Adam-type optimizers; make_private ranks torch SGD with momentum or a schedule on "
          f"its own workload). The amplified BLT row is for reference: its bound is not proven for adaptively "
          f"chosen gradients. Planned in {seconds:.1f} s.")
    if choice.learning_rate_note:
        print(f"\n{choice.learning_rate_note[0].upper()}{choice.learning_rate_note[1:]}.")
    if args.batch_advice:
        print("\n" + advice.table())
    if args.plot:
        print(f"Plot written to {args.plot}")
    return 0


def _write_plot_or_json(plan, report: dict, args) -> bool:
    """Draw --plot (and name it in the report); print the report for --json. True when printed."""
    if args.plot:
        _plot(plan, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
        return True
    return False


def _plot(plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotExtraError("--plot needs matplotlib: pip install matplotlib") from None
    import numpy as np

    from opake.dpftrl.strategies import toeplitz

    n = plan.participation.n_steps
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lags = np.arange(1, n)
    for row in plan.rows:
        mech = row.mechanism
        c = mech.toeplitz_coefficients(n)
        if np.any(c[1:] > 0):
            left.loglog(lags, c[1:], label=row.name)
        rows_err = toeplitz.per_query_errors(toeplitz.inverse_coefficients(c))
        right.plot(np.arange(n), row.noise_multiplier * np.sqrt(rows_err), label=row.name)
    left.set(title="strategy coefficients c_k", xlabel="lag k")
    right.set(title="RMSE of prefix sum at step t (equal privacy)", xlabel="step t")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opake", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    plan = sub.add_parser("plan", help="optimize, calibrate and compare strategies for a run")
    plan.add_argument("--n-steps", type=int, help="number of steps (default 5000)")
    plan.add_argument("--min-sep", type=int, help="steps between two participations of a unit (default 100)")
    plan.add_argument("--max-participations", type=int, help="participations per unit (default 5)")
    plan.add_argument("--num-examples", type=int, help="data set size: plan from a data set (with --batch-size, "
                                                       "--epochs) instead of --n-steps/--min-sep/--max-participations")
    plan.add_argument("--batch-size", type=int, help="expected examples per step (data set plan)")
    plan.add_argument("--epochs", type=int, help="passes over the data (data set plan)")
    plan.add_argument("--epsilon", type=float, default=8.0)
    plan.add_argument("--delta", type=float, default=1e-5)
    plan.add_argument("--max-buffers", type=int, default=10)
    plan.add_argument("--error", choices=("max", "mean"), default="max")
    plan.add_argument("--batch-advice", action="store_true",
                      help="data set plan: the chosen mechanism at other batch sizes and epochs, ranked by noise "
                           "per example processed (seconds more)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", metavar="FILE.png", help="draw coefficients and per-step error (matplotlib)")
    plan.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="report the planning stages on stderr (default: when stderr is a terminal)")
    plan.set_defaults(func=_plan)
    demo = sub.add_parser("demo", help="train a small model with BLT, BandMF and Poisson DP-SGD at the same "
                                       "epsilon, over several seeds")
    demo.add_argument("--epsilon", type=float, default=3.0)
    demo.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="seeds of initialization, batches and noise (the data split is fixed)")
    demo.set_defaults(func=_demo)
    audit = sub.add_parser("audit", help="audit the demo's private training: claimed epsilon vs an empirical lower "
                                         "bound (one-run canary audit)")
    audit.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the audited run (delta 1e-5)")
    audit.add_argument("--canaries", type=int, default=1000, help="gradient canaries of the white-box audit")
    audit.add_argument("--confidence", type=float, default=0.95)
    audit.add_argument("--seed", type=int, default=0, help="seed of the coins, initialization, batches and noise")
    audit.add_argument("--no-control", action="store_true", help="skip the deliberately under-noised control run")
    audit.set_defaults(func=_audit)
    return parser


def _demo(args) -> int:
    from opake.demo import DemoSettings, main as demo_main

    return demo_main(DemoSettings(epsilon=args.epsilon, seeds=tuple(args.seeds)))


def _audit(args) -> int:
    from opake.audit.demo import AuditDemoSettings, main as audit_main

    return audit_main(AuditDemoSettings(epsilon=args.epsilon, gradient_canaries=args.canaries,
                                        confidence=args.confidence, seed=args.seed, control=not args.no_control))


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv if argv and argv[0] in ("plan", "demo", "audit", "-h", "--help") else ["plan"] + argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"opake: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
