"""Scripts in the shape of Opacus' examples/mnist.py and cifar10.py run on opake with only the import changed.

tests/torch/opacus/opacus_examples/mnist_style.py and cifar10_style.py are written in the shape of Opacus'
two examples (their options and defaults, model, loops and Opacus calls) on random tensors of
MNIST's and CIFAR-10's shapes. Each is run here as a script, in a subprocess of this
interpreter, with small sizes (the number of examples divides the batch size, so that Opacus'
sample rate ``1 / ceil(N / B)`` and opake's ``B / N`` are the same). Checked: it completes and
writes only where its command line says; every epsilon it prints is non-decreasing and is, to
the printed digits, the PLD of the Poisson-subsampled Gaussian at its sigma, sample rate and
steps taken, computed here with dp_accounting directly; its text differs from its Opacus form in
the import line only; and where Opacus is importable here or the peer environment
/work/peer-opacus exists, the Opacus form runs too and opake's last epsilon is no larger.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "opacus_examples"
PEER_PYTHON = pathlib.Path("/work/peer-opacus/bin/python")
OPAKE_IMPORT = "from opake.torch import PrivacyEngine\n"
OPACUS_IMPORT = "from opacus import PrivacyEngine\n"
DELTA = 1e-5
EPSILON_PRINTED = re.compile(r"\(ε = ([0-9.]+), δ = ")

# Small runs at the examples' sigmas and clipping norms: N examples, batch size B, E epochs.
MNIST = dict(examples=256, batch=32, epochs=2, sigma=1.0)
MNIST_ARGS = ["--examples", "256", "-b", "32", "-n", "2", "--test-examples", "128", "--seed", "0",
              "--device", "cpu"]
# Batch size 2 of 64 examples: about one batch in eight is empty (Poisson sampling), and each still steps.
MNIST_RUNS = dict(examples=64, batch=2, epochs=1, sigma=1.0)
MNIST_RUNS_ARGS = ["--examples", "64", "-b", "2", "-n", "1", "-r", "2", "--test-examples", "64", "--seed", "1",
                   "--device", "cpu"]
CIFAR = dict(examples=128, batch=16, epochs=3, sigma=1.5, print_freq=10)
CIFAR_ARGS = ["--examples", "128", "--batch-size", "16", "--epochs", "3", "--test-examples", "64", "--lr", "0.01",
              "--seed", "0"]                      # two loader workers (the default -j 2)


def _pld_epsilon(sigma: float, rate: float, steps: int, delta: float = DELTA) -> float:
    """dp_accounting's PLD of the Poisson-subsampled Gaussian composed ``steps`` times (add/remove one)."""
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(delta)


def _opacus_form(text: str) -> str:
    assert text.count(OPAKE_IMPORT) == 1
    return text.replace(OPAKE_IMPORT, OPACUS_IMPORT)


