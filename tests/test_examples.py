"""Every script in examples/ runs (loops shortened with OPAKE_EXAMPLE_STEPS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def test_all_seed_examples_have_a_script():
    assert {"noise_injection.py", "noise_multi_epoch.py", "privacy_accounting.py", "train_loop.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    env = dict(os.environ, OPAKE_EXAMPLE_STEPS="50")
    done = subprocess.run([sys.executable, script], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
