"""Hugging Face ``transformers.Trainer`` on a privacy plan: ``DPTrainer`` (optional extra).

``DPTrainer`` is ``transformers.Trainer`` training through ``opake.torch.make_private``: the plan's
batches, per-example clipping at ``args.max_grad_norm``, correlated noise in the optimizer step,
epsilon in the logs, the noise state in every checkpoint (docs/transformers.md). What it does with
each ``TrainingArguments`` field is one table (``ARGUMENT_RULES``, ``arguments_table()``); the
values it cannot honour raise ``UnsupportedTrainingArgumentError`` with their reasons. Needs
``pip install opake[transformers]``; ``opake.torch`` never imports this package.

``DPTrainingArguments`` is ``TrainingArguments`` with the privacy request's fields (budget, delta,
sampling, ...: one command-line flag each under ``HfArgumentParser``), which ``DPTrainer`` reads.

``DPSFTTrainer`` and ``DPDPOTrainer`` are TRL's ``SFTTrainer`` and ``DPOTrainer`` on the same plan
(``opake.transformers.trl``, docs/transformers.md "TRL"), with ``DPSFTConfig`` and ``DPDPOConfig``
for their arguments; they import TRL when first asked for.
"""

import transformers as _transformers

from opake.errors import MissingDependencyError

if int(_transformers.__version__.split(".")[0]) < 5:
    raise MissingDependencyError(
        f"opake.transformers needs transformers>=5 (tested with 5.24); found {_transformers.__version__}. "
        f"DPTrainer overrides Trainer methods whose names and roles changed in version 5"
    )

from opake.transformers.arguments import (  # noqa: E402
    ARGUMENT_RULES,
    ArgumentRule,
    UnsupportedTrainingArgumentError,
    arguments_table,
    check_arguments,
)
from opake.transformers.trainer import (  # noqa: E402
    CHECKPOINT_NAME,
    DPTrainer,
    IncompleteCheckpointError,
    PrivateTrainerMixin,
    ResumeChoiceError,
)
from opake.transformers.training_arguments import DPTrainingArguments, PrivacyArguments  # noqa: E402

__all__ = [
    "ARGUMENT_RULES",
    "ArgumentRule",
    "CHECKPOINT_NAME",
    "DPTrainer",
    "DPTrainingArguments",
    "IncompleteCheckpointError",
    "PrivacyArguments",
    "PrivateTrainerMixin",
    "ResumeChoiceError",
    "UnsupportedTrainingArgumentError",
    "arguments_table",
    "check_arguments",
]

_TRL_TRAINERS = ("DPSFTTrainer", "DPDPOTrainer", "DPSFTConfig", "DPDPOConfig")


def __getattr__(name: str):
    """``DPSFTTrainer``, ``DPDPOTrainer`` and their configs load TRL on first use
    (``opake.transformers.trl``), so that ``opake.transformers`` works without TRL installed."""
    if name in _TRL_TRAINERS:
        from opake.transformers import trl as trl_trainers

        return getattr(trl_trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
