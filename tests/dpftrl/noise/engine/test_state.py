"""Noise state: checkpoints (state_dict, torch.save), resume in a new process, copy semantics,
and the explicit choice between replaying and redrawing noise when a state is copied or restored."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine.state import CorruptedStateError, NoiseState, RetiredStateError, fresh_draw_key
from opake.random import key
from opake.types import clipped
from engine_support import flat, hand_blt

HERE = Path(__file__).resolve()   # the resumed process imports this module (and tests/engine_support.py)
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
    restored = fresh_state.load_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True), draws="replay")
    assert restored.step == STOP and restored == state and restored.draw_key == state.key
    rest, _ = _run(fresh_fn, restored, range(STOP, N_STEPS))
    assert all(torch.equal(a, b) for a, b in zip(first + rest, uninterrupted))


def test_state_dict_is_plain_data():
    _, state = _engine()
    saved = state.state_dict()
    assert saved["format"] == "opake.dpftrl.noise.NoiseState" and saved["step"] == 0 and saved["version"] == 3
    assert isinstance(saved["key"], str) and isinstance(saved["inverse"], dict)
    assert saved["draw_key"] == saved["key"] == key(2024).hex()
    assert isinstance(saved["digest"], str) and len(saved["digest"]) == 64
    assert saved["buffers"].shape == (2, 27)


_RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path[:0] = [{tests!r}, {folder!r}]
    import test_state as t
    path, out = sys.argv[1], sys.argv[2]
    noise_fn, state = t._engine()
    state = state.load_state_dict(torch.load(path, weights_only=True), draws="replay")
    outputs, final = t._run(noise_fn, state, range(state.step, t.N_STEPS))
    torch.save({{"outputs": outputs, "final": final.state_dict()}}, out)
    """
)


def test_resume_in_a_new_process_continues_bit_identically(tmp_path):
    noise_fn, state = _engine()
    uninterrupted, final_state = _run(noise_fn, state, range(N_STEPS))
    noise_fn, state = _engine()
    first, state = _run(noise_fn, state, range(STOP))
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(state.state_dict(), checkpoint)
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT.format(tests=str(HERE.parents[3]), folder=str(HERE.parent)))
    result_path = tmp_path / "result.pt"
    completed = subprocess.run(
        [sys.executable, str(script), str(checkpoint), str(result_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    result = torch.load(result_path, weights_only=True)
    resumed = first + result["outputs"]
    assert len(resumed) == N_STEPS
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))
    assert torch.equal(result["final"]["buffers"], final_state.buffers)


@pytest.mark.parametrize("implicit_copy", [
    lambda state: pickle.dumps(state),
    lambda state: torch.save(state, __import__("io").BytesIO()),
    copy.copy,
    copy.deepcopy,
], ids=["pickle", "torch.save", "copy.copy", "copy.deepcopy"])
def test_pickling_or_copying_a_whole_state_is_refused_and_points_to_the_explicit_paths(implicit_copy):
    # An unpickled or copied state would release its steps again without choosing how to draw.
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(2))
    with pytest.raises(TypeError, match=r"state_dict\(\).*load_state_dict\(saved, draws='replay'\).*fresh_key=k"):
        implicit_copy(state)
    _, after = noise_fn(_grads(2), state)  # the refused copy left the state usable
    assert after.step == 3


def test_loading_a_checkpoint_from_another_configuration_is_refused():
    _, state = _engine()
    saved = state.state_dict()
    _, other = mf_gaussian_noise(_template(), hand_blt("near_one_decay"), n_steps=N_STEPS + 1,
                                 noise_multiplier=1.3, key=key(2024))
    with pytest.raises(ValueError, match=r"different noise engine configuration \(mechanism_fingerprint.*n_steps"):
        other.load_state_dict(saved, draws="replay")
    _, other = _engine(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"buffers: saved \(2, 27\) torch\.float32"):
        other.load_state_dict(saved, draws="replay")
    _, other = mf_gaussian_noise({"w": torch.zeros(27)}, hand_blt("near_one_decay"), n_steps=N_STEPS,
                                 noise_multiplier=1.3, key=key(2024))
    with pytest.raises(ValueError, match="layout_fingerprint"):
        other.load_state_dict(saved, draws="replay")
    with pytest.raises(ValueError, match="not a noise-state checkpoint"):
        state.load_state_dict({"buffers": saved["buffers"]}, draws="replay")
    with pytest.raises(ValueError, match="invalid step"):
        state.load_state_dict({**saved, "step": N_STEPS + 1}, draws="replay")


