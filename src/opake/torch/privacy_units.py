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

The number of units is public (it fixes ``num_bins`` or ``q``), as the number of examples is.
"""

from __future__ import annotations

import numpy as np
import torch

from opake.dpftrl.sampling import PrivacyUnits

__all__ = ["description", "privacy_units"]

EXAMPLE = "example"


def privacy_units(privacy_unit, num_examples: int) -> PrivacyUnits | None:
    """``privacy_unit`` (None, one hashable id per example, or a ``PrivacyUnits``) checked against
    a data set of ``num_examples`` examples; None for example-level privacy."""
    if privacy_unit is None:
        return None
    if isinstance(privacy_unit, PrivacyUnits):
        units = privacy_unit
    else:
        if isinstance(privacy_unit, (str, bytes)):
            raise TypeError(
                f"privacy_unit takes one id per example (a list, array or column of user ids), got the string "
                f"{privacy_unit!r}; pass the ids themselves, e.g. privacy_unit=dataset['user_id']"
            )
        if isinstance(privacy_unit, (torch.Tensor, np.ndarray)):
            if privacy_unit.ndim != 1:
                raise ValueError(f"privacy_unit must hold one id per example (1-D), got shape "
                                 f"{tuple(privacy_unit.shape)}")
            # A tensor's elements hash by identity: read their values.
            ids = privacy_unit.tolist()
        else:
            try:
                ids = list(privacy_unit)
            except TypeError:
                raise TypeError(f"privacy_unit must be None, a sequence of one id per example or an "
                                f"opake.dpftrl.sampling.PrivacyUnits, got {type(privacy_unit).__name__}") from None
        if len(ids) != num_examples:
            raise ValueError(f"privacy_unit has {len(ids)} ids but the dataset has {num_examples} examples; give "
                             f"one id (the user of that example) per example, in the dataset's order")
        unequal = next((value for value in ids if _not_self_equal(value)), _NONE)
        if unequal is not _NONE:
            raise ValueError(f"privacy unit id {unequal!r} is not equal to itself (NaN), so its examples could "
                             f"not be grouped; use ids such as integers or strings")
        units = PrivacyUnits.from_ids(ids)
    if units.num_examples != num_examples:
        raise ValueError(f"privacy_unit assigns {units.num_examples} examples to units but the dataset has "
                         f"{num_examples}; build PrivacyUnits from one id per example of this dataset")
    return units


_NONE = object()


def _not_self_equal(value) -> bool:
    try:
        return bool(value != value)
    except Exception:  # an id whose comparison does not give a truth value: hashing decides
        return False


def description(units: PrivacyUnits | None) -> str:
    """``PrivacyPlan.privacy_unit``: ``"example"``, or ``"user (N units)"``."""
    return EXAMPLE if units is None else f"user ({units.num_units} units)"
