"""DPTrainer's checkpoints as a whole: complete before rotation, verified before loading, resumed safely.

A checkpoint is resumable only with every rank's private file (the noise state), so that file is
written (to a temporary name, then renamed) after Trainer's files and before Trainer deletes older
checkpoints. The kill tests fork a child process that trains a tiny DPTrainer with
``save_total_limit=1`` and kills itself with SIGKILL at a chosen point of the second save; the
parent then resumes with ``train(resume_from_checkpoint=True)`` (no ``draws=``) and must end on the
uninterrupted run's parameters, bit for bit. The negative control runs the old order (the private
file after Trainer's rotation) to the same kill: nothing is left to resume from.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import shutil
import signal

import pytest
import torch

transformers = pytest.importorskip("transformers")

import opake.random  # noqa: E402
from opake.torch.checkpoint import CheckpointError, whole_digest  # noqa: E402
from opake.torch.contract import RestartedWorkerError  # noqa: E402
from opake.transformers import (  # noqa: E402
    CHECKPOINT_NAME,
    DPTrainer,
    IncompleteCheckpointError,
    PrivateTrainerMixin,
    ResumeChoiceError,
)
from opake.transformers import trainer as trainer_module  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402
from transformers_support import (  # noqa: E402
    PLAN,
    CharDataset,
    arguments,
    assert_same,
    collate,
    dp_trainer,
    gpt2,
    parameters,
    sentences,
)

# AdamW, dropout and a linear schedule; 8 steps (4 per epoch); checkpoints at steps 3, 6 and 8.
SETTINGS = dict(optim="adamw_torch", learning_rate=1e-2, save_strategy="steps", save_steps=3)
KILLED_SAVE = "checkpoint-6"


def dataset():
    return CharDataset(sentences(32))


def checkpointing_trainer(folder, model=None, *, seed=3, **settings):
    model = gpt2(dropout=0.1) if model is None else model
    return dp_trainer(model, arguments(folder, **{**SETTINGS, **settings}), dataset(), seed=seed)


def keyless_trainer(folder, model, **settings):
    """A DPTrainer built as a stock script builds it: no key=, one is drawn from the OS."""
    return DPTrainer(model=model, args=arguments(folder, **{**SETTINGS, **settings}), train_dataset=dataset(),
                     data_collator=collate, **PLAN)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The whole run, never stopped: its parameters, and its checkpoints 3, 6 and 8 (no limit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests' own runs (one_thread): the same float sums
    try:
        folder = tmp_path_factory.mktemp("uninterrupted")
        model = gpt2(dropout=0.1)
        checkpointing_trainer(folder, model).train()
        return parameters(model), folder / "out"
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped (as if killed) after step 5 of 8: checkpoints 3 (complete) and none after."""

    class StopAfterFive(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 5

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = tmp_path_factory.mktemp("stopped")
        trainer = checkpointing_trainer(folder, save_steps=2)  # checkpoints 2 and 4
        trainer.add_callback(StopAfterFive())
        with pytest.warns(UserWarning, match="taken 5 of its 8"):
            trainer.train()
        return folder / "out"
    finally:
        torch.set_num_threads(threads)


def copy_of(run_output, tmp_path):
    """A copy of a run's output_dir (the resumed runs write their own checkpoints into it)."""
    copy = tmp_path / "out"
    shutil.copytree(run_output, copy)
    return copy


# -- a kill in the save window -------------------------------------------------------------------


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_before_the_private_file():
    write = trainer_module.write_atomically

    def write_or_die(state, path):
        if KILLED_SAVE in path:
            _kill()
        write(state, path)

    trainer_module.write_atomically = write_or_die


def _kill_between_the_write_and_the_rename():
    rename = os.replace

    def rename_or_die(source, destination):
        if KILLED_SAVE in str(destination) and os.path.basename(str(destination)) == CHECKPOINT_NAME:
            _kill()
        rename(source, destination)

    os.replace = rename_or_die


def _kill_before_the_rotation():
    rotate = trainer_module.rotate_checkpoints

    def rotate_or_die(output_dir, **kwargs):
        if os.path.isdir(os.path.join(output_dir, KILLED_SAVE)):
            _kill()
        rotate(output_dir, **kwargs)

    trainer_module.rotate_checkpoints = rotate_or_die


def _kill_in_the_old_window():
    """The order before this fix: Trainer saved and rotated, then the callback's on_save wrote the
    private file. The kill comes between the two at the second save."""

    def old_order(self, model, trial):
        transformers.Trainer._save_checkpoint(self, model, trial)  # Trainer's files, then its rotation
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        if KILLED_SAVE in folder:
            _kill()
        self._write_private_file(folder)

    PrivateTrainerMixin._save_checkpoint = old_order


KILL_POINTS = {"before_private_file": _kill_before_the_private_file,
               "between_write_and_rename": _kill_between_the_write_and_the_rename,
               "before_rotation": _kill_before_the_rotation,
               "old_order": _kill_in_the_old_window}


def _train_until_killed(folder, point: str) -> None:
    """The child: patches its own copy of the code (a forked process), trains, and dies at ``point``."""
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    KILL_POINTS[point]()
    checkpointing_trainer(folder, save_total_limit=1).train()
    os._exit(0)  # not killed: the parent sees 0, not -SIGKILL


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill tests fork the training process")


def killed_run(tmp_path, point: str):
    child = multiprocessing.get_context("fork").Process(target=_train_until_killed, args=(tmp_path, point))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed at {point} (exit code {child.exitcode})"
    output = tmp_path / "out"
    return output, {path.name: sorted(p.name for p in path.iterdir()) for path in output.glob("checkpoint-*")}


@needs_fork
@pytest.mark.parametrize("point", ["before_private_file", "between_write_and_rename", "before_rotation"])
def test_a_kill_in_the_save_window_leaves_the_last_complete_checkpoint_resumable(tmp_path, uninterrupted, point):
    output, folders = killed_run(tmp_path, point)
    reference, _ = uninterrupted
    assert CHECKPOINT_NAME in folders["checkpoint-3"]  # not rotated away: the save of step 6 never completed
    resumed_from = "checkpoint-6" if point == "before_rotation" else "checkpoint-3"
    if point == "before_rotation":
        assert CHECKPOINT_NAME in folders[KILLED_SAVE]
    else:
        assert CHECKPOINT_NAME not in folders[KILLED_SAVE] and "trainer_state.json" in folders[KILLED_SAVE]
        assert (CHECKPOINT_NAME + ".partial" in folders[KILLED_SAVE]) == (point == "between_write_and_rename")

    assert trainer_module.last_complete_checkpoint(str(output), 1, warn=False) == str(output / resumed_from)
    model = gpt2(seed=1, dropout=0.1)  # other weights: the checkpoint replaces them
    resumed = checkpointing_trainer(tmp_path, model, save_total_limit=1)
    if point == "before_rotation":
        resumed.train(resume_from_checkpoint=True)
    else:
        # What a stock script (run_clm.py) passes: transformers' get_last_checkpoint, the newest folder,
        # named explicitly; the save cut short there leaves checkpoint-3 as the run's latest.
        stock = get_last_checkpoint(str(output))
        assert stock == str(output / KILLED_SAVE)
        with pytest.warns(UserWarning, match=rf"skipping incomplete checkpoint.*{KILLED_SAVE} \(missing "
                                             rf"{re.escape(CHECKPOINT_NAME)}\)"):
            resumed.train(resume_from_checkpoint=stock)
    assert resumed.state.global_step == resumed.private.steps_taken == 8
    assert_same(parameters(model), reference)
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-8"]  # rotation caught up


@needs_fork
def test_the_old_order_leaves_no_resumable_checkpoint(tmp_path):
    """Negative control: the private file written after Trainer's rotation (the callback's on_save).
    Killed in between, the only folder left lacks the noise state: the run cannot resume."""
    output, folders = killed_run(tmp_path, "old_order")
    assert list(folders) == [KILLED_SAVE] and CHECKPOINT_NAME not in folders[KILLED_SAVE]
    trainer = checkpointing_trainer(tmp_path, save_total_limit=1)
    with pytest.warns(UserWarning, match="skipping incomplete"), \
            pytest.raises(IncompleteCheckpointError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


# -- every file verified before anything loads -----------------------------------------------------


def flip_one_bit(path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    position = rng.randrange(len(data) * 8)
    data[position // 8] ^= 1 << (position % 8)
    path.write_bytes(bytes(data))


PRIVATE_FILE_FLIPS = 16


def test_a_flipped_bit_in_any_file_is_refused_before_anything_loads(tmp_path, uninterrupted):
    """One flipped bit in each of Trainer's files (always refused: each file's SHA-256 is recorded)
    and several in the private file (refused, or in zip bytes no reader uses: then what loads is
    what was saved). One trainer meets every refusal, then resumes the intact checkpoint: it ends
    on the uninterrupted run's parameters, so no refusal changed anything."""
    reference, run_output = uninterrupted
    intact = run_output / "checkpoint-3"
    original = torch.load(intact / CHECKPOINT_NAME, weights_only=True)
    model = gpt2(seed=1, dropout=0.1)
    trainer = checkpointing_trainer(tmp_path / "resumed", model)
    before = parameters(model)
    trainer_files = sorted(p.name for p in intact.iterdir() if p.name != CHECKPOINT_NAME)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(
        trainer_files)
    flips = [(name, 0) for name in trainer_files] + [(CHECKPOINT_NAME, trial) for trial in range(PRIVATE_FILE_FLIPS)]
    refused, harmless = [], []
    for name, trial in flips:
        damaged = tmp_path / f"flipped-{name}-{trial}"
        shutil.copytree(intact, damaged)
        flip_one_bit(damaged / name, random.Random(f"{name}-{trial}"))
        if name == CHECKPOINT_NAME and _loads_unchanged(damaged / name, original):
            harmless.append(trial)  # a bit of the zip container that no reader uses
            continue
        with pytest.raises(CheckpointError, match=re.escape(str(damaged / name))):
            trainer.train(resume_from_checkpoint=str(damaged), draws="replay")
        assert trainer.private.steps_taken == 0
        assert_same(parameters(model), before)
        refused.append(name)
    assert len(refused) + len(harmless) == len(flips)
    assert set(trainer_files) <= set(refused)
    assert refused.count(CHECKPOINT_NAME) >= PRIVATE_FILE_FLIPS // 2  # the fixed seeds' flips: most are refused

    trainer.train(resume_from_checkpoint=str(intact), draws="replay")
    assert trainer.private.steps_taken == 8
    assert_same(parameters(model), reference)


def _loads_unchanged(path, original) -> bool:
    try:
        loaded = torch.load(path, weights_only=True)
    except Exception:
        return False
    return isinstance(loaded, dict) and whole_digest(loaded) == whole_digest(original)


def test_a_file_added_or_removed_after_the_save_is_refused(tmp_path, uninterrupted):
    _, run_output = uninterrupted
    trainer = checkpointing_trainer(tmp_path / "resumed")
    removed = shutil.copytree(run_output / "checkpoint-3", tmp_path / "removed")
    (removed / "scheduler.pt").unlink()
    with pytest.raises(CheckpointError, match=r"scheduler\.pt is missing"):
        trainer.train(resume_from_checkpoint=str(removed), draws="replay")
    added = shutil.copytree(run_output / "checkpoint-3", tmp_path / "added")
    shutil.copy(added / "model.safetensors", added / "adapter_model.safetensors")  # Trainer would load it first
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors.*does not record"):
        trainer.train(resume_from_checkpoint=str(added), draws="replay")
    assert trainer.private.steps_taken == 0


# -- resuming without draws=, and the key ---------------------------------------------------------


def test_resume_without_draws_replays_only_from_the_last_complete_checkpoint(tmp_path, uninterrupted, stopped):
    reference, _ = uninterrupted
    output = copy_of(stopped, tmp_path)
    model = gpt2(seed=1, dropout=0.1)
    trainer = checkpointing_trainer(tmp_path, model, save_steps=2)
    before = parameters(model)
    with pytest.raises(ResumeChoiceError, match=r"checkpoint-2 is not the last complete checkpoint.*checkpoint-4.*"
                                                r"draws='replay'.*fresh_key"):
        trainer.train(resume_from_checkpoint=str(output / "checkpoint-2"))
    assert_same(parameters(model), before)
    trainer.train(resume_from_checkpoint=str(output / "checkpoint-4"))  # a stock script's resume: no draws=
    assert trainer.private.steps_taken == 8
    assert_same(parameters(model), reference)


def test_a_trainer_built_without_a_key_adopts_the_checkpoints_key(tmp_path, uninterrupted, stopped):
    reference, _ = uninterrupted
    output = copy_of(stopped, tmp_path)
    model = gpt2(seed=1, dropout=0.1)
    trainer = keyless_trainer(tmp_path, model, save_steps=2)
    assert trainer.private.plan.key.hex() != opake.random.key(3).hex()  # drawn from the OS
    trainer.train(resume_from_checkpoint=True)
    assert trainer.private.plan.key.hex() == opake.random.key(3).hex()
    assert trainer.optimizer.optimizer is trainer.private.optimizer  # Trainer's accelerate wrapper around the new one
    assert trainer.private.steps_taken == 8
    assert_same(parameters(model), reference)  # clipped once, by the second plan's hooks only


def test_a_trainer_built_with_another_key_is_refused(tmp_path, stopped):
    output = copy_of(stopped, tmp_path)
    model = gpt2(seed=1, dropout=0.1)
    trainer = checkpointing_trainer(tmp_path, model, seed=4, save_steps=2)
    before = parameters(model)
    with pytest.raises(CheckpointError, match=r"another key than the key= given.*Omit key="):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.private.steps_taken == 0 and trainer.private.plan.key.hex() == opake.random.key(4).hex()
    assert_same(parameters(model), before)
    assert trainer._resumed_from is None and (output / "checkpoint-4" / CHECKPOINT_NAME).is_file()


# -- a worker restarted by its launcher --------------------------------------------------------------


def test_a_restarted_worker_resumes_from_the_last_complete_checkpoint(tmp_path, monkeypatch, uninterrupted,
                                                                      stopped):
    reference, _ = uninterrupted
    copy_of(stopped, tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    model = gpt2(seed=1, dropout=0.1)
    trainer = keyless_trainer(tmp_path, model, save_steps=2)  # the stock script, run again by torchrun
    with pytest.warns(UserWarning, match=r"restarted this worker.*resuming from .*checkpoint-4.*draws='replay'"):
        trainer.train()
    assert trainer.private.steps_taken == 8
    assert_same(parameters(model), reference)


def test_a_restarted_worker_without_a_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    model = gpt2(dropout=0.1)
    trainer = checkpointing_trainer(tmp_path, model, num_train_epochs=1)
    before = parameters(model)
    with pytest.raises(RestartedWorkerError, match=r"RESTART_COUNT=2.*no complete checkpoint.*second time.*"
                                                   r"resume_from_checkpoint=False"):
        trainer.train()
    assert trainer.private.steps_taken == 0
    assert_same(parameters(model), before)
    trainer.train(resume_from_checkpoint=False)  # the deliberate new run
    assert trainer.private.steps_taken == 4


# -- several processes are one run or none ---------------------------------------------------------


@pytest.mark.slow   # the real torchrun, two ranks importing transformers
def test_trainer_seeing_one_process_under_torchrun_is_refused(tmp_path):
    """The real ``torchrun --nproc_per_node 2`` on CPU without --use_cpu: transformers counts one process
    in each (TrainingArguments.world_size 1), so each would train as if alone into the same output_dir.
    Both ranks are refused before anything is planned. (With --use_cpu the same launch is one run of two
    ranks: tests/transformers/test_distributed.py.)"""
    import subprocess
    import sys

    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("torchrun is not installed")
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "torchrun_world_script.py")
    done = subprocess.run([launcher, "--nproc_per_node", "2", "--master_port", str(_free_port()), script,
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    verdicts = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert verdicts == ["rank 0: LauncherWorldError", "rank 1: LauncherWorldError"], done.stdout + done.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
