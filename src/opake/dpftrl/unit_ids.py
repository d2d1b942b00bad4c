"""Privacy-unit ids read by value: one unit number per example, from ids of any plain form.

``PrivacyUnits.from_ids`` (``opake.dpftrl.sampling``) groups examples into units by their ids.
Grouping must be by value: a tensor or numpy scalar hashes by identity, so equal tensor ids
grouped as they come would each make a unit of their own and turn user-level privacy into
example-level privacy silently (16 users of ``(org, user)`` 0-d tensor pairs became 64 units).
``unit_numbers`` reads each id as one key of plain Python values at any depth (tuples, lists,
tensors, numpy arrays and scalars nested in each other), numbers units by first appearance,
refuses what cannot be compared by value (``UncomparableIdError``, ``NaNIdError``) and warns
about ids that a person would group otherwise (``LookAlikeIdsWarning``).
"""

from __future__ import annotations

import enum
import itertools
import math
import unicodedata
import warnings

import numpy as np
import torch

from opake.errors import InvalidArgumentError, OpakeError

__all__ = ["LookAlikeIdsWarning", "NaNIdError", "UncomparableIdError", "unit_numbers"]

class UncomparableIdError(OpakeError, TypeError):
    """A privacy unit id that cannot be compared by value: equal only to itself, or not hashable."""


class NaNIdError(OpakeError, ValueError):
    """A privacy unit id holding NaN, which equals nothing (itself included), so no group holds it."""


class LookAlikeIdsWarning(UserWarning):
    """Privacy unit ids grouped by value that a person would group otherwise: distinct ids with the
    same text or Unicode form (two users), or ids of different types that Python holds equal (one)."""


# Ids of these exact types are their own keys (no NaN aside): they hash by value, and a str, bytes
# or None equals no value of another type, while numbers of two types can be equal (1 == 1.0 == True).
_PLAIN_KINDS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_NUMBER_KINDS = frozenset({int, float, bool})
_EQUAL_TO_OWN_KIND_ONLY = frozenset({str, bytes, type(None)})
_TEXT_KINDS = frozenset({str, bytes})
# A subclass of a builtin is read as the builtin's value through the builtin's own conversion
# (``str(member)`` of a ``(str, Enum)`` class is ``"Color.RED"``, not the value it compares as).
_BUILTIN_VALUE = ((int, int.__int__), (float, float.__float__), (complex, complex.__complex__),
                  (str, str.__str__), (bytes, bytes.__bytes__))
_LOOK_ALIKE_EXAMPLES = 3


def _id_keys(ids) -> tuple[list, frozenset, bool]:
    """One hashable key per id of ``ids`` (a sequence, or a tensor or array with one id per row); the
    types of the plain values the keys are made of; and whether each key is one plain value.

    The common cases are read with passes of ``type`` in C and no Python call per id: plain values
    (a list of ints or strings, a 1-D tensor or array) and tuples or lists of plain values (pairs
    such as ``(org, user)`` of ints, the rows of a 2-D tensor). Anything else goes through
    ``_IdReader`` id by id.
    """
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim == 0:
            raise InvalidArgumentError(f"privacy unit ids must hold one id per example along their first dimension, "
                                       f"got a 0-d {type(ids).__name__}")
        values = ids.tolist()
    else:
        values = list(ids)
    kinds = frozenset(map(type, values))
    if kinds <= _PLAIN_KINDS:
        _refuse_nan(values, kinds, values)
        return values, kinds, True
    if kinds <= {tuple, list}:
        kinds = frozenset(map(type, itertools.chain.from_iterable(values)))
        if kinds <= _PLAIN_KINDS:
            _refuse_nan(values, kinds, itertools.chain.from_iterable(values))
            return list(map(tuple, values)), kinds, False
    reader = _IdReader()
    keys = [reader.keyed(value, example) for example, value in enumerate(values)]
    return keys, frozenset(reader.leaf_kinds), False


def _refuse_nan(values: list, kinds: frozenset, plain_values) -> None:
    """Raise ``NaNIdError`` for the first id of ``values`` that holds NaN, if one does; ``plain_values``
    are the plain values the ids are made of, ``kinds`` their types."""
    if not kinds & {float, complex}:
        return
    if kinds == {float}:
        holds_nan = any(map(math.isnan, plain_values))
    else:
        holds_nan = any(value != value for value in plain_values)
    if holds_nan:
        reader = _IdReader()
        for example, value in enumerate(values):
            reader.keyed(value, example)  # raises at the first id holding NaN


