"""Noise-state checkpoints: corrupted, truncated, edited or non-finite payloads are refused.

Before the digest, most single-byte flips in a saved state loaded silently and continued with
other noise. Every load path (``load_state_dict``, ``NoiseState.from_state_dict`` and the
distributed stages' ``load_state_dict``) now verifies the SHA-256 digest that ``state_dict()``
stores, and refuses NaN/inf buffers.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile

import pytest
import torch

from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.noise.distributed import shard_mf_gaussian_noise
from opake.dpftrl.noise.engine.state import CheckpointIntegrityError, NoiseState, checkpoint_digest
from opake.random import key
from opake.types import clipped
from engine_support import flat, hand_blt

N_STEPS = 8
TEMPLATE = {"encoder.weight": torch.zeros(5, 4), "head": torch.zeros(7)}


def _engine():
    return mf_gaussian_noise(TEMPLATE, hand_blt("near_one_decay"), n_steps=N_STEPS, noise_multiplier=1.3,
                             key=key(11))


def _grads(step):
    generator = torch.Generator().manual_seed(step)
    return clipped({name: torch.randn(t.shape, generator=generator) for name, t in TEMPLATE.items()}, 1.0)


def _saved_after(steps=3):
    noise_fn, state = _engine()
    for step in range(steps):
        _, state = noise_fn(_grads(step), state)
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.state_dict().items()}


def _load_everywhere(saved):
    """Every load path: into an engine state, and rebuilt alone."""
    _, state = _engine()
    state.load_state_dict(saved, draws="replay")
    NoiseState.from_state_dict(saved, draws="replay")


def _same_checkpoint(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _flip_bytes_of_value(value, index: int):
    """``value`` with byte ``index`` of its encoding XOR-ed with 0x01 (strings: UTF-8)."""
    if isinstance(value, str):
        raw = bytearray(value.encode())
        raw[index % len(raw)] ^= 0x01
        return raw.decode(errors="replace")
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value ^ (1 << (8 * (index % 8)))
    if isinstance(value, float):
        raw = bytearray(struct.pack("<d", value))
        raw[index % 8] ^= 0x01
        return struct.unpack("<d", bytes(raw))[0]
    raise TypeError(type(value))


def _metadata_flips(saved):
    """(description, corrupted checkpoint) for a flipped byte in every metadata entry."""
    for name, value in saved.items():
        if name == "buffers":
            continue
        if name == "inverse":
            for entry in ("kind", "omega", "one_minus_theta"):
                for index in (0, 3):
                    inverse = {k: (list(v) if isinstance(v, list) else v) for k, v in value.items()}
                    if isinstance(inverse[entry], list):
                        inverse[entry][0] = _flip_bytes_of_value(inverse[entry][0], index)
                    else:
                        inverse[entry] = _flip_bytes_of_value(inverse[entry], index)
                    yield f"inverse.{entry}[byte {index}]", {**saved, "inverse": inverse}
            continue
        for index in (0, 1, 5, 7, 31, 63):
            yield f"{name}[byte {index}]", {**saved, name: _flip_bytes_of_value(value, index)}


def test_every_single_byte_flip_in_the_buffers_is_refused():
    saved = _saved_after()
    raw = saved["buffers"].view(torch.uint8).reshape(-1)
    positions = sorted({*range(0, raw.numel(), 7), raw.numel() - 1})
    for position in positions:
        for bit in (0x01, 0x80):
            buffers = saved["buffers"].clone()
            buffers.view(torch.uint8).reshape(-1)[position] ^= bit
            corrupted = {**saved, "buffers": buffers}
            with pytest.raises(ValueError, match="failed its integrity check|NaN or infinite"):
                _load_everywhere(corrupted)


def test_every_single_byte_flip_in_the_metadata_is_refused():
    saved = _saved_after()
    flips = list(_metadata_flips(saved))
    assert {name.split("[")[0].split(".")[0] for name, _ in flips} == set(saved) - {"buffers"}
    for description, corrupted in flips:
        assert not _same_checkpoint(corrupted, saved), description
        with pytest.raises(ValueError):
            _load_everywhere(corrupted)


def _zip_member_span(data: bytes, name: str) -> tuple[int, int]:
    """Where member ``name``'s (stored, uncompressed) bytes lie in a torch.save zip file."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(name))
    assert info.compress_type == zipfile.ZIP_STORED
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    return start, start + info.file_size