def test_loading_into_a_retired_state_allocates_new_buffers():
    noise_fn, state = _engine()
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.state_dict().items()}
    _, current = noise_fn(_grads(0), state)
    restored = state.load_state_dict(saved, draws="replay")  # state is retired: its storage belongs to `current`
    assert restored.step == 0 and current.is_current and restored.is_current
    assert restored.buffers.data_ptr() != current.buffers.data_ptr()


def test_copy_is_independent():
    noise_fn, state = _engine()
    kept = state.copy(draws="replay")
    _, advanced = noise_fn(_grads(0), state)
    assert kept.is_current and kept.step == 0 and torch.count_nonzero(kept.buffers) == 0
    assert torch.count_nonzero(advanced.buffers) > 0


def test_an_interrupted_call_marks_the_buffers_corrupted():
    noise_fn, state = _engine()

    def interrupt(*args):
        raise KeyboardInterrupt

    noise_fn._samplers.own.fill = interrupt  # simulate an interruption after the checks passed
    with pytest.raises(KeyboardInterrupt):
        noise_fn(_grads(0), state)
    with pytest.raises(CorruptedStateError, match=r"interrupted.*restore the state from a checkpoint.*"
                                                  r"draws='replay'.*bit-identical.*fresh_key=k.*twice"):
        noise_fn(_grads(0), state)


def test_identity_state_round_trips():
    noise_fn, state = mf_gaussian_noise({"w": torch.zeros(3)}, identity_strategy(), n_steps=3,
                                        noise_multiplier=1.0, key=key(1))
    _, state = noise_fn(clipped({"w": torch.zeros(3)}, 1.0), state)
    restored = noise_fn.init().load_state_dict(state.state_dict(), draws="replay")
    assert restored.step == 1 and restored.buffers.shape == (0, 3)


def test_from_state_dict_never_shares_buffers_with_the_source():
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(1))
    rebuilt = NoiseState.from_state_dict(state.state_dict(), draws="replay")
    assert rebuilt == state and rebuilt.buffers.data_ptr() != state.buffers.data_ptr()
    _, advanced = noise_fn(_grads(1), rebuilt)  # accepted after the configuration check
    assert state.is_current and advanced.step == 2


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_another_state_version_is_refused(version):
    # Version 1 stored the BLT buffers S themselves (this version stores them scaled per epoch);
    # version 2 had no draw key and no digest. Either would continue with unchecked noise.
    _, state = _engine()
    saved = {**state.state_dict(), "version": version}
    with pytest.raises(ValueError, match=f"version {version} is not supported .*reads version 3"):
        state.load_state_dict(saved, draws="replay")
    assert state.is_current



# -- releasing a step twice: replay or fresh draws, chosen explicitly ----------------------------

_CHOICE_MESSAGE = (r"no default: pass draws='replay' or fresh_key=k.*bit-identical.*difference with no noise"
                   r".*second release.*accounting must count")


def _identity_engine(size=200_000, seed=7):
    # Identity strategy in float64: the noise of every step is sigma * l2_bound * z exactly, so
    # statistics of output differences are those of z.
    template = {"w": torch.zeros(size, dtype=torch.float64)}
    return mf_gaussian_noise(template, identity_strategy(), n_steps=6, noise_multiplier=1.0, key=key(seed),
                             dtype=torch.float64)


def _identity_grads(value, size=200_000):
    return clipped({"w": torch.full((size,), float(value), dtype=torch.float64)}, 1.0)


@pytest.mark.parametrize("call", [
    lambda state, saved: state.copy(),
    lambda state, saved: state.load_state_dict(saved),
    lambda state, saved: NoiseState.from_state_dict(saved),
], ids=["copy", "load_state_dict", "from_state_dict"])
def test_copying_or_restoring_without_choosing_how_to_draw_is_refused(call):
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(2))
    saved = state.state_dict()
    with pytest.raises(TypeError, match=_CHOICE_MESSAGE):
        call(state, saved)
    assert state.is_current
    _, state = noise_fn(_grads(2), state)  # and it still works
    assert state.step == 3


