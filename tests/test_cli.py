"""The opake command: plan output checked against independent accounting references."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest

from opake.cli import main


def _plan_json(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_calibrates_every_strategy_to_the_budget(capsys):
    report = _plan_json(capsys, "--n-steps", "300", "--min-sep", "30", "--max-participations", "4",
                        "--epsilon", "2.0", "--delta", "1e-6", "--max-buffers", "3")
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert set(rows) >= {"BLT", "DP-SGD"}
    # The whole run is one Gaussian with noise multiplier sigma / S (docs/math.md section 6), so at
    # equal (epsilon, delta) sigma / S is the same for every strategy and equals the Gaussian
    # mechanism's noise multiplier, here from dp_accounting (an independent implementation).
    sigma_eff = dp_accounting.get_sigma_gaussian(2.0, 1e-6)
    for row in rows.values():
        assert row["epsilon"] <= 2.0
        assert row["noise_multiplier"] / row["sensitivity"] == pytest.approx(sigma_eff, rel=1e-5)
    assert rows["DP-SGD"]["sensitivity"] == pytest.approx(2.0)  # sqrt(k'), k' = 4
    assert rows["DP-SGD"]["rmse_max"] == pytest.approx(rows["DP-SGD"]["noise_multiplier"] * math.sqrt(300), rel=1e-12)
    assert rows["BLT"]["rmse_max"] < rows["DP-SGD"]["rmse_max"]
    assert rows["BLT"]["state_bytes_per_parameter"] == 4 * len(report["blt"]["theta"])


def test_plan_defaults_to_the_seed_example(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "n_steps=5000, min_sep=100, max_participations=5" in out
    assert "DP-SGD" in out and "BLT" in out


def test_bad_input_is_a_clear_error(capsys):
    assert main(["plan", "--min-sep", "6000"]) == 2
    err = capsys.readouterr().err
    assert "min_sep" in err and "n_steps" in err


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(["plan", "--n-steps", "200", "--min-sep", "20", "--max-participations", "2",
                 "--max-buffers", "2", "--plot", str(path)]) == 0
    assert path.stat().st_size > 1000


def test_context_mode_keeps_its_unamplified_caveat(capsys):
    assert main(["plan", "--n-steps", "200", "--min-sep", "20", "--max-participations", "2",
                 "--max-buffers", "2"]) == 0
    out = capsys.readouterr().out
    assert "no amplification" in out and "without amplification" in out
    assert "--num-examples, --batch-size, --epochs" in out  # where the Poisson DP-SGD comparison is


def test_context_options_alone_still_default_the_others(capsys):
    report = _plan_json(capsys, "--n-steps", "300", "--max-buffers", "2")
    assert report["context"] == {"n_steps": 300, "min_sep": 100, "max_participations": 5,
                                 "effective_participations": 3}


def test_a_data_set_plan_states_what_make_private_takes_without_a_strategy(capsys):
    """One table: the candidates make_private chooses among, the one it takes marked, with the
    noise multiplier and epsilon its plan has (make_private's own plan, built here, agrees)."""
    report = _plan_json(capsys, "--num-examples", "1200", "--batch-size", "40", "--epochs", "20", "--epsilon", "3")
    rows = {r["strategy"]: r for r in report["strategies"]}
    proven = ("BLT", "BandMF", "DP-SGD Poisson")  # the amplified BLT row is not proven for adaptive gradients
    least = min(proven, key=lambda name: rows[name]["rmse_max"])
    default = report["make_private_default"]
    assert least == "BandMF" and default["chosen"].startswith("BandMF")  # 4 bands: 30.9 against 34.1 and 35.1
    assert [name for name, row in rows.items() if row["chosen"]] == ["BandMF"]
    assert default["epsilon"] == rows["BandMF"]["epsilon"] <= 3.0
    assert default["noise_multiplier"] == rows["BandMF"]["noise_multiplier"]
    assert default["chosen"] in default["reason"]
    from opake.random import key
    from opake.torch import plan_privacy

    plan = plan_privacy(num_examples=1200, batch_size=40, epochs=20, max_grad_norm=1.0, key=key(0),
                        target_epsilon=3.0, target_delta=1e-5)
    assert (plan.noise_multiplier, plan.epsilon) == (default["noise_multiplier"], default["epsilon"])


def test_the_command_answers_help_without_importing_the_planner():
    """`opake --help` must answer at once: the CLI module imports neither torch, scipy nor dp_accounting
    (each command imports what it runs). Checked in a fresh interpreter, as the command starts."""
    import subprocess
    import sys

    script = ("import sys, opake.cli; heavy = [m for m in ('torch', 'scipy', 'dp_accounting') if m in sys.modules]; "
              "print(heavy)")
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "[]"
    help_text = subprocess.run([sys.executable, "-m", "opake", "--help"], capture_output=True, text=True, check=True)
    assert "plan" in help_text.stdout
