"""TRL's ``SFTTrainer`` and ``DPOTrainer`` on a privacy plan: ``DPSFTTrainer``, ``DPDPOTrainer``.

Each is ``PrivateTrainerMixin`` on the TRL trainer (docs/transformers.md, "TRL"): TRL prepares
the data set (tokenizing, completion masks, the reference model, PEFT adapters) in its
``__init__``, then ``make_private`` plans the run on the prepared rows and hooks the model. What
TRL's trainers do that would break the guarantee is replaced or refused:

* **The loss.** TRL scores tokens with a fused LM head that multiplies the hidden states by
  ``lm_head.weight`` directly, outside the head's layer, so the per-example hooks would not see
  that use; and TRL divides by the batch's token count (SFT). Here the model runs its ordinary
  forward (every trainable layer through its hooked module) and the loss is formed from its
  logits per example: SFT's is each example's own token mean (installed by ``make_private``;
  with ``completion_only_loss`` the mean over its own completion tokens), DPO's is each pair's
  loss (``opake.transformers.preference``).
* **Preference pairs.** One data set row of DPO is one pair, and one privacy unit: the plan
  samples pairs, ``per_device_train_batch_size`` counts pairs (a micro-batch of k pairs runs 2k
  rows), and the clipper clips each pair's chosen and rejected rows together
  (``PerExampleClipper.expect_units(..., rows_per_example=2)``). The reference model runs under
  ``torch.no_grad()``: a separate model has no hooks, and the policy with its adapters disabled
  (PEFT) records nothing without gradients, so the reference is neither clipped nor counted.
* **The arguments.** ``SFTConfig`` and ``DPOConfig`` add fields; each has a row
  (``opake.transformers.trl_arguments``), and a value a row does not accept is refused with its
  reason before TRL or opake touches the model. ``DPSFTConfig`` and ``DPDPOConfig`` are those
  configs with the privacy fields of ``DPTrainingArguments`` (``--target_epsilon`` ... on a
  command line); the trainers read the request from them or from their keyword arguments.

Needs ``pip install trl`` (in opake's ``transformers`` extra); ``opake.transformers`` imports this
module only when ``DPSFTTrainer`` or ``DPDPOTrainer`` is asked for.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from opake.errors import InvalidArgumentError, MissingDependencyError

try:
    import trl
    from trl.trainer.utils import use_adapter
except ImportError as error:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "DPSFTTrainer and DPDPOTrainer need TRL: pip install trl (or opake[transformers])"
    ) from error

from opake.transformers.arguments import UnsupportedTrainingArgumentError
from opake.transformers.batches import pair_micro_batches
from opake.transformers.preference import PairLossSettings, completion_log_probs, pair_losses
from opake.transformers.trainer import PrivateTrainerMixin
from opake.transformers.training_arguments import PRIVACY_FIELDS, PrivacyArguments
from opake.transformers.trl_arguments import DPO_ARGUMENT_RULES, SFT_ARGUMENT_RULES

__all__ = ["DPDPOConfig", "DPDPOTrainer", "DPSFTConfig", "DPSFTTrainer"]


@dataclasses.dataclass
class DPSFTConfig(PrivacyArguments, trl.SFTConfig):
    """TRL's ``SFTConfig`` with the privacy fields (``PrivacyArguments``, as ``DPTrainingArguments``):
    the arguments of ``DPSFTTrainer``, one flag each under ``HfArgumentParser``."""


@dataclasses.dataclass
class DPDPOConfig(PrivacyArguments, trl.DPOConfig):
    """TRL's ``DPOConfig`` with the privacy fields (``PrivacyArguments``): the arguments of
    ``DPDPOTrainer``."""

_NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def _bf16_available() -> bool:
    """Whether bfloat16 autocast is the right default here: on a GPU that has it, not on a CPU
    (TRL's configs default bf16 to True, which TrainingArguments refuses without such a GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _as_config(args, config_class):
    """``args`` as ``config_class`` (TRL's trainers convert plain TrainingArguments the same way):
    every TrainingArguments field kept, TRL's own at their defaults. The privacy fields of a
    ``DPTrainingArguments`` are left out: the trainer has read them into its request already."""
    if isinstance(args, config_class):
        return args
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(args)
              if field.init and field.name not in PRIVACY_FIELDS}
    return config_class(**values)


