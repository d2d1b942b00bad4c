"""Where each parameter lives in the engine's flat (B, d) buffers, and checks against it.

The gradient template (a pytree of tensors) is flattened once with optree. Leaf k, of n_k
elements, owns columns [offset_k, offset_k + n_k) of the buffers, in optree's leaf order. Only
shapes, dtypes, the device and paths are kept, never the template's tensors.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import optree
import torch

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, path_code
from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["Layout", "LeafSlot"]


def _kind(leaf: torch.Tensor) -> tuple:
    """(dtype, layout, contiguous) of a gradient leaf (sparse layouts are never contiguous)."""
    layout = leaf.layout
    return leaf.dtype, layout, layout == torch.strided and leaf.is_contiguous()


def path_text(path: tuple) -> str:
    """A readable name for a pytree path, for error messages."""
    return "/".join(str(entry) for entry in path) if path else "<root>"


@dataclass(frozen=True)
class LeafSlot:
    """One parameter tensor: its path, shape, template dtype and its columns in the buffers."""

    path: tuple
    code: bytes
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def blocks(self) -> range:
        """Indices of the fixed-size noise blocks of this leaf."""
        return range(-(-self.numel // BLOCK_ELEMENTS))


@dataclass(frozen=True, eq=False)
class Layout:
    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSlot, ...]
    size: int
    device: torch.device
    fingerprint: str

    @classmethod
    def from_template(cls, template) -> Layout:
        paths, leaves, treespec = optree.tree_flatten_with_path(template)
        if not leaves:
            raise InvalidArgumentError(
                "grad_template has no tensors; pass the model's parameters, e.g. "
                "dict(model.named_parameters()) or a single tensor"
            )
        slots, devices, offset = [], set(), 0
        digest = hashlib.sha256()
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise InvalidTypeError(
                    f"grad_template leaves must be torch.Tensor; the leaf at {path_text(path)!r} is "
                    f"{type(leaf).__name__}"
                )
            if not leaf.is_floating_point():
                raise InvalidTypeError(
                    f"grad_template leaf {path_text(path)!r} has dtype {leaf.dtype}; gradients are "
                    f"floating point, so leave integer/bool tensors out of the template"
                )
            code = path_code(path)
            slots.append(LeafSlot(path, code, leaf.shape, leaf.dtype, offset, leaf.numel()))
            devices.add(leaf.device)
            digest.update(code + repr(tuple(leaf.shape)).encode() + b"|")
            offset += leaf.numel()
        if len(devices) != 1:
            raise InvalidArgumentError(
                f"grad_template tensors are on several devices {sorted(map(str, devices))}; the noise "
                f"engine keeps one flat buffer on one device: build one engine per device"
            )
        return cls(treespec, tuple(slots), offset, devices.pop(), digest.hexdigest()[:32])

    @functools.cached_property
    def shapes(self) -> list:
        """The leaves' shapes, in layout order (a list, compared in one step by the checks)."""
        return [slot.shape for slot in self.leaves]

    def flatten_gradients(self, pytree) -> list[torch.Tensor]:
        """The gradient leaves in layout order, after checking them against the template.

        Raises ValueError for a different structure, shape or device and TypeError for
        non-tensor or non-floating leaves; reads no tensor data.
        """
        return self.flatten_gradients_with_kinds(pytree)[0]

    def flatten_gradients_with_kinds(self, pytree) -> tuple[list[torch.Tensor], set]:
        """``flatten_gradients``, and the set of the leaves' (dtype, layout, contiguous) kinds.

        The common case (everything matches) is checked with a few whole-list operations; only
        when one fails does the leaf-by-leaf walk run, to name the first offending leaf.
        """
        leaves, treespec = optree.tree_flatten(pytree)
        if (treespec == self.treespec
                and all(isinstance(leaf, torch.Tensor) for leaf in leaves)
                and [leaf.shape for leaf in leaves] == self.shapes):
            devices = {leaf.device for leaf in leaves}
            kinds = {_kind(leaf) for leaf in leaves}
            if devices == {self.device} and all(dtype.is_floating_point for dtype, _, _ in kinds):
                return leaves, kinds
        leaves = self._flatten_gradients_checked(pytree)
        return leaves, {_kind(leaf) for leaf in leaves}

    def _flatten_gradients_checked(self, pytree) -> list[torch.Tensor]:
        paths, leaves, treespec = optree.tree_flatten_with_path(pytree)
        if treespec != self.treespec:
            expected = {path_text(slot.path) for slot in self.leaves}
            got = {path_text(p) for p in paths}
            missing, extra = sorted(expected - got), sorted(got - expected)
            detail = f"missing {missing}, unexpected {extra}" if (missing or extra) else (
                f"expected structure {self.treespec}, got {treespec}")
            raise InvalidArgumentError(
                f"the gradients do not have the structure of grad_template ({detail}); pass "
                f"gradients for exactly the parameters the engine was built for"
            )
        for slot, leaf in zip(self.leaves, leaves):
            where = path_text(slot.path)
            if not isinstance(leaf, torch.Tensor):
                raise InvalidTypeError(f"gradient {where!r} is {type(leaf).__name__}, expected a torch.Tensor")
            if leaf.shape != slot.shape:
                raise InvalidArgumentError(
                    f"gradient {where!r} has shape {tuple(leaf.shape)} but grad_template has "
                    f"{tuple(slot.shape)}"
                )
            if leaf.device != self.device:
                raise InvalidArgumentError(
                    f"gradient {where!r} is on {leaf.device} but the noise engine is on {self.device}; "
                    f"move the gradients or build the engine from a template on {leaf.device}"
                )
            if not leaf.is_floating_point():
                raise InvalidTypeError(
                    f"gradient {where!r} has dtype {leaf.dtype}; noise is added to floating-point "
                    f"gradients only (grad_template has {slot.dtype})"
                )
        return leaves
