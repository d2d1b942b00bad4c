"""The planning progress line: silent when off or not a terminal, says what runs when on.

Also the wiring: make_private(progress=...), plan_dataset(progress=...) and ``opake plan
--progress / --no-progress`` report on stderr only when asked (or on a terminal), and a plan
reported on prints the same numbers as one that is not.
"""

from __future__ import annotations

import io
import threading
import warnings

import pytest
import torch
from torch import nn

import opake.progress
from opake.cli import main
from opake.dpftrl.noise import identity_strategy
from opake.planner import plan_dataset, plan_run
from opake.progress import Progress, calibration_reporter
from opake.random import key
from opake.torch import make_private


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_disabled_progress_writes_nothing_and_starts_no_thread():
    stream = _Terminal()
    progress = Progress(False, stream=stream, delay=0)
    with progress.stage("resolving"):
        progress.note("evaluation 1")
    progress.close("done")
    assert stream.getvalue() == "" and progress._ticker is None


def test_the_default_is_on_only_for_a_terminal():
    assert Progress(None, stream=io.StringIO()).enabled is False
    assert Progress(None, stream=_Terminal()).enabled is True
    assert Progress.of(False).enabled is False
    given = Progress(True, stream=io.StringIO())
    assert Progress.of(given) is given
    with pytest.raises(TypeError, match="progress must be None .*, True or False"):
        Progress.of("yes")


def test_forced_on_a_log_stream_every_report_is_a_whole_line():
    stream = io.StringIO()
    progress = Progress(True, stream=stream, delay=0)
    report = calibration_reporter(progress, 3.0)
    with progress.stage("calibrating"):
        report(4.8, 2.95)
        report(4.7, 3.01)
    progress.close("noise multiplier 4.75")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("opake: calibrating (")
    assert "evaluation 1: sigma 4.8, epsilon 2.95 (target 3)" in lines[1]
    assert "evaluation 2: sigma 4.7, epsilon 3.01 (target 3)" in lines[2]
    assert lines[3].startswith("opake: noise multiplier 4.75 (") and lines[3].endswith(" s)")
    assert "\r" not in stream.getvalue()


def test_on_a_terminal_the_line_is_rewritten_in_place_and_ended():
    stream = _Terminal()
    progress = Progress(True, stream=stream, delay=0)
    with progress.stage("resolving the strategy"):
        progress.note("a long optimization")
    progress.close("planned")
    text = stream.getvalue()
    assert text.lstrip("\r").startswith("opake: resolving the strategy (")
    assert text.endswith("\ropake: planned (0.0 s)\n")
    assert text.count("\n") == 1  # one line, rewritten with carriage returns
    assert progress._ticker is None  # joined by close
    assert not any(thread.name == "opake-progress" for thread in threading.enumerate())


class _UnsizedTerminal(_Terminal):
    def fileno(self):
        return 2


def test_a_terminal_reporting_no_size_gets_the_default_width(monkeypatch):
    # a pseudo-terminal nobody sized reports 0 columns: the line must not be cut to nothing
    monkeypatch.setattr(opake.progress.os, "get_terminal_size", lambda fd: __import__("os").terminal_size((0, 0)))
    monkeypatch.setenv("COLUMNS", "100")
    stream = _UnsizedTerminal()
    progress = Progress(True, stream=stream, delay=0)
    with progress.stage("choosing the bands: 256 band(s) " + "x" * 200):
        progress.note("evaluation 3: sigma 5.2, epsilon 7.99 (target 8)")
    progress.close()
    line = stream.getvalue().rstrip("\n").split("\r")[-1]  # the last report (close ends its line)
    assert line.startswith("opake: choosing the bands: 256 band(s) x")
    assert line.endswith("...: evaluation 3: sigma 5.2, epsilon 7.99 (target 8) (0 s)")
    assert len(line) == 99


def test_nothing_is_written_before_the_delay():
    stream = _Terminal()
    progress = Progress(True, stream=stream, delay=60)
    with progress.stage("fast"):
        progress.note("done at once")
    progress.close("planned")
    assert stream.getvalue() == ""


def _tiny_make_private(**overrides):
    model = nn.Linear(5, 3)
    arguments = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     dataset=torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,))),
                     batch_size=5, epochs=1, target_epsilon=2.5, target_delta=1e-5, max_grad_norm=1.0, key=key(0))
    arguments.update(overrides)
    return make_private(**arguments)


def test_make_private_with_progress_off_prints_nothing_and_warns_nothing(capfd, monkeypatch):
    monkeypatch.setattr(opake.progress, "DELAY_SECONDS", 0.0)  # would print at once if it were on
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning (numpy's RuntimeWarning included) fails the plan
        # the identity's bins are orthogonal: its amplified bound is proven, and calibrated like a BLT's
        _tiny_make_private(target_epsilon=2.25, strategy=identity_strategy(), progress=False)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_make_private_reports_its_calibration_when_asked():
    from opake.dpftrl.noise import blt_strategy

    stream = io.StringIO()
    private = _tiny_make_private(target_epsilon=2.75, strategy=blt_strategy(),
                                 progress=Progress(True, stream=stream, delay=0))
    text = stream.getvalue()
    assert f"calibrating the noise multiplier (balls in bins, {private.plan.accounting} bound)" in text
    assert "evaluation 1: sigma " in text
    assert f"opake: noise multiplier {private.noise_multiplier:.6g}: epsilon {private.epsilon:.6g} <= 2.75" in text
    # the same plan without a report: the same noise
    assert _tiny_make_private(target_epsilon=2.75, strategy=blt_strategy(),
                              progress=False).noise_multiplier == private.noise_multiplier
    # without a strategy the report names the mechanisms compared and prices the chosen one
    stream = io.StringIO()
    chosen = _tiny_make_private(target_epsilon=2.75, progress=Progress(True, stream=stream, delay=0))
    text = stream.getvalue()
    assert "BLT on balls in bins" in text and f"gives epsilon {chosen.epsilon:.6g}" in text


def test_plan_functions_report_their_stages_and_stay_silent_when_off(capfd):
    stream = io.StringIO()
    reported = plan_dataset(40, 10, 2, 3.0, 1e-5, max_buffers=2, progress=Progress(True, stream=stream, delay=0))
    text = stream.getvalue()
    for stage in ("BLT on balls in bins: resolving and calibrating", "choosing the bands: 1 band(s)",
                  "BLT amplified: calibrating the noise multiplier (4 bins)", "planned 5 rows"):
        assert stage in text
    quiet = plan_dataset(40, 10, 2, 3.0, 1e-5, max_buffers=2, progress=False)
    assert [r.noise_multiplier for r in quiet.rows] == [r.noise_multiplier for r in reported.rows]
    plan_run(40, 4, 2, 3.0, 1e-5, max_buffers=2, progress=False)
    assert capfd.readouterr().err == ""


def test_cli_progress_flags(capsys, monkeypatch):
    monkeypatch.setattr(opake.progress, "DELAY_SECONDS", 0.0)
    context = ["plan", "--n-steps", "40", "--min-sep", "4", "--max-participations", "2", "--max-buffers", "2"]
    assert main(context + ["--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert main(context) == 0  # default: stderr is not a terminal under pytest
    assert capsys.readouterr().err == ""
    assert main(context + ["--progress"]) == 0
    err = capsys.readouterr().err
    assert "opake: BLT: resolving the strategy for n_steps=40" in err and "opake: planned 3 strategies" in err
