"""Benchmark: resolving a BLT strategy (optimizer time and loss) against the optimum and jax-privacy.

Run with opake's interpreter from the repository root:

    .venv/bin/python benchmarks/blt_resolve.py             # peer figures from the cache
    .venv/bin/python benchmarks/blt_resolve.py --run-peer  # recompute the peer live (minutes)
    .venv/bin/python benchmarks/blt_resolve.py --quick     # seconds: two small contexts, n = 1e3 schedule

For each participation context it clears the resolve cache and times one cold
``blt_strategy(max_buffers=10, error=...).resolve(n_steps, min_sep, max_participations)``, then
reports the number of buffers, the sensitivity S, sqrt(loss) (loss = S^2 x max or mean error),
for single participation the ratio to the optimal Toeplitz value, and the peer's figures.

The peer (jax-privacy's ``buffered_toeplitz.optimize``) runs only in its own virtual environment
(default ../peer-jaxp next to the repository, or $OPAKE_PEER_JAXP) through
``benchmarks/peers/jaxp_blt.py``. Its results are cached in
``benchmarks/peer_cache/jax_privacy_blt.json`` because one call takes minutes on a small
machine; ``--run-peer --update-cache`` refreshes that file. The benchmark runs without the peer.

A second table times the schedule-aware resolve that torch.optim.SGD with a learning-rate
schedule gets (``blt_strategy(workload="parameters", momentum=0.9, lr_schedule=...)``, a 5% linear
warmup then cosine decay; also with Nesterov and with dampening 0.3) at n = 1e3 .. 1e6, each
against the constant-schedule resolve of the same workload in the same run: ``--repeats`` (3)
alternating cold resolves of each, the ratio scheduled / constant as the fastest over the
fastest and as the median of the pairs, in wall and CPU seconds, with the load average. ``--buffers`` adds the buffer-count check: for cosine, linear
warmup + decay and step schedules, the chosen count against two more buffers forced, and at
n = 64..256 against the best general Toeplitz strategy for the same weighted workload
(``tests/optimal_toeplitz.py``, torch L-BFGS in float64; minutes).

The table is also written as JSON to benchmarks/out/blt_resolve.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_RUNNER = HERE / "peers" / "jaxp_blt.py"
PEER_CACHE = HERE / "peer_cache" / "jax_privacy_blt.json"
PYPI_RUNNER = HERE / "peers" / "opake_pypi_blt.py"
PYPI_CACHE = HERE / "peer_cache" / "opake_pypi_blt.json"
OUT_FILE = HERE / "out" / "blt_resolve.json"
MAX_BUFFERS = 10

# (label, n_steps, min_sep, max_participations, error)
CONTEXTS = [
    ("single 1e3", 1_000, 1, 1, "max"),
    ("single 1e4", 10_000, 1, 1, "max"),
    ("single 1e5", 100_000, 1, 1, "max"),
    ("single 1e6", 1_000_000, 1, 1, "max"),
    ("single 1e7", 10_000_000, 1, 1, "max"),
    ("n=5000 b=100 k=5", 5_000, 100, 5, "max"),
    ("n=2000 b=100 k=None", 2_000, 100, None, "max"),
    ("n=20000 b=1000 k=20", 20_000, 1_000, 20, "max"),
    ("n=5000 b=100 k=5 mean", 5_000, 100, 5, "mean"),
]

# Optimal Toeplitz sqrt(max loss) = sum_{k<n} c_k^2 (docs/math.md section 5), for the cross-check.
OPTIMAL_TABLE = {
    100: 2.531352, 1_000: 3.265003, 2_000: 3.485678, 10_000: 3.998010,
    100_000: 4.730953, 1_000_000: 5.463889, 10_000_000: 6.196825,
}


def context_key(n: int, min_sep: int, k: int | None, error: str, max_buffers: int = MAX_BUFFERS) -> str:
    """The key of a context in the peer cache file."""
    return f"n={n} min_sep={min_sep} max_participations={k} error={error} max_buffers={max_buffers}"


# ---------------------------------------------------------------------------------------------
# Optimal Toeplitz reference


def optimal_toeplitz_sqrt_max_loss(ns) -> dict[int, float]:
    """sum_{k<n} c_k^2 with c_k = binom(2k, k) / 4^k, for each n (float64, one cumulative pass)."""
    ns = sorted(set(int(n) for n in ns))
    if not ns:
        return {}
    top = ns[-1]
    ratios = np.ones(top, dtype=np.float64)
    k = np.arange(1, top, dtype=np.float64)
    ratios[1:] = (2.0 * k - 1.0) / (2.0 * k)
    c = np.cumprod(ratios)  # c_0 = 1, c_k = c_{k-1} (2k - 1) / (2k)
    partial = np.cumsum(c * c)
    return {n: float(partial[n - 1]) for n in ns}


def check_optimal_table(values: dict[int, float]) -> list[str]:
    """Mismatches between the computed optimum and the docs/math.md table (6 decimals)."""
    problems = []
    for n, ref in OPTIMAL_TABLE.items():
        if n in values and abs(values[n] - ref) > 1.5e-6:
            problems.append(f"optimal Toeplitz n={n}: computed {values[n]:.7f}, table {ref:.6f}")
    return problems


# ---------------------------------------------------------------------------------------------
# opake


def opake_version() -> str:
    try:
        from importlib.metadata import version

        return version("opake")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def resolve_ours(n: int, min_sep: int, k: int | None, error: str) -> dict:
    """One cold resolve of opake's BLT recipe; every failure becomes an 'error' entry."""
    try:
        from opake.dpftrl.noise import blt_strategy
        from opake.dpftrl.strategies import strategy as strategy_module

        try:  # import the optimizer outside the timed region
            import opake.dpftrl.strategies.blt_optimize  # noqa: F401
        except Exception:  # noqa: BLE001 - resolve() below reports it
            pass
        recipe = blt_strategy(max_buffers=MAX_BUFFERS, error=error)
        strategy_module._resolve_blt.cache_clear()
        start = time.perf_counter()
        mech = recipe.resolve(n_steps=n, min_sep=min_sep, max_participations=k)
        seconds = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
                "traceback": traceback.format_exc(limit=6)}
    loss = mech.max_loss if error == "max" else mech.mean_loss
    return {
        "seconds": seconds,
        "num_buffers": int(mech.num_buffers),
        "sensitivity": float(mech.sensitivity),
        "max_loss": float(mech.max_loss),
        "mean_loss": float(mech.mean_loss),
        "loss": float(loss),
        "sqrt_loss": math.sqrt(loss),
        "theta": [float(x) for x in mech.theta],
        "omega": [float(x) for x in mech.omega],
    }