def test_malformed_choices_are_refused_with_what_to_pass_instead():
    noise_fn, state = _engine()
    with pytest.raises(TypeError, match="either draws='replay' or fresh_key=k, not both"):
        state.copy(draws="replay", fresh_key=key(5))
    with pytest.raises(ValueError, match=r"draws must be 'replay', got 'fresh'; to draw new noise pass fresh_key=k"):
        state.copy(draws="fresh")
    with pytest.raises(TypeError, match=r"fresh_key must be an opake\.random\.RngKey .* got int"):
        state.copy(fresh_key=5)
    with pytest.raises(ValueError, match="engine's key or the key this state already draws with.*replay"):
        state.copy(fresh_key=key(2024))  # the engine's key
    redrawn = state.copy(fresh_key=key(5))
    with pytest.raises(ValueError, match="already draws with"):
        redrawn.copy(fresh_key=key(5))  # derives the draw key it already has
    with pytest.raises(ValueError, match="already draws with"):
        redrawn.copy(fresh_key=redrawn.draw_key)
    assert state.is_current and redrawn.is_current


def test_a_replayed_copy_repeats_the_noise_and_leaks_the_gradient_difference():
    # Why the choice matters: two releases of one step with replayed noise and different
    # gradients subtract to the gradients' difference, with no noise left at all.
    noise_fn, state = _identity_engine()
    _, state = noise_fn(_identity_grads(0.0), state)
    same = state.copy(draws="replay")
    other = state.copy(draws="replay")
    assert same.draw_key == other.draw_key == state.key
    first, _ = noise_fn(_identity_grads(0.25), state)
    again, _ = noise_fn(_identity_grads(0.25), same)
    assert torch.equal(first.pytree["w"], again.pytree["w"])  # bit-identical gradients: nothing new
    different, _ = noise_fn(_identity_grads(-0.5), other)
    leaked = first.pytree["w"] - different.pytree["w"]
    torch.testing.assert_close(leaked, torch.full_like(leaked, 0.75), rtol=0, atol=1e-14)
    assert first.pytree["w"].std() > 0.99  # although each output alone carries unit-variance noise


def test_a_fresh_key_copy_draws_new_noise_of_the_full_std():
    noise_fn, state = _identity_engine()
    _, state = noise_fn(_identity_grads(0.0), state)
    fresh = state.copy(fresh_key=key(99).fold_in("retry-1"))
    assert fresh.key == state.key and fresh.draw_key == fresh_draw_key(key(99).fold_in("retry-1"))
    assert fresh.draw_key not in (state.key, key(99).fold_in("retry-1"))
    first, state = noise_fn(_identity_grads(0.25), state)
    second, fresh = noise_fn(_identity_grads(-0.5), fresh)
    # The two releases no longer cancel: their difference is g1 - g2 plus the difference of two
    # independent noises, std sqrt(2) (identity, sigma = l2_bound = 1).
    residual = first.pytree["w"] - second.pytree["w"] - 0.75
    assert abs(residual.mean().item()) < 0.02
    assert abs(residual.std().item() - 2**0.5) < 0.02
    assert abs(torch.corrcoef(torch.stack([first.pytree["w"], second.pytree["w"]]))[0, 1].item()) < 0.02
    # Later steps stay fresh too, and one sampler serves the fresh draw key.
    later, _ = noise_fn(_identity_grads(0.0), state)
    later_fresh, _ = noise_fn(_identity_grads(0.0), fresh)
    assert abs((later.pytree["w"] - later_fresh.pytree["w"]).std().item() - 2**0.5) < 0.02
    assert list(noise_fn._samplers._others) == [fresh.draw_key]
    # Different fresh keys give different streams; the same fresh key gives the same stream
    # (so use a new key for every retry).
    fn, s = _identity_engine(size=8)
    a, _ = fn(_identity_grads(0.0, 8), s.copy(fresh_key=key(1)))
    b, _ = fn(_identity_grads(0.0, 8), s.copy(fresh_key=key(2)))
    c, _ = fn(_identity_grads(0.0, 8), s.copy(fresh_key=key(1)))
    assert not torch.equal(a.pytree["w"], b.pytree["w"]) and torch.equal(a.pytree["w"], c.pytree["w"])


