"""Causal language modelling in the shape of transformers' ``examples/pytorch/language-modeling/run_clm.py``,
trained privately: the stock script with two names switched, ``Trainer`` -> ``DPTrainer`` and
``TrainingArguments`` -> ``DPTrainingArguments`` (which adds ``--target_epsilon``, ``--target_delta``,
``--noise_multiplier``, ``--privacy_seed`` ... to the command line). Written for opake's tests from the
stock script's arguments and calls (three argument dataclasses parsed by ``HfArgumentParser``, the
text tokenized and cut into ``block_size`` blocks by ``group_texts``, ``Trainer(...)``,
``train(resume_from_checkpoint=...)``, ``save_model``, ``evaluate`` and perplexity), not copied.

    python run_clm_style.py --model_name_or_path MODEL_DIR --train_file train.txt \\
        --validation_file valid.txt --block_size 16 --do_train --do_eval --output_dir out \\
        --per_device_train_batch_size 8 --num_train_epochs 2 --target_epsilon 8 --target_delta 1e-5

What the guarantee protects: ``group_texts`` concatenates the texts and cuts them into blocks, and
the blocks are the training set's rows, so the printed epsilon is for adding or removing one block
of ``block_size`` tokens (a text spanning several blocks is protected as a group of them).

Left out of the stock script: streaming data sets (the plan indexes a map-style data set), the hub
(``--dataset_name`` may name a local folder of data files), the ``evaluate`` package (accuracy is
computed here) and the model card.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
import torch
import transformers
from datasets import load_dataset
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

from opake.transformers import DPTrainer, DPTrainingArguments  # the stock script: Trainer, TrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune, or to train from scratch."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "A model folder (or hub name)."})
    model_type: str | None = field(default=None, metadata={"help": "Training from scratch: a model type."})
    config_overrides: str | None = field(default=None, metadata={"help": (
        "From scratch: config settings to override, e.g. n_embd=16,n_layer=1")})
    config_name: str | None = field(default=None, metadata={"help": "A config, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded and prepared data are cached."})
    dtype: str | None = field(default=None, metadata={
        "help": "Load the model in this dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run a model's own code."})

    def __post_init__(self):
        if self.config_overrides is not None and (self.config_name is not None or self.model_name_or_path is not None):
            raise ValueError("--config_overrides can't be used with --config_name or --model_name_or_path")


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on."""

    dataset_name: str | None = field(default=None, metadata={"help": "A data set for load_dataset."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    train_file: str | None = field(default=None, metadata={"help": "A training file (txt, csv or json)."})
    validation_file: str | None = field(default=None, metadata={"help": "An evaluation file."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep this many training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep this many evaluation blocks."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per training block."})
    validation_split_percentage: int | None = field(default=5, metadata={
        "help": "The percentage of the training data held out for validation when there is no validation split."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks of txt files."})

    def __post_init__(self):
        if self.dataset_name is None and self.train_file is None and self.validation_file is None:
            raise ValueError("Need either a dataset name or a training/validation file.")
        for name in (self.train_file, self.validation_file):
            if name is not None and name.rsplit(".", 1)[-1] not in ("csv", "json", "txt"):
                raise ValueError(f"{name}: a data file is a csv, json or txt file")


def parse(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, DPTrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def raw_datasets_of(data_args, cache_dir=None):
    """The raw text, split into ``train`` and ``validation`` (held out of train when there is no
    validation split), as the stock script loads it."""
    if data_args.dataset_name is not None:
        def load(split=None):
            return load_dataset(data_args.dataset_name, data_args.dataset_config_name, split=split,
                                cache_dir=cache_dir)
    else:
        files = {"train": data_args.train_file, "validation": data_args.validation_file}
        files = {split: name for split, name in files.items() if name is not None}
        extension = next(iter(files.values())).rsplit(".", 1)[-1]
        options = {"keep_linebreaks": data_args.keep_linebreaks} if extension == "txt" else {}
        builder = "text" if extension == "txt" else extension

        def load(split=None):
            return load_dataset(builder, data_files=files, split=split, cache_dir=cache_dir, **options)
    raw = load()
    if "validation" not in raw:
        held_out = data_args.validation_split_percentage
        raw["validation"] = load(f"train[:{held_out}%]")
        raw["train"] = load(f"train[{held_out}%:]")
    return raw


def model_and_tokenizer(model_args):
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        if model_args.config_overrides is not None:
            config.update_from_string(model_args.config_overrides)
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source:
        raise ValueError("a tokenizer is needed: pass --tokenizer_name (a new one is not trained here)")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if model_args.model_name_or_path:
        dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, dtype=dtype,
                                                     trust_remote_code=model_args.trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model, tokenizer


def blocks_of(raw, tokenizer, config, data_args, training_args):
    """The texts tokenized, concatenated and cut into blocks of ``block_size`` tokens (``group_texts``:
    the remainder of each map batch is dropped), labels equal to the inputs."""
    columns = list(raw["train" if training_args.do_train else "validation"].features)
    text_column = "text" if "text" in columns else columns[0]

    def tokenize(examples):
        return tokenizer(examples[text_column])

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                            remove_columns=columns)
    longest = getattr(config, "max_position_embeddings", getattr(config, "n_positions", 1024))
    if data_args.block_size is None:
        block_size = min(tokenizer.model_max_length, longest, 1024)
    else:
        block_size = min(data_args.block_size, tokenizer.model_max_length)

    def group_texts(examples):
        joined = {name: list(chain(*examples[name])) for name in examples}
        total = len(joined[next(iter(examples))])
        if total < block_size:
            raise ValueError(f"block_size of {block_size} is too big - use a value <= {total}")
        total = (total // block_size) * block_size
        result = {name: [tokens[i:i + block_size] for i in range(0, total, block_size)]
                  for name, tokens in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts"):
        return tokenized.map(group_texts, batched=True, num_proc=data_args.preprocessing_num_workers)


def main(argv=None):
    """The script; returns the trainer (for tests: the stock script returns nothing)."""
    model_args, data_args, training_args = parse(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)

    raw = raw_datasets_of(data_args, model_args.cache_dir)
    model, tokenizer = model_and_tokenizer(model_args)
    lm_datasets = blocks_of(raw, tokenizer, model.config, data_args, training_args)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        predictions, labels = eval_preds
        labels, predictions = labels[:, 1:].reshape(-1), predictions[:, :-1].reshape(-1)  # next-token targets
        return {"accuracy": float(np.mean(predictions == labels))}

    trainer = DPTrainer(  # the stock script: Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return trainer


if __name__ == "__main__":
    main()