def _refuse_auxiliary_loss(trainer) -> None:
    if getattr(trainer, "aux_loss_enabled", False):
        raise UnsupportedTrainingArgumentError(
            f"{type(trainer.model).__name__}'s config turns on its Mixture-of-Experts load-balancing loss, which "
            f"averages the router's statistics over every token of the batch (one example would change the "
            f"others' gradients); pass router_aux_loss_coef=0.0 in the config")


class DPSFTTrainer(PrivateTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose training is the privacy plan of ``opake.torch.make_private``.

    Takes SFTTrainer's arguments, then the plan's, keyword-only or in ``args`` (a ``DPSFTConfig``),
    as ``DPTrainer`` does (``target_delta``, ``target_epsilon`` or ``noise_multiplier``,
    ``strategy``, ``sampling``, ``amplification``, ``key``, ``privacy_unit``). The loss is each example's own token mean
    (over its completion with ``completion_only_loss``). ``SFTConfig`` values that would break
    the guarantee (packing, padding-free batches, DFT loss, activation offloading) raise
    ``UnsupportedTrainingArgumentError`` with their reasons; ``args=None`` is an ``SFTConfig``
    with bf16 only where a GPU supports it. Logs carry TRL's ``mean_token_accuracy`` and
    ``num_tokens`` beside the epsilon (statistics of the training data without noise: keep the
    logs private).
    """

    argument_rules = SFT_ARGUMENT_RULES

    def default_arguments(self):
        return trl.SFTConfig(output_dir="tmp_trainer", bf16=_bf16_available())

    def arguments_of_trainer(self, args):
        return _as_config(args, trl.SFTConfig)

    def check_trainer_setup(self) -> None:
        _refuse_auxiliary_loss(self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's ordinary forward with ``labels``: ``outputs.loss`` is the mean over the examples
        of each one's own token mean (``make_private``'s per-example loss), never with
        ``num_items_in_batch`` nor TRL's fused head (module docstring)."""
        if "labels" not in inputs:
            raise InvalidArgumentError(
                "DPSFTTrainer needs labels in each batch (TRL's collator makes them from input_ids)"
            )
        outputs = model(**{**inputs, "use_cache": False})
        self._record_token_metrics(outputs.logits, inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _record_token_metrics(self, logits: torch.Tensor, inputs) -> None:
        """TRL's ``mean_token_accuracy`` and ``num_tokens`` logs, from the logits in hand."""
        mode = "train" if self.model.training else "eval"
        with torch.no_grad():
            labels = inputs["labels"][:, 1:].to(logits.device)
            valid = labels != -100
            correct = (logits[:, :-1].argmax(dim=-1) == labels) & valid
            count = int(valid.sum())
            self._metrics[mode]["mean_token_accuracy"].append(int(correct.sum()) / count if count else 0.0)
            if mode == "train" and "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


class DPDPOTrainer(PrivateTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` whose training is the privacy plan of ``opake.torch.make_private``, one
    preference pair being one privacy unit.

    Takes DPOTrainer's arguments (``ref_model=`` for a separate frozen reference; with PEFT the
    policy with its adapters disabled is the reference), then the plan's, keyword-only or in
    ``args`` (a ``DPDPOConfig``), as ``DPTrainer`` does. ``per_device_train_batch_size x
    gradient_accumulation_steps`` is the planned expected number of *pairs* per step, and each
    micro-batch holds at most
    ``per_device_train_batch_size`` pairs (twice as many rows). Each pair's chosen and rejected
    rows are clipped together at ``max_grad_norm``, and epsilon is for adding or removing one
    pair. ``DPOConfig`` values whose loss would mix pairs (``loss_type`` 'aot', 'aot_unpaired',
    'sft') and the settings that break the guarantee are refused with their reasons.
    """

    argument_rules = DPO_ARGUMENT_RULES
    loss_reduction = "sum"  # training_step backpropagates the sum of the pairs' losses (loss_to_clip)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.private.plan = dataclasses.replace(
            self.private.plan, loss="DPO: the sum over preference pairs of each pair's own loss (a pair's chosen and "
                                    "rejected rows clipped together)")

    def default_arguments(self):
        return trl.DPOConfig(output_dir="tmp_trainer", bf16=_bf16_available())

    def arguments_of_trainer(self, args):
        return _as_config(args, trl.DPOConfig)

    def check_trainer_setup(self) -> None:
        _refuse_auxiliary_loss(self)

    # -- pairs as micro-batches -------------------------------------------------------------

    def examples_in(self, batch) -> int:
        """The pairs of a collated preference batch: half its rows."""
        return int(batch["input_ids"].shape[0]) // 2

    def micro_batch_parts(self, inputs, size: int) -> list:
        """Micro-batches of whole pairs; the clipper learns which two rows form each pair."""
        parts = pair_micro_batches(inputs, size, self.micro_batch_size)
        pairs = torch.cat([numbers for _, numbers in parts]) if parts else torch.zeros(0, dtype=torch.long)
        self.private.optimizer.clipper.expect_units(pairs, rows_per_example=2)
        return [(part, False) for part, _ in parts]

    def loss_to_clip(self, loss: torch.Tensor, part) -> torch.Tensor:
        """The sum of the micro-batch's pair losses (``compute_loss`` returns their mean): the clipper,
        built with ``loss_reduction="sum"``, then sees each pair's own gradient."""
        return loss * self.examples_in(part)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # later forward passes with gradients (outside training) are not pairs of the plan
            self.private.optimizer.clipper.expect_units(None)

    # -- the loss ----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The mean over the batch's pairs of each pair's loss, from the policy's logits (its ordinary
        forward) and the reference's log-probabilities (computed without gradients)."""
        model_inputs = {name: value for name, value in inputs.items() if name not in _NOT_MODEL_INPUTS}
        model_inputs["use_cache"] = False
        completion = inputs["completion_mask"]
        settings = PairLossSettings.of_trainer(self)
        reference = self._reference_log_probs(model_inputs, inputs)  # first: no pass of the policy awaits backward
        outputs = model(**model_inputs)
        policy = completion_log_probs(outputs.logits, inputs["input_ids"], completion, settings.ld_alpha,
                                      with_square_mass=settings.use_weighting)
        square_mass = None
        if settings.use_weighting:
            policy, square_mass = policy
        losses = pair_losses(policy, reference, completion, settings, square_mass)
        self._record_pair_metrics(policy.detach(), reference.detach())
        loss = losses.mean()
        return (loss, outputs) if return_outputs else loss

    def compute_ref_log_probs(self, model, inputs):
        """TRL's precompute of a batch's reference log-probabilities (``precompute_ref_log_probs``), from
        the reference's ordinary forward: TRL's fused head with labels is refused on a hooked model."""
        model_inputs = {name: value for name, value in inputs.items() if name not in _NOT_MODEL_INPUTS}
        return self._reference_log_probs({**model_inputs, "use_cache": False}, inputs).chunk(2)

    def _reference_log_probs(self, model_inputs: dict, inputs) -> torch.Tensor:
        """(2 * pairs,) the reference model's completion log-probabilities, chosen rows first."""
        if "ref_chosen_logps" in inputs:  # precompute_ref_log_probs: computed before make_private
            return torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
        with torch.no_grad():
            if self.ref_model is None:  # PEFT: the policy with its adapters disabled (or TRL's "ref" adapter)
                unwrapped = self.accelerator.unwrap_model(self.model)
                adapter = "ref" if "ref" in getattr(unwrapped, "peft_config", {}) else None
                with use_adapter(unwrapped, adapter_name=adapter):
                    logits = self.model(**model_inputs).logits
            else:
                logits = self.ref_model(**model_inputs).logits
            return completion_log_probs(logits, inputs["input_ids"], inputs["completion_mask"], self.ld_alpha)

    def _record_pair_metrics(self, policy: torch.Tensor, reference: torch.Tensor) -> None:
        """TRL's reward logs (``rewards/chosen``, ``rewards/margins``, ...), from the pairs in hand."""
        mode = "train" if self.model.training else "eval"
        chosen, rejected = (self.beta * (policy - reference.to(policy.dtype))).chunk(2)
        policy_chosen, policy_rejected = policy.chunk(2)
        if chosen.numel() == 0:
            return
        for name, value in (("rewards/chosen", chosen.mean()), ("rewards/rejected", rejected.mean()),
                            ("rewards/accuracies", (chosen > rejected).float().mean()),
                            ("rewards/margins", (chosen - rejected).mean()),
                            ("logps/chosen", policy_chosen.mean()), ("logps/rejected", policy_rejected.mean())):
            number = float(value)
            self._metrics[mode][name].append(number if math.isfinite(number) else float("nan"))
