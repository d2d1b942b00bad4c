"""The checkpoint of a private run: what ``PrivateTraining.state_dict()`` holds, and the check on load.

A checkpoint holds the model, the optimizer, the noise state (with its integrity digest), the
root key (hex) and a record of the plan: everything a resumed run needs to continue the same
batches and noise, in plain tensors, numbers and strings (``torch.load(..., weights_only=True)``
reads it). It loads only into a run planned identically with the same key: another plan would
continue other batches under another accounting. Restoring the noise state needs an explicit
choice between replaying its draws and drawing fresh ones (``NoiseState.load_state_dict``;
SECURITY.md, "Replaying or redrawing noise").

Format history (version 1 throughout; what older checkpoints lack is read as what they planned):
a checkpoint from before ``sampling=`` planned balls in bins, unamplified; before privacy units,
the example; before automatic clipping, flat clipping; the amplified bound was once recorded as
``"rdp"``.
"""

from __future__ import annotations

import hashlib

from opake.dpftrl.sampling import PrivacyUnits

__all__ = ["FORMAT", "VERSION", "check_checkpoint", "clipping_record", "plan_record"]

FORMAT = "opake.torch.PrivateTraining"
VERSION = 1
_BEFORE_SAMPLING = {"sampling": "balls_in_bins", "accounting": "rigorous", "num_groups": None, "sample_rate": None,
                    "clipping": "flat"}
_OLD_METHOD_NAMES = {"rdp": "amplified"}
EXAMPLE = "example"


def plan_record(plan) -> dict:
    """What a checkpoint records of ``plan`` (a ``PrivacyPlan``): plain values only."""
    return {"n_steps": plan.n_steps, "num_bins": plan.num_bins, "noise_multiplier": plan.noise_multiplier,
            "max_grad_norm": plan.max_grad_norm, "sampling": plan.sampling, "accounting": str(plan.accounting),
            "num_groups": plan.num_groups, "sample_rate": plan.sample_rate,
            "privacy_unit": units_record(plan.units), "clipping": clipping_record(plan.clipping)}


def clipping_record(rule) -> str:
    """The clipping rule in one string (``description`` of opake's rules; the repr of another)."""
    return getattr(rule, "description", None) or repr(rule)


def units_record(units: PrivacyUnits | None) -> str:
    """``"example"``, or the number of units and a SHA-256 digest of every example's unit number
    (another assignment is another plan)."""
    if units is None:
        return EXAMPLE
    digest = hashlib.sha256(units.unit_of_example.astype("<i8").tobytes()).hexdigest()
    return f"units {units.num_units} sha256:{digest}"


def check_checkpoint(state_dict, plan, key_hex: str) -> None:
    """Refuse, before anything is restored, a checkpoint of another format, version, plan or key."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        raise ValueError("not a checkpoint of make_private's run: expected PrivateTraining.state_dict()")
    if state_dict.get("version") != VERSION:
        raise ValueError(f"checkpoint version {state_dict.get('version')!r} is not supported (reads {VERSION})")
    saved = {**_BEFORE_SAMPLING, "privacy_unit": EXAMPLE, **state_dict["plan"]}
    saved["accounting"] = _OLD_METHOD_NAMES.get(saved["accounting"], saved["accounting"])
    if state_dict["key"] != key_hex or saved != plan_record(plan):
        raise ValueError(
            "this checkpoint belongs to another plan or key (different sampling, bins, horizon, accounting, "
            "noise, privacy units or clipping rule); build the run with the same make_private arguments and "
            "key=opake.random.RngKey.from_hex(saved['key'])"
        )
