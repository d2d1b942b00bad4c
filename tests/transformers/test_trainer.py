"""DPTrainer: transformers.Trainer on the privacy plan, against a hand-written loop over the plan.

Tiny GPT-2 models built from configs (nothing downloads), trained on synthetic sentences
tokenized by a character-level tokenizer (tests/transformers_support.py). The strongest check: DPTrainer's trained
parameters equal, bit for bit, those of the documented loop over ``private.data_loader`` with
the same key (same batches, same noise), for full fine-tuning and for LoRA.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import opake.random  # noqa: E402
from opake.torch import ForeignOptimizerError, UnplannedBatchError, make_private  # noqa: E402
from opake.transformers import (  # noqa: E402
    CHECKPOINT_NAME,
    DPTrainer,
    UnsupportedTrainingArgumentError,
)
from transformers_support import (  # noqa: E402
    PAD,
    PLAN,
    VOCAB,
    CharDataset,
    arguments,
    assert_same,
    collate,
    dp_trainer,
    gpt2,
    parameters,
    sentences,
)


def collate_allowing_empty(features):
    return collate(features) if features else {name: t[:0] for name, t in collate([{"input_ids": torch.ones(1,
                                               dtype=torch.long)}]).items()}


def lora(model):
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def hand_loop(model, dataset, *, batch_size, epochs, lr, seed=3, micro_batch=8, optimizer_class=torch.optim.SGD):
    """The documented opake.torch loop, with Trainer's SGD (or ``optimizer_class``) and linear schedule
    built by hand; a planned batch larger than ``micro_batch`` is run as ceil(size / micro_batch)
    balanced virtual batches before its one step (docs/torch.md), as DPTrainer does for
    per_device_train_batch_size."""
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=lr)
    n_steps = epochs * (len(dataset) // batch_size)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, n_steps)
    private = make_private(module=model, optimizer=optimizer, dataset=dataset, batch_size=batch_size,
                           epochs=epochs, max_grad_norm=1.0, lr_scheduler=scheduler, key=opake.random.key(seed),
                           collate_fn=collate_allowing_empty, **PLAN)
    for _ in range(epochs):
        for batch in private.data_loader:
            private.optimizer.zero_grad()
            parts = -(-len(batch["input_ids"]) // micro_batch)
            for part in range(parts):
                model(**{name: value.tensor_split(parts)[part] for name, value in batch.items()}).loss.backward()
            private.optimizer.step()
            scheduler.step()
    return private


# -- the plan's batches ------------------------------------------------------------------------


def test_plain_trainer_on_its_own_loader_is_refused(tmp_path):
    model, dataset = gpt2(), CharDataset(sentences(32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    private = make_private(module=model, optimizer=optimizer, dataset=dataset, batch_size=8, epochs=1,
                           max_grad_norm=1.0, key=opake.random.key(0), collate_fn=collate_allowing_empty, **PLAN)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, optim="adamw_torch"),
                                   train_dataset=dataset, data_collator=collate,
                                   optimizers=(private.optimizer, None))
    before = parameters(model)
    with pytest.raises(UnplannedBatchError, match="batches the accountant did not price"):
        trainer.train()
    assert private.steps_taken == 0
    assert_same(parameters(model), before)


def test_plain_trainer_given_the_private_module_is_refused_before_any_step(tmp_path):
    # Trainer builds its own AdamW over the model it is given: that optimizer would train on
    # autograd's unclipped, un-noised gradients while private.epsilon is reported.
    model, dataset = gpt2(), CharDataset(sentences(32))
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), dataset=dataset,
                           batch_size=8, epochs=1, max_grad_norm=1.0, key=opake.random.key(0),
                           collate_fn=collate_allowing_empty, **PLAN)
    settings = dict(optim="adamw_torch", max_steps=2, logging_steps=1)
    trainer = transformers.Trainer(model=private.module, args=arguments(tmp_path, **settings), train_dataset=dataset,
                                   data_collator=collate)
    before = parameters(model)
    with pytest.raises(ForeignOptimizerError, match=r"AdamW holds parameters of a module made private.*DPTrainer"):
        trainer.train()
    assert private.steps_taken == 0
    assert_same(parameters(model), before)
    # negative control: the unprotected behaviour, the same Trainer on the detached module trains
    private.detach()
    transformers.Trainer(model=model, args=arguments(tmp_path, **settings), train_dataset=dataset,
                         data_collator=collate).train()
    assert any(not torch.equal(p, before[name]) for name, p in parameters(model).items())


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_dp_trainer_equals_the_hand_written_loop(tmp_path, adapters):
    dataset = CharDataset(sentences(48))
    build = (lambda: lora(gpt2())) if adapters else gpt2  # gpt2() seeds torch: LoRA's init is the same too
    trained, reference = build(), build()
    initial = parameters(trained)
    trainer = dp_trainer(trained, arguments(tmp_path), dataset)
    trainer.train()
    private = hand_loop(reference, dataset, batch_size=8, epochs=2, lr=0.05)

    assert trainer.private.plan.participation == private.plan.participation
    assert trainer.private.plan.strategy == private.plan.strategy  # the BLT for Trainer's linear schedule
    assert trainer.private.noise_multiplier == private.noise_multiplier
    assert trainer.state.global_step == trainer.private.steps_taken == private.plan.participation.n_steps == 12
    assert_same(parameters(trained), parameters(reference))
    changed = {name for name, value in parameters(trained).items() if not torch.equal(value, initial[name])}
    trainable = {name for name, p in trained.named_parameters() if p.requires_grad}
    assert changed == trainable
    if adapters:
        assert trainable and all("lora_" in name for name in trainable)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_trainers_adamw_is_corrected_for_the_noise_as_make_private_corrects_it(tmp_path, optim):
    dataset = CharDataset(sentences(48))
    trained, reference, uncorrected = gpt2(), gpt2(), gpt2()
    trainer = dp_trainer(trained, arguments(tmp_path, optim=optim, learning_rate=3e-3), dataset)
    trainer.train()
    assert trainer.private.noise_correction.enabled and "AdamW" in trainer.private.noise_correction.reason
    adamw = lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # noqa: E731 (Trainer's decay: 0)
    private = hand_loop(reference, dataset, batch_size=8, epochs=2, lr=3e-3, optimizer_class=adamw)
    assert private.noise_correction.enabled
    assert_same(parameters(trained), parameters(reference))
    # Negative control: noise_correction=False trains Trainer's AdamW as it is, another run.
    off = dp_trainer(uncorrected, arguments(tmp_path, optim=optim, learning_rate=3e-3), dataset,
                     noise_correction=False)
    off.train()
    assert not off.private.noise_correction.enabled
    assert any(not torch.equal(a, b) for a, b in zip(parameters(trained).values(), parameters(uncorrected).values()))


def test_gradient_accumulation_cuts_one_planned_batch_into_micro_batches(tmp_path):
    dataset = CharDataset(sentences(48))
    results, sizes = {}, []
    for per_device, steps in ((8, 1), (4, 2)):
        model = gpt2()
        trainer = dp_trainer(model, arguments(tmp_path, per_device_train_batch_size=per_device,
                                              gradient_accumulation_steps=steps), dataset)
        if steps == 2:  # record the micro-batches the model sees, per optimizer step
            model.register_forward_pre_hook(
                lambda module, args, kwargs: sizes.append((trainer.private.steps_taken, len(kwargs["input_ids"]))),
                with_kwargs=True)
        trainer.train()
        results[per_device] = (trainer, parameters(model))
    whole, parts = results[8][0], results[4][0]
    assert whole.private.plan.expected_batch_size == parts.private.plan.expected_batch_size == 8
    assert parts.private.plan.participation == whole.private.plan.participation
    assert parts.state.global_step == parts.private.plan.participation.n_steps == 12
    assert all(size <= 4 for _, size in sizes)
    batches = parts.private.optimizer.batches
    for step in range(12):
        seen = [size for taken, size in sizes if taken == step]
        planned = len(batches.indices(step))
        assert sum(seen) == planned and len(seen) == -(-planned // 4)
    for name, value in results[8][1].items():
        torch.testing.assert_close(results[4][1][name], value, rtol=1e-5, atol=1e-6)


def test_empty_planned_batches_step_on_noise_alone(tmp_path):
    dataset = CharDataset(sentences(12))  # expected batch size 1: 12 bins, some empty
    trainer = dp_trainer(gpt2(), arguments(tmp_path, per_device_train_batch_size=1, num_train_epochs=1), dataset)
    empty = [t for t in range(12) if not trainer.private.optimizer.batches.indices(t)]
    assert empty, "the test needs a plan with an empty bin (change the key)"
    trainer.train()
    assert trainer.private.steps_taken == 12


# -- the loss, the clipping, precision ---------------------------------------------------------


def test_loss_is_the_mean_of_each_examples_own_token_mean(tmp_path):
    dataset = CharDataset(["a cat.", "the big red dog sat on a log."])
    model = gpt2()
    trainer = dp_trainer(model, arguments(tmp_path, per_device_train_batch_size=1, num_train_epochs=1), dataset)
    batch = collate([dataset[0], dataset[1]])
    loss = trainer.compute_loss(model, dict(batch))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits.double()
    per_example = []
    for row in range(2):
        length = int(batch["attention_mask"][row].sum())
        per_example.append(F.cross_entropy(logits[row, :length - 1], batch["input_ids"][row, 1:length]))
    torch.testing.assert_close(loss.double(), torch.stack(per_example).mean(), rtol=1e-5, atol=1e-6)
    # HF's batch-wide token mean weights the long sentence by its token count: a different number
    tokens = [int(batch["attention_mask"][row].sum()) - 1 for row in range(2)]
    batch_wide = sum(t * value for t, value in zip(tokens, per_example)) / sum(tokens)
    assert abs(float(batch_wide) - float(loss.detach())) > 1e-3
    assert trainer.get_batch_samples(iter([batch]), 1, "cpu")[1] is None  # no num_items_in_batch
    assert torch.equal(trainer.compute_loss(model, dict(batch), num_items_in_batch=40), loss)  # dropped


def test_max_grad_norm_is_the_per_example_clipping_norm(tmp_path):
    dataset = CharDataset(sentences(8))
    default = dp_trainer(gpt2(), arguments(tmp_path), dataset)
    assert default.private.plan.max_grad_norm == 1.0  # Trainer's default
    model = gpt2()
    trainer = dp_trainer(model, arguments(tmp_path, max_grad_norm=1e-3, num_train_epochs=1, learning_rate=1.0),
                         dataset, noise_multiplier=1e-6)
    assert trainer.private.plan.max_grad_norm == 1e-3
    assert trainer.private.optimizer.clipper.max_grad_norm == 1e-3
    assert trainer.args.max_grad_norm == 0.0  # Trainer's own clipping of the summed .grad is off
    before = parameters(model)
    trainer.train()  # one bin of all 8 examples: one step, at learning rate 1 (linear schedule, step 0)
    # SGD moves by the clipped sum over the expected batch size (8), noise negligible: every
    # example's gradient is far above 1e-3, so each adds exactly 1e-3 of norm, at most 8e-3 in all
    moved = float(torch.cat([(parameters(model)[n] - before[n]).reshape(-1) for n in before]).norm())
    assert trainer.private.steps_taken == 1 and len(trainer.private.optimizer.batches.indices(0)) == 8
    assert moved <= 1e-3 * (1 + 1e-4)
    assert moved > 0.3e-3  # the examples' gradients point roughly the same way at initialization


def test_bf16_trains_under_autocast(tmp_path):
    model = lora(gpt2())
    dtypes = []
    inner = model.base_model.model.transformer.h[0].attn.c_attn.lora_A["default"]
    inner.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    trainer = dp_trainer(model, arguments(tmp_path, bf16=True, num_train_epochs=1), CharDataset(sentences(32)))
    trainer.train()
    assert trainer.private.steps_taken == 4
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("build", [gpt2, llama, lambda: lora(gpt2())], ids=["gpt2", "llama", "gpt2-lora"])
@pytest.mark.parametrize("reentrant", [None, True], ids=["default", "reentrant"])
def test_gradient_checkpointing_trains_the_run_without_it(tmp_path, build, reentrant):
    """Trainer turns checkpointing on in train(); the hooks record each layer call once (the
    recomputation in backward is recognized), so the run equals the one without checkpointing."""
    dataset = CharDataset(sentences(32))
    results = {}
    for checkpointing in (False, True):
        model = build()
        settings = dict(num_train_epochs=1)
        if checkpointing and reentrant is None:  # the deprecated name, as most scripts still write it
            settings.update(gradient_checkpointing=True)
        elif checkpointing:
            settings.update(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": reentrant})
        trainer = dp_trainer(model, arguments(tmp_path, **settings), dataset)
        layer = next(module for name, module in model.named_modules()
                     if name.endswith(("h.0.mlp.c_fc", "layers.0.mlp.up_proj")))
        calls = []
        layer.register_forward_hook(lambda *args: calls.append(torch.is_grad_enabled()))
        trainer.train()
        assert trainer.private.steps_taken == 4
        results[checkpointing] = (parameters(model), calls)
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results[False], results[True]
    assert len(checkpointed_calls) == 2 * len(plain_calls)  # every checkpointed forward ran again in backward
    assert_same(checkpointed, plain)


# -- logs and checkpoints ----------------------------------------------------------------------


def test_a_run_stopped_by_a_callback_warns_with_what_was_spent(tmp_path):
    from opake.torch import ShortRunWarning

    class StopAfterTwoSteps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    dataset = CharDataset(sentences(32))  # 4 planned steps
    stopped = dp_trainer(gpt2(), arguments(tmp_path, num_train_epochs=1), dataset)
    stopped.add_callback(StopAfterTwoSteps())
    with pytest.warns(ShortRunWarning, match=r"DPTrainer.train\(\) returned early: .* taken 2 of its 4 planned"):
        stopped.train()
    spent = stopped.private.epsilon_spent()
    assert stopped.state.log_history[-1]["epsilon"] == spent <= stopped.private.plan.epsilon
    complete = dp_trainer(gpt2(), arguments(tmp_path, num_train_epochs=1), dataset)
    with warnings.catch_warnings():  # negative control: the whole plan, logs read every step, no warning
        warnings.simplefilter("error", ShortRunWarning)
        complete.train()


def test_max_steps_is_the_plans_horizon_the_last_epoch_cut_where_it_ends(tmp_path):
    """max_steps=7 with 5 steps an epoch: a plan of exactly 7 steps (the second epoch cut after 2), no
    ShortRunWarning, the noise calibrated for those 7 steps (epsilon the target, spent at the last
    step). Trainer's SGD schedule decays over the 7 steps (linear, to 0 after them): the choice ranks
    the mechanisms on exactly those rates."""
    from opake.torch import ShortRunWarning
    from opake.torch.loader import PlanExhaustedError

    trainer = dp_trainer(gpt2(), arguments(tmp_path, max_steps=7, optim="sgd", logging_steps=1),
                         CharDataset(sentences(40)), noise_multiplier=None, target_epsilon=4.0)
    plan = trainer.private.plan
    assert plan.n_steps == 7 and plan.steps_per_epoch == 5 and plan.epochs == 2 and plan.request.steps == 7
    assert 4.0 * (1 - 1e-3) <= plan.epsilon <= 4.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)
        result = trainer.train()
    assert trainer.private.steps_taken == trainer.state.global_step == 7
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert plan.choice.workload.learning_rates == pytest.approx(tuple(rates))  # the workload the choice ranked on
    assert result.metrics["epsilon"] == trainer.state.log_history[-1]["epsilon"] == trainer.private.epsilon_spent()
    assert trainer.private.epsilon_spent() == plan.epsilon
    with pytest.raises(PlanExhaustedError, match="7 steps"):  # the plan is spent: no second run
        trainer.train()


def test_logs_carry_epsilon_and_noise_multiplier_and_no_gradient_norm(tmp_path):
    trainer = dp_trainer(gpt2(), arguments(tmp_path, num_train_epochs=1), CharDataset(sentences(32)),
                         noise_multiplier=None, target_epsilon=4.0)
    trainer.train()
    history = trainer.state.log_history
    assert len(history) >= 2 and any("loss" in entry for entry in history)
    assert trainer.private.epsilon <= 4.0 + 1e-6
    spent = [entry["epsilon"] for entry in history]
    assert spent == sorted(spent) and spent[-1] == trainer.private.epsilon    # the last log: every step taken
    for entry in history:
        assert 0 < entry["epsilon"] <= entry["epsilon_planned"] == trainer.private.epsilon
        assert entry["delta"] == 1e-5
        assert entry["noise_multiplier"] == trainer.private.optimizer.noise_multiplier
        assert "grad_norm" not in entry


def test_save_and_resume_with_replay_continues_bit_identically(tmp_path):
    """AdamW, dropout, a linear schedule: resumed inside an epoch (step 3 of 4) and at an epoch's
    end (step 4), the run ends on the uninterrupted run's parameters, bit for bit."""
    dataset = CharDataset(sentences(32))  # 4 steps per epoch, 8 in all
    settings = dict(optim="adamw_torch", learning_rate=1e-2, save_strategy="steps", save_steps=1)
    full_model = gpt2(dropout=0.1)
    full = dp_trainer(full_model, arguments(tmp_path / "full", **settings), dataset)
    full.train()
    for step in (3, 4):
        checkpoint = tmp_path / "full" / "out" / f"checkpoint-{step}"
        saved = torch.load(checkpoint / CHECKPOINT_NAME, weights_only=True)
        assert saved["noise"]["step"] == step and saved["key"] == opake.random.key(3).hex()
        resumed_model = gpt2(seed=1, dropout=0.1)  # other initial weights: the checkpoint replaces them
        resumed = dp_trainer(resumed_model, arguments(tmp_path / f"resumed{step}", **settings), dataset)
        if step == 3:
            with pytest.raises(TypeError, match="draws='replay'.*fresh_key"):
                resumed.train(resume_from_checkpoint=str(checkpoint))
        resumed.train(resume_from_checkpoint=str(checkpoint), draws="replay")
        assert resumed.state.global_step == resumed.private.steps_taken == 8
        assert resumed.state.epoch == 2.0
        assert_same(parameters(resumed_model), parameters(full_model))

    other_key = dp_trainer(gpt2(), arguments(tmp_path / "other", **settings), dataset, seed=4)
    with pytest.raises(ValueError, match="another key than the key= given"):
        other_key.train(resume_from_checkpoint=str(checkpoint), draws="replay")


