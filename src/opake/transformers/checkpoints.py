"""DPTrainer's checkpoint folders: written whole and atomically, found complete, verified before loading.

A private run's checkpoint is a folder of Trainer's own files (model, optimizer, scheduler, RNG
and trainer state) and one private file per rank (``opake_private.pt``: ``PrivateTraining.
state_dict()`` and the SHA-256 of every file Trainer wrote there). DPTrainer writes the private
files after Trainer's files and before Trainer rotates older checkpoints away, each to a
temporary name then renamed (``write_atomically``), so a kill at any moment leaves the last
complete checkpoint on disk. A folder is complete when Trainer's state and every rank's private
file are there (``missing_parts``); ``last_complete_checkpoint`` skips newer folders whose save
was cut short. Before a resume loads anything, every recorded file is checked against its digest
(``check_file_digests``).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from opake.errors import OpakeError
from opake.torch.checkpoint import CheckpointError

__all__ = ["CHECKPOINT_NAME", "IncompleteCheckpointError", "ResumeChoiceError", "check_file_digests",
           "check_same_step", "checkpoint_folders", "checkpoint_name", "file_digests", "is_newest_folder",
           "last_complete_checkpoint", "missing_parts", "rank_file_name", "write_atomically"]

CHECKPOINT_NAME = "opake_private.pt"
TRAINER_STATE = "trainer_state.json"
TRAINER_FILES = "trainer_files"  # the private file's entry: SHA-256 of every file Trainer wrote in the folder
_PARTIAL = ".partial"  # the private file is written under this suffix, then renamed
_JIT_UNFINISHED = "checkpoint-is-incomplete.txt"  # Trainer's SIGTERM save removes it when it has finished
# Files a resume may load tensors or pickles from: one in the folder whose digest was not recorded
# could stand in for a recorded one (Trainer picks among several weight formats).
_LOADABLE_EXTENSIONS = (".safetensors", ".bin", ".pt", ".pth")
_CHECKPOINT_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint folder without every file a resume needs (a save that was cut short, one saved
    with ``save_only_model``, or a folder DPTrainer did not write), or no complete checkpoint to
    resume from. Nothing was loaded."""


class ResumeChoiceError(OpakeError, TypeError):
    """Resuming needs the choice between replaying the saved draws and drawing fresh ones, and this
    resume is not one DPTrainer can make it for (SECURITY.md, "Replaying or redrawing noise")."""


def checkpoint_name(args) -> str:
    """``opake_private.pt`` in one process; ``opake_private-rank{r}-of-{W}.pt`` for rank r of W (each
    rank's noise state is its own part)."""
    return rank_file_name(args.process_index, args.world_size)


def rank_file_name(rank: int, world_size: int) -> str:
    if world_size == 1:
        return CHECKPOINT_NAME
    stem, extension = os.path.splitext(CHECKPOINT_NAME)
    return f"{stem}-rank{rank}-of-{world_size}{extension}"


def is_private_file(name: str) -> bool:
    """Whether ``name`` is one of opake's private files (any rank's), or one being written."""
    stem, extension = os.path.splitext(CHECKPOINT_NAME)
    name = name[:-len(_PARTIAL)] if name.endswith(_PARTIAL) else name
    return name.startswith(stem) and name.endswith(extension)


def write_atomically(state: dict, path: str) -> None:
    """``torch.save(state)`` to ``path`` through a temporary name: a kill leaves the old file or the
    whole new one, never a partial one under the real name."""
    partial = path + _PARTIAL
    with open(partial, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())  # on disk before the name points at it
    os.replace(partial, path)


def sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()  # streamed in chunks


def trainer_files(folder: str) -> list[str]:
    """Every file under ``folder`` (relative, '/'-separated) except opake's private files and
    Trainer's marker of an unfinished save."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if not is_private_file(name) and name != _JIT_UNFINISHED:
                found.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return sorted(found)


def file_digests(folder: str) -> dict:
    return {name: sha256(os.path.join(folder, name)) for name in trainer_files(folder)}


def check_file_digests(folder: str, recorded: dict, private_name: str) -> None:
    """Refuse a folder whose files are not the ones the private file recorded: one missing, one
    changed, or an unrecorded file a resume could load in place of a recorded one."""
    for name, digest in sorted(recorded.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing: the checkpoint was saved with it ({private_name} records its digest). Resume "
                f"from an intact copy or another checkpoint. Nothing was loaded")
        if sha256(path) != digest:
            raise CheckpointError(
                f"{path} is not the file saved with this checkpoint: its SHA-256 differs from the one recorded in "
                f"{private_name} (a flipped bit, a truncated copy or an edit). Resume from an intact copy or "
                f"another checkpoint. Nothing was loaded")
    strays = [name for name in trainer_files(folder) if name not in recorded and name.endswith(_LOADABLE_EXTENSIONS)]
    if strays:
        raise CheckpointError(
            f"{folder} holds {strays} that {private_name} does not record: added after the checkpoint was saved, "
            f"and a resume could load them. Remove them or resume from another checkpoint. Nothing was loaded")


def missing_parts(folder: str, world_size: int) -> list[str]:
    """What ``folder`` lacks to be a complete checkpoint of a DPTrainer on ``world_size`` processes:
    Trainer's state (its last file) and every rank's private file (written after all of Trainer's)."""
    if not os.path.isdir(folder):
        return ["the folder itself"]
    needed = [TRAINER_STATE] + [rank_file_name(rank, world_size) for rank in range(world_size)]
    missing = [name for name in needed if not os.path.isfile(os.path.join(folder, name))]
    if os.path.exists(os.path.join(folder, _JIT_UNFINISHED)):
        missing.append(f"the end of Trainer's SIGTERM save ({_JIT_UNFINISHED} is still there)")
    return missing


def check_same_step(folder: str, saved: dict) -> None:
    """Trainer's state and the noise state of one checkpoint are at the same step."""
    trainer_step = transformers.TrainerState.load_from_json(os.path.join(folder, TRAINER_STATE)).global_step
    noise = saved.get("noise")
    noise_step = noise.get("step") if isinstance(noise, dict) else None
    if trainer_step != noise_step:
        raise CheckpointError(f"{folder}: Trainer's state is at step {trainer_step} but the noise state at step "
                              f"{noise_step}; the checkpoint folder was mixed from two runs. Nothing was loaded")


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, newest step first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(match.group(1)), name) for name in os.listdir(output_dir)
             if (match := _CHECKPOINT_FOLDER.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [os.path.join(output_dir, name) for _, name in sorted(steps, reverse=True)]


def is_newest_folder(folder: str, output_dir: str) -> bool:
    """Whether ``folder`` is the newest ``checkpoint-<step>`` folder of ``output_dir``."""
    folders = checkpoint_folders(output_dir)
    return bool(folders) and os.path.isdir(folder) and os.path.samefile(folders[0], folder)


def last_complete_checkpoint(output_dir: str, world_size: int, *, warn: bool = True) -> str | None:
    """The newest complete checkpoint folder of ``output_dir`` (None if there is none); newer
    incomplete ones are skipped, with a warning naming them and what they lack."""
    skipped = []
    for folder in checkpoint_folders(output_dir):
        missing = missing_parts(folder, world_size)
        if not missing:
            break
        skipped.append(f"{folder} (missing {', '.join(missing)})")
    else:
        folder = None
    if skipped and warn:
        warnings.warn(f"skipping incomplete checkpoint folders, newer than the last complete one ({folder}): "
                      f"{'; '.join(skipped)}. A save was cut short there; nothing of it is loaded", stacklevel=4)
    return folder
