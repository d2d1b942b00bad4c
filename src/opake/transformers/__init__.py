"""Hugging Face ``transformers.Trainer`` on a privacy plan: ``DPTrainer`` (optional extra).

``DPTrainer`` is ``transformers.Trainer`` training through ``opake.torch.make_private``: the plan's
batches, per-example clipping at ``args.max_grad_norm``, correlated noise in the optimizer step,
epsilon in the logs, the noise state in every checkpoint (docs/transformers.md). What it does with
each ``TrainingArguments`` field is one table (``ARGUMENT_RULES``, ``arguments_table()``); the
values it cannot honour raise ``UnsupportedTrainingArgumentError`` with their reasons. Needs
``pip install opake[transformers]``; ``opake.torch`` never imports this package.
"""

import transformers as _transformers

if int(_transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
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
from opake.transformers.trainer import CHECKPOINT_NAME, DPTrainer  # noqa: E402

__all__ = [
    "ARGUMENT_RULES",
    "ArgumentRule",
    "CHECKPOINT_NAME",
    "DPTrainer",
    "UnsupportedTrainingArgumentError",
    "arguments_table",
    "check_arguments",
]
