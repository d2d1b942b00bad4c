"""The checkpoint of a private run: what ``PrivateTraining.state_dict()`` holds, and the check on load.

A checkpoint holds the model, the optimizer, the noise state (with its integrity digest), the
root key (hex) and a record of the plan: everything a resumed run needs to continue the same
batches and noise, in plain tensors, numbers and strings (``torch.load(..., weights_only=True)``
reads it). It loads only into a run planned identically with the same key: another plan would
continue other batches under another accounting. Restoring the noise state needs an explicit
choice between replaying its draws and drawing fresh ones (``NoiseState.load_state_dict``;
SECURITY.md, "Replaying or redrawing noise").

The whole checkpoint carries a SHA-256 ``"digest"`` of every other entry (``whole_digest``: the
model's, the optimizer's and the noise state's tensors, byte for byte, and every number and
string), so a flipped bit anywhere is refused before anything is restored; the noise state keeps
its own digest too. A checkpoint written before the whole digest existed loads with a warning.

Format history (version 1 throughout; what older checkpoints lack is read as what they planned):
a checkpoint from before ``sampling=`` planned balls in bins, unamplified; before privacy units,
the example; before automatic clipping, flat clipping; the amplified bound was once recorded as
``"rdp"``.
"""

from __future__ import annotations

import hashlib
import warnings

import torch

from opake.dpftrl.sampling import PrivacyUnits
from opake.errors import OpakeError

__all__ = ["CheckpointError", "FORMAT", "VERSION", "check_checkpoint", "clipping_record", "plan_record",
           "whole_digest"]

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


class CheckpointError(OpakeError, ValueError):
    """A checkpoint that cannot be restored into this run (another format, plan or key; corrupted or
    edited; older than the steps this run has already released). Nothing was restored."""


def whole_digest(state_dict: dict) -> str:
    """SHA-256 (hex) of every entry of ``state_dict`` but ``"digest"``: names in sorted order, each
    tensor's dtype, shape and bytes (a DTensor's local shard), every other value's repr."""
    digest = hashlib.sha256()
    _feed(digest, {name: value for name, value in state_dict.items() if name != "digest"})
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if isinstance(value, dict):
        digest.update(b"{")
        for name in sorted(value, key=repr):
            digest.update(repr(name).encode() + b":")
            _feed(digest, value[name])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[" if isinstance(value, list) else b"(")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.to_local() if hasattr(value, "to_local") else value
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"<{tensor.dtype}|{tuple(tensor.shape)}>".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    else:
        digest.update(f"<{type(value).__name__}:{value!r}>".encode())


def check_checkpoint(state_dict, plan, key_hex: str) -> None:
    """Refuse, before anything is restored, a checkpoint of another format, version, plan or key, or one
    whose bytes are not the ones saved."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        raise CheckpointError("not a checkpoint of make_private's run: expected PrivateTraining.state_dict()")
    if state_dict.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version {state_dict.get('version')!r} is not supported (reads {VERSION})")
    if "digest" not in state_dict:
        warnings.warn("this checkpoint has no whole digest (written by an older opake): only its noise state's "
                      "integrity is checked, not the model's or the optimizer's", stacklevel=3)
    elif state_dict["digest"] != whole_digest(state_dict):
        raise CheckpointError(
            "this checkpoint's contents do not match its digest: the model, optimizer or noise state was edited "
            "or corrupted after it was saved (a flipped bit, a truncated copy). Resume from an intact copy or an "
            "earlier checkpoint. Nothing was restored")
    saved = {**_BEFORE_SAMPLING, "privacy_unit": EXAMPLE, **state_dict["plan"]}
    saved["accounting"] = _OLD_METHOD_NAMES.get(saved["accounting"], saved["accounting"])
    if state_dict["key"] != key_hex or saved != plan_record(plan):
        raise CheckpointError(
            "this checkpoint belongs to another plan or key (different sampling, bins, horizon, accounting, "
            "noise, privacy units or clipping rule); build the run with the same make_private arguments and "
            "key=opake.random.RngKey.from_hex(saved['key'])"
        )


def check_module_state(module, saved: dict) -> None:
    """Refuse, before anything is loaded, a model state whose names or shapes differ from ``module``'s
    (``nn.Module.load_state_dict`` copies the matching tensors first and complains about the rest after)."""
    current = module.state_dict()
    if not isinstance(saved, dict):
        raise CheckpointError("the checkpoint's 'module' entry is not a state dict")
    missing = [name for name in current if name not in saved]
    unexpected = [name for name in saved if name not in current]
    reshaped = [name for name, value in current.items() if name in saved and isinstance(value, torch.Tensor)
                and (not isinstance(saved[name], torch.Tensor) or tuple(saved[name].shape) != tuple(value.shape))]
    if missing or unexpected or reshaped:
        parts = [f"{label} {names[:3]}" for label, names in
                 (("missing", missing), ("unexpected", unexpected), ("with another shape", reshaped)) if names]
        raise CheckpointError(
            f"the checkpoint's model does not fit this module ({'; '.join(parts)}): it was saved from another "
            f"architecture, or the module changed since. Build the module the run was saved from. Nothing was "
            f"restored")


def check_optimizer_state(optimizer, saved: dict) -> None:
    """Refuse, before anything is loaded, an optimizer state whose groups do not match ``optimizer``'s."""
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise CheckpointError("the checkpoint's 'optimizer' entry is not an optimizer state dict")
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    saved_sizes = [len(group.get("params", ())) for group in saved["param_groups"]]
    if sizes != saved_sizes:
        raise CheckpointError(
            f"the checkpoint's optimizer has parameter groups of sizes {saved_sizes}, this optimizer {sizes}: it "
            f"was saved from another optimizer set-up. Build the optimizer as the saved run did. Nothing was "
            f"restored")
    indices = {index for group in saved["param_groups"] for index in group["params"]}
    strays = [index for index in saved["state"] if index not in indices]
    if strays:
        raise CheckpointError(f"the checkpoint's optimizer holds state for unknown parameters {strays[:3]}; it "
                              f"was edited or corrupted. Nothing was restored")
