"""opake.random: explicit, deterministic, hashable keys."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from opake.random import RngKey, encode_parts, key


def test_keys_are_values():
    assert key(42) == key(42) and hash(key(42)) == hash(key(42))
    assert key(42) != key(43) and key(0) != key(-1)
    assert len({key(i) for i in range(100)}) == 100
    assert key(2**100) != key(2**100 + 1)
    assert key(np.int64(7)) == key(7)
    assert pickle.loads(pickle.dumps(key(5))) == key(5)


def test_keys_are_fixed_across_processes():
    code = "from opake.random import key; print(key(42).hex(), key(42).split(3)[2].fold_in('x').hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [key(42).hex(), key(42).split(3)[2].fold_in("x").hex()]


def test_key_material_is_the_documented_hash():
    # SHAKE-256 over the unambiguous encoding of (domain tag, seed); written out here by hand.
    def part(tag, payload):
        return tag + len(payload).to_bytes(8, "big") + payload

    data = part(b"s", b"opake.random.key") + part(b"i", (42).to_bytes(1, "big", signed=True))
    assert key(42).material == hashlib.shake_256(data).digest(32)


@pytest.mark.parametrize("seed", [1.0, True, None, "42", b"42", 3 + 0j])
def test_only_integer_seeds_are_accepted(seed):
    with pytest.raises(TypeError, match=r"key\(seed\) needs an integer seed"):
        key(seed)


def test_split_gives_distinct_children_independent_of_the_count():
    parent = key(1)
    children = parent.split(4)
    assert len(set(children)) == 4 and parent not in children
    assert parent.split(2) == children[:2]
    assert parent.split(1) == (children[0],)
    assert children[0].split(2) != parent.split(2)
    with pytest.raises(ValueError, match="n >= 1"):
        parent.split(0)
    with pytest.raises(TypeError, match="integer count"):
        parent.split(2.0)


def test_fold_in_distinguishes_ints_and_strings():
    parent = key(1)
    assert parent.fold_in(3) == parent.fold_in(3)
    assert parent.fold_in(3) != parent.fold_in("3")
    assert parent.fold_in(3) != parent.fold_in(4)
    assert parent.fold_in("layer") != parent.fold_in("layer2")
    assert parent.fold_in(0) not in parent.split(2)
    with pytest.raises(TypeError, match="int or a str"):
        parent.fold_in(1.5)
    with pytest.raises(TypeError, match="int or a str"):
        parent.fold_in(False)


def test_encoding_is_unambiguous():
    assert encode_parts(("ab", "c")) != encode_parts(("a", "bc"))
    assert encode_parts((1,)) != encode_parts(("1",)) != encode_parts((b"1",))
    assert encode_parts((-1,)) != encode_parts((255,))
    with pytest.raises(TypeError, match="ints, strs or bytes"):
        encode_parts((1.0,))


def test_derived_bytes_and_the_hot_loop_deriver_agree():
    parent = key(9)
    derive = parent.deriver("engine")
    assert derive((1, "p", b"q"), 40) == parent.derive_bytes("engine", (1, "p", b"q"), 40)
    assert parent.derive_bytes("engine", (1,), 16) != parent.derive_bytes("other", (1,), 16)
    assert parent.derive_bytes("engine", (1,), 16) != key(10).derive_bytes("engine", (1,), 16)


def test_hex_round_trip_and_validation():
    parent = key(77)
    assert RngKey.from_hex(parent.hex()) == parent
    with pytest.raises(ValueError, match="64 hex digits"):
        RngKey.from_hex("abcd")
    with pytest.raises(TypeError, match=r"opake\.random\.key\(seed\)"):
        RngKey(b"short")
    assert "RngKey(" in repr(parent) and parent.hex() not in repr(parent)


def test_keys_touch_no_global_random_state():
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state, numpy_state = torch.random.get_rng_state(), np.random.get_state()[1].copy()
    key(5).split(3)[1].fold_in("x").derive_bytes("d", (1,), 64)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state)


def test_keys_are_immutable():
    parent = key(1)
    with pytest.raises(AttributeError):
        parent.material = b"0" * 32
