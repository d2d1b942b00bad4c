"""benchmarks/quality_regime.py --quick: both settings and optimizers, every method and report column on tiny sizes, and the
resumable JSON (a second run does no run again); its Opacus peer where ../peer-opacus (or
``OPAKE_PEER_OPACUS``) is installed. Also the tuning rule on made-up validation losses (no
training): the grid is extended past whichever end holds the best rate."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality_regime.py"
ABSENT = str(ROOT / "benchmarks" / "out" / "no-such-peer")


def _module():
    spec = importlib.util.spec_from_file_location("quality_regime_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(out, *extra, peer=ABSENT):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if peer is not None:
        environment["OPAKE_PEER_OPACUS"] = peer
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *extra], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=environment)


def test_the_tuning_grid_moves_past_an_edge_until_the_best_rate_is_inside():
    regime = _module()
    assert [regime.rate_of(k) for k in (-6, -5, -4, 0, 1)] == [1e-3, 3e-3, 1e-2, 1.0, 3.0]
    assert all(regime._index(regime.rate_of(k)) == k for k in range(regime.GRID[0], regime.GRID[1] + 1))
    jobs, _ = regime.next_jobs({}, -4, (0, 1, 2), 12)
    assert jobs == [(3e-3, 0), (1e-2, 0), (3e-2, 0)]
    losses = {3e-3: 5.0, 1e-2: 4.0, 3e-2: 3.0}  # the best at the upper end: one more rate above
    runs = {(rate, 0): {"validation": value} for rate, value in losses.items()}
    assert regime.next_jobs(runs, -4, (0, 1, 2), 12)[0] == [(0.1, 0)]
    runs[(0.1, 0)] = {"validation": 3.5}  # now inside: the other seeds at the best
    jobs, state = regime.next_jobs(runs, -4, (0, 1, 2), 12)
    assert jobs == [(3e-2, 1), (3e-2, 2)] and state == {"rate": 3e-2, "edge": False}
    runs = {(rate, 0): {"validation": value} for rate, value in {1e-3: 2.0, 3e-3: 3.0, 1e-2: float("inf")}.items()}
    assert regime.next_jobs(runs, -5, (0, 1, 2), 12)[0] == [(3e-4, 0)]  # a diverged rate counts as worst
    runs = {(3e-3, 0): {"validation": 3.0}}  # a run left from another start: the rates between are filled in
    assert regime.next_jobs(runs, -2, (0, 1, 2), 12)[0] == [(1e-2, 0), (3e-2, 0), (0.1, 0), (0.3, 0)]


@pytest.mark.slow
def test_quick_mode_runs_both_settings_and_optimizers_and_every_method_and_resumes(tmp_path, capsys):
    # Two stages of the four cover both settings (pretrained, from scratch) and both optimizers.
    stages = ("--stages", "finetune-adamw", "scratch-sgd")
    out = tmp_path / "regime.json"
    done = _run(out, "--no-opacus", *stages)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    for stage in ("finetune, adamw", "scratch, sgd"):
        assert stage in done.stdout
    assert "test loss mean +- std" in done.stdout and "pred. error" in done.stdout
    data = json.loads(out.read_text())
    cells = {name.rsplit("|", 2)[0] for name in data["runs"]}
    for method in ("non-private", "opake default", "DP-SGD (opake)", "BLT", "BandMF"):
        assert sum(cell.endswith("|" + method) for cell in cells) == 2, method
    for name, result in data["runs"].items():
        assert result["seconds"] > 0 and result["validation"] > 0 and result["test"] > 0, name
    predicted = [cell["predicted"]["error"] for cell in data["cells"].values() if "predicted" in cell]
    assert len(predicted) == 8 and all(error > 0 for error in predicted)  # 2 stages x 4 private opake methods
    again = _run(out, "--no-opacus", *stages)  # everything is in the file: no run again, the same table
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r"seed \d+: validation", again.stdout) and "bit-identical to" not in again.stdout
    assert json.loads(out.read_text())["runs"] == data["runs"]
    assert _module().main(["--report", "--out", str(out)]) == 0   # the report alone: no interpreter to start
    assert "scratch, sgd" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_mode_with_the_opacus_peer(tmp_path):
    regime = _module()
    if regime.peer_python() is None:
        pytest.skip("Opacus' own interpreter is not installed (../peer-opacus or OPAKE_PEER_OPACUS)")
    out = tmp_path / "regime.json"
    done = _run(out, "--stages", "finetune-adamw", "--methods", "DP-SGD (opake)", "Opacus DP-SGD", peer=None)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    opacus = {name: r for name, r in data["runs"].items() if "|Opacus DP-SGD|" in name}
    opake = {name: r for name, r in data["runs"].items() if "|DP-SGD (opake)|" in name}
    assert len(opacus) >= 4 and not data["errors"]
    # The same mechanism on both sides: noise multipliers within 2% (PRV against PLD), seeds differ.
    sigma = next(iter(opake.values()))["sigma"]
    assert all(abs(r["sigma"] / sigma - 1) < 0.02 for r in opacus.values())
    assert len({r["test"] for r in opacus.values()}) == len(opacus)


@pytest.mark.slow
def test_a_failing_peer_is_reported_and_the_run_exits_non_zero(tmp_path):
    """An interpreter that cannot run the peer: the error is in the JSON and on stderr, the exit is 1."""
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no opacus here' >&2\nexit 3\n")
    broken.chmod(0o755)
    out = tmp_path / "regime.json"
    done = _run(out, "--stages", "finetune-adamw", "--methods", "Opacus DP-SGD", "--seeds", "0", peer=str(broken))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no opacus here" in done.stderr
    errors = json.loads(out.read_text())["errors"]
    assert any("exited 3" in message and "no opacus here" in message for message in errors.values())


def test_the_report_merges_stages_run_by_other_processes_and_refuses_another_configuration(tmp_path):
    regime = _module()
    meta = {"config": {"sizes": 1}}
    first, second, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"meta": meta, "runs": {"x|1|0": {"test": 1.0}}, "cells": {"x": {}}, "errors": {}}))
    second.write_text(json.dumps({"meta": meta, "runs": {"y|1|0": {"test": 2.0}}, "cells": {"y": {}},
                                  "errors": {"z": "failed"}}))
    other.write_text(json.dumps({"meta": {"config": {"sizes": 2}}, "runs": {}, "cells": {}, "errors": {}}))
    data = regime.merged(first, [second])
    assert set(data["runs"]) == {"x|1|0", "y|1|0"} and set(data["cells"]) == {"x", "y"} and data["errors"] == {
        "z": "failed"}
    with pytest.raises(SystemExit, match="another configuration"):
        regime.merged(first, [other])
