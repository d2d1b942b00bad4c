"""README.md's two quick starts run as written, on a CPU, on tiny stand-ins.

The text of each quick-start code block is read from README.md and executed; the test only
defines what the block takes as given (``model``, ``optimizer``, ``train_ds``, ``path``; for Hugging
Face ``model``, ``train_ds``, ``collator``), so an edit of the README that breaks the snippet
breaks this test.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def quick_start(heading: str) -> str:
    """The first ```python block under the README section ``heading``."""
    text = README.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, f"README.md's section {heading!r} has no python block"
    return found.group(1)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_pytorch_quick_start_runs_as_written(tmp_path):
    from opake.torch import ShortRunWarning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    features = torch.randn(128, 10)
    train_ds = torch.utils.data.TensorDataset(features, features[:, :3].argmax(dim=1))
    given = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "train_ds": train_ds,
             "path": tmp_path / "private.pt"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)  # the loop runs the whole plan
        exec(compile(quick_start("Quick start (PyTorch)"), "README.md (PyTorch quick start)", "exec"), given)
    private = given["private"]
    assert private.steps_taken == private.plan.n_steps == 5 * (128 // 64)
    assert private.epsilon <= 3.0 + 1e-9
    assert torch.load(given["path"], weights_only=True)["format"]


def test_the_hugging_face_quick_start_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tests.test_transformers_trainer import CharDataset, collate, gpt2, sentences

    monkeypatch.chdir(tmp_path)  # output_dir="out"
    given = {"model": gpt2(), "train_ds": CharDataset(sentences(256)), "collator": collate}
    exec(compile(quick_start("Quick start (Hugging Face)"), "README.md (Hugging Face quick start)", "exec"), given)
    trainer = given["trainer"]
    assert trainer.private.steps_taken == trainer.private.plan.n_steps == 3 * (256 // 128)
    assert trainer.private.epsilon <= 8.0 + 1e-9
    assert not trainer.args.bf16 or torch.cuda.is_available()
