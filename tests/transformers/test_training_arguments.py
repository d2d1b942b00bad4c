"""The privacy request in Hugging Face's form: ``DPTrainingArguments``, ``DPSFTConfig``, ``DPDPOConfig``.

``HfArgumentParser`` turns the privacy fields into flags; a trainer given the request in its
arguments plans exactly the run it plans from the same settings as keyword arguments (the same
request, noise multiplier, epsilon and batches for the same key); a setting given both ways is
refused before the model is touched. Tiny GPT-2 and Llama models and data from
tests/transformers_support.py and tests/trl_support.py (nothing downloads).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import opake.random  # noqa: E402
from opake.errors import OpakeError  # noqa: E402
from opake.torch import PrivacySpec  # noqa: E402
from opake.errors import PlanError  # noqa: E402
from opake.transformers import (  # noqa: E402
    ARGUMENT_RULES,
    DPTrainer,
    DPTrainingArguments,
    PrivacyArguments,
    check_arguments,
)
from opake.transformers.arguments import PRIVACY  # noqa: E402
from opake.transformers.training_arguments import PRIVACY_FIELDS  # noqa: E402
from transformers_support import CharDataset, arguments, collate, gpt2, sentences  # noqa: E402

# TRL's configs still set the deprecated gradient_checkpointing field, as most scripts do.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

DELTA = 1e-5


def dp_arguments(tmp_path, privacy: dict, args_class=DPTrainingArguments, **overrides):
    """``arguments(tmp_path, **overrides)`` (the trainer tests' TrainingArguments) as ``args_class``
    with the privacy fields ``privacy``."""
    args = arguments(tmp_path, **overrides)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return args_class(**values, **privacy)


def hooked(model) -> bool:
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def assert_same_plan(first, second, steps=4):
    assert first.request == second.request
    for name in ("noise_multiplier", "epsilon", "delta", "participation", "strategy", "clipping", "accounting",
                 "sampling", "expected_batch_size"):
        assert getattr(first, name) == getattr(second, name), name
    for step in range(steps):
        assert torch.equal(first.sampler.batch(step), second.sampler.batch(step))


# -- the command line ------------------------------------------------------------------------------


def test_the_privacy_fields_are_command_line_flags():
    parser = transformers.HfArgumentParser(DPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "o", "--target_epsilon", "8",
                                                  "--target_delta", "1e-5"])
    assert isinstance(args, DPTrainingArguments)
    assert (args.target_epsilon, args.target_delta, args.noise_multiplier, args.privacy_seed) == (8.0, 1e-5, None, None)
    (every,) = parser.parse_args_into_dataclasses([
        "--output_dir", "o", "--noise_multiplier", "0.9", "--target_delta", "1e-6", "--strategy", "band_mf:4",
        "--sampling", "poisson", "--amplification", "true", "--clipping", "automatic", "--privacy_seed", "7",
        "--noise_correction", "false"])
    assert every.privacy_keywords() == dict(noise_multiplier=0.9, target_delta=1e-6, strategy="band_mf:4",
                                            sampling="poisson", amplification=True, clipping="automatic",
                                            key=opake.random.key(7), noise_correction=False)
    with pytest.raises(SystemExit):  # argparse's choices: a typo fails on the command line itself
        parser.parse_args_into_dataclasses(["--output_dir", "o", "--sampling", "uniform"])
    help_text = " ".join(parser.format_help().split())  # argparse wraps the lines
    assert "--target-epsilon TARGET_EPSILON The privacy budget" in help_text
    assert "(target_epsilon, target_delta)-DP" in help_text


def test_a_stock_script_parser_takes_the_budget():
    @dataclasses.dataclass
    class ModelArguments:  # what a stock script puts beside its training arguments
        model_name_or_path: str = "gpt2"

    parser = transformers.HfArgumentParser((ModelArguments, DPTrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses(
        ["--model_name_or_path", "tiny", "--output_dir", "o", "--target_epsilon", "8", "--target_delta", "1e-5",
         "--per_device_train_batch_size", "4"])
    assert model_args.model_name_or_path == "tiny"
    assert training_args.target_epsilon == 8.0 and training_args.per_device_train_batch_size == 4


# -- the table -------------------------------------------------------------------------------------


def test_every_privacy_field_has_one_row_mapping_it():
    rows = {rule.name: rule for rule in ARGUMENT_RULES if rule.where == PRIVACY}
    assert set(rows) == set(PRIVACY_FIELDS) == {f.name for f in dataclasses.fields(PrivacyArguments)}
    assert all(rule.treatment == "map" for rule in rows.values())
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(PRIVACY_FIELDS) - base == set(PRIVACY_FIELDS)  # no TrainingArguments field is shadowed
    check_arguments(DPTrainingArguments(output_dir="o", report_to="none", target_epsilon=8.0, target_delta=DELTA,
                                        privacy_seed=1, strategy="dp_sgd"))


# -- DPTrainer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("privacy", [
    dict(noise_multiplier=0.8, target_delta=DELTA, strategy="dp_sgd", sampling="poisson"),
    dict(target_epsilon=8.0, target_delta=DELTA),  # the least-noise choice, for Trainer's SGD and schedule
], ids=["noise_multiplier", "target_epsilon"])
def test_dp_trainer_plans_the_same_run_from_its_arguments_as_from_keywords(tmp_path, privacy):
    dataset = CharDataset(sentences(48))
    by_keywords = DPTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=dataset, data_collator=collate,
                            key=opake.random.key(3), **privacy)
    by_arguments = DPTrainer(model=gpt2(), args=dp_arguments(tmp_path, {**privacy, "privacy_seed": 3}),
                             train_dataset=dataset, data_collator=collate)
    assert_same_plan(by_keywords.private.plan, by_arguments.private.plan)
    assert by_arguments.private.plan.request == PrivacySpec(batch_size=8, epochs=2, max_grad_norm=1.0, **privacy)
    assert by_arguments.private.plan.key == opake.random.key(3) and by_arguments._key_given
    assert isinstance(by_arguments.args, DPTrainingArguments)  # Trainer runs on (a copy of) the same class


def test_settings_may_be_split_between_the_arguments_and_the_keywords(tmp_path):
    dataset = CharDataset(sentences(32))
    trainer = DPTrainer(model=gpt2(), args=dp_arguments(tmp_path, dict(target_delta=DELTA, noise_correction=False),
                                                         optim="adamw_torch"),
                        train_dataset=dataset, data_collator=collate, noise_multiplier=0.8, key=opake.random.key(0))
    assert trainer.private.plan.request.noise_multiplier == 0.8 and trainer.private.delta == DELTA
    assert not trainer.private.noise_correction.enabled  # from the arguments, into the optimizer


@pytest.mark.parametrize("privacy, keywords, pattern", [
    (dict(target_epsilon=8.0, target_delta=DELTA), dict(target_epsilon=4.0),
     r"DPTrainingArguments\.target_epsilon and target_epsilon="),
    (dict(noise_multiplier=0.8, target_delta=DELTA, privacy_seed=1), dict(key=opake.random.key(1)),
     r"DPTrainingArguments\.privacy_seed and key="),
    (dict(noise_multiplier=0.8, target_delta=DELTA, sampling="poisson"), dict(sampling="poisson"),
     r"DPTrainingArguments\.sampling and sampling="),
])
def test_a_setting_given_both_ways_is_refused_before_the_model_is_touched(tmp_path, privacy, keywords, pattern):
    model = gpt2()
    with pytest.raises(TypeError, match=pattern) as refused:
        DPTrainer(model=model, args=dp_arguments(tmp_path, privacy), train_dataset=CharDataset(sentences(16)),
                  data_collator=collate, **keywords)
    assert isinstance(refused.value, OpakeError) and not hooked(model)


def test_a_bad_request_in_the_arguments_is_refused_before_the_model_is_touched(tmp_path):
    model = gpt2()
    with pytest.raises(PlanError, match="'band_mf' is not a strategy opake knows by name"):
        DPTrainer(model=model, args=dp_arguments(tmp_path, dict(noise_multiplier=0.8, target_delta=DELTA,
                                                                strategy="band_mf")),
                  train_dataset=CharDataset(sentences(16)), data_collator=collate)
    with pytest.raises(TypeError, match="needs target_delta"):
        DPTrainer(model=model, args=dp_arguments(tmp_path, dict(noise_multiplier=0.8)),
                  train_dataset=CharDataset(sentences(16)), data_collator=collate)
    assert not hooked(model)


# -- TRL ---------------------------------------------------------------------------------------------

TRL_PLAN = dict(noise_multiplier=0.8, target_delta=DELTA)


@pytest.fixture
def trl_data(monkeypatch):
    """``trl`` and ``datasets`` (skipped without them) and tests/trl_support.py, TRL's telemetry off."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("CI", "1")
    datasets.disable_progress_bars()
    import trl_support

    return trl, datasets, trl_support


def trl_settings(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_train_epochs=1, learning_rate=0.05, optim="sgd", report_to="none", save_strategy="no",
                bf16=False, use_cpu=True, disable_tqdm=True, max_length=32, seed=0)


def test_the_trl_configs_carry_the_privacy_fields(trl_data):
    trl, _, _ = trl_data
    from opake.transformers import DPDPOConfig, DPSFTConfig

    for config, parent in ((DPSFTConfig, trl.SFTConfig), (DPDPOConfig, trl.DPOConfig)):
        assert issubclass(config, parent) and issubclass(config, PrivacyArguments)
        (parsed,) = transformers.HfArgumentParser(config).parse_args_into_dataclasses(
            ["--output_dir", "o", "--target_epsilon", "8", "--target_delta", "1e-5", "--bf16", "false"])
        assert isinstance(parsed, config) and (parsed.target_epsilon, parsed.target_delta) == (8.0, 1e-5)


def test_dp_sft_trainer_plans_the_same_run_from_its_config(trl_data, tmp_path):
    trl, datasets, support = trl_data
    from opake.transformers import DPSFTConfig, DPSFTTrainer

    def trainer(args, **keywords):
        return DPSFTTrainer(model=support.llama(), args=args, train_dataset=datasets.Dataset.from_dict(
            support.sft_rows(32)), processing_class=support.tokenizer(), **keywords)

    by_keywords = trainer(trl.SFTConfig(**trl_settings(tmp_path)), key=opake.random.key(3), **TRL_PLAN)
    by_config = trainer(DPSFTConfig(**trl_settings(tmp_path), **TRL_PLAN, privacy_seed=3))
    assert_same_plan(by_keywords.private.plan, by_config.private.plan)
    # DPTrainingArguments given to a TRL trainer: its privacy fields read, the rest made an SFTConfig
    plain = dp_arguments(tmp_path, {**TRL_PLAN, "privacy_seed": 3}, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, num_train_epochs=1)
    converted = trainer(plain)
    assert_same_plan(by_keywords.private.plan, converted.private.plan)
    assert isinstance(converted.args, trl.SFTConfig) and not isinstance(converted.args, PrivacyArguments)


def test_dp_dpo_trainer_plans_the_same_run_from_its_config(trl_data, tmp_path):
    trl, datasets, support = trl_data
    from opake.transformers import DPDPOConfig, DPDPOTrainer

    def trainer(args, **keywords):
        model = support.gpt2()
        return DPDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=datasets.Dataset
                            .from_dict(support.preference_rows(32)), processing_class=support.tokenizer(), **keywords)

    by_keywords = trainer(trl.DPOConfig(**trl_settings(tmp_path)), key=opake.random.key(3), **TRL_PLAN)
    config = DPDPOConfig(**trl_settings(tmp_path), **TRL_PLAN, privacy_seed=3)
    by_config = trainer(config)
    assert_same_plan(by_keywords.private.plan, by_config.private.plan)
    with pytest.raises(TypeError, match=r"DPDPOConfig\.target_delta and target_delta="):
        trainer(config, target_delta=DELTA)
