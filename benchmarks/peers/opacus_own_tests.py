"""Opacus' own ``privacy_engine_test.py`` run against opake's adapter, its import lines changed.

    .venv/bin/python benchmarks/peers/opacus_own_tests.py [--workdir /tmp/opacus_port] [-k EXPR] [-n 2]

Opacus' test file is the specification of its ``PrivacyEngine`` (docs/from_opacus.md, "Opacus'
own tests"). This script takes it from a git mirror of Opacus' repository (``--mirror``, default
``/work/.mirror/pytorch+opacus/repo``, at ``--rev``), with the test utilities it imports
(``opacus/tests/utils.py``: plain torch models), into a folder outside this repository, rewrites
the lines that import from ``opacus`` (and those lines only: ``IMPORTS`` below) to opake's
names, and runs pytest on it in this interpreter (opake's environment; Opacus itself is not
imported). It prints the counts and the failures grouped by their first error line.

Two third-party packages the file imports and opake does not need, ``torchvision`` (its models
and ``FakeData``) and ``opt_einsum``, are installed into ``WORKDIR/deps`` with pip, without
their dependencies, when this interpreter lacks them (torchvision at the release paired with
the installed torch). Where torchvision's compiled operators cannot load (PyPI's wheel is built
for CUDA; a CPU-only torch lacks its libraries), a ``conftest.py`` beside the file declares the two
operators its Python modules register fakes for, so its models, transforms and ``FakeData`` import
(the file uses nothing else of it). One test builds ``densenet121(pretrained=True)``, whose ImageNet
weights this machine cannot download: the conftest writes a freshly initialized densenet121's weights
under that download's file name in the run's own ``TORCH_HOME`` (``WORKDIR/torch_home``); the test
checks an error raised before any weight is used.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TEST_FILE = "opacus/tests/privacy_engine_test.py"
UTILS_FILE = "opacus/tests/utils.py"
DEFAULT_MIRROR = "/work/.mirror/pytorch+opacus/repo"

# Each import line of the Opacus file that names Opacus, and the line that replaces it. A line
# missing here stops the script (a newer file imports something new: map it, do not guess).
IMPORTS = {
    "from opacus import PrivacyEngine":
        "from opake.torch import PrivacyEngine",
    "from opacus.layers.dp_multihead_attention import DPMultiheadAttention":
        "from opake.torch.opacus import DPMultiheadAttention",
    # used only by test_generate_noise_in_secure_mode, which Opacus itself skips
    "from opacus.optimizers.optimizer import _generate_noise":
        "_generate_noise = None",
    "from opacus.schedulers import StepGradClip, StepNoise":
        "from opake.torch.opacus import StepGradClip, StepNoise",
    "from opacus.utils.module_utils import are_state_dict_equal":
        "from opake.torch.opacus import are_state_dict_equal",
    "from opacus.validators.errors import UnsupportedModuleError":
        "from opake.torch import ModelValidationError as UnsupportedModuleError",
    "from opacus.validators.module_validator import ModuleValidator":
        "from opake.torch import ModuleValidator",
}


def git_show(mirror: str, rev: str, path: str) -> str:
    return subprocess.run(["git", "-C", mirror, "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def rewrite_imports(source: str) -> str:
    """The file with each Opacus import line replaced (``IMPORTS``); every other line as it was."""
    lines = []
    for line in source.splitlines():
        stripped = line.strip()
        if re.match(r"(from|import)\s+opacus\b", stripped):
            if stripped not in IMPORTS:
                raise SystemExit(f"an Opacus import this script does not map: {stripped!r}; add it to IMPORTS")
            line = line[: len(line) - len(line.lstrip())] + IMPORTS[stripped]
        lines.append(line)
    return "\n".join(lines) + "\n"


def ensure_deps(deps: Path) -> None:
    """Install torchvision and opt_einsum into ``deps`` (no dependencies) where this interpreter lacks them."""
    import torch

    missing = []
    sys.path.insert(0, str(deps))
    if importlib.util.find_spec("torchvision") is None:
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        assert major == 2, torch.__version__
        missing.append(f"torchvision=={0}.{minor + 15}.*")  # torch 2.m pairs with torchvision 0.(m+15)
    if importlib.util.find_spec("opt_einsum") is None:
        missing.append("opt_einsum")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps),
                        *missing], check=True)


# Beside the test file, not in it: lets torchvision's pure-Python parts import without its C++ operators.
CONFTEST = '''import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.find_spec("torchvision")
try:
    torch.ops.load_library(str(next(Path(_spec.submodule_search_locations[0]).glob("_C*.so"))))
except (OSError, StopIteration):
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for _name in ("nms", "qnms"):
        _LIBRARY.define(f"{_name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

# densenet121(pretrained=True) downloads ImageNet weights, which this machine cannot: the file named
# by that download, in this run's own TORCH_HOME, holds a freshly initialized densenet121's weights.
from torchvision import models

_URL = models.DenseNet121_Weights.IMAGENET1K_V1.url
_TARGET = Path(torch.hub.get_dir()) / "checkpoints" / _URL.rsplit("/", 1)[-1]
if not _TARGET.exists():
    _TARGET.parent.mkdir(parents=True, exist_ok=True)
    torch.save(models.densenet121(weights=None).state_dict(), _TARGET)
'''


def prepare(workdir: Path, mirror: str, rev: str) -> Path:
    package = workdir / "opacus_port"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(git_show(mirror, rev, UTILS_FILE))
    (package / "privacy_engine_test.py").write_text(rewrite_imports(git_show(mirror, rev, TEST_FILE)))
    (workdir / "conftest.py").write_text(CONFTEST)
    (workdir / "pytest.ini").write_text("[pytest]\n")  # the rootdir: none of this repository's settings
    return package / "privacy_engine_test.py"


def summarize(report: Path) -> tuple[collections.Counter, dict]:
    counts, causes = collections.Counter(), collections.defaultdict(list)
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = (child.get("message") or child.text or "").strip().splitlines() or ["?"]
                causes[message[0][:160]].append(name)
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
    return counts, causes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/opacus_port")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR)
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("-n", type=int, default=0, help="pytest-xdist workers (0: none)")
    args, extra = parser.parse_known_args(argv)
    workdir = Path(args.workdir).resolve()
    if Path(__file__).resolve().parents[2] in workdir.parents:
        raise SystemExit("--workdir must be outside this repository (its pytest settings would apply)")
    deps = workdir / "deps"
    ensure_deps(deps)
    test_file = prepare(workdir, args.mirror, args.rev)
    report = workdir / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "--rootdir", str(workdir), str(test_file), *extra]
    if args.k:
        command += ["-k", args.k]
    if args.n:
        command += ["-n", str(args.n)]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(deps), str(workdir)]),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCH_HOME=str(workdir / "torch_home"))
    subprocess.run(command, cwd=workdir, env=environment)
    counts, causes = summarize(report)
    print(f"\nOpacus' {TEST_FILE} ({args.rev}) against opake's adapter: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped, of {sum(counts.values())}")
    for message, names in sorted(causes.items(), key=lambda item: -len(item[1])):
        print(f"\n{len(names):3d}  {message}")
        for name in names:
            print(f"       {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