class _Refused(Exception):
    """Raised inside ``_IdReader.key``; ``keyed`` names the whole id and its example in the error."""

    def __init__(self, error: type, reason: str):
        super().__init__(reason)
        self.error, self.reason = error, reason


class _IdReader:
    """Reads ids as keys of plain Python values (tuples for sequences and arrays, equal for ids equal
    by value, hashed by value) and collects in ``leaf_kinds`` the types of the values met, which tell
    ``_warn_if_look_alike`` which of its checks could find anything."""

    def __init__(self):
        self.leaf_kinds: set = set()

    def keyed(self, value, example: int):
        """``key(value)``; a refusal is raised as an opake error naming the id and its example."""
        try:
            return self.key(value)
        except _Refused as refused:
            raise refused.error(f"the privacy unit id {value!r} of example {example} {refused.reason}") from None

    def key(self, value):
        """``value``'s key; raises ``_Refused`` for what cannot be compared by value."""
        kind = type(value)
        if kind in _PLAIN_KINDS:
            if value != value:  # only a float or complex NaN is unequal to itself here
                raise _Refused(NaNIdError, "holds NaN, which equals nothing (itself included), so its examples "
                                           "could not be grouped; give those examples a real id (an int or str)")
            self.leaf_kinds.add(kind)
            return value
        if kind is tuple or kind is list:
            return tuple(map(self.key, value))
        if isinstance(value, torch.Tensor):
            return self.key(value.item() if value.numel() == 1 else value.tolist())
        if isinstance(value, np.ndarray):
            return self.key(value.item() if value.size == 1 else value.tolist())
        if isinstance(value, np.generic):
            return self.key(value.item())
        return self._other_key(value)

    def _other_key(self, value):
        """The key of a value of no plain kind: a subclass of a builtin or of a sequence, a set, an enum
        member (a singleton: equal by identity is equal by value) or an object with value equality."""
        for builtin, plain_value in _BUILTIN_VALUE:
            if isinstance(value, builtin):
                return self.key(plain_value(value))
        if isinstance(value, (tuple, list)):
            return tuple(map(self.key, value))
        if isinstance(value, (set, frozenset)):
            return frozenset(map(self.key, value))
        kind = type(value)
        if not isinstance(value, enum.Enum):
            _refuse_unless_compared_by_value(value)
        self.leaf_kinds.add(kind)
        return value


def _refuse_unless_compared_by_value(value) -> None:
    """Raise ``_Refused`` for an object that is unhashable, equal or hashed by identity, or unequal to
    itself (a NaN of its own kind)."""
    kind = type(value)
    if kind.__hash__ is None:
        raise _Refused(UncomparableIdError, f"holds a value of type {kind.__name__}, which is not hashable; use a "
                                            f"tuple of its values (an int or str per field)")
    if kind.__eq__ is object.__eq__ or kind.__hash__ is object.__hash__:
        raise _Refused(UncomparableIdError, f"holds a value of type {kind.__name__}, which compares or hashes by "
                                            f"identity: two equal ids would be two users; pass the user's "
                                            f"number or name (an int, a str or a tuple of them)")
    if _not_self_equal(value):
        raise _Refused(NaNIdError, f"holds {value!r}, which is not equal to itself (NaN), so its examples "
                                   f"could not be grouped; give those examples a real id (an int or str)")


def _not_self_equal(value) -> bool:
    try:
        return bool(value != value)
    except Exception:  # a comparison without a truth value: its hash, checked before, decides
        return False


