"""benchmarks/opacus_epsilon.py --quick runs and prints both tables with sane numbers (seconds).

Its epsilon column is the adapter's; where Opacus is installed beside the repository (the
benchmark's peer environment) the ratio to Opacus' PRV for the same sample rate and steps is at
most 1, else the column reads nan.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_prints_both_tables():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "opacus_epsilon.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    part1 = [line for line in lines if line.startswith("| tiny") and "SGD" not in line]
    part2 = [line for line in lines if line.startswith("| tiny") and "SGD" in line]
    assert len(part1) == 2 and len(part2) == 2
    for line in part1:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        epsilon, rdp, ratio = float(cells[2]), float(cells[3]), float(cells[5])
        assert 0 < epsilon < rdp                      # the PLD is tighter than the RDP bound
        assert math.isnan(ratio) or ratio <= 1.0      # no larger than Opacus' PRV for the same q and steps
    for line in part2:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert float(cells[4]) <= float(cells[1])    # the chosen run meets its target epsilon
