"""Every benchmark stays runnable: each script in benchmarks/ runs with ``--quick`` (tiny sizes, its
real code path, seconds), exits 0 and prints its table.

The peers (jax-privacy, opake 0.16.1 from PyPI, Opacus) live in their own environments; the runs
here point ``OPAKE_PEER_*`` at a path that does not exist, so each script must skip its peer part
cleanly, as on a machine without them. The scripts run two at a time (this machine has two cores;
most of a quick run is starting Python and torch), longest first; each test waits for its own (under
pytest-xdist, one at a time: ``quick_run``). Every test here is slow (a subprocess of seconds).
A script's table is recognized by a line of its header (``TABLES``); ``test_every_script_is_covered``
asks each new script for its header here. ``opacus_epsilon.py --quick`` has its own test with checks of its numbers
(tests/benchmarks/test_opacus_epsilon.py), so it is not run twice.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
OWN_TEST = {"opacus_epsilon.py": "tests/benchmarks/test_opacus_epsilon.py",
            "quality_regime.py": "tests/benchmarks/test_quality_regime.py"}
# A line each script's table prints (its header), and the quick run's rough cost, longest first.
TABLES = {
    "quality.py": "test loss mean +- std",
    "distributed_finetune.py": "step s (max rank)",
    "accounting.py": "amplified bound per evaluation",
    "distributed.py": "gather ms",
    "finetune_step.py": "Throughput. ms:",
    "noise_engine.py": "floor ms  opake ms",
    "training_step.py": "plain ms opake ms",
    "adam_noise_correction.py": "| mechanism | optimizer |",
    "blt_resolve.py": "learning-rate schedule",
    "plan_time.py": "BLT named s",
    "band_mf.py": "poisson PLD accounting",
}
TIMEOUT = 300
ABSENT = str(ROOT / "benchmarks" / "out" / "no-such-peer")


def _scripts() -> list[str]:
    return sorted(path.name for path in BENCHMARKS.glob("*.py") if path.name not in OWN_TEST)


# A native abort while spawned gloo workers tear down after the profiler has run (seen once, in
# distributed_finetune.py under a full parallel run; never in isolation): the script is run once
# more, and only on exactly that signature (a Python error or a wrong table still fails at once).
_TEARDOWN_ABORT = ("terminate called without an active exception", "terminated with signal SIGABRT")


def _run(script: str) -> dict:
    result = _run_once(script)
    if result["returncode"] not in (0, None) and all(sign in result["stderr"] for sign in _TEARDOWN_ABORT):
        result = _run_once(script)
    return result


def _run_once(script: str) -> dict:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "OPAKE_PEER_OPACUS": ABSENT, "OPAKE_PEER_JAXP": ABSENT, "OPAKE_PEER_OPAKE": ABSENT}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True, text=True,
                              timeout=TIMEOUT, cwd=ROOT, env=environment)
    except subprocess.TimeoutExpired as expired:
        return {"returncode": None, "stdout": expired.stdout or "", "stderr": f"timed out after {TIMEOUT} s",
                "seconds": time.perf_counter() - started}
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "seconds": time.perf_counter() - started}


@pytest.fixture(scope="module")
def quick_run(request):
    """``quick_run(script)``: the result of ``script --quick``. In one process, the scripts selected
    in this session start together (two at a time) and each test waits for its own; under
    pytest-xdist (make test) the other worker already fills the second core, so each test runs its
    own script when it comes (and no worker starts scripts the other one runs)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        yield _run
        return
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_quick_mode_runs_and_prints_its_table"
                and hasattr(item, "callspec")]
    order = sorted(selected, key=lambda name: list(TABLES).index(name) if name in TABLES else -1)
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {script: pool.submit(_run, script) for script in order}
    yield lambda script: futures[script].result()
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("script", _scripts())
def test_quick_mode_runs_and_prints_its_table(script, quick_run):
    result = quick_run(script)
    where = f"benchmarks/{script} --quick ({result['seconds']:.0f} s)"
    assert result["returncode"] == 0, f"{where} failed:\n{result['stderr'][-3000:]}"
    header = TABLES.get(script)
    assert header is not None, f"add the header of benchmarks/{script}'s table to TABLES"
    assert header in result["stdout"], f"{where} printed no table:\n{result['stdout'][-2000:]}"
    assert "Traceback" not in result["stderr"], f"{where} printed a traceback:\n{result['stderr'][-3000:]}"


def test_every_script_is_covered():
    """Each benchmark has a quick run checked here (with its table's header) or its own test."""
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    for script, test in OWN_TEST.items():
        assert (ROOT / test).exists() and script in scripts
    for script in scripts - set(OWN_TEST):
        assert "--quick" in (BENCHMARKS / script).read_text(), f"benchmarks/{script} has no --quick mode"
    unnamed = sorted(scripts - set(OWN_TEST) - set(TABLES))
    assert not unnamed, f"name the header of each one's table in TABLES (tests/benchmarks/test_quick.py): {unnamed}"
    assert not set(TABLES) - scripts, f"TABLES names scripts that are gone: {sorted(set(TABLES) - scripts)}"


@pytest.mark.slow
def test_the_fine_tuning_profile_runs_and_times_every_part_of_the_private_step():
    """``finetune_step.py --profile`` (a mode of its own, which ``--quick`` alone does not reach): it
    broke unseen once, when the noise stage moved from the optimizer to the run."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "OPAKE_PEER_OPACUS": ABSENT}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "finetune_step.py"), "--quick", "--profile", "--models",
                           "gpt2"], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    inside = next(line for line in done.stdout.splitlines() if "inside the DP step" in line)
    for part in ("clipping passes (all)", "noise (noise_fn)", "AdamW step"):
        assert part in inside, f"the profile does not time {part!r}: {inside}"
