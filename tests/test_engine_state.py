"""Noise state: checkpoints (state_dict, torch.save), resume in a new process, copy semantics."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine.state import CorruptedStateError, NoiseState
from opake.random import key
from opake.types import clipped
from test_engine_support import flat, hand_blt

TESTS = Path(__file__).resolve().parent
N_STEPS, STOP = 10, 4


def _template():
    return {"encoder.weight": torch.zeros(5, 4), "encoder.bias": torch.zeros(4), "head": torch.zeros(3)}


def _grads(step: int):
    # Deterministic non-zero gradients that differ per step.
    generator = torch.Generator().manual_seed(1000 + step)
    return clipped({name: torch.randn(t.shape, generator=generator) for name, t in _template().items()}, 0.5, 2.0)


def _engine(dtype=torch.float32):
    return mf_gaussian_noise(_template(), hand_blt("near_one_decay"), n_steps=N_STEPS, noise_multiplier=1.3,
                             key=key(2024), dtype=dtype)


def _run(noise_fn, state, steps):
    outputs = []
    for step in steps:
        noisy, state = noise_fn(_grads(step), state)
        outputs.append(flat(noisy.pytree))
    return outputs, state


def test_state_dict_round_trip_in_process_continues_bit_identically(tmp_path):
    noise_fn, state = _engine()
    uninterrupted, _ = _run(noise_fn, state, range(N_STEPS))
    noise_fn, state = _engine()
    first, state = _run(noise_fn, state, range(STOP))
    torch.save(state.state_dict(), tmp_path / "noise.pt")
    fresh_fn, fresh_state = _engine()
    restored = fresh_state.load_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True))
    assert restored.step == STOP and restored == state
    rest, _ = _run(fresh_fn, restored, range(STOP, N_STEPS))
    assert all(torch.equal(a, b) for a, b in zip(first + rest, uninterrupted))


def test_state_dict_is_plain_data():
    _, state = _engine()
    saved = state.state_dict()
    assert saved["format"] == "opake.dpftrl.noise.NoiseState" and saved["step"] == 0
    assert isinstance(saved["key"], str) and isinstance(saved["inverse"], dict)
    assert saved["buffers"].shape == (2, 27)


_RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_engine_state as t
    mode, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    noise_fn, state = t._engine()
    if mode == "state_dict":
        state = state.load_state_dict(torch.load(path, weights_only=True))
    else:
        state = torch.load(path, weights_only=False)
    outputs, final = t._run(noise_fn, state, range(state.step, t.N_STEPS))
    torch.save({{"outputs": outputs, "final": final.state_dict()}}, out)
    """
)


@pytest.mark.parametrize("mode", ["state_dict", "pickled_state"])
def test_resume_in_a_new_process_continues_bit_identically(tmp_path, mode):
    noise_fn, state = _engine()
    uninterrupted, final_state = _run(noise_fn, state, range(N_STEPS))
    noise_fn, state = _engine()
    first, state = _run(noise_fn, state, range(STOP))
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(state.state_dict() if mode == "state_dict" else state, checkpoint)
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT.format(tests=str(TESTS)))
    result_path = tmp_path / "result.pt"
    completed = subprocess.run(
        [sys.executable, str(script), mode, str(checkpoint), str(result_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    result = torch.load(result_path, weights_only=True)
    resumed = first + result["outputs"]
    assert len(resumed) == N_STEPS
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))
    assert torch.equal(result["final"]["buffers"], final_state.buffers)


def test_whole_state_pickles_and_its_checks_still_apply(tmp_path):
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(2))
    clone = pickle.loads(pickle.dumps(state))
    assert isinstance(clone, NoiseState) and clone == state and clone.buffers is not state.buffers
    other_fn, _ = mf_gaussian_noise(_template(), hand_blt("near_one_decay"), n_steps=N_STEPS,
                                    noise_multiplier=1.3, key=key(2025))
    with pytest.raises(ValueError, match="differs in: key"):
        other_fn(_grads(2), clone)


def test_loading_a_checkpoint_from_another_configuration_is_refused():
    _, state = _engine()
    saved = state.state_dict()
    _, other = mf_gaussian_noise(_template(), hand_blt("near_one_decay"), n_steps=N_STEPS + 1,
                                 noise_multiplier=1.3, key=key(2024))
    with pytest.raises(ValueError, match=r"different noise engine configuration \(mechanism_fingerprint.*n_steps"):
        other.load_state_dict(saved)
    _, other = _engine(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"buffers: saved \(2, 27\) torch\.float32"):
        other.load_state_dict(saved)
    _, other = mf_gaussian_noise({"w": torch.zeros(27)}, hand_blt("near_one_decay"), n_steps=N_STEPS,
                                 noise_multiplier=1.3, key=key(2024))
    with pytest.raises(ValueError, match="layout_fingerprint"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="not a noise-state checkpoint"):
        state.load_state_dict({"buffers": saved["buffers"]})
    with pytest.raises(ValueError, match="invalid step"):
        state.load_state_dict({**saved, "step": N_STEPS + 1})


def test_loading_into_a_retired_state_allocates_new_buffers():
    noise_fn, state = _engine()
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.state_dict().items()}
    _, current = noise_fn(_grads(0), state)
    restored = state.load_state_dict(saved)  # state is retired: its storage belongs to `current`
    assert restored.step == 0 and current.is_current and restored.is_current
    assert restored.buffers.data_ptr() != current.buffers.data_ptr()


def test_copy_is_independent():
    noise_fn, state = _engine()
    kept = state.copy()
    _, advanced = noise_fn(_grads(0), state)
    assert kept.is_current and kept.step == 0 and torch.count_nonzero(kept.buffers) == 0
    assert torch.count_nonzero(advanced.buffers) > 0


def test_an_interrupted_call_marks_the_buffers_corrupted():
    noise_fn, state = _engine()

    def interrupt(*args):
        raise KeyboardInterrupt

    noise_fn._sampler.fill = interrupt  # simulate an interruption after the checks passed
    with pytest.raises(KeyboardInterrupt):
        noise_fn(_grads(0), state)
    with pytest.raises(CorruptedStateError, match="interrupted.*restore the state from a checkpoint"):
        noise_fn(_grads(0), state)


def test_identity_state_round_trips():
    noise_fn, state = mf_gaussian_noise({"w": torch.zeros(3)}, identity_strategy(), n_steps=3,
                                        noise_multiplier=1.0, key=key(1))
    _, state = noise_fn(clipped({"w": torch.zeros(3)}, 1.0), state)
    restored = noise_fn.init().load_state_dict(state.state_dict())
    assert restored.step == 1 and restored.buffers.shape == (0, 3)


def test_from_state_dict_never_shares_buffers_with_the_source():
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(1))
    rebuilt = NoiseState.from_state_dict(state.state_dict())
    assert rebuilt == state and rebuilt.buffers.data_ptr() != state.buffers.data_ptr()
    _, advanced = noise_fn(_grads(1), rebuilt)  # accepted after the configuration check
    assert state.is_current and advanced.step == 2


def test_a_checkpoint_of_another_state_version_is_refused():
    # Version 1 stored the BLT buffers S themselves; this version stores them scaled per epoch,
    # so reading a version-1 checkpoint would continue with wrong noise.
    _, state = _engine()
    saved = {**state.state_dict(), "version": 1}
    with pytest.raises(ValueError, match="version 1 is not supported"):
        state.load_state_dict(saved)