def _run(python, script: pathlib.Path, args: list, cwd: pathlib.Path, opake: bool = True) -> str:
    """Run ``script`` with ``args`` in an empty ``cwd``; its standard output (progress bars off)."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONIOENCODING="utf-8", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")  # one thread: half the CPU time of two on 2 shared cores
    if opake:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([str(python), str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=600)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert not any(cwd.iterdir()), f"{script.name} wrote into its working directory: {list(cwd.iterdir())}"
    return done.stdout


def _epsilons(printed: str) -> list[float]:
    return [float(value) for value in EPSILON_PRINTED.findall(printed)]


def _assert_priced_by_the_pld(printed: list[float], sigma: float, rate: float, steps: list[int]) -> None:
    assert len(printed) == len(steps) and printed == sorted(printed)
    for value, taken in zip(printed, steps):
        assert abs(value - _pld_epsilon(sigma, rate, taken)) <= 0.005 + 1e-9, (value, taken)


def _opacus_python():
    """An interpreter with Opacus: this one where it imports opacus, else the peer environment; or skip."""
    try:
        import opacus  # noqa: F401
        return sys.executable
    except ImportError:
        if PEER_PYTHON.exists():
            return PEER_PYTHON
    pytest.skip("Opacus is not importable here and /work/peer-opacus/bin/python does not exist")


def _cifar_print_steps(examples, batch, epochs, print_freq) -> list[int]:
    """The steps taken when cifar10_style prints: after step i of each epoch where i % print_freq == 0."""
    per_epoch = examples // batch
    return [epoch * per_epoch + i + 1 for epoch in range(epochs) for i in range(per_epoch) if i % print_freq == 0]


# --- the scripts are Opacus scripts but for the import line ----------------------------------------

@pytest.mark.parametrize("name", ["mnist_style.py", "cifar10_style.py"])
def test_each_script_differs_from_its_opacus_form_in_the_import_line_only(name):
    text = (SCRIPTS / name).read_text(encoding="utf-8")
    opacus_text = _opacus_form(text)
    changed = [(ours, theirs) for ours, theirs in zip(text.splitlines(), opacus_text.splitlines()) if ours != theirs]
    assert changed == [(OPAKE_IMPORT.strip(), OPACUS_IMPORT.strip())]
    assert len(text.splitlines()) == len(opacus_text.splitlines())
    imported = {alias.name if isinstance(node, ast.Import) else node.module
                for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert "opake.torch" in imported and not any(module.startswith(("opake.", "opacus", "torchvision"))
                                                 for module in imported - {"opake.torch"})
    assert "opake" not in text.replace(OPAKE_IMPORT, "").replace("opake-specific", "")  # no other opake call


# --- opake runs them ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mnist_run(tmp_path_factory):
    """mnist_style.py on opake (MNIST_ARGS, saving its model): read by two tests below."""
    folder = tmp_path_factory.mktemp("mnist")
    out = folder / "out"
    return _run(sys.executable, SCRIPTS / "mnist_style.py", [*MNIST_ARGS, "--save-model", "--out-dir", str(out)],
                folder / "cwd"), out


@pytest.fixture(scope="module")
def cifar_run(tmp_path_factory):
    """cifar10_style.py on opake (CIFAR_ARGS, with its checkpoint file): read by two tests below."""
    folder = tmp_path_factory.mktemp("cifar")
    out = folder / "out"
    out.mkdir()                                  # the script writes its checkpoint there, as Opacus' does
    return _run(sys.executable, SCRIPTS / "cifar10_style.py",
                [*CIFAR_ARGS, "--checkpoint-file", str(out / "checkpoint")], folder / "cwd"), out


@pytest.mark.slow   # the script in a subprocess, 5-7 s
def test_mnist_style_runs_and_prints_the_pld_epsilon_each_epoch(mnist_run):
    printed, out = mnist_run
    rate, per_epoch = MNIST["batch"] / MNIST["examples"], MNIST["examples"] // MNIST["batch"]
    _assert_priced_by_the_pld(_epsilons(printed), MNIST["sigma"], rate,
                              [per_epoch * epoch for epoch in range(1, MNIST["epochs"] + 1)])
    assert "Test set: Average loss" in printed
    assert sorted(path.name for path in out.iterdir()) == ["mnist_cnn_mnist_0.1_1.0_1.0_32_2.pt",
                                                           "run_results_mnist_0.1_1.0_1.0_32_2.pt"]
    state = torch.load(out / "mnist_cnn_mnist_0.1_1.0_1.0_32_2.pt", weights_only=True)
    assert sorted(state) == sorted(f"{layer}.{kind}" for layer in ("conv1", "conv2", "fc1", "fc2")
                                   for kind in ("weight", "bias"))      # the plain module's keys


@pytest.mark.slow   # the script in a subprocess, 5-7 s
def test_mnist_style_n_runs_reprivatizes_the_returned_loader_as_a_fresh_run(tmp_path):
    # Run 2 gets the loader run 1's make_private returned: a fresh run over the same data and batch size,
    # priced from its own first step (as Opacus privatizes its DPDataLoader again).
    printed = _run(sys.executable, SCRIPTS / "mnist_style.py", [*MNIST_RUNS_ARGS, "--out-dir", str(tmp_path / "out")],
                   tmp_path / "cwd")
    rate, per_epoch = MNIST_RUNS["batch"] / MNIST_RUNS["examples"], MNIST_RUNS["examples"] // MNIST_RUNS["batch"]
    epsilons = _epsilons(printed)
    assert len(epsilons) == 2 and epsilons[0] == epsilons[1]
    assert "Loss: nan" in printed          # an empty batch (its mean loss is nan) was trained on, and stepped
    _assert_priced_by_the_pld(epsilons[:1], MNIST_RUNS["sigma"], rate, [per_epoch])
    assert "Accuracy averaged over 2 runs" in printed


@pytest.mark.slow   # the script in a subprocess, 5-7 s
def test_cifar10_style_runs_with_momentum_a_cosine_schedule_and_checkpoints(cifar_run):
    printed, out = cifar_run
    steps = _cifar_print_steps(CIFAR["examples"], CIFAR["batch"], CIFAR["epochs"], CIFAR["print_freq"])
    _assert_priced_by_the_pld(_epsilons(printed), CIFAR["sigma"], CIFAR["batch"] / CIFAR["examples"], steps)
    assert printed.count("Test set:") == CIFAR["epochs"]
    assert {path.name for path in out.iterdir()} <= {"checkpoint.tar", "model_best.pth.tar"}
    checkpoint = torch.load(out / "checkpoint.tar", weights_only=False)   # the script's own file: numpy floats
    assert checkpoint["epoch"] == CIFAR["epochs"] + 1 and checkpoint["arch"] == "Convnet"
    assert all(not key.startswith("_module.") for key in checkpoint["state_dict"])
    groups = checkpoint["optimizer"]["param_groups"]
    last_lr = 0.01 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 3 / 4, dtype=torch.float64)).item())
    assert all(abs(group["lr"] - last_lr) < 1e-12 and group["momentum"] == 0.9 for group in groups)
    assert len(checkpoint["optimizer"]["state"]) == 10             # a momentum buffer per parameter tensor


# --- Opacus runs their Opacus forms; opake's epsilon is no larger -----------------------------------

@pytest.mark.slow   # the Opacus form in its own interpreter, and opake's run
@pytest.mark.parametrize("name, args, final_steps, sigma, rate", [
    ("mnist_style.py", MNIST_ARGS, MNIST["epochs"] * MNIST["examples"] // MNIST["batch"], MNIST["sigma"],
     MNIST["batch"] / MNIST["examples"]),
    ("cifar10_style.py", CIFAR_ARGS, _cifar_print_steps(CIFAR["examples"], CIFAR["batch"], CIFAR["epochs"],
                                                        CIFAR["print_freq"])[-1], CIFAR["sigma"],
     CIFAR["batch"] / CIFAR["examples"]),
])
def test_the_opacus_form_runs_with_opacus_and_opake_prints_no_larger_epsilon(tmp_path, request, name, args,
                                                                              final_steps, sigma, rate):
    python = _opacus_python()
    opacus_script = tmp_path / name
    opacus_script.write_text(_opacus_form((SCRIPTS / name).read_text(encoding="utf-8")), encoding="utf-8")
    out = tmp_path / "opacus_out"
    out.mkdir()
    where = ["--out-dir", str(out)] if name == "mnist_style.py" else ["--checkpoint-file", str(out / "checkpoint")]
    printed = {"opacus": _epsilons(_run(python, opacus_script, [*args, *where], tmp_path / "opacus_cwd", opake=False)),
               # opake's run of the same arguments (and the same output options): the module's run above
               "opake": _epsilons(request.getfixturevalue("mnist_run" if name == "mnist_style.py" else "cifar_run")[0])}
    assert len(printed["opacus"]) == len(printed["opake"]) >= 2
    assert printed["opake"][-1] <= printed["opacus"][-1] + 0.01          # both printed to two decimals
    assert abs(printed["opake"][-1] - _pld_epsilon(sigma, rate, final_steps)) <= 0.005 + 1e-9