def _warn_if_look_alike(keys: list, units: list, first_keys, leaf_kinds: frozenset, flat: bool) -> None:
    """One ``LookAlikeIdsWarning`` listing a few look-alike groups, if any: ``keys`` and ``units`` one
    per example, ``first_keys`` each unit's first key in unit order, ``leaf_kinds`` and ``flat`` as
    ``_id_keys`` gives them. O(number of ids); for ints, or ASCII strings alone, nothing but set tests
    and one join of the distinct strings."""
    merged = _merged_across_types(keys, units, leaf_kinds)
    alike = _distinct_but_alike(first_keys, leaf_kinds, flat)
    if not merged and not alike:
        return
    parts = []
    if alike:
        parts.append(f"{len(alike)} group(s) of distinct ids with the same text or Unicode (NFKC) form, each "
                     f"id its own user: " + "; ".join(_listed(group) for group in alike[:_LOOK_ALIKE_EXAMPLES]))
    if merged:
        parts.append(f"{len(merged)} group(s) of ids of different types that Python holds equal, each group "
                     f"one user: " + "; ".join(_listed(group) for group in merged[:_LOOK_ALIKE_EXAMPLES]))
    warnings.warn(LookAlikeIdsWarning(
        "privacy unit ids that look alike were grouped by value: " + ". ".join(parts) + ". If that is not "
        "who the users are, normalize the ids before passing them (e.g. str(id) for every id, "
        "unicodedata.normalize('NFC', name)), so that one user has one id and two users two different ones"),
        stacklevel=3)


def _listed(keys: list) -> str:
    """``"1, 1.0 and True"``; text with its code points escaped, so an NFC and an NFD name differ."""
    return ", ".join(ascii(key) for key in keys[:-1]) + f" and {ascii(keys[-1])}"


def _merged_across_types(keys: list, units: list, leaf_kinds: frozenset) -> list:
    """Groups of ids that differ in the types of their values but are equal (``1``, ``1.0``,
    ``True``), so one unit: per unit, its first key then one key of every other type shape."""
    if len(leaf_kinds - _EQUAL_TO_OWN_KIND_ONLY) < 2:
        return []  # equal values of two types need two types that can equal another's values
    shapes: dict = {}  # unit -> {type shape: first key of that shape}
    for key, unit in zip(keys, units):
        shapes.setdefault(unit, {}).setdefault(_type_shape(key), key)
    return [list(by_shape.values()) for by_shape in shapes.values() if len(by_shape) > 1]


def _type_shape(key):
    """The types of a key's values, in its shape: ``(1, "a")`` -> ``(int, str)``."""
    kind = type(key)
    if kind is tuple:
        return tuple(map(_type_shape, key))
    if kind is frozenset:
        return frozenset(map(_type_shape, key))
    return kind


def _distinct_but_alike(first_keys, leaf_kinds: frozenset, flat: bool) -> list:
    """Groups of distinct keys with one ``_folded`` form (``3`` and ``"3"``; NFC and NFD names)."""
    if not _may_fold_together(first_keys, leaf_kinds, flat):
        return []
    groups: dict = {}
    for key in first_keys:
        groups.setdefault(_folded(key), []).append(key)
    return [group for group in groups.values() if len(group) > 1]


def _may_fold_together(first_keys, leaf_kinds: frozenset, flat: bool) -> bool:
    """Whether distinct keys could share a ``_folded`` form: text beside numbers or beside bytes, or
    text that is not all ASCII (ASCII is its own NFKC form; checked with one join for flat keys)."""
    texts = leaf_kinds & _TEXT_KINDS
    if not texts:
        return False
    if leaf_kinds & {int, float} or len(texts) == 2 or not flat:
        return True
    text = str if str in texts else bytes
    if leaf_kinds != {text}:  # None or True beside the text
        first_keys = (key for key in first_keys if type(key) is text)
    return not text().join(first_keys).isascii()


def _folded(key):
    """What a person reads in a key: text in its NFKC form, bytes as their UTF-8 text, numbers as
    their text; ``True`` and ``None`` stay themselves."""
    kind = type(key)
    if kind is str:
        return key if key.isascii() else unicodedata.normalize("NFKC", key)
    if kind is bytes:
        try:
            return _folded(key.decode("utf-8"))
        except UnicodeDecodeError:
            return key
    if kind is int or kind is float:
        return str(key)
    if kind is tuple:
        return tuple(map(_folded, key))
    if kind is frozenset:
        return frozenset(map(_folded, key))
    return key


def unit_numbers(ids) -> list[int]:
    """One unit number per id of ``ids`` (a sequence, or a tensor or array with one id per row),
    numbered by first appearance; ids equal by value share a number."""
    keys, leaf_kinds, flat = _id_keys(ids)
    number_of_key = {key: number for number, key in enumerate(dict.fromkeys(keys))}
    units = list(map(number_of_key.__getitem__, keys))
    _warn_if_look_alike(keys, units, number_of_key, leaf_kinds, flat)
    return units
