"""Losses whose every example's gradient depends on that example alone, and Hugging Face's heads.

Per-example clipping bounds each example's gradient by C, and the accountant assumes that adding
or removing one example moves the released clipped sum by at most C. That holds only if no
other example's gradient changes with it: the loss must be a sum (or a mean with a divisor that
does not depend on the other examples) of terms each of which depends on one example.

The supported forms (``make_private(..., loss_reduction=...)``):

* a per-example loss vector ``losses`` of shape (B,): ``losses.sum()`` with ``"sum"``, or
  ``losses.mean()`` with ``"mean"`` (the clipper undoes the 1/B of the batch in hand, which is
  exact per example);
* a per-example token mean: each example's own loss averaged over its own valid tokens
  (``token_mean_per_example``), then summed or averaged over the examples as above;
* ``F.cross_entropy(model(x), y)`` and other means over the batch dimension (``"mean"``).

Not a supported form: a mean over all valid tokens of the batch, which is what a Hugging Face
causal-LM loss computes (``sum of token losses / number of valid tokens in the batch``; with
``num_items_in_batch`` the divisor spans several micro-batches). Example i's gradient is then
scaled by ``T_i / T_batch``: adding one example with many tokens shrinks every other example's
contribution, so the clipped sum moves by more than C (measured: 1.13-1.15 C on GPT-2 with
padding). Clipping cannot repair that, because a gradient smaller than C is not rescaled.

``install_per_example_loss`` makes a Hugging Face model (causal LM, masked LM, sequence and
token classification heads, also inside a PEFT model) compute ``outputs.loss`` in a supported
form: the labels are taken out of the forward call (so the model's own batch-wide loss is never
formed), and the loss is computed from the logits per example, reduced as ``loss_reduction``
says. Any other Hugging Face head called with ``labels=`` is refused, with the fix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opake.errors import InvalidArgumentError, OpakeError

__all__ = ["PerExampleLoss", "UnsupportedLossError", "is_hugging_face_model", "loss_form",
           "per_example_classification_loss", "token_mean_per_example"]

IGNORE_INDEX = -100


class UnsupportedLossError(OpakeError, ValueError):
    """A loss whose per-example terms would depend on other examples of the batch."""


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (their loss in half precision would round the gradients
    the clipper bounds); float32 and float64 logits as they are, so that a float64 model keeps
    float64 gradients (clipped sums to 1e-12, not float32's 1e-8)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def token_mean_per_example(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool = True,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(B,) cross-entropy of each example averaged over its own valid tokens (0 when it has none).

    ``logits`` is (B, T, V), ``labels`` (B, T) with ``ignore_index`` on padding. ``shift=True``
    (causal LM) scores position t's logits against label t + 1, as Hugging Face's causal-LM loss
    does; ``shift=False`` (masked LM, token classification) scores them against label t.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise InvalidArgumentError(f"expected logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and "
                                   f"{tuple(labels.shape)}")
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.to(logits.device)
    token_losses = F.cross_entropy(_at_least_float32(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=ignore_index, reduction="none").view(labels.shape)
    valid = (labels != ignore_index).sum(dim=1)
    return token_losses.sum(dim=1) / valid.clamp(min=1)


def per_example_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """(B,) loss of each example for a sequence-classification head, by ``config.problem_type``.

    Single-label: cross-entropy (an example labelled ``-100`` contributes 0, where
    ``CrossEntropyLoss`` would divide the batch by the number of the others); regression: squared
    error averaged over the example's outputs; multi-label: binary cross-entropy averaged over the
    example's labels. The problem type is inferred as Hugging Face does when the config has none.
    """
    labels = labels.to(logits.device)
    logits = _at_least_float32(logits)
    problem = getattr(config, "problem_type", None)
    num_labels = getattr(config, "num_labels", logits.shape[-1])
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    batch = logits.shape[0]
    if problem == "regression":
        return F.mse_loss(logits.reshape(batch, -1), labels.to(logits.dtype).reshape(batch, -1),
                          reduction="none").mean(dim=1)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.reshape(batch, num_labels), labels.reshape(batch),
                               ignore_index=IGNORE_INDEX, reduction="none")
    if problem == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.reshape(batch, -1), labels.to(logits.dtype).reshape(batch, -1),
                                                  reduction="none").mean(dim=1)
    raise UnsupportedLossError(f"unknown problem_type {problem!r} in the model's config")


# Hugging Face heads by class-name suffix: how each one's per-example loss is formed.
_CAUSAL, _TOKENS, _SEQUENCE = "causal language modelling", "token-level", "sequence classification"
_HEADS = (("ForCausalLM", _CAUSAL), ("LMHeadModel", _CAUSAL), ("ForMaskedLM", _TOKENS),
          ("ForTokenClassification", _TOKENS), ("ForSequenceClassification", _SEQUENCE))


def is_hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` PreTrainedModel (checked without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)


def _head_of(module: nn.Module) -> str | None:
    name = type(module).__name__
    return next((kind for suffix, kind in _HEADS if name.endswith(suffix)), None)


_USER_LOSS = {"mean": "the caller's loss: a mean over the batch's examples of per-example terms (loss_reduction='mean')",
              "sum": "the caller's loss: a sum over the batch's examples of per-example terms (loss_reduction='sum')"}


def loss_form(module: nn.Module, loss_reduction: str) -> str:
    """The loss form the clipping of ``module`` assumes (``PrivacyPlan.loss``): a Hugging Face head's
    per-example loss that ``PerExampleLoss`` installs, or the caller's loss, reduced as
    ``loss_reduction`` says ("mean" or "sum" over the batch's examples)."""
    if loss_reduction not in _USER_LOSS:
        raise InvalidArgumentError(
            f"loss_reduction must be one of {tuple(_USER_LOSS)} (how the loss combines the examples' "
            f"losses over the batch dimension), got {loss_reduction!r}"
        )
    heads = [m for m in module.modules() if is_hugging_face_model(m) and _head_of(m) is not None]
    if not heads:
        return _USER_LOSS[loss_reduction]
    return (f"Hugging Face {type(heads[0]).__name__}: the {loss_reduction} over examples of each example's own "
            f"{_head_of(heads[0])} loss (installed by make_private)")


class PerExampleLoss:
    """The hooks that give Hugging Face models a per-example ``outputs.loss``; ``remove()`` undoes them."""

    def __init__(self, module: nn.Module, loss_reduction: str):
        self.loss_reduction = loss_reduction
        self.models = [m for m in module.modules() if is_hugging_face_model(m)]
        self._handles = []
        self._pending: dict[int, torch.Tensor] = {}
        # Every Hugging Face model gets the hooks: a head takes its labels out of the call and
        # forms the loss per example; a model without a known head refuses labels= (its inner
        # models, such as GPT2LMHeadModel's transformer, are called without labels anyway).
        # The loss hook runs even when the forward raises (always_call): it is what takes the
        # call's labels back, and labels left behind would be scored against the next call's
        # logits (a later generate() or forward without labels would fail on them).
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(self._take_labels, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._per_example_loss, with_kwargs=True,
                                                             always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _take_labels(self, model, args, kwargs):
        if "labels" not in kwargs or kwargs["labels"] is None:
            return None
        if _head_of(model) is None:
            raise UnsupportedLossError(
                f"{type(model).__name__} was called with labels=, but opake does not know how to form its "
                f"loss per example (its own loss may normalize over the whole batch, which breaks the "
                f"privacy guarantee). Call the model without labels and compute a per-example loss "
                f"vector from its outputs (see opake.torch.losses), then losses.mean().backward()"
            )
        if kwargs.get("fused_lm_head"):
            raise UnsupportedLossError(
                f"{type(model).__name__} was called with TRL's fused_lm_head=True and labels=: that head multiplies "
                f"the hidden states by lm_head.weight outside the head's layer (no per-example hook sees it) and "
                f"divides by the batch's token count. Train TRL's trainers through opake.transformers.DPSFTTrainer "
                f"or DPDPOTrainer, which form the loss per example from the model's ordinary forward"
            )
        if kwargs.get("return_dict") is False:
            raise UnsupportedLossError(
                f"{type(model).__name__} was called with labels= and return_dict=False; opake replaces the "
                f"model's loss by a per-example one in its output dict: drop return_dict=False"
            )
        kwargs = dict(kwargs)
        self._pending[id(model)] = kwargs.pop("labels")
        kwargs.pop("num_items_in_batch", None)  # a divisor over the batch: exactly what must not be used
        if kwargs.get("shift_labels") is not None:
            raise UnsupportedLossError("shift_labels= is not supported with opake's per-example loss; pass labels=")
        return args, kwargs

    def _per_example_loss(self, model, args, kwargs, output):
        labels = self._pending.pop(id(model), None)
        if labels is None or output is None:  # no labels, or the forward raised: nothing to score
            return None
        kind = _head_of(model)
        logits = output["logits"]
        if kind == _SEQUENCE:
            losses = per_example_classification_loss(logits, labels, model.config)
        else:
            losses = token_mean_per_example(logits, labels, shift=kind == _CAUSAL)
        output["loss"] = losses.sum() if self.loss_reduction == "sum" else losses.mean()
        return output
