"""Canaries that go through the real pipeline, and the audit's dataset of a run.

Two kinds, each scored from what the run releases:

* ``GradientCanaries(count)`` (white-box). The audited module gets ``count`` extra scalar
  parameters (``AuditedModule.canary``, a bias-free ``Linear(count, 1)`` at zero). Canary i is an
  example whose loss is ``2^10 * max_grad_norm * canary.weight[i]``: its gradient is zero on the
  user's parameters and ``2^10 max_grad_norm e_i`` on the audit ones, so the run's own per-example
  clipping scales it to exactly the bound, ``max_grad_norm e_i`` (the worst case the accountant
  prices); the user's examples have zero gradient on the audit parameters. Coordinate i of the
  released gradients thus depends on canary i's participation and on the noise only, and the
  canaries do not interfere. Scores: ``"released"`` (default) reads the noisy gradient of every
  step (the mechanism's output) against each bin's participation pattern, decorrelated through
  the strategy matrix, and takes the best bin (``opake.audit.training``); ``"final"`` is the drop
  of coordinate i over the run (last iterate only).
* ``InputCanaries(inputs, labels)`` (black-box): canary i is the training example (inputs[i],
  labels[i]), typically a held-out input with a wrong label (``mislabeled_canaries``); its score is
  minus its loss on the final model (``"loss"``) or its logit margin for its label (``"margin"``).

Add/remove adjacency, and why absent canaries stay as placeholders. ``make_private`` derives its
plan (number of bins, normalization, steps) from ``len(dataset)``, and its guarantee is for that
plan. If an absent canary were left out, the plan would change with the number of canaries
included, which the audit must keep secret. So every canary has a fixed index after the user's
examples (``AuditDataset``); an absent one is a placeholder whose gradient is exactly zero
(weight 0 on its loss, no audit coordinate). The samplers draw every example's bin (or group and
inclusion) from the key and its own index only (``opake.dpftrl.sampling``), so a zero-gradient
placeholder changes no other example's batches and adds nothing to any clipped sum: the run is,
in distribution, the run on the data without that canary, under the fixed plan. Including or
excluding one canary is therefore an add/remove neighbour of the claim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.random import RngKey

__all__ = ["AuditDataset", "AuditedModule", "GradientCanaries", "InputCanaries", "inclusion_coins",
           "mislabeled_canaries"]

CANARY_SCALE = 1024.0  # 2^10: the canary's gradient is 2^10 clipping norms, clipped to exactly one
_GRADIENT_SCORES = ("released", "final")
_INPUT_SCORES = ("loss", "margin")


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"the number of canaries must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class GradientCanaries:
    """``count`` white-box canaries, one audit coordinate each (module docstring)."""

    count: int
    score: str = "released"

    def __post_init__(self):
        object.__setattr__(self, "count", _count(self.count))
        if self.score not in _GRADIENT_SCORES:
            raise InvalidArgumentError(f"GradientCanaries.score must be one of {_GRADIENT_SCORES}, got {self.score!r}")

    @property
    def white_box(self) -> bool:
        return True

    def describe(self) -> str:
        how = ("best bin's projection of the released noisy gradients" if self.score == "released"
               else "drop of its coordinate over the run (final model)")
        plural = "y" if self.count == 1 else "ies"
        return f"{self.count} gradient canar{plural} (white-box: clipped gradient = max_grad_norm e_i; score: {how})"


@dataclass(frozen=True, eq=False)
class InputCanaries:
    """``len(labels)`` black-box canaries: training examples (inputs[i], labels[i])."""

    inputs: torch.Tensor
    labels: torch.Tensor
    score: str = "loss"

    def __post_init__(self):
        if not isinstance(self.inputs, torch.Tensor) or not isinstance(self.labels, torch.Tensor):
            raise InvalidTypeError("InputCanaries needs tensors: inputs (count, ...) and labels (count,)")
        if self.labels.dim() != 1 or self.inputs.shape[0] != self.labels.shape[0] or self.labels.numel() == 0:
            raise InvalidArgumentError(
                f"InputCanaries needs inputs (count, ...) and labels (count,) with count >= 1, got "
                f"{tuple(self.inputs.shape)} and {tuple(self.labels.shape)}"
            )
        if self.score not in _INPUT_SCORES:
            raise InvalidArgumentError(f"InputCanaries.score must be one of {_INPUT_SCORES}, got {self.score!r}")

    @property
    def count(self) -> int:
        return int(self.labels.shape[0])

    @property
    def white_box(self) -> bool:
        return False

    def describe(self) -> str:
        how = "minus its loss" if self.score == "loss" else "its logit margin"
        plural = "y" if self.count == 1 else "ies"
        return f"{self.count} input canar{plural} (black-box: score = {how} on the final model)"


def mislabeled_canaries(inputs: torch.Tensor, labels: torch.Tensor, num_classes: int, key: RngKey,
                        score: str = "loss") -> InputCanaries:
    """Input canaries: ``inputs`` (held out from the training data) with uniformly random WRONG labels.

    A wrong label is what the model would not learn from the other examples, so a canary's loss
    is low mostly when it was trained on. Label i is ``(labels[i] + 1 + u_i) mod num_classes``,
    u_i uniform on 0..num_classes-2, drawn from ``key``.
    """
    if not isinstance(key, RngKey):
        raise InvalidTypeError(f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise InvalidArgumentError(
            f"num_classes must be an integer >= 2 (a wrong label must exist), got {num_classes!r}"
        )
    labels = torch.as_tensor(labels, dtype=torch.long)
    words = np.frombuffer(key.derive_bytes("opake.audit.canaries", ("mislabel", labels.numel()), 8 * labels.numel()),
                          dtype="<u8")
    shift = torch.from_numpy((words % np.uint64(num_classes - 1)).astype(np.int64))  # bias < 2^-60
    return InputCanaries(inputs, (labels + 1 + shift) % num_classes, score)


def inclusion_coins(count: int, key: RngKey) -> np.ndarray:
    """``count`` fair coins (True = the canary is included), one bit of SHAKE-256 output each."""
    count = _count(count)
    if not isinstance(key, RngKey):
        raise InvalidTypeError(f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}")
    raw = np.frombuffer(key.derive_bytes("opake.audit.coins", (count,), -(-count // 8)), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:count].astype(bool)


class AuditedModule(nn.Module):
    """The user's module, plus one audit coordinate per gradient canary (none for input canaries).

    ``forward(x, slot)`` returns ``(module(x), canary_term)``: ``canary_term[b]`` is
    ``2^10 max_grad_norm * canary.weight[slot[b]]`` for a gradient canary's example (slot >= 0)
    and 0 otherwise (``None`` without gradient canaries). ``module`` is the user's module itself.
    """

    def __init__(self, module: nn.Module, gradient_canaries: int, max_grad_norm: float):
        super().__init__()
        self.module = module
        self.scale = CANARY_SCALE * float(max_grad_norm)
        self.canary = None
        if gradient_canaries:
            self.canary = nn.Linear(int(gradient_canaries), 1, bias=False)
            nn.init.zeros_(self.canary.weight)

    def forward(self, x, slot):
        outputs = self.module(x)
        if self.canary is None:
            return outputs, None
        rows = torch.nonzero(slot >= 0).flatten()
        selector = torch.zeros(slot.shape[0], self.canary.in_features, dtype=self.canary.weight.dtype,
                               device=self.canary.weight.device)
        selector[rows, slot[rows]] = self.scale
        return outputs, self.canary(selector).squeeze(1)


class AuditDataset(torch.utils.data.Dataset):
    """The user's examples, then one fixed slot per canary (module docstring).

    Item: ``(x, y, slot, weight)``. A user's example i: ``(x_i, y_i, -1, 1)``. Canary j (index
    ``len(base) + j``): an included input canary ``(inputs[j], labels[j], -1, 1)``; an included
    gradient canary ``(x_0 * 0, y_0, j, 0)`` (its loss is the audit term only); an absent canary of
    either kind ``(x, y, -1, 0)``: a placeholder with zero gradient. The training loop's loss is
    ``mean(weight * loss(model(x), y) + canary_term)``.
    """

    def __init__(self, base, canaries, included: np.ndarray):
        if len(base) < 1:
            raise InvalidArgumentError("the audited dataset is empty; give the run's training examples")
        first = base[0]
        if not (isinstance(first, (tuple, list)) and len(first) == 2):
            raise InvalidTypeError(
                f"the audited dataset's items must be (input, label) pairs, got {type(first).__name__}"
            )
        included = np.asarray(included, dtype=bool)
        if included.shape != (canaries.count,):
            raise InvalidArgumentError(f"need one coin per canary ({canaries.count}), got shape {included.shape}")
        self.base = base
        self.canaries = canaries
        self.included = included
        self._blank = (torch.zeros_like(torch.as_tensor(first[0])), torch.as_tensor(first[1]))

    def __len__(self) -> int:
        return len(self.base) + self.canaries.count

    def __getitem__(self, index: int):
        n = len(self.base)
        if index < n:
            x, y = self.base[index]
            return torch.as_tensor(x), torch.as_tensor(y), torch.tensor(-1), torch.tensor(1.0)
        j = index - n
        if j >= self.canaries.count:
            raise IndexError(index)
        present = bool(self.included[j])
        if isinstance(self.canaries, InputCanaries):
            return (self.canaries.inputs[j], self.canaries.labels[j], torch.tensor(-1),
                    torch.tensor(1.0 if present else 0.0))
        x, y = self._blank
        return x, y, torch.tensor(j if present else -1), torch.tensor(0.0)