def test_train_twice_and_checkpoints_without_noise_state_are_refused(tmp_path):
    trainer = dp_trainer(gpt2(), arguments(tmp_path, num_train_epochs=1), CharDataset(sentences(16)))
    with pytest.raises(TypeError, match="resume_from_checkpoint"):
        trainer.train(draws="replay")
    trainer.train()
    with pytest.raises(RuntimeError, match="consumed plan"):
        trainer.train()
    folder = tmp_path / "plain"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(CHECKPOINT_NAME)):
        dp_trainer(gpt2(), arguments(tmp_path, num_train_epochs=1), CharDataset(sentences(16))).train(
            resume_from_checkpoint=str(folder), draws="replay")


def test_evaluation_between_steps_changes_nothing(tmp_path):
    dataset, held_out = CharDataset(sentences(32)), CharDataset(sentences(8, seed=1))
    plain, evaluated = gpt2(), gpt2()
    dp_trainer(plain, arguments(tmp_path, num_train_epochs=1), dataset).train()
    trainer = DPTrainer(model=evaluated, args=arguments(tmp_path, num_train_epochs=1, eval_strategy="steps",
                                                        eval_steps=1, per_device_eval_batch_size=4),
                        train_dataset=dataset, eval_dataset=held_out, data_collator=collate,
                        key=opake.random.key(3), **PLAN)
    trainer.train()
    assert sum("eval_loss" in entry for entry in trainer.state.log_history) == 4
    assert_same(parameters(evaluated), parameters(plain))