@pytest.mark.parametrize("member", ["data/0", "data.pkl"], ids=["buffer bytes", "pickled metadata"])
def test_single_byte_flips_in_a_saved_file_are_refused_or_harmless(member):
    # A flip in the file is refused by torch.load (a broken pickle) or by the loader (digest,
    # field checks), or it changed nothing that was loaded (e.g. a pickle memo index no
    # later opcode reads); it never loads as a different checkpoint.
    saved = _saved_after()
    stream = io.BytesIO()
    torch.save(saved, stream)
    data = stream.getvalue()
    start, stop = _zip_member_span(data, member)
    accepted_different = []
    for position in range(start, stop, 1 if member == "data.pkl" else 3):  # every pickle byte, every 3rd buffer byte
        corrupted = bytearray(data)
        corrupted[position] ^= 0x01
        try:
            loaded = torch.load(io.BytesIO(bytes(corrupted)), weights_only=True)
        except Exception:  # torch.load refused the file itself
            continue
        try:
            _load_everywhere(loaded)
        except ValueError:
            continue
        if not _same_checkpoint(loaded, saved):
            accepted_different.append(position - start)
    assert accepted_different == []


def test_non_finite_buffers_are_refused_even_with_a_matching_digest():
    saved = _saved_after()
    for value in (float("nan"), float("inf"), -float("inf")):
        buffers = saved["buffers"].clone()
        buffers[1, 3] = value
        stale = {**saved, "buffers": buffers}
        with pytest.raises(CheckpointIntegrityError, match="failed its integrity check"):
            _load_everywhere(stale)
        resealed = {**stale, "digest": checkpoint_digest(stale)}
        with pytest.raises(CheckpointIntegrityError, match="NaN or infinite buffers"):
            _load_everywhere(resealed)


def test_truncated_edited_or_stale_checkpoints_are_refused():
    saved = _saved_after()
    without_digest = {k: v for k, v in saved.items() if k != "digest"}
    with pytest.raises(ValueError, match=r"missing \['digest'\]; it is truncated"):
        _load_everywhere(without_digest)
    with pytest.raises(ValueError, match=r"unexpected entries \['note'\]"):
        _load_everywhere({**saved, "note": "hi"})
    # Shortened buffers (a truncated tensor) no longer match the digest.
    with pytest.raises(ValueError, match="failed its integrity check|different noise engine"):
        _load_everywhere({**saved, "buffers": saved["buffers"][:, :-1].clone()})
    # state_dict() hands out the live buffers: saved after a noise_fn call, they belong to the
    # next step, and the digest says so instead of continuing with the wrong buffers.
    noise_fn, state = _engine()
    live = state.state_dict()
    noise_fn(_grads(0), state)
    with pytest.raises(CheckpointIntegrityError, match=r"changed after state_dict\(\) returned"):
        _load_everywhere(live)


def test_a_refused_checkpoint_leaves_the_loading_state_usable():
    saved = _saved_after()
    buffers = saved["buffers"].clone()
    buffers[0, 0] += 1.0
    noise_fn, state = _engine()
    with pytest.raises(CheckpointIntegrityError):
        state.load_state_dict({**saved, "buffers": buffers}, draws="replay")
    assert state.is_current and state.step == 0 and torch.count_nonzero(state.buffers) == 0
    _, state = noise_fn(_grads(0), state)
    assert state.step == 1


def test_a_clean_round_trip_through_torch_save_still_loads_and_continues_bit_identically(tmp_path):
    noise_fn, state = _engine()
    outputs = []
    for step in range(N_STEPS):
        noisy, state = noise_fn(_grads(step), state)
        outputs.append(flat(noisy.pytree))
        if step == 2:
            torch.save(state.state_dict(), tmp_path / "state.pt")
    fresh_fn, fresh = _engine()
    restored = fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True), draws="replay")
    for step in range(3, N_STEPS):
        noisy, restored = fresh_fn(_grads(step), restored)
        assert torch.equal(flat(noisy.pytree), outputs[step])


def test_the_distributed_restore_path_verifies_integrity_and_requires_a_choice():
    shards = {"encoder.weight": slice(3, 17), "head": slice(0, 7)}
    noise_fn, state = shard_mf_gaussian_noise(TEMPLATE, hand_blt("near_one_decay"), shards=shards, n_steps=N_STEPS,
                                              noise_multiplier=1.3, key=key(11))
    grads = clipped({"encoder.weight": torch.ones(14), "head": torch.ones(7)}, 1.0)
    _, state = noise_fn(grads, state)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.state_dict().items()}
    with pytest.raises(TypeError, match="no default: pass draws='replay' or fresh_key=k"):
        noise_fn.load_state_dict(saved)
    corrupted = saved["buffers"].clone()
    corrupted.view(torch.uint8).reshape(-1)[5] ^= 0x10
    with pytest.raises(CheckpointIntegrityError, match="failed its integrity check"):
        noise_fn.load_state_dict({**saved, "buffers": corrupted}, draws="replay")
    replayed = noise_fn.load_state_dict(saved, draws="replay")
    redrawn = noise_fn.load_state_dict(saved, fresh_key=key(3))
    a, _ = noise_fn(grads, state)
    b, _ = noise_fn(grads, replayed)
    c, _ = noise_fn(grads, redrawn)
    for name in TEMPLATE:
        assert torch.equal(a.pytree[name], b.pytree[name])
        assert not torch.equal(a.pytree[name], c.pytree[name])
    assert all(math.isfinite(v) for v in flat(c.pytree).tolist())
