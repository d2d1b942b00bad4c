"""Supervised fine-tuning in the shape of TRL's ``trl/scripts/sft.py``, trained privately: the stock
script with two names switched, ``SFTTrainer`` -> ``DPSFTTrainer`` and ``SFTConfig`` -> ``DPSFTConfig``
(``--target_epsilon``, ``--target_delta``, ``--noise_multiplier``, ``--privacy_seed`` ... on the command
line). Written for opake's tests from the stock script's arguments and calls (``TrlParser`` over
``ScriptArguments``, the config, ``ModelConfig`` and ``DatasetMixtureConfig``; the model named by
its path, ``get_peft_config`` for ``--use_peft``; ``train(resume_from_checkpoint=...)``,
``save_model``), not copied.

    python sft_style.py --model_name_or_path MODEL_DIR --dataset_name DATA_DIR \\
        --learning_rate 2.0e-4 --num_train_epochs 1 --per_device_train_batch_size 2 \\
        --gradient_accumulation_steps 8 --eval_strategy steps --eval_steps 100 --use_peft \\
        --lora_r 32 --lora_alpha 16 --output_dir out --target_epsilon 8 --target_delta 1e-5

``--packing`` (in the stock docstring's command lines) is refused: docs/transformers.md says why.
Left out: the hub (``--dataset_name`` may name a local folder of data files), streaming data sets
(the plan indexes a map-style data set).
"""

from __future__ import annotations

import sys

from datasets import load_dataset
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser, get_dataset, get_peft_config
from trl import get_quantization_config

from opake.transformers import DPSFTConfig, DPSFTTrainer  # the stock script: SFTConfig, SFTTrainer


def parse(argv=None):
    parser = TrlParser((ScriptArguments, DPSFTConfig, ModelConfig, DatasetMixtureConfig))
    return parser.parse_args_and_config(args=sys.argv[1:] if argv is None else list(argv),
                                        fail_with_unknown_args=False)


def dataset_of(script_args, dataset_args):
    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                            streaming=script_args.dataset_streaming)
    raise ValueError("Either `datasets` or `dataset_name` must be provided.")


def main(argv=None):
    """The script; returns the trainer (for tests: the stock script returns nothing)."""
    script_args, training_args, model_args, dataset_args = parse(argv)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    dataset = dataset_of(script_args, dataset_args)

    trainer = DPSFTTrainer(  # the stock script: SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    return trainer


if __name__ == "__main__":
    main()