def test_checkpoint_restored_with_replay_is_bit_identical_and_with_a_fresh_key_is_not(tmp_path):
    noise_fn, state = _engine()
    uninterrupted, _ = _run(noise_fn, state, range(N_STEPS))
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(STOP))
    torch.save(state.state_dict(), tmp_path / "noise.pt")

    fn, init = _engine()
    replayed = init.load_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True), draws="replay")
    rest, _ = _run(fn, replayed, range(STOP, N_STEPS))
    assert all(torch.equal(a, b) for a, b in zip(rest, uninterrupted[STOP:]))

    fn, init = _engine()
    redrawn = init.load_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True), fresh_key=key(77))
    assert redrawn.draw_key == fresh_draw_key(key(77)) and redrawn.key == key(2024)
    rest, _ = _run(fn, redrawn, range(STOP, N_STEPS))
    assert not any(torch.equal(a, b) for a, b in zip(rest, uninterrupted[STOP:]))

    rebuilt = NoiseState.from_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True), fresh_key=key(77))
    rebuilt_rest, _ = _run(fn, rebuilt, range(STOP, N_STEPS))
    assert all(torch.equal(a, b) for a, b in zip(rebuilt_rest, rest))
    with pytest.raises(ValueError, match="engine's key"):
        NoiseState.from_state_dict(torch.load(tmp_path / "noise.pt", weights_only=True), fresh_key=key(2024))


def test_a_restored_fresh_key_state_saved_again_and_replayed_continues_the_fresh_stream(tmp_path):
    noise_fn, state = _engine()
    _, state = _run(noise_fn, state, range(STOP))
    saved = state.state_dict()
    fn, init = _engine()
    redrawn = init.load_state_dict(saved, fresh_key=key(77))
    _, redrawn = _run(fn, redrawn, range(STOP, STOP + 2))
    torch.save(redrawn.state_dict(), tmp_path / "redrawn.pt")
    assert torch.load(tmp_path / "redrawn.pt", weights_only=True)["draw_key"] == fresh_draw_key(key(77)).hex()
    fresh_tail, _ = _run(fn, redrawn, range(STOP + 2, N_STEPS))

    fn, init = _engine()
    resumed = init.load_state_dict(torch.load(tmp_path / "redrawn.pt", weights_only=True), draws="replay")
    assert resumed.draw_key == fresh_draw_key(key(77))
    resumed_tail, _ = _run(fn, resumed, range(STOP + 2, N_STEPS))
    assert all(torch.equal(a, b) for a, b in zip(resumed_tail, fresh_tail))
    # Redrawing it with the same fresh key again would replay that stream: refused.
    with pytest.raises(ValueError, match="already draws with"):
        _engine()[1].load_state_dict(torch.load(tmp_path / "redrawn.pt", weights_only=True), fresh_key=key(77))


def test_loading_into_a_current_state_retires_it_even_at_the_same_step():
    # The engine state at step 0 and a fresh-key checkpoint at step 0 would otherwise share
    # buffers while drawing with different keys, mixing two streams in one set of buffers.
    noise_fn, state = _engine()
    restored = state.load_state_dict(state.state_dict(), fresh_key=key(8))
    assert restored.is_current and not state.is_current
    with pytest.raises(RetiredStateError, match="retired by load_state_dict.*use that state"):
        noise_fn(_grads(0), state)
    _, after = noise_fn(_grads(0), restored)
    assert after.step == 1


def test_the_retired_state_error_does_not_recommend_a_copy_without_its_cost():
    noise_fn, state = _engine()
    noise_fn(_grads(0), state)
    with pytest.raises(RetiredStateError, match=r"copy\(draws='replay'\) or state\.copy\(fresh_key=k\) \*before\* "
                                                r"noise_fn.*bit-identical.*second release.*accounting"):
        noise_fn(_grads(0), state)