# -- refusals ----------------------------------------------------------------------------------


def test_trainer_arguments_without_a_private_meaning_are_refused(tmp_path):
    dataset = CharDataset(sentences(16))
    with pytest.raises(UnsupportedTrainingArgumentError, match="model_init=.*hooked"):
        DPTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=dataset, model_init=gpt2, **PLAN)
    with pytest.raises(UnsupportedTrainingArgumentError, match="compute_loss_func=.*rescale the others"):
        DPTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=dataset,
                  compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.loss, **PLAN)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(dataset)

    with pytest.raises(UnsupportedTrainingArgumentError, match="train_dataset=.*map-style"):
        DPTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=Stream(), **PLAN)
    trainer = dp_trainer(gpt2(), arguments(tmp_path), dataset)
    with pytest.raises(UnsupportedTrainingArgumentError, match="hyperparameter"):
        trainer.hyperparameter_search()
    with pytest.raises(UnsupportedTrainingArgumentError, match="hyperparameter"):
        trainer.train(trial={"learning_rate": 0.1})


def test_refused_arguments_leave_the_model_unhooked(tmp_path):
    model = gpt2()
    with pytest.raises(UnsupportedTrainingArgumentError, match="data_seed=5"):
        dp_trainer(model, arguments(tmp_path, data_seed=5), CharDataset(sentences(16)))
    dp_trainer(model, arguments(tmp_path), CharDataset(sentences(16)))  # make_private accepts it: no hooks yet
