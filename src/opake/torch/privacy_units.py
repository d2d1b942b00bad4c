"""The privacy unit of ``make_private(..., privacy_unit=...)``: the example, or a user's examples.

With ``privacy_unit=None`` the protected unit is one example. With one id per example (a user, a
document, a session) the unit is all the examples that share an id, and the guarantee is for
adding or removing one unit with all its examples (SECURITY.md):

* **Sampling.** Units, not examples, are put in bins (or Poisson groups): ``UnitSampler`` over
  ``PrivacyUnits.from_ids(ids)``, built exactly as the example-level sampler would be over
  ``num_units`` items (``num_bins = num_units // batch_size``; Poisson ``q = batch_size * g /
  num_units``). Every unit's draws depend on the key and its own number only (units are numbered
  by first appearance), so one more unit moves no other; a drawn unit brings all its examples.
* **Clipping.** Each unit's summed gradient over its rows is clipped to ``max_grad_norm``
  (``PerExampleClipper.expect_units``), so one unit moves the clipped sum by at most C whatever
  its number of examples.
* **Accounting.** Exactly as for examples, with units in their place: the same
  ``balls_in_bins``/``poisson`` calls on the unit sampler's ``num_bins``/``sample_rate``, and the
  participation ``(n_steps, min_sep, max_participations)`` holds for every unit.
* **Normalization.** The clipped sum is divided by the expected number of units per batch.

Ids are compared by value at any depth (``PrivacyUnits.from_ids``): tuples, lists, tensors
(one element: its value; more: the tuple of their values), numpy scalars and arrays, nested in
each other, become one key of plain Python values, so ``list(zip(org_ids, user_ids))`` over a
tensor data set (tuples of 0-d tensors) groups its examples by user, as ``(3, 7)`` would. A
tensor hashes by identity: grouped as they come, every example would be a user of its own and
the plan would price users while the run clipped and sampled examples. So what cannot be compared
by value is refused before anything is planned: objects equal only to themselves
(``UncomparableIdError``) and NaN anywhere in an id (``NaNIdError``). Ids that look alike
(``3`` and ``"3"``, the NFC and NFD forms of one name) stay distinct users and ids Python holds
equal across types (``1``, ``1.0``, ``True``) one user; both are reported in one
``LookAlikeIdsWarning``. A privacy_unit tensor or array gives one id per row of its first
dimension. The errors and the warning are defined beside ``PrivacyUnits.from_ids`` in
``opake.dpftrl.sampling`` (a layer below this one, which may not import from here) and re-exported
here. Flat ints or strings, a 1-D tensor or array, and tuples of plain values are read with no
Python call per id; other forms id by id, in one pass.

The number of units is public (it fixes ``num_bins`` or ``q``), as the number of examples is.
"""

from __future__ import annotations

import numpy as np
import torch

from opake.dpftrl.sampling import LookAlikeIdsWarning, NaNIdError, PrivacyUnits, UncomparableIdError
from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["LookAlikeIdsWarning", "NaNIdError", "UncomparableIdError", "description", "privacy_units"]

EXAMPLE = "example"


def privacy_units(privacy_unit, num_examples: int) -> PrivacyUnits | None:
    """``privacy_unit`` (None, one id per example, or a ``PrivacyUnits``) checked against a data set
    of ``num_examples`` examples: its ``PrivacyUnits``, or None for example-level privacy."""
    if privacy_unit is None:
        return None
    if isinstance(privacy_unit, PrivacyUnits):
        units = privacy_unit
    else:
        units = PrivacyUnits.from_ids(_one_id_per_example(privacy_unit, num_examples))
    if units.num_examples != num_examples:
        raise InvalidArgumentError(f"privacy_unit assigns {units.num_examples} examples to units but the dataset has "
                                   f"{num_examples}; build PrivacyUnits from one id per example of this dataset")
    return units


def _one_id_per_example(privacy_unit, num_examples: int):
    """``privacy_unit`` as a sequence (a list, or a tensor or array, rows being examples) of exactly
    ``num_examples`` ids; the ids themselves are read by ``PrivacyUnits.from_ids``."""
    if isinstance(privacy_unit, (str, bytes)):
        raise InvalidTypeError(
            f"privacy_unit takes one id per example (a list, array or column of user ids), got the string "
            f"{privacy_unit!r}; pass the ids themselves, e.g. privacy_unit=dataset['user_id']"
        )
    if isinstance(privacy_unit, (torch.Tensor, np.ndarray)):
        if privacy_unit.ndim == 0:
            raise InvalidArgumentError(f"privacy_unit must hold one id per example (one per row), got a 0-d "
                                       f"{type(privacy_unit).__name__}")
        ids = privacy_unit
    else:
        try:
            ids = list(privacy_unit)
        except TypeError:
            raise InvalidTypeError(f"privacy_unit must be None, a sequence of one id per example or an "
                                   f"opake.dpftrl.sampling.PrivacyUnits, got {type(privacy_unit).__name__}") from None
    if len(ids) != num_examples:
        raise InvalidArgumentError(f"privacy_unit has {len(ids)} ids but the dataset has {num_examples} examples; give "
                                   f"one id (the user of that example) per example, in the dataset's order")
    return ids


def description(units: PrivacyUnits | None) -> str:
    """``PrivacyPlan.privacy_unit``: ``"example"``, or ``"user (N units)"``."""
    return EXAMPLE if units is None else f"user ({units.num_units} units)"
