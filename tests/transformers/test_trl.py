"""DPSFTTrainer and DPDPOTrainer: TRL's trainers on a privacy plan, with tiny models built from configs.

A word-level tokenizer and sentences made from a small vocabulary (tests/trl_support.py); GPT-2 and Llama
of one layer (nothing downloads). The guarantee's assumption is checked where it can break:
adding one example (SFT) or one preference pair (DPO) moves the released clipped sum by at most
C, and the unprotected behaviour does not (TRL's batch-wide token mean for SFT; clipping a
pair's chosen and rejected rows apart for DPO). The per-pair DPO losses equal TRL's own loss on
an unhooked copy of the model, loss type by loss type.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")

import opake.random  # noqa: E402
from opake.transformers import DPDPOTrainer, DPSFTTrainer, UnsupportedTrainingArgumentError  # noqa: E402
from opake.transformers.arguments import check_arguments  # noqa: E402
from opake.transformers.trl_arguments import (  # noqa: E402
    DPO_ARGUMENT_RULES,
    DPO_ROWS,
    SFT_ARGUMENT_RULES,
    SFT_ROWS,
    trl_arguments_table,
)
from trl_support import WORDS, gpt2, llama, preference_rows, sft_rows, tokenizer  # noqa: E402

# TRL's configs still set the deprecated gradient_checkpointing field, as most scripts do.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
PLAN = dict(noise_multiplier=0.8, target_delta=1e-5)


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """TRL's telemetry off (it skips CI runs) and no progress bars (one thread: conftest.py)."""
    monkeypatch.setenv("CI", "1")
    datasets.disable_progress_bars()


def settings(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  num_train_epochs=1, learning_rate=0.05, optim="sgd", report_to="none", save_strategy="no",
                  logging_steps=1, bf16=False, use_cpu=True, disable_tqdm=True, max_length=32, seed=0)
    values.update(overrides)
    return values


def sft_trainer(tmp_path, model=None, rows=None, seed=3, trainer=DPSFTTrainer, **overrides):
    return trainer(model=llama() if model is None else model, args=trl.SFTConfig(**settings(tmp_path, **overrides)),
                   train_dataset=datasets.Dataset.from_dict(rows or sft_rows(32)), processing_class=tokenizer(),
                   key=opake.random.key(seed), **PLAN)


def dpo_trainer(tmp_path, model=None, rows=None, seed=3, trainer=DPDPOTrainer, ref_model="copy", **overrides):
    model = gpt2() if model is None else model
    if ref_model == "copy":
        ref_model = copy.deepcopy(model)
    return trainer(model=model, ref_model=ref_model, args=trl.DPOConfig(**settings(tmp_path, **overrides)),
                   train_dataset=datasets.Dataset.from_dict(rows or preference_rows(32)), processing_class=tokenizer(),
                   key=opake.random.key(seed), **PLAN)


