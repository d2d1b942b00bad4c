"""Keyed block draws: full-width seeding, independence from globals, block naming."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler, _cpu_state_template, path_code
from opake.random import encode_parts, key


def _draw(sampler, step=0, path=("w",), block=0, size=64, dtype=torch.float32):
    out = torch.empty(size, dtype=dtype)
    sampler.fill(out, step, path_code(path), block)
    return out


def test_the_cpu_generator_state_layout_is_the_known_one():
    # Written independently of the module: torch's Mersenne Twister seeded with s starts
    # with state[0] = s and state[1] = 1812433253 * (s ^ (s >> 30)) + 1 (mod 2**32).
    generator = torch.Generator().manual_seed(12345)
    state = generator.get_state().numpy()
    assert state.shape == (5056,)
    words = state[24:24 + 8 * 624].view(np.uint64)
    assert int(words[0]) == 12345
    assert int(words[1]) == (1812433253 * (12345 ^ (12345 >> 30)) + 1) % 2**32
    _cpu_state_template()  # the module's own check passes


def test_every_derived_word_of_the_state_matters():
    # The sampler writes 624 derived words; flipping one bit of any of them changes the draws,
    # so the stream is keyed by far more than torch's 32-bit manual seed.
    size = 1024  # more outputs than one Twister round (624), so every word feeds some output
    sampler = BlockSampler(key(1), torch.device("cpu"))
    reference = _draw(sampler, size=size)
    derived = np.frombuffer(key(1).derive_bytes("opake.dpftrl.noise", (0, path_code(("w",)), 0), 4 * 624),
                            dtype=np.uint32)
    generator = torch.Generator()

    def draws(words):
        template = _cpu_state_template().copy()
        template[24:24 + 8 * 624].view(np.uint64)[:] = words
        generator.set_state(torch.from_numpy(template))
        return torch.empty(size).normal_(generator=generator)

    assert torch.equal(draws(derived), reference)
    for index in (0, 1, 311, 623):
        flipped = derived.copy()
        flipped[index] ^= 1 if index else 0x80000000  # word 0 contributes only its top bit
        assert not torch.equal(draws(flipped), reference)


def test_draws_depend_on_key_step_path_and_block_only():
    sampler = BlockSampler(key(1), torch.device("cpu"))
    reference = _draw(sampler)
    assert torch.equal(_draw(BlockSampler(key(1), torch.device("cpu"))), reference)
    assert torch.equal(_draw(sampler), reference)  # no state carried between calls
    for other in (_draw(sampler, step=1), _draw(sampler, path=("v",)), _draw(sampler, block=1),
                  _draw(BlockSampler(key(2), torch.device("cpu")))):
        assert not torch.equal(other, reference)


def test_draws_neither_read_nor_change_global_random_state():
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first = _draw(BlockSampler(key(3), torch.device("cpu")))
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(99)
    assert torch.equal(_draw(BlockSampler(key(3), torch.device("cpu"))), first)


def test_blocks_and_steps_never_repeat_a_stream():
    sampler = BlockSampler(key(4), torch.device("cpu"))
    seen = set()
    for step in range(20):
        for block in range(5):
            for path in (("a",), ("b",), (0,)):
                seen.add(hashlib.sha256(_draw(sampler, step, path, block, size=32).numpy().tobytes()).digest())
    assert len(seen) == 20 * 5 * 3


def test_path_codes_are_unambiguous_and_restricted_to_str_and_int_keys():
    assert path_code(("a/b",)) != path_code(("a", "b"))
    assert path_code((1,)) != path_code(("1",))
    assert path_code(()) == encode_parts(())
    with pytest.raises(TypeError, match=r"pytree keys must be str or int.*\(1, 2\)"):
        path_code(((1, 2),))
    with pytest.raises(TypeError, match="pytree keys must be str or int"):
        path_code((True,))


def test_float64_draws_are_standard_normal_too():
    values = _draw(BlockSampler(key(5), torch.device("cpu")), size=200_000, dtype=torch.float64)
    # mean sd 1/447, variance relative sd sqrt(2/2e5) = 0.0032; 7 sd bounds (false failure < 1e-11).
    assert abs(values.mean().item()) < 7 / 447 and abs(values.var().item() - 1) < 7 * 0.0032


def test_block_size_is_a_fixed_constant():
    # Changing it changes every noise value of every model with a leaf above it: it is part of
    # the definition of the noise, like the key derivation.
    assert BLOCK_ELEMENTS == 2**20


def test_sampler_requires_an_rng_key():
    with pytest.raises(TypeError, match=r"opake\.random\.key\(seed\)"):
        BlockSampler(42, torch.device("cpu"))


def test_devices_without_a_generator_are_refused_clearly():
    with pytest.raises(ValueError, match="cannot draw noise on device meta"):
        BlockSampler(key(0), torch.device("meta"))
