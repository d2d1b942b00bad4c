"""Explicit random keys: every random draw in opake is a function of a key the caller chose.

A key is a frozen, hashable value made from an integer seed with :func:`key`. New keys are
derived from it by :meth:`RngKey.split` (n independent children) and :meth:`RngKey.fold_in`
(mix in a step number or a name). Nothing here reads or changes global random state (no
``torch.manual_seed``, no ``numpy.random.seed``), and no function in opake invents a seed when
none is given: the key is always a required argument.

Derivation. A key holds 32 bytes of key material. Every derivation hashes the parent material
together with a domain tag and the derivation's inputs with SHAKE-256 (an extendable-output
hash from the standard library), so results are identical across processes, machines and
Python versions, and distinct inputs give unrelated outputs. Inputs are encoded without
ambiguity: each part carries a type tag and its length, so ``fold_in(1)`` differs from
``fold_in("1")`` and ``("ab", "c")`` from ``("a", "bc")``.

>>> from opake.random import key
>>> k = key(42)
>>> k == key(42), k == key(43)
(True, False)
>>> left, right = k.split(2)
>>> k.split(3)[:2] == (left, right)   # children do not depend on how many were asked for
True
>>> k.fold_in("layer1") == k.fold_in("layer1")
True
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass

from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["Deriver", "RngKey", "key"]

_MATERIAL_BYTES = 32
_TAG_ROOT = "opake.random.key"
_TAG_SPLIT = "opake.random.split"
_TAG_FOLD = "opake.random.fold_in"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _encode_int(value: int) -> bytes:
    # Two's-complement big-endian, long enough for any Python int; the length prefix added by
    # encode_parts makes the encoding unambiguous.
    value = int(value)
    length = (value.bit_length() + 8) // 8
    return value.to_bytes(length, "big", signed=True)


def encode_parts(parts) -> bytes:
    """Unambiguous byte encoding of a sequence of ints, strs and bytes.

    Each part becomes ``type tag (1 byte) + length (8 bytes) + payload``, so two different
    sequences never encode to the same bytes. Used for every derivation in this module and by
    the noise engine to name (step, parameter path, block).
    """
    out = bytearray()
    for part in parts:
        if type(part) is int:  # the common case, without the slower abstract-class check
            tag, payload = b"i", _encode_int(part)
        elif _is_int(part):
            tag, payload = b"i", _encode_int(part)
        elif isinstance(part, str):
            tag, payload = b"s", part.encode("utf-8")
        elif isinstance(part, (bytes, bytearray)):
            tag, payload = b"b", bytes(part)
        else:
            raise InvalidTypeError(
                f"random key derivations take ints, strs or bytes, got {part!r} "
                f"({type(part).__name__})"
            )
        out += tag + len(payload).to_bytes(8, "big") + payload
    return bytes(out)


def _shake(material: bytes, tag: str, parts, size: int) -> bytes:
    return hashlib.shake_256(encode_parts((tag, material, *parts))).digest(size)


@dataclass(frozen=True)
class RngKey:
    """An immutable random key: 32 bytes of key material.

    Create one with :func:`key`; derive more with :meth:`split` and :meth:`fold_in`. Keys are
    compared and hashed by their material, print a short fingerprint, and serialize as a hex
    string (:meth:`hex`, :meth:`from_hex`).
    """

    material: bytes

    def __post_init__(self):
        material = self.material
        if not isinstance(material, (bytes, bytearray)) or len(material) != _MATERIAL_BYTES:
            raise InvalidTypeError(
                f"RngKey material must be {_MATERIAL_BYTES} bytes; create keys with "
                f"opake.random.key(seed) instead of constructing RngKey directly"
            )
        object.__setattr__(self, "material", bytes(material))

    def split(self, n: int = 2) -> tuple[RngKey, ...]:
        """``n`` new keys, independent of each other and of this key.

        Child ``i`` depends only on this key and ``i``, so ``k.split(3)[:2] == k.split(2)``.
        """
        if not _is_int(n):
            raise InvalidTypeError(f"split(n) needs an integer count, got {n!r} ({type(n).__name__})")
        if n < 1:
            raise InvalidArgumentError(f"split(n) needs n >= 1, got {n}")
        return tuple(
            RngKey(_shake(self.material, _TAG_SPLIT, (index,), _MATERIAL_BYTES))
            for index in range(int(n))
        )

    def fold_in(self, data: int | str) -> RngKey:
        """A new key that mixes ``data`` (an int such as a step, or a str such as a name) in."""
        if not (_is_int(data) or isinstance(data, str)):
            raise InvalidTypeError(
                f"fold_in takes an int or a str, got {data!r} ({type(data).__name__}); "
                f"convert other values to one of these explicitly"
            )
        return RngKey(_shake(self.material, _TAG_FOLD, (data,), _MATERIAL_BYTES))

    def derive_bytes(self, domain: str, parts, size: int) -> bytes:
        """``size`` pseudo-random bytes determined by (this key, ``domain``, ``parts``).

        ``parts`` is a sequence of ints, strs and bytes. Library code uses this to seed
        generators (the noise engine passes the step, the parameter path and a block index);
        different domains or parts give unrelated bytes.
        """
        return self.deriver(domain)(parts, size)

    def deriver(self, domain: str) -> Deriver:
        """A :class:`Deriver`: ``derive(parts, size) == derive_bytes(domain, parts, size)``.

        For hot loops: the hash of the key material and domain is computed once.
        """
        if not isinstance(domain, str):
            raise InvalidTypeError(f"domain must be a str, got {type(domain).__name__}")
        return Deriver(hashlib.shake_256(encode_parts(("opake.random.derive:" + domain, self.material))))

    def hex(self) -> str:
        """The key material as 64 hex digits (inverse of :meth:`from_hex`)."""
        return self.material.hex()

    @classmethod
    def from_hex(cls, text: str) -> RngKey:
        """The key whose :meth:`hex` is ``text`` (for checkpoints)."""
        if not isinstance(text, str):
            raise InvalidTypeError(f"RngKey.from_hex takes a str, got {type(text).__name__}")
        try:
            material = bytes.fromhex(text)
        except ValueError:
            raise InvalidArgumentError(
                f"RngKey.from_hex needs {2 * _MATERIAL_BYTES} hex digits, got {text!r}"
            ) from None
        if len(material) != _MATERIAL_BYTES:
            raise InvalidArgumentError(f"RngKey.from_hex needs {2 * _MATERIAL_BYTES} hex digits, got {len(text)}")
        return cls(material)

    def __repr__(self) -> str:
        return f"RngKey({self.material[:6].hex()}...)"


class Deriver:
    """Derives bytes for one (key, domain): ``derive(parts, size)``.

    SHAKE-256 absorbs its input in order, so a copy of the hash state after the key material
    and domain, fed the encoded parts, gives the hash of the whole input. ``encoded(data,
    size)`` takes ``encode_parts(parts)`` already computed (callers that reuse most parts can
    concatenate cached encodings: the encoding of a sequence is the concatenation of the
    encodings of its parts).
    """

    __slots__ = ("_prefix",)

    def __init__(self, prefix):
        self._prefix = prefix

    def __call__(self, parts, size: int) -> bytes:
        return self.encoded(encode_parts(parts), size)

    def encoded(self, data: bytes, size: int) -> bytes:
        hasher = self._prefix.copy()
        hasher.update(data)
        return hasher.digest(size)


def key(seed: int) -> RngKey:
    """The random key for an integer ``seed`` (any size, negative allowed).

    The seed must be an ``int`` (or numpy integer): floats, bools, strings and None are refused,
    so a key is never made from an accidental value.
    """
    if not _is_int(seed):
        raise InvalidTypeError(
            f"key(seed) needs an integer seed, got {seed!r} ({type(seed).__name__}); "
            f"pass an explicit int such as key(42)"
        )
    return RngKey(hashlib.shake_256(encode_parts((_TAG_ROOT, int(seed)))).digest(_MATERIAL_BYTES))
