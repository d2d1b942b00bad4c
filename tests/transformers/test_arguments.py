"""The TrainingArguments table: it covers every field, each refusal says its reason, and the
documentation carries the table the code generates."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opake.transformers import (  # noqa: E402
    ARGUMENT_RULES,
    ArgumentRule,
    DPTrainer,
    UnsupportedTrainingArgumentError,
    arguments_table,
    check_arguments,
)
from opake.transformers.arguments import CONSTRUCTOR, FIELD, PROPERTY, rule_for, with_launcher_settings  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


# One value each row refuses (every row that restricts its values must appear here).
REFUSED = {
    "gradient_accumulation_steps": 0,
    "num_train_epochs": 2.5,
    "max_steps": 2.5,
    "max_grad_norm": 0.0,
    "train_sampling_strategy": "group_by_length",
    "dataloader_drop_last": True,
    "data_seed": 7,
    "auto_find_batch_size": True,
    "label_smoothing_factor": 0.1,
    "neftune_noise_alpha": 5.0,
    "use_liger_kernel": True,
    "fp16": True,
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "torch_compile": True,
    "activation_checkpointing_kwargs": {"use_reentrant": False, "context_fn": print},
    "optim": "lomo",
    "deepspeed": "ds_config.json",
    "fsdp_config": {"cpu_offload": True},
    "parallelism_config": object(),
    "accelerator_config": transformers.trainer_pt_utils.AcceleratorConfig(
        gradient_accumulation_kwargs={"num_steps": 2}),
    "hub_strategy": "all_checkpoints",
    "mixed_precision": "fp16",
    "n_gpu": 2,
    "train_dataset": Stream(),
    "model_init": lambda: None,
    "compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss,
}


def default_arguments(tmp_path):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)


def with_value(args, name, value):
    """``args`` with one field, or one derived property, set to ``value`` (bypassing the
    TrainingArguments checks that would, e.g., refuse fp16 on a CPU before DPTrainer sees it)."""
    rule = next(rule for rule in ARGUMENT_RULES if rule.name == name)
    if rule.where == PROPERTY and isinstance(getattr(type(args), name, None), property):
        patched = type("Patched", (type(args),), {name: property(lambda self: value)})
        args = dataclasses.replace(args)
        args.__class__ = patched
        return args
    setattr(args, name, value)
    return args


def test_every_training_arguments_field_has_exactly_one_row():
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    rows = [rule.name for rule in ARGUMENT_RULES]
    assert len(rows) == len(set(rows))
    field_rows = {rule.name for rule in ARGUMENT_RULES if rule.where == FIELD}
    assert fields - field_rows == set(), "fields without a row"
    assert field_rows - fields == set(), "rows for fields that do not exist"
    for rule in ARGUMENT_RULES:
        if rule.where == PROPERTY:
            assert rule.name not in fields and hasattr(transformers.TrainingArguments("x"), rule.name)
        if rule.where == CONSTRUCTOR:
            assert rule.name in inspect.signature(DPTrainer.__init__).parameters
            assert rule.name in inspect.signature(transformers.Trainer.__init__).parameters


def test_the_refusal_values_cover_every_restricted_row():
    restricted = {rule.name for rule in ARGUMENT_RULES if rule.accepted != "any"}
    assert restricted == set(REFUSED)
    assert all(rule.accepted != "any" for rule in ARGUMENT_RULES if rule.treatment == "refuse")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_value_raises_with_its_reason(tmp_path, name):
    rule = next(rule for rule in ARGUMENT_RULES if rule.name == name)
    args = default_arguments(tmp_path)
    if rule.where == CONSTRUCTOR:
        check_arguments(args, {name: None if name != "train_dataset" else [1, 2]})  # accepted
        call = lambda: check_arguments(args, {name: REFUSED[name]})  # noqa: E731
    else:
        check_arguments(args)  # the defaults are accepted
        changed = with_value(args, name, REFUSED[name])
        call = lambda: check_arguments(changed)  # noqa: E731
    with pytest.raises(UnsupportedTrainingArgumentError) as error:
        call()
    message = str(error.value)
    assert f"{rule.where} {name}=" in message
    assert rule.reason in message and rule.accepted in message
    assert message.count("\n  - ") == 1  # only this one


def test_all_violations_are_listed_together(tmp_path):
    args = default_arguments(tmp_path)
    args.data_seed, args.label_smoothing_factor = 5, 0.2
    with pytest.raises(UnsupportedTrainingArgumentError, match=r"(?s)label_smoothing_factor=0\.2.*data_seed=5"):
        check_arguments(args, {"compute_loss_func": REFUSED["compute_loss_func"]})


def test_a_field_the_table_does_not_know_is_accepted_only_at_its_default(tmp_path):
    @dataclasses.dataclass
    class Newer(transformers.TrainingArguments):
        brand_new_option: int = 0

    check_arguments(Newer(output_dir=str(tmp_path), report_to="none"))
    with pytest.raises(UnsupportedTrainingArgumentError, match="brand_new_option=3: opake does not know"):
        check_arguments(Newer(output_dir=str(tmp_path), report_to="none", brand_new_option=3))


def test_activation_checkpointing_is_accepted_but_not_with_fsdp(tmp_path):
    args = default_arguments(tmp_path)
    for kwargs in (None, {"use_reentrant": True}, {"use_reentrant": False, "every_n_layers": 2}):
        check_arguments(dataclasses.replace(args, activation_checkpointing=True,
                                            activation_checkpointing_kwargs=kwargs))
    deprecated = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                gradient_checkpointing=True)
    assert deprecated.activation_checkpointing  # TrainingArguments copies the deprecated name
    check_arguments(deprecated)
    sharded = with_value(dataclasses.replace(args, activation_checkpointing=True), "fsdp", ["full_shard"])
    with pytest.raises(UnsupportedTrainingArgumentError, match="fsdp with activation_checkpointing=True"):
        check_arguments(sharded)


def test_dp_trainer_refuses_before_touching_the_model(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UnsupportedTrainingArgumentError, match=r"(?s)label_smoothing_factor=0\.1.*whole batch"):
        DPTrainer(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                                   label_smoothing_factor=0.1),
                  train_dataset=[{"x": torch.zeros(2)}] * 4, target_delta=1e-5, noise_multiplier=1.0)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_rows_are_validated():
    with pytest.raises(ValueError, match="treatment must be one of"):
        ArgumentRule("x", "drop", "because")
    with pytest.raises(ValueError, match="must say which values it accepts"):
        ArgumentRule("x", "refuse", "because")
    with pytest.raises(ValueError, match="give both accepts and accepted"):
        ArgumentRule("x", "map", "because", accepted="1")


def test_the_documentation_carries_the_generated_table():
    text = DOCS.read_text()
    found = re.search(r"<!-- arguments table: begin -->\n(.*?)<!-- arguments table: end -->", text, re.S)
    assert found, "docs/transformers.md lacks the generated table markers"
    assert found.group(1) == arguments_table(), (
        "docs/transformers.md's table differs from the code's: regenerate it with "
        "python -m opake.transformers.arguments")


# --- what accelerate launch puts in the environment -------------------------------------------------

@dataclasses.dataclass
class _LaunchedArguments:
    """The fields with_launcher_settings reads, for a world size the test chooses."""
    fsdp: str = ""
    fsdp_config: dict | None = None
    world_size: int = 2
    activation_checkpointing: bool = False


_FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block, GPT2MLP"}


def test_accelerate_launch_fsdp_becomes_training_arguments_fsdp():
    launched = with_launcher_settings(_LaunchedArguments(), _FSDP)
    assert launched.fsdp == "full_shard"
    assert launched.fsdp_config == {"reshard_after_forward": True, "transformer_layer_cls_to_wrap": ["GPT2Block", "GPT2MLP"]}
    shard_grad_op = with_launcher_settings(_LaunchedArguments(), {**_FSDP, "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"})
    assert shard_grad_op.fsdp_config["reshard_after_forward"] is False
    # without accelerate's flag, on one process, or with fsdp already asked for: unchanged
    for args, environ in ((_LaunchedArguments(), {}), (_LaunchedArguments(world_size=1), _FSDP),
                          (_LaunchedArguments(fsdp="full_shard", fsdp_config={"x": 1}), _FSDP)):
        assert with_launcher_settings(args, environ) is args


@pytest.mark.parametrize("environ, message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed shards and reduces gradients itself"),
    ({**_FSDP, "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, "hybrid sharding and NO_SHARD are not supported"),
    ({**_FSDP, "FSDP_RESHARD_AFTER_FORWARD": "NO_SHARD"}, "hybrid sharding and NO_SHARD are not supported"),
    ({**_FSDP, "FSDP_ACTIVATION_CHECKPOINTING": "true"}, "activation_checkpointing"),
])
def test_accelerate_launch_settings_dp_trainer_cannot_honour_are_refused(environ, message):
    with pytest.raises(UnsupportedTrainingArgumentError, match=message):
        with_launcher_settings(_LaunchedArguments(), environ)


def test_accelerate_launch_fsdp_offloading_is_refused_by_the_fsdp_config_row():
    launched = with_launcher_settings(_LaunchedArguments(), {**_FSDP, "FSDP_OFFLOAD_PARAMS": "true"})
    assert not rule_for("fsdp_config").accepts(launched.fsdp_config)
    assert rule_for("fsdp_config").accepts(with_launcher_settings(_LaunchedArguments(), _FSDP).fsdp_config)


def test_fsdp_with_resumable_checkpoints_is_refused_with_the_two_ways_out(tmp_path):
    """Trainer cannot checkpoint the optimizer state of a model DPTrainer shards (transformers
    refuses such a run in its own words); the refusal names save_only_model (with which DPTrainer
    checkpoints and resumes the sharded run itself) and save_strategy."""
    def arguments(**changes):
        return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True, **changes)

    with pytest.raises(UnsupportedTrainingArgumentError, match="pass save_only_model=True.*resumes.*save_strategy='no'"):
        check_arguments(arguments())  # Trainer's default: a checkpoint every 500 steps
    check_arguments(arguments(save_only_model=True))
    check_arguments(arguments(save_strategy="no"))
