"""The ``opake`` command.

``opake demo``: train a small classifier on bundled data with BLT and with DP-SGD at the same
epsilon (see ``opake.demo``).

``opake plan``: resolve the strategies for a run's participation context, calibrate each to the
same (epsilon, delta) without amplification, and compare their errors. With no arguments it plans
the seed's multi-epoch example (5000 steps, each unit at most 5 times, at least 100 steps apart).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from opake.plan import plan_run


def _extra_strategies(args):
    from opake.dpftrl.noise import band_mf_strategy

    # As many bands as the separation (one participation per band window, Band23), at least
    # 4 floats per buffer of the BLT, at most the horizon.
    bands = min(args.n_steps, max(2, args.min_sep, 4 * args.max_buffers))
    return (("BandMF", band_mf_strategy(bands=bands)),)


def _plan(args) -> int:
    start = time.perf_counter()
    plan = plan_run(
        args.n_steps, args.min_sep, args.max_participations, args.epsilon, args.delta,
        max_buffers=args.max_buffers, error=args.error,
        extra_strategies=_extra_strategies(args),
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
    if args.plot:
        _plot(plan, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
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
          f"table yet. Planned in {seconds:.2f} s.")
    if args.plot:
        print(f"Plot written to {args.plot}")
    return 0


def _plot(plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    import numpy as np

    from opake.dpftrl.noise import toeplitz

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
    plan.add_argument("--n-steps", type=int, default=5000)
    plan.add_argument("--min-sep", type=int, default=100)
    plan.add_argument("--max-participations", type=int, default=5)
    plan.add_argument("--epsilon", type=float, default=8.0)
    plan.add_argument("--delta", type=float, default=1e-5)
    plan.add_argument("--max-buffers", type=int, default=10)
    plan.add_argument("--error", choices=("max", "mean"), default="max")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", metavar="FILE.png", help="draw coefficients and per-step error (matplotlib)")
    plan.set_defaults(func=_plan)
    demo = sub.add_parser("demo", help="train a small model with BLT and with DP-SGD at the same epsilon")
    demo.add_argument("--epsilon", type=float, default=3.0)
    demo.set_defaults(func=_demo)
    return parser


def _demo(args) -> int:
    from opake.demo import DemoSettings, main as demo_main

    return demo_main(DemoSettings(epsilon=args.epsilon))


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv if argv and argv[0] in ("plan", "demo", "-h", "--help") else ["plan"] + argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"opake: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