def evaluate_with_ours(theta, omega, n: int, min_sep: int, k: int | None, error: str) -> float | None:
    """The loss of (the peer's) BLT parameters under opake's own sensitivity and error formulas."""
    try:
        from opake.dpftrl.strategies import blt
        from opake.dpftrl.strategies.strategy import mechanism_from_blt
        from opake.dpftrl.participation import Participation

        mech = mechanism_from_blt(blt.BLTParams(np.asarray(theta), np.asarray(omega)),
                                  Participation(n, min_sep, k))
        return float(mech.max_loss if error == "max" else mech.mean_loss)
    except Exception:  # noqa: BLE001 - the cross-check is optional
        return None


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules (torch.optim.SGD's parameter workload)

SCHEDULE_SIZES = (1_000, 10_000, 100_000, 1_000_000)
SCHEDULE_SGD = (("momentum 0.9", dict(momentum=0.9)),
                ("Nesterov 0.9", dict(momentum=0.9, nesterov=True)),
                ("dampening 0.3", dict(momentum=0.9, dampening=0.3)))


def warmup_cosine(n: int) -> np.ndarray:
    """5% linear warmup, then cosine decay to 1e-3 of the peak."""
    t = np.arange(n)
    warm = max(1, n // 20)
    return np.minimum((t + 1) / warm, 1.0) * (0.5 * (1.0 + np.cos(np.pi * t / n)) + 1e-3)


def test_schedules(n: int) -> dict:
    t = np.arange(n)
    return {
        "cosine": 0.01 + 0.5 * (1.0 + np.cos(np.pi * t / n)),
        "warmup-linear": np.minimum((t + 1) / max(1, n // 10), 1.0) * np.maximum(1.0 - t / n, 0.01),
        "step": 0.1 * 0.1 ** (t // max(1, n // 3)),
    }


def _timed_resolve(recipe, n: int) -> dict:
    from opake.dpftrl.strategies import strategy as strategy_module

    strategy_module._resolve_blt.cache_clear()
    wall, cpu = time.perf_counter(), time.process_time()
    mech = recipe.resolve(n_steps=n, min_sep=1, max_participations=1)
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "num_buffers": mech.num_buffers,
            "max_loss": float(mech.max_loss)}


def schedule_rows(sizes, settings=SCHEDULE_SGD, repeats: int = 3) -> list[dict]:
    """Cold resolves with and without the warmup-cosine schedule, per size and SGD setting:
    ``repeats`` alternating pairs (constant, then scheduled) in this process. The ratio
    scheduled / constant is given as min(scheduled) / min(constant) and as the median of the
    pairs' ratios, in wall and in CPU seconds, with the load average (1 minute) before and after."""
    from opake.dpftrl.noise import blt_strategy

    import opake.dpftrl.strategies.blt_optimize  # noqa: F401 - imported outside the timed region

    rows = []
    for n in sizes:
        eta = tuple(warmup_cosine(n))
        for label, sgd in settings:
            load_before = os.getloadavg()[0]
            pairs = [(_timed_resolve(blt_strategy(workload="parameters", **sgd), n),
                      _timed_resolve(blt_strategy(workload="parameters", lr_schedule=eta, **sgd), n))
                     for _ in range(repeats)]
            constant = min((c for c, _ in pairs), key=lambda run: run["wall"])
            scheduled = min((s_ for _, s_ in pairs), key=lambda run: run["wall"])
            rows.append({
                "n_steps": n, "sgd": label, "constant": constant, "scheduled": scheduled, "runs": pairs,
                "ratio_wall": scheduled["wall"] / constant["wall"],
                "ratio_wall_median": float(np.median([s_["wall"] / c["wall"] for c, s_ in pairs])),
                "ratio_cpu": min(s_["cpu"] for _, s_ in pairs) / min(c["cpu"] for c, _ in pairs),
                "ratio_cpu_median": float(np.median([s_["cpu"] / c["cpu"] for c, s_ in pairs])),
                "load": (load_before, os.getloadavg()[0]),
            })
            print(f"  [schedule] n={n} {label}: {scheduled['wall']:.2f} s, ratio {rows[-1]['ratio_wall']:.2f}",
                  file=sys.stderr, flush=True)
    return rows


def format_schedule_table(rows) -> str:
    header = (f"{'n':>9}  {'SGD':<14}  {'const s':>8}  {'B':>2}  {'sched s':>8}  {'B':>2}  {'sqrt(loss)':>10}"
              f"  {'ratio min':>9}  {'ratio med':>9}  {'cpu min':>7}  {'cpu med':>7}  {'load':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        c, s_ = r["constant"], r["scheduled"]
        load = f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        lines.append(f"{r['n_steps']:>9}  {r['sgd']:<14}  {c['wall']:>8.2f}  {c['num_buffers']:>2}  {s_['wall']:>8.2f}"
                     f"  {s_['num_buffers']:>2}  {math.sqrt(s_['max_loss']):>10.4f}  {r['ratio_wall']:>9.2f}"
                     f"  {r['ratio_wall_median']:>9.2f}  {r['ratio_cpu']:>7.2f}  {r['ratio_cpu_median']:>7.2f}"
                     f"  {load:>9}")
    return "\n".join(lines)


def buffer_rows() -> list[dict]:
    """The chosen buffer count against two more buffers forced and the best Toeplitz strategy."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dense  # the torch SGD oracle of the tests
    from optimal_toeplitz import optimal_toeplitz

    from opake.dpftrl.participation import Participation
    from opake.dpftrl.strategies import blt, blt_optimize, blt_workload

    rows = []
    for n in (64, 128, 256, 2_000, 20_000):
        for name, eta in test_schedules(n).items():
            ctx, workload = Participation(n, 1, 1), blt_workload.ParameterWorkload(0.9)
            chosen = blt_optimize.optimize(ctx, lr_schedule=eta, workload=workload)
            forced = blt_optimize.optimize(ctx, lr_schedule=eta, workload=workload, min_gain=-math.inf,
                                           max_buffers=chosen.params.num_buffers + 2)
            row = {"n_steps": n, "schedule": name, "num_buffers": chosen.params.num_buffers,
                   "loss": chosen.max_loss, "loss_by_buffers": list(chosen.loss_by_buffers),
                   "forced_buffers": forced.params.num_buffers, "forced_loss": forced.max_loss}
            if n <= 256:
                w = dense.torch_sgd_trajectory_matrix(n, 0.9, 0.0, False, eta)
                row["toeplitz_loss"] = optimal_toeplitz(w, blt.coefficients(chosen.params, n))[0]
            rows.append(row)
            print(f"  [buffers] n={n} {name}", file=sys.stderr, flush=True)
    return rows


def format_buffer_table(rows) -> str:
    header = (f"{'n':>6}  {'schedule':<14}  {'B':>2}  {'loss':>12}  {'B+2':>3}  {'forced loss':>12}"
              f"  {'forced/B':>9}  {'Toeplitz':>12}  {'B/Toeplitz':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        toeplitz = r.get("toeplitz_loss")
        lines.append(f"{r['n_steps']:>6}  {r['schedule']:<14}  {r['num_buffers']:>2}  {r['loss']:>12.6f}"
                     f"  {r['forced_buffers']:>3}  {r['forced_loss']:>12.6f}  {r['forced_loss'] / r['loss']:>9.6f}"
                     f"  {_fmt(toeplitz, '.6f', 12)}  {_fmt(None if toeplitz is None else r['loss'] / toeplitz, '.5f', 10)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Peer (jax-privacy, in its own interpreter)


def peer_python(env_var: str = "OPAKE_PEER_JAXP", default: str = "peer-jaxp") -> Path | None:
    venv = Path(os.environ.get(env_var, ROOT.parent / default))
    python = venv / "bin" / "python"
    return python if python.exists() else None


def load_peer_cache(path: Path = PEER_CACHE) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"contexts": {}}


def run_peer(python: Path, n: int, min_sep: int, k: int | None, error: str, timeout: float,
             runner: Path = PEER_RUNNER) -> dict:
    """Optimize one BLT with a peer in its own interpreter (sequential, low priority)."""
    cmd = [str(python), str(runner), str(n), str(min_sep), str(k), error, str(MAX_BUFFERS)]
    if os.name == "posix":
        cmd = ["nice", "-n", "15", *cmd]
    env = dict(os.environ, JAX_ENABLE_X64="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": "too slow", "timeout_seconds": timeout}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1][:200] if lines else f"exit status {proc.returncode}"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": "unreadable output from the peer runner"}


# ---------------------------------------------------------------------------------------------
# Table


def _fmt(value, spec: str, width: int) -> str:
    if value is None:
        return "-".rjust(width)
    if isinstance(value, str):
        return value.rjust(width)
    return format(value, spec).rjust(width)


COLUMNS = [  # (header, key, format, width)
    ("context", "label", "", 22),
    ("err", "error", "", 4),
    ("B", "num_buffers", "d", 3),
    ("S", "sensitivity", ".5f", 9),
    ("sqrt(loss)", "sqrt_loss", ".6f", 11),
    ("optimal", "optimal_toeplitz_sqrt_max_loss", ".6f", 9),
    ("/optimal", "ratio_optimal", ".6f", 9),
    ("time s", "seconds", ".3f", 9),
    ("peer B", "peer_num_buffers", "d", 6),
    ("peer sqrt", "peer_sqrt_loss", ".6f", 10),
    ("peer s", "peer_seconds", ".1f", 8),
    ("loss o/p", "loss_ratio", ".5f", 9),
    ("time o/p", "time_ratio", ".2g", 9),
]


def format_table(rows: list[dict]) -> str:
    header = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, _, _, w) in enumerate(COLUMNS))
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for i, (_, key, spec, width) in enumerate(COLUMNS):
            value = row.get(key)
            cells.append(str(value).ljust(width) if i == 0 else _fmt(value, spec, width))
        line = "  ".join(cells).rstrip()
        if row.get("ours_error"):
            line = "  ".join(cells[:2]) + "  resolve() failed: " + row["ours_error"]
            if row.get("peer_sqrt_loss") is not None:
                line += (f"   [peer: B={row.get('peer_num_buffers')} sqrt(loss)={row['peer_sqrt_loss']:.6f}"
                         f" {row.get('peer_seconds') or float('nan'):.1f} s]")
        lines.append(line)
        if row.get("peer_note"):
            lines.append(" " * 24 + "peer: " + row["peer_note"])
    return "\n".join(lines)


def build_row(label, n, b, k, error, ours: dict, optimal: float | None, peer: dict | None) -> dict:
    row = {"label": label, "n_steps": n, "min_sep": b, "max_participations": k, "error": error}
    if "error" in ours:
        row["ours_error"] = ours["error"]
    else:
        row.update({key: ours[key] for key in
                    ("num_buffers", "sensitivity", "sqrt_loss", "loss", "max_loss", "mean_loss",
                     "seconds", "theta", "omega")})
    if optimal is not None:
        row["optimal_toeplitz_sqrt_max_loss"] = optimal
        if "sqrt_loss" in row and error == "max":
            row["ratio_optimal"] = row["sqrt_loss"] / optimal
    if peer is not None:
        if "loss" in peer:
            row["peer_num_buffers"] = peer.get("num_buffers")
            row["peer_loss"] = peer["loss"]
            row["peer_sqrt_loss"] = math.sqrt(peer["loss"])
            row["peer_seconds"] = peer.get("seconds")
            row["peer_theta"], row["peer_omega"] = peer.get("theta"), peer.get("omega")
            if "loss" in row:
                row["loss_ratio"] = row["loss"] / peer["loss"]
                if peer.get("seconds"):
                    row["time_ratio"] = row["seconds"] / peer["seconds"]
            if peer.get("theta") is not None:
                mine = evaluate_with_ours(peer["theta"], peer["omega"], n, b, k, error)
                if mine is not None:
                    # Same parameters, our formulas vs the peer's: should agree to ~1e-9.
                    row["peer_params_loss_by_opake"] = mine
                    row["peer_params_loss_rel_diff"] = mine / peer["loss"] - 1.0
        elif "skipped" in peer:
            row["peer_note"] = f"skipped ({peer['skipped']})"
        elif "error" in peer:
            row["peer_note"] = f"failed: {peer['error']}"
    return row


def add_pypi(row: dict, entry: dict | None) -> None:
    """opake 0.16.1 (PyPI) figures for the row's context, when known."""
    if not entry:
        return
    if "loss" not in entry:
        note = entry.get("unsupported") or entry.get("skipped") or entry.get("error")
        row["pypi"] = {"note": note}
        return
    pypi = {key: entry.get(key) for key in ("num_buffers", "loss", "seconds", "theta", "omega")}
    pypi["sqrt_loss"] = math.sqrt(entry["loss"])
    if "loss" in row:
        pypi["loss_ratio"] = row["loss"] / entry["loss"]
        if entry.get("seconds"):
            pypi["time_ratio"] = row["seconds"] / entry["seconds"]
    row["pypi"] = pypi


def format_pypi_table(rows: list[dict]) -> str:
    header = (f"{'context':<22}  {'err':>4}  {'B':>3}  {'sqrt(loss)':>11}  {'seconds':>8}"
              f"  {'loss o/p':>9}  {'time o/p':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        pypi = row.get("pypi")
        if pypi is None:
            continue
        start = f"{row['label']:<22}  {row['error']:>4}"
        if "note" in pypi:
            lines.append(f"{start}  {pypi['note']}")
            continue
        lines.append(
            f"{start}  {_fmt(pypi['num_buffers'], 'd', 3)}  {_fmt(pypi['sqrt_loss'], '.6f', 11)}"
            f"  {_fmt(pypi['seconds'], '.1f', 8)}  {_fmt(pypi.get('loss_ratio'), '.5f', 9)}"
            f"  {_fmt(pypi.get('time_ratio'), '.2g', 9)}"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-peer", action="store_true",
                        help="recompute jax-privacy's BLTs live (needs $OPAKE_PEER_JAXP or ../peer-jaxp; minutes per context)")
    parser.add_argument("--run-pypi", action="store_true",
                        help="recompute opake 0.16.1 (PyPI) live (needs $OPAKE_PEER_OPAKE or ../peer-opake)")
    parser.add_argument("--update-cache", action="store_true",
                        help="with --run-peer / --run-pypi: store the live results in the peer cache files")
    parser.add_argument("--peer-timeout", type=float, default=600.0,
                        help="seconds before a live peer call is abandoned as too slow (default 600)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only contexts whose label contains TEXT (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path (default benchmarks/out/blt_resolve"
                                                                 "[_quick].json)")
    parser.add_argument("--schedule-sizes", type=int, nargs="*", default=None,
                        help="horizons of the learning-rate schedule table (default 1e3 1e4 1e5 1e6, quick 1e3; "
                             "none to skip)")
    parser.add_argument("--quick", action="store_true",
                        help="seconds, a smoke test: contexts 'single 1e3' and 'n=2000 b=100 k=None' (unless --only), "
                             "the schedule table at n = 1e3 with momentum only")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating constant / scheduled resolves per row of the schedule table (default 3)")
    parser.add_argument("--buffers", action="store_true",
                        help="also check the buffer counts under schedules (forced counts, optimal Toeplitz; minutes)")
    args = parser.parse_args(argv)
    if args.quick and not args.only:
        args.only = ["single 1e3", "n=2000 b=100 k=None"]
    if args.schedule_sizes is None:
        args.schedule_sizes = [1_000] if args.quick else list(SCHEDULE_SIZES)
    if args.out is None:
        args.out = OUT_FILE.with_name("blt_resolve_quick.json") if args.quick else OUT_FILE

    contexts = [c for c in CONTEXTS if not args.only or any(t in c[0] for t in args.only)]
    singles = [n for (_, n, b, k, e) in contexts if k == 1]
    optimal = optimal_toeplitz_sqrt_max_loss(set(singles) | set(OPTIMAL_TABLE))
    problems = check_optimal_table(optimal)

    cache = load_peer_cache()
    python = peer_python() if args.run_peer else None
    if args.run_peer and python is None:
        print("--run-peer: no jax-privacy environment (set OPAKE_PEER_JAXP); using the cache", file=sys.stderr)
    live: dict[str, dict] = {}
    pypi_cache = load_peer_cache(PYPI_CACHE)
    pypi_python = peer_python("OPAKE_PEER_OPAKE", "peer-opake") if args.run_pypi else None
    if args.run_pypi and pypi_python is None:
        print("--run-pypi: no PyPI-opake environment (set OPAKE_PEER_OPAKE); using the cache", file=sys.stderr)
    pypi_live: dict[str, dict] = {}

    rows = []
    for label, n, b, k, error in contexts:
        ours = resolve_ours(n, b, k, error)
        key = context_key(n, b, k, error)
        if python is not None:
            print(f"[peer] {label} ...", file=sys.stderr, flush=True)
            peer = run_peer(python, n, b, k, error, args.peer_timeout)
            live[key] = peer
        else:
            peer = cache.get("contexts", {}).get(key)
        single = k == 1 and error == "max"
        rows.append(build_row(label, n, b, k, error, ours, optimal.get(n) if single else None, peer))
        if pypi_python is not None:
            print(f"[opake 0.16.1] {label} ...", file=sys.stderr, flush=True)
            pypi_live[key] = run_peer(pypi_python, n, b, k, error, args.peer_timeout, runner=PYPI_RUNNER)
            add_pypi(rows[-1], pypi_live[key])
        else:
            add_pypi(rows[-1], pypi_cache.get("contexts", {}).get(key))

    if live and args.update_cache:
        for entry in live.values():
            version = entry.pop("jax_privacy_version", None)
            jax_version = entry.pop("jax_version", None)
            if version:
                cache["jax_privacy_version"] = version
            if jax_version:
                cache["jax_version"] = jax_version
        cache.setdefault("peer", "jax-privacy")
        cache.setdefault("contexts", {}).update(live)
        cache["date"] = datetime.date.today().isoformat()
        PEER_CACHE.parent.mkdir(parents=True, exist_ok=True)
        PEER_CACHE.write_text(json.dumps(cache, indent=1) + "\n")

    if pypi_live and args.update_cache:
        for entry in pypi_live.values():
            for field in ("opake_pypi_version", "torch_version"):
                value = entry.pop(field, None)
                if value:
                    pypi_cache[field] = value
        pypi_cache.setdefault("peer", "opake 0.16.1 (PyPI)")
        pypi_cache.setdefault("contexts", {}).update(pypi_live)
        pypi_cache["date"] = datetime.date.today().isoformat()
        PYPI_CACHE.write_text(json.dumps(pypi_cache, indent=1) + "\n")
    if pypi_python is not None:
        pypi_source = "live run"
    elif pypi_cache.get("contexts"):
        pypi_source = f"cached from {pypi_cache.get('date', '?')} ({PYPI_CACHE.relative_to(ROOT)})"
    else:
        pypi_source = "absent"

    if python is not None:
        peer_source = "live run"
    elif cache.get("contexts"):
        peer_source = f"cached from {cache.get('date', '?')} ({PEER_CACHE.relative_to(ROOT)})"
    else:
        peer_source = "absent"
    peer_version = next((e.get("jax_privacy_version") for e in live.values() if e.get("jax_privacy_version")),
                        cache.get("jax_privacy_version"))

    print(f"BLT resolve: opake {opake_version()}, max_buffers={MAX_BUFFERS}, one cold resolve per context")
    print(f"peer: jax-privacy {peer_version or '?'} buffered_toeplitz.optimize, timings {peer_source}")
    print("sqrt(loss): loss = S^2 x max (or mean) error; /optimal: vs optimal Toeplitz sum_{k<n} c_k^2;"
          " o/p: ours / peer (loss, seconds)")
    print()
    print(format_table(rows))
    diffs = [abs(r["peer_params_loss_rel_diff"]) for r in rows if "peer_params_loss_rel_diff" in r]
    if diffs:
        print(f"\npeer's parameters re-evaluated with opake's formulas: max |relative loss difference| = {max(diffs):.2e}")
    pypi_table = format_pypi_table(rows)
    if pypi_table:
        print(f"\nopake 0.16.1 from PyPI (blt_strategy; max error only), timings {pypi_source}; o/p: ours / it")
        print(pypi_table)
    for problem in problems:
        print("WARNING:", problem)
    if not problems:
        print(f"optimal Toeplitz values match the docs/math.md table ({len(OPTIMAL_TABLE)} values, 6 decimals)")

    settings = SCHEDULE_SGD[:1] if args.quick else SCHEDULE_SGD
    sched_rows = schedule_rows(args.schedule_sizes, settings, args.repeats) if args.schedule_sizes else []
    if sched_rows:
        print(f"\nlearning-rate schedule (torch.optim.SGD parameter workload, 5% warmup + cosine); {args.repeats} "
              f"alternating cold resolves\n(the same workload without a schedule, then with it) per row in this "
              f"process; const s / sched s: the fastest, wall;\nratio = sched / const: min = fastest / fastest, "
              f"med = median of the pairs' ratios, in wall and cpu seconds; load: 1-minute load average")
        print(format_schedule_table(sched_rows))
    buf_rows = buffer_rows() if args.buffers else []
    if buf_rows:
        print("\nbuffer counts under schedules (momentum 0.9): chosen B, two more forced, best Toeplitz (n <= 256)")
        print(format_buffer_table(buf_rows))

    report = {
        "benchmark": "blt_resolve",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "opake_version": opake_version(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "max_buffers": MAX_BUFFERS,
        "peer": {"name": "jax-privacy", "version": peer_version, "source": peer_source},
        "pypi_peer": {"name": "opake (PyPI)", "version": pypi_cache.get("opake_pypi_version"),
                      "source": pypi_source},
        "optimal_toeplitz_check": problems or "ok",
        "rows": rows,
        "schedule_rows": sched_rows,
        "buffer_rows": buf_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
