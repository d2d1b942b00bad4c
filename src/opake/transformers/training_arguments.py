"""A private run's request in Hugging Face's form: arguments classes with the privacy fields.

``DPTrainingArguments`` is ``transformers.TrainingArguments`` with the settings of the privacy
request that fit on a command line (``PrivacyArguments``), as TRL's ``SFTConfig`` is
TrainingArguments with TRL's. ``HfArgumentParser`` turns each into a flag, so a stock training
script whose parser holds ``DPTrainingArguments`` takes ``--target_epsilon 8 --target_delta 1e-5``
with no other edit; ``DPSFTConfig`` and ``DPDPOConfig`` (``opake.transformers.trl``) are TRL's
configs with the same fields, from the same mixin.

A trainer (``DPTrainer``, ``DPSFTTrainer``, ``DPDPOTrainer``) makes one ``PrivacySpec`` of them
and of the TrainingArguments fields the plan reads (``per_device_train_batch_size x
gradient_accumulation_steps x world_size`` the batch size, ``num_train_epochs`` the epochs (with
``max_steps > 0``, the epochs those steps reach),
``max_grad_norm`` the clipping bound); ``privacy_seed`` becomes the key
(``opake.random.key(seed)``). ``noise_correction`` goes to the optimizer, not into the request:
it is post-processing and changes no privacy figure. The same settings may be given as the
trainer's keyword arguments instead (``DPTrainer(target_epsilon=8, ...)``: Python objects such as
a strategy recipe or user ids go there); one setting given both ways is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import transformers

from opake.errors import InvalidTypeError
from opake.random import key as key_of_seed

__all__ = ["DPTrainingArguments", "PRIVACY_FIELDS", "PrivacyArguments", "privacy_settings"]

# The trainers' keyword for a field whose name differs (a seed on the command line, a key in Python).
_KEYWORD_OF_FIELD = {"privacy_seed": "key"}


@dataclass
class PrivacyArguments:
    """The privacy fields of ``DPTrainingArguments``, ``DPSFTConfig`` and ``DPDPOConfig`` (one mixin):
    all None by default, each read into the run's ``PrivacySpec`` (``noise_correction`` into the
    optimizer, ``privacy_seed`` into the key) by the trainer."""

    target_epsilon: float | None = field(default=None, metadata={"help": (
        "The privacy budget: the noise multiplier is calibrated so that the whole run is "
        "(target_epsilon, target_delta)-DP. Give this or noise_multiplier.")})
    target_delta: float | None = field(default=None, metadata={"help": (
        "The delta of the guarantee (required), e.g. 1e-5, below 1 / len(train_dataset).")})
    noise_multiplier: float | None = field(default=None, metadata={"help": (
        "A given noise multiplier instead of target_epsilon; the run's epsilon at target_delta is computed.")})
    strategy: str | None = field(default=None, metadata={"help": (
        "The correlated noise by name: 'blt' (a BLT fitted to the optimizer), 'band_mf:G' (BandMF with G "
        "bands) or 'dp_sgd' (independent noise). Default: with target_epsilon the mechanism with the least "
        "noise at the budget, with noise_multiplier the BLT.")})
    sampling: Literal["balls_in_bins", "poisson"] | None = field(default=None, metadata={"help": (
        "How batches are drawn: 'balls_in_bins' (every example once an epoch; any strategy) or 'poisson' "
        "(cyclic Poisson; band_mf and dp_sgd). Default: the chosen mechanism's, else balls_in_bins.")})
    amplification: bool | None = field(default=None, metadata={"help": (
        "Default: the tightest bound proven for adaptively chosen gradients. False: the unamplified bound; "
        "True: the amplified balls-in-bins bound (not proven for adaptive gradients with a BLT: warns).")})
    clipping: Literal["flat", "automatic"] | None = field(default=None, metadata={"help": (
        "The per-example clipping rule at max_grad_norm: 'flat' (default) or 'automatic' (AUTO-S, "
        "C / (norm + 0.01)); the noise and epsilon are the same.")})
    privacy_seed: int | None = field(default=None, metadata={"help": (
        "Seeds the key that draws the batches and the noise (opake.random.key(seed)), for a reproducible "
        "run; whoever knows it can remove the noise. Default: a key from the operating system.")})
    noise_correction: bool | None = field(default=None, metadata={"help": (
        "Correct AdamW's second moment for the noise (default: on for Trainer's AdamW); post-processing, "
        "no privacy figure changes.")})

    def privacy_keywords(self) -> dict:
        """The fields that are set (not None), as the trainers' keyword arguments (``key`` for
        ``privacy_seed``)."""
        keywords = {}
        for privacy_field in fields(PrivacyArguments):
            value = getattr(self, privacy_field.name)
            if value is not None:
                keyword = _KEYWORD_OF_FIELD.get(privacy_field.name, privacy_field.name)
                keywords[keyword] = key_of_seed(value) if keyword == "key" else value
        return keywords


PRIVACY_FIELDS = tuple(privacy_field.name for privacy_field in fields(PrivacyArguments))


@dataclass
class DPTrainingArguments(PrivacyArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` with the privacy fields (``PrivacyArguments``): the
    arguments of ``DPTrainer``, one flag each under ``HfArgumentParser``."""


def privacy_settings(args, keywords: dict, trainer: str) -> dict:
    """The privacy settings of a trainer: those ``args`` sets (a ``PrivacyArguments``) and the
    ``keywords`` given to the trainer (None where not given), merged; one setting given both ways
    is refused with both places named."""
    from_args = args.privacy_keywords() if isinstance(args, PrivacyArguments) else {}
    given = {name: value for name, value in keywords.items() if value is not None}
    both = sorted(set(from_args) & set(given))
    if both:
        field_of = {keyword: name for name, keyword in _KEYWORD_OF_FIELD.items()}
        named = ", ".join(f"{type(args).__name__}.{field_of.get(name, name)} and {name}=" for name in both)
        raise InvalidTypeError(
            f"{trainer} got these privacy settings twice: {named}. Give each in one place, the arguments "
            f"(a command line's flags) or the trainer's keyword, so that the run's request is not ambiguous")
    return {**keywords, **from_args}