def parameters(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def release(trainer, batch) -> torch.Tensor:
    """The clipped sum of one training step over ``batch`` (collated by the trainer's collator),
    flattened: what the step would noise and release."""
    trainer.training_step(trainer.model, trainer.data_collator(batch))
    return torch.cat([value.reshape(-1) for value in trainer.private.optimizer.clipper.clipped_sum().values()])


def hooked(model) -> bool:
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


# -- SFT -------------------------------------------------------------------------------------------


def test_sft_trains_on_the_plan_with_completion_only_loss_and_checkpointing(tmp_path):
    model = llama()
    initial = parameters(model)
    trainer = sft_trainer(tmp_path, model)
    assert trainer.args.activation_checkpointing  # SFTConfig's default, honoured (Trainer turns it on in train())
    assert trainer.completion_only_loss and -100 in trainer.train_dataset[0]["labels"]
    trainer.train()
    assert model.is_activation_checkpointing
    assert trainer.state.global_step == trainer.private.steps_taken == trainer.private.plan.n_steps == 4
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 4 and len({entry["loss"] for entry in history}) > 1
    assert all(0 < entry["epsilon"] <= entry["epsilon_planned"] == trainer.private.epsilon for entry in history)
    assert all("mean_token_accuracy" in entry and "grad_norm" not in entry for entry in history)
    assert all(not torch.equal(value, initial[name]) for name, value in parameters(model).items())


def test_sft_loss_is_each_examples_own_completion_token_mean(tmp_path):
    trainer = sft_trainer(tmp_path)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    labels = batch["labels"][:, 1:]
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
    valid = (labels != -100).double()
    own_means = (token * valid).sum(dim=1) / valid.sum(dim=1)
    torch.testing.assert_close(loss.double(), own_means.mean(), rtol=1e-5, atol=1e-6)
    batch_wide = (token * valid).sum() / valid.sum()  # TRL's loss: the batch's token count divides
    assert abs(float(batch_wide.detach()) - float(loss.detach())) > 1e-3


def test_adding_one_example_moves_the_sft_release_by_at_most_C(tmp_path):
    class BatchWideTokenMean(DPSFTTrainer):
        """The unprotected behaviour: TRL's loss, summed token losses over the batch's token count."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"][:, 1:]
            logits = model(**{name: value for name, value in inputs.items() if name != "labels"}).logits
            token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="sum")
            return token / (labels != -100).sum()

    # Eight copies of one short example and one long one: the copies' gradients point the same way,
    # so a batch-wide divisor that grows with the long example visibly shrinks their sum.
    rows = {"prompt": ["the cat"] * 8 + ["a dog"], "completion": [" sat"] * 8 + [" ran " + " ".join(WORDS[:20])]}
    max_grad_norm = 12.0  # above every example's norm in this batch: nothing is clipped, a rescaling shows
    moved = {}
    for trainer_class in (DPSFTTrainer, BatchWideTokenMean):
        trainer = sft_trainer(tmp_path, rows=rows, trainer=trainer_class, max_grad_norm=max_grad_norm,
                              per_device_train_batch_size=9, gradient_accumulation_steps=1)
        examples = [trainer.train_dataset[i] for i in range(9)]
        without, added = release(trainer, examples[:8]), release(trainer, examples)
        moved[trainer_class] = float((added - without).norm())
    assert moved[DPSFTTrainer] <= max_grad_norm * (1 + 1e-6)
    assert moved[BatchWideTokenMean] > 1.1 * max_grad_norm  # the hole the per-example loss closes


@pytest.mark.parametrize("field, value, reason", [
    ("packing", True, "several examples in one row"),
    ("padding_free", True, "flattens every example of a batch into one row"),
    ("loss_type", "dft", "not formed per example"),
    ("activation_offloading", True, "saved-tensor hooks"),
    ("router_aux_loss_coef", 0.5, "load-balancing loss"),
])
def test_sft_settings_that_break_the_guarantee_are_refused_before_anything_moves(tmp_path, field, value, reason):
    model = llama()
    initial = parameters(model)
    with pytest.raises(UnsupportedTrainingArgumentError, match=f"SFTConfig {field}=.*{reason}"):
        sft_trainer(tmp_path, model, **{field: value})
    assert not hooked(model)
    assert all(torch.equal(value, initial[name]) for name, value in parameters(model).items())


def test_sft_default_arguments_run_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # args=None writes to ./tmp_trainer, as Trainer does
    trainer = DPSFTTrainer(model=llama(), train_dataset=datasets.Dataset.from_dict(sft_rows(16)),
                           processing_class=tokenizer(), key=opake.random.key(0), **PLAN)
    bf16_here = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert isinstance(trainer.private_args, trl.SFTConfig) and trainer.args.bf16 == bf16_here
    # TRL's default optimizer (Trainer's AdamW) is corrected for the noise, as make_private corrects one
    assert trainer.private.noise_correction.enabled, trainer.private.noise_correction
    plain = transformers.TrainingArguments(**{name: value for name, value in settings(tmp_path).items()
                                              if name != "max_length"})  # converted to an SFTConfig, as TRL does
    trainer = DPSFTTrainer(model=llama(), args=plain, train_dataset=datasets.Dataset.from_dict(sft_rows(16)),
                           processing_class=tokenizer(), key=opake.random.key(0), **PLAN)
    assert isinstance(trainer.private_args, trl.SFTConfig) and trainer.private_args.learning_rate == 0.05


# -- DPO -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapters", [False, True], ids=["reference-model", "lora"])
def test_dpo_trains_on_pairs_with_a_frozen_reference(tmp_path, adapters):
    if adapters:
        lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        trainer = DPDPOTrainer(model=gpt2(), args=trl.DPOConfig(**settings(tmp_path)), peft_config=lora,
                               train_dataset=datasets.Dataset.from_dict(preference_rows(32)),
                               eval_dataset=datasets.Dataset.from_dict(preference_rows(8, seed=1)),
                               processing_class=tokenizer(), key=opake.random.key(3), **PLAN)
        reference = None
    else:
        trainer = dpo_trainer(tmp_path)
        reference = parameters(trainer.ref_model)
    model = trainer.model
    initial = parameters(model)
    passes = []
    model.register_forward_pre_hook(lambda module, args, kwargs: passes.append(torch.is_grad_enabled()),
                                    with_kwargs=True)
    trainer.train()
    plan = trainer.private.plan
    assert plan.expected_batch_size == 8 and plan.n_steps == 4 == trainer.state.global_step  # 32 pairs, 8 a step
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len({entry["loss"] for entry in history}) > 1 and all("epsilon" in entry for entry in history)
    assert abs(history[0]["loss"] - 0.6931) < 1e-3  # the policy starts at the reference: -log sigmoid(0)
    batches = trainer.private.optimizer.batches
    assert trainer.private.optimizer.last_step_examples == len(batches.indices(3))  # pairs, not rows
    changed = {name for name, value in parameters(model).items() if not torch.equal(value, initial[name])}
    assert changed == {name for name, p in model.named_parameters() if p.requires_grad}
    if reference is not None:  # the reference model was never trained, hooked or counted
        assert all(torch.equal(value, reference[name]) for name, value in parameters(trainer.ref_model).items())
        assert not hooked(trainer.ref_model)
        assert all(passes)  # the policy ran only with gradients; the reference is another model
    else:  # with LoRA the reference is the policy with its adapters off, run without gradients
        assert passes.count(False) == passes.count(True) > 0
        assert all("lora_" in name for name in changed)
        trained = parameters(model)
        metrics = trainer.evaluate()  # without gradients: takes no pairs, steps nothing
        assert metrics["eval_loss"] > 0 and "eval_rewards/accuracies" in trainer.state.log_history[-1]
        assert trainer.private.steps_taken == 4
        assert all(torch.equal(value, trained[name]) for name, value in parameters(model).items())


def test_precomputed_reference_log_probs_are_the_reference_forwards(tmp_path):
    trainer = dpo_trainer(tmp_path, precompute_ref_log_probs=True)  # computed by TRL before make_private
    trainer.train()
    assert trainer.private.steps_taken == 4
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    live = {name: value for name, value in batch.items() if not name.startswith("ref_")}
    model_inputs = {name: value for name, value in live.items() if name != "completion_mask"}
    torch.testing.assert_close(torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]),
                               trainer._reference_log_probs(model_inputs, live))


def test_adding_one_pair_moves_the_dpo_release_by_at_most_C(tmp_path):
    class RowClipping(DPDPOTrainer):
        """The unprotected behaviour: a pair's chosen and rejected rows clipped apart, as two examples."""

        def micro_batch_parts(self, inputs, size):
            parts = super().micro_batch_parts(inputs, size)
            self.private.optimizer.clipper.expect_units(None)
            return parts

    max_grad_norm = 1e-3  # below every gradient: each clipped quantity weighs exactly C
    moved = {}
    for trainer_class in (DPDPOTrainer, RowClipping):
        trainer = dpo_trainer(tmp_path, model=gpt2(seed=1), rows=preference_rows(9, seed=5), trainer=trainer_class,
                              max_grad_norm=max_grad_norm, per_device_train_batch_size=9,
                              gradient_accumulation_steps=1)
        pairs = [trainer.train_dataset[i] for i in range(9)]
        without, added = release(trainer, pairs[:8]), release(trainer, pairs)
        moved[trainer_class] = float((added - without).norm())
    assert moved[DPDPOTrainer] <= max_grad_norm * (1 + 1e-6)
    assert moved[RowClipping] > 1.1 * max_grad_norm  # two rows of one pair, each up to C


LOSS_VARIANTS = [dict(loss_type=[name]) for name in ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust",
                                                      "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop",
                                                      "sigmoid_norm")] + [
    dict(loss_type=["sigmoid", "hinge"], loss_weights=[0.7, 0.3]),
    dict(loss_type=["sigmoid"], f_divergence_type="js_divergence"),
    dict(loss_type=["sigmoid"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    dict(loss_type=["sigmoid"], f_divergence_type="forward_kl"),
    dict(loss_type=["sigmoid"], ld_alpha=0.4),
    dict(loss_type=["sigmoid"], use_weighting=True),
]


def test_per_pair_losses_equal_trls_loss_on_an_unhooked_copy(tmp_path):
    trainer = dpo_trainer(tmp_path, model=gpt2(seed=2), ref_model=gpt2(seed=4), label_smoothing=0.1)
    reference_trainer = trl.DPOTrainer(model=gpt2(seed=2), ref_model=gpt2(seed=4),  # the same weights, unhooked
                                       args=trl.DPOConfig(**settings(tmp_path / "trl", label_smoothing=0.1,
                                                                     use_weighting=True)),  # its head's WPO terms
                                       train_dataset=trainer.train_dataset, processing_class=tokenizer())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    for variant in LOSS_VARIANTS:
        # Both trainers read the DPO settings from the attributes TRL's __init__ sets from the config.
        values = {"loss_types": variant["loss_type"], "loss_weights": variant.get("loss_weights"),
                  "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5, "ld_alpha": None,
                  "use_weighting": False, **{name: value for name, value in variant.items() if name != "loss_type"}}
        values["loss_weights"] = values["loss_weights"] or [1.0] * len(values["loss_types"])
        for each in (trainer, reference_trainer):
            for name, value in values.items():
                setattr(each, name, value)
        with torch.no_grad():
            ours = trainer.compute_loss(trainer.model, dict(batch))
            theirs = reference_trainer.compute_loss(reference_trainer.model, dict(batch))
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-6, msg=lambda text: f"{variant}: {text}")


@pytest.mark.parametrize("overrides, message", [
    (dict(loss_type=["aot"]), "DPOConfig loss_type=.*sort the batch's pairs"),
    (dict(loss_type=["sigmoid", "sft"]), "DPOConfig loss_type=.*all chosen tokens of the batch"),
    (dict(padding_free=True), "DPOConfig padding_free=True"),
    (dict(data_collator=lambda rows: rows), "DPDPOTrainer argument data_collator=.*pair the wrong rows"),
    (dict(privacy_unit=list(range(32))), "DPDPOTrainer argument privacy_unit=.*user-level DPO"),
])
def test_dpo_settings_that_break_the_guarantee_are_refused_before_anything_moves(tmp_path, overrides, message):
    model, reference = gpt2(), gpt2()
    initial = parameters(model)
    config = {name: value for name, value in overrides.items() if name not in ("data_collator", "privacy_unit")}
    arguments = {name: value for name, value in overrides.items() if name in ("data_collator", "privacy_unit")}
    with pytest.raises(UnsupportedTrainingArgumentError, match=message):
        DPDPOTrainer(model=model, ref_model=reference, args=trl.DPOConfig(**settings(tmp_path, **config)),
                     train_dataset=datasets.Dataset.from_dict(preference_rows(32)), processing_class=tokenizer(),
                     key=opake.random.key(0), **{**PLAN, **arguments})
    assert not hooked(model)
    assert all(torch.equal(value, initial[name]) for name, value in parameters(model).items())


# -- the second table ------------------------------------------------------------------------------


@pytest.mark.parametrize("config, rows", [(trl.SFTConfig, SFT_ROWS), (trl.DPOConfig, DPO_ROWS)],
                         ids=["SFTConfig", "DPOConfig"])
def test_every_field_trl_adds_has_a_row(config, rows):
    base = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    added = {field.name for field in dataclasses.fields(config)} - base
    named = {rule.name for rule in rows if rule.where == config.__name__}
    assert added == named
    trainer = DPSFTTrainer if config is trl.SFTConfig else DPDPOTrainer
    parent = trl.SFTTrainer if config is trl.SFTConfig else trl.DPOTrainer
    constructor = {rule.name for rule in rows if rule.where == f"{trainer.__name__} argument"} - {"privacy_unit"}
    assert constructor <= set(__import__("inspect").signature(parent.__init__).parameters)


def test_an_unknown_trl_field_is_accepted_only_at_its_default(tmp_path):
    @dataclasses.dataclass
    class NewerSFTConfig(trl.SFTConfig):
        brand_new_option: int = 0

    values = settings(tmp_path)
    check_arguments(NewerSFTConfig(**values), rules=SFT_ARGUMENT_RULES)
    with pytest.raises(UnsupportedTrainingArgumentError, match="NewerSFTConfig brand_new_option=2: opake does not"):
        check_arguments(NewerSFTConfig(**values, brand_new_option=2), rules=SFT_ARGUMENT_RULES)
    check_arguments(trl.DPOConfig(**values), rules=DPO_ARGUMENT_RULES)


def test_the_documentation_example_runs_as_written(tmp_path, monkeypatch):
    section = DOCS.read_text().split("## TRL", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # output_dir="sft", "dpo"
    given = {"model": llama(), "policy": llama(seed=1), "tokenizer": tokenizer(),
             "completions": datasets.Dataset.from_dict(sft_rows(32)),
             "preferences": datasets.Dataset.from_dict(preference_rows(32))}
    exec(compile(code, "docs/transformers.md (TRL)", "exec"), given)
    for trainer in (given["sft"], given["dpo"]):
        assert trainer.private.steps_taken == trainer.private.plan.n_steps == 4
        assert trainer.private.epsilon <= 8.0 + 1e-9
    assert all("lora_" in name for name, p in given["sft"].model.named_parameters() if p.requires_grad)


def test_the_documentation_carries_the_generated_trl_table():
    text = DOCS.read_text()
    found = re.search(r"<!-- trl arguments table: begin -->\n(.*?)<!-- trl arguments table: end -->", text, re.S)
    assert found, "docs/transformers.md lacks the TRL table markers"
    assert found.group(1) == trl_arguments_table(), (
        "docs/transformers.md's TRL table differs from the code's: regenerate it with "
        "python -m opake.transformers.trl_arguments")


def test_trls_own_trainer_on_a_private_model_is_refused_with_the_fix(tmp_path):
    """make_private's per-example loss meets TRL's fused LM head (what made a plain SFTTrainer fail
    with "'NoneType' object is not subscriptable"): a refusal that names the private trainer."""
    from opake.torch import make_private
    from opake.torch.losses import UnsupportedLossError

    model = llama()
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**settings(tmp_path)),
                             train_dataset=datasets.Dataset.from_dict(sft_rows(16)), processing_class=tokenizer())
    initial = parameters(model)
    make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 dataset=trainer.train_dataset, batch_size=8, epochs=1, max_grad_norm=1.0,
                 key=opake.random.key(0), collate_fn=trainer.data_collator, **PLAN)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with pytest.raises(UnsupportedLossError, match="fused_lm_head=True.*DPSFTTrainer"):
        trainer.compute_loss(model, dict(batch))
    assert all(torch.equal(value, initial[name]) for name, value in parameters(model).items())
