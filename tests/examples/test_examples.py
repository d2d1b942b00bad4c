"""Every script in examples/ runs (loops shortened with OPAKE_EXAMPLE_STEPS), and
examples/finetune_lora.py (reduced sizes) reports what it claims: the plan's epsilon, the same
epsilon in Trainer's logs, and a validation loss that LoRA fine-tuning lowered."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def _run(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPAKE_EXAMPLE_STEPS="50")
    return subprocess.run([sys.executable, script], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finetune_lora():
    """One run of finetune_lora.py for both tests below (OPAKE_EXAMPLE_STEPS is its --quick)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return _run("finetune_lora.py")


def test_all_seed_examples_have_a_script():
    assert {"noise_injection.py", "noise_multi_epoch.py", "privacy_accounting.py", "train_loop.py"} <= set(SCRIPTS)


@pytest.mark.slow   # a subprocess each, 3-8 s
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, request):
    done = request.getfixturevalue("finetune_lora") if script == "finetune_lora.py" else _run(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


@pytest.mark.slow
def test_finetune_lora_runs_and_reports_epsilon_and_validation_loss(finetune_lora):
    assert finetune_lora.returncode == 0, finetune_lora.stderr[-3000:]
    out = finetune_lora.stdout
    planned = re.search(r"noise multiplier ([\d.]+), epsilon ([\d.]+) at delta 1e-05", out)
    assert re.search(r"^why: .* has the least noise at epsilon 8", out, re.M), out  # the choice says why
    logged = re.search(r"epsilon in the logs: ([\d.]+)", out)
    losses = re.search(r"validation loss before ([\d.]+), after ([\d.]+)", out)
    assert planned and logged and losses, out
    assert float(planned.group(1)) > 0
    assert float(planned.group(2)) <= 8.0 + 5e-3  # calibrated to target_epsilon=8 (printed to 2 decimals)
    assert logged.group(1) == planned.group(2)
    assert float(losses.group(2)) < float(losses.group(1))
