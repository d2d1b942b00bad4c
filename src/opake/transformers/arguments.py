"""What ``DPTrainer`` does with every ``transformers.TrainingArguments`` field: one table.

Each row names a field (or a derived property of the arguments, an argument of the ``Trainer``
constructor, or one of the privacy fields ``DPTrainingArguments`` adds, ``PrivacyArguments``),
what ``DPTrainer`` does with it, which values it accepts, and why:

* ``pass``: Trainer uses it as usual; it does not touch what the privacy guarantee depends on.
* ``map``: opake reads it into the privacy plan or the planned loader (and may restrict it).
* ``ignore``: it has no effect under ``DPTrainer`` (the reason says why that is harmless).
* ``refuse``: only the listed values are accepted; any other is refused with the reason.

``check_arguments`` generates every refusal from this table (all offending fields in one
error), and refuses a field the table does not know (a newer transformers) unless it has its
default value. ``arguments_table()`` renders the table for docs/transformers.md; a test keeps
the two identical.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass

from opake.errors import InvalidArgumentError, InvalidStateError, OpakeError

__all__ = ["ARGUMENT_RULES", "PRIVACY", "ArgumentRule", "UnsupportedTrainingArgumentError", "arguments_table",
           "check_arguments", "is_constructor_rule", "is_property_rule", "with_launcher_settings"]

TREATMENTS = ("pass", "map", "ignore", "refuse")
FIELD, PROPERTY, CONSTRUCTOR = "TrainingArguments", "TrainingArguments property", "DPTrainer argument"
# The privacy fields DPTrainingArguments, DPSFTConfig and DPDPOConfig share (opake.transformers.training_arguments).
PRIVACY = "PrivacyArguments"


class UnsupportedTrainingArgumentError(OpakeError, ValueError):
    """A TrainingArguments field (or Trainer argument) whose value DPTrainer cannot honour privately."""


def _anything(value) -> bool:
    return True


def _plain(value):
    """An enum member's value (TrainingArguments turns strings into ExplicitEnum members)."""
    return getattr(value, "value", value)


def _whole_positive(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 1 and float(value).is_integer())


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_finite(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _map_style(value) -> bool:
    import torch

    return (value is not None and not isinstance(value, torch.utils.data.IterableDataset)
            and hasattr(value, "__len__") and hasattr(value, "__getitem__"))


# The activation_checkpointing_kwargs tested with the per-example hooks (Trainer takes every_n_layers
# and offload out; torch.utils.checkpoint gets the rest).
_CHECKPOINTING_KEYS = frozenset({"use_reentrant", "every_n_layers", "offload", "preserve_rng_state"})

# Optimizers whose update does not wait for the noised gradient in optimizer.step(), or that need
# calls DPOptimizer does not forward.
_REFUSED_OPTIMIZERS = frozenset({
    "lomo", "adalomo", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
    "apollo_adamw_layerwise", "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd",
})


@dataclass(frozen=True)
class ArgumentRule:
    """One row: ``name`` (a field, property or constructor argument, as ``where`` says), the
    ``treatment`` (one of TREATMENTS), the ``reason``, and for restricted rows the predicate
    ``accepts`` with its description ``accepted``."""

    name: str
    treatment: str
    reason: str
    accepts: Callable[[object], bool] = _anything
    accepted: str = "any"
    where: str = FIELD

    def __post_init__(self):
        if self.treatment not in TREATMENTS:
            raise InvalidArgumentError(f"treatment must be one of {TREATMENTS}, got {self.treatment!r}")
        if (self.accepts is _anything) != (self.accepted == "any"):
            raise InvalidArgumentError(f"rule {self.name!r}: give both accepts and accepted, or neither")
        if self.treatment == "refuse" and self.accepts is _anything:
            raise InvalidArgumentError(f"rule {self.name!r}: a refusing rule must say which values it accepts")


def _rule(name, treatment, reason, accepts=_anything, accepted="any", where=FIELD):
    return ArgumentRule(name, treatment, reason, accepts, accepted, where)


_LOGS = ("logs are computed from the training data without noise (loss, token counts): treat them, and "
         "every tracker they go to, as private (docs/transformers.md)")
_EVAL = "evaluation runs without gradients, so the per-example hooks record nothing; it never steps the plan"
_SCRIPT = "read by training scripts, not by Trainer"
_DISTRIBUTED = ("DistributedDataParallel's setting; DPTrainer keeps Trainer's DDP wrap from synchronizing gradients "
                "(make_private reduces the clipped sums itself), so it has no effect")

_REQUEST = ("into the run's privacy request, PrivacySpec({name}=); the trainer's {name}= keyword says the same "
            "(giving both is refused)")

ARGUMENT_RULES: tuple[ArgumentRule, ...] = (
    # -- the privacy request (the fields of DPTrainingArguments, DPSFTConfig, DPDPOConfig) ----------
    _rule("target_epsilon", "map",
          "the budget the noise multiplier is calibrated to, " + _REQUEST.format(name="target_epsilon"),
          where=PRIVACY),
    _rule("target_delta", "map", "the delta of the guarantee, " + _REQUEST.format(name="target_delta"),
          where=PRIVACY),
    _rule("noise_multiplier", "map",
          "a given noise multiplier instead of a budget, " + _REQUEST.format(name="noise_multiplier"),
          where=PRIVACY),
    _rule("strategy", "map",
          "the mechanism by name ('blt', 'band_mf:G', 'dp_sgd'; None: the least noise at the budget), "
          + _REQUEST.format(name="strategy") + "; a recipe value goes to the keyword", where=PRIVACY),
    _rule("sampling", "map", "how the batches are drawn, " + _REQUEST.format(name="sampling"), where=PRIVACY),
    _rule("amplification", "map", "which proven bound prices the batches, " + _REQUEST.format(name="amplification"),
          where=PRIVACY),
    _rule("clipping", "map",
          "the clipping rule at max_grad_norm ('flat' or 'automatic'), " + _REQUEST.format(name="clipping"),
          where=PRIVACY),
    _rule("privacy_seed", "map",
          "the run's key, opake.random.key(privacy_seed), which draws the batches and the noise (the trainer's "
          "key= says the same; giving both is refused); without either, a key from the operating system",
          where=PRIVACY),
    _rule("noise_correction", "map",
          "not part of the privacy request: DPOptimizer steps AdamW with its second moment corrected for the "
          "noise (post-processing; the trainer's noise_correction= says the same, giving both is refused)",
          where=PRIVACY),
    # -- the privacy plan ------------------------------------------------------------------------
    _rule("per_device_train_batch_size", "map",
          "the plan's expected batch size is per_device_train_batch_size x gradient_accumulation_steps "
          "(make_private(batch_size=)); each planned batch, whose size varies, is trained in micro-batches "
          "of at most per_device_train_batch_size examples"),
    _rule("gradient_accumulation_steps", "map",
          "micro-batches of ONE planned batch before its one optimizer step (Trainer itself runs with 1): "
          "accumulating several planned batches would release them as one step the accountant did not price",
          lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    _rule("num_train_epochs", "map",
          "make_private(epochs=): the plan has epochs x (len(train_dataset) // batch size) steps, and the "
          "accountant prices each example's participation in every epoch (not read when max_steps > 0)",
          _whole_positive, "a whole number >= 1"),
    _rule("max_steps", "map",
          "> 0: the run's horizon in steps, as in Trainer (it overrides num_train_epochs): the plan has "
          "exactly max_steps steps (make_private(steps=)), the last epoch cut where they end, and the noise "
          "is calibrated to the budget for those steps; <= 0: num_train_epochs decides", _integer,
          "an integer"),
    _rule("max_grad_norm", "map",
          "the per-example clipping norm C (make_private(max_grad_norm=); with DPTrainer(clipping='automatic') "
          "the bound of automatic clipping); Trainer's own clipping of the "
          "summed .grad is turned off (it would clip the sum, not each example)", _positive_finite, "> 0"),
    _rule("train_sampling_strategy", "refuse",
          "the plan's sampler draws the batches (balls in bins or cyclic Poisson); a length-grouped or "
          "sequential order would replace the batches the accountant priced", lambda v: _plain(v) == "random",
          "'random' (replaced by the plan's sampler)"),
    _rule("length_column_name", "ignore", "used only by train_sampling_strategy='group_by_length', refused"),
    _rule("dataloader_drop_last", "refuse",
          "every planned batch is one priced step, even a small or empty one; dropping one changes the plan",
          lambda v: not v, "False"),
    _rule("data_seed", "refuse",
          "the batches are drawn by the privacy plan from key=; pass DPTrainer(key=opake.random.key(seed))",
          lambda v: v is None, "None"),
    _rule("auto_find_batch_size", "refuse",
          "halves the batch size after an out-of-memory error and restarts, after noise was already released "
          "for the planned size; lower per_device_train_batch_size (micro-batches) instead", lambda v: not v,
          "False"),
    _rule("ignore_data_skip", "ignore",
          "the planned loader itself continues at the next untaken step after a resume (DPTrainer runs Trainer "
          "with ignore_data_skip=True so that Trainer skips nothing)"),
    _rule("dataloader_num_workers", "map", "an option of the planned loader (a torch DataLoader)"),
    _rule("dataloader_pin_memory", "map", "an option of the planned loader"),
    _rule("dataloader_persistent_workers", "map", "an option of the planned loader"),
    _rule("dataloader_prefetch_factor", "map", "an option of the planned loader"),
    _rule("dataloader_multiprocessing_context", "map", "an option of the planned loader"),
    _rule("dataloader_in_order", "map", "an option of the planned loader"),
    _rule("remove_unused_columns", "map",
          "applied to the planned loader's collator (or dataset) as Trainer applies it to its own"),
    # -- the loss --------------------------------------------------------------------------------
    _rule("label_smoothing_factor", "refuse",
          "Trainer's LabelSmoother divides the summed loss by the number of valid tokens of the whole batch: "
          "one example's tokens would rescale every other example's gradient", lambda v: v == 0, "0"),
    _rule("average_tokens_across_devices", "ignore",
          "DPTrainer never passes num_items_in_batch (the loss is each example's own token mean, averaged "
          "over examples), so there is no token count to average"),
    _rule("neftune_noise_alpha", "refuse",
          "NEFTune's embedding noise is scaled by the batch's padded length, so one example's length changes "
          "the other examples' gradients", lambda v: v is None, "None"),
    _rule("use_liger_kernel", "refuse",
          "Liger replaces layers and the loss with fused kernels (its fused linear cross-entropy takes the "
          "batch-wide token mean) that have no per-example rule", lambda v: not v, "False"),
    _rule("liger_kernel_config", "ignore", "used only with use_liger_kernel, refused"),
    # -- precision and compilation ---------------------------------------------------------------
    _rule("bf16", "map",
          "autocast to bfloat16 (through accelerate); the per-example norms and clipped sums stay in float32"),
    _rule("fp16", "refuse",
          "fp16 needs a GradScaler, which multiplies the loss by a dynamic scale (the hooks would clip scaled "
          "gradients) and skips steps on overflow (a planned step not taken); use bf16=True",
          lambda v: not v, "False"),
    _rule("bf16_full_eval", "refuse",
          "casts the model's parameters to half precision in place when evaluate() runs outside train(); the "
          "noise state was built for their training dtype", lambda v: not v, "False"),
    _rule("fp16_full_eval", "refuse", "as bf16_full_eval", lambda v: not v, "False"),
    _rule("tf32", "pass", "a matmul precision setting; privacy does not depend on it"),
    _rule("torch_compile", "refuse",
          "not tested with the per-example hooks, which keep Python state between forward and backward; "
          "refused until it is", lambda v: not v, "False"),
    _rule("torch_compile_backend", "ignore", "used only with torch_compile (setting it turns that on: refused)"),
    _rule("torch_compile_mode", "ignore", "used only with torch_compile (setting it turns that on: refused)"),
    _rule("activation_checkpointing", "pass",
          "Trainer turns it on in train() (activation_checkpointing_enable, non-reentrant unless "
          "activation_checkpointing_kwargs says otherwise); the per-example hooks record each layer call of the "
          "forward once and recognize its recomputation in backward, so every example is still clipped on its "
          "own (tested: the trained parameters equal the run without it, bit for bit, GPT-2 and Llama, full and "
          "LoRA). Not combined with fsdp"),
    _rule("activation_checkpointing_kwargs", "refuse",
          "use_reentrant=True is accepted too: reentrant checkpointing recomputes the forward in backward, and "
          "DPTrainer runs backward right after each micro-batch's forward, so the recomputed calls belong to the "
          "one forward pass awaiting its gradients (tested bit for bit as above); other keys (context_fn, "
          "selective checkpointing) change what is recomputed in ways not tested with the per-example hooks",
          lambda v: not v or set(v) <= _CHECKPOINTING_KEYS,
          "None or a dict of " + ", ".join(sorted(_CHECKPOINTING_KEYS))),
    _rule("gradient_checkpointing", "pass",
          "the deprecated name of activation_checkpointing (TrainingArguments copies one into the other)"),
    _rule("gradient_checkpointing_kwargs", "ignore",
          "the deprecated name of activation_checkpointing_kwargs (TrainingArguments copies it there, where it is "
          "checked)"),
    # -- optimizer and schedule ------------------------------------------------------------------
    _rule("optim", "refuse",
          "any optimizer Trainer builds is wrapped by DPOptimizer, except those that update parameters inside "
          "backward, before the noised gradient exists (LOMO, AdaLomo, the layer-wise GaLore and APOLLO), and "
          "the schedule-free ones (they need optimizer.train()/eval(), which DPOptimizer does not forward)",
          lambda v: _plain(v) not in _REFUSED_OPTIMIZERS, "any other than " + ", ".join(sorted(_REFUSED_OPTIMIZERS))),
    _rule("optim_args", "pass", "options of the optimizer DPOptimizer wraps"),
    _rule("optim_target_modules", "pass", "options of the optimizer DPOptimizer wraps"),
    _rule("learning_rate", "pass", "the optimizer's; it updates the parameters after the noise (post-processing)"),
    _rule("lr_scheduler_type", "pass",
          "Trainer's schedule; with optim='sgd' it also shapes the BLT strategy (strategy_for_optimizer)"),
    _rule("lr_scheduler_kwargs", "pass", "as lr_scheduler_type"),
    _rule("warmup_steps", "pass", "as lr_scheduler_type"),
    _rule("weight_decay", "pass", "applied by the optimizer after the noise (post-processing)"),
    _rule("adam_beta1", "pass", "the optimizer's"),
    _rule("adam_beta2", "pass", "the optimizer's"),
    _rule("adam_epsilon", "pass", "the optimizer's"),
    # -- parallelism -----------------------------------------------------------------------------
    _rule("deepspeed", "refuse",
          "DeepSpeed shards and reduces gradients itself, outside the per-example hooks and the noise engine",
          lambda v: v is None, "None"),
    _rule("fsdp", "map",
          "DPTrainer shards the model itself with FSDP2's fully_shard (each layer of fsdp_config's "
          "transformer_layer_cls_to_wrap, or of the model's _no_split_modules, then the root) before planning, "
          "so make_private runs sharded: clipped sums reduce-scattered, each rank noising its shards; Trainer "
          "then leaves the model as it is (no second FSDP or DDP wrap)", where=FIELD),
    _rule("fsdp_config", "map",
          "transformer_layer_cls_to_wrap and reshard_after_forward are used; CPU offloading is refused (the "
          "noise and the clipped sums stay on the parameters' device)",
          lambda v: not (v or {}).get("cpu_offload") and not (v or {}).get("offload_params"),
          "no cpu_offload / offload_params"),
    _rule("parallelism_config", "refuse",
          "tensor, context and sequence parallelism split examples or layers across devices, outside the "
          "per-example hooks", lambda v: v is None, "None"),
    _rule("accelerator_config", "refuse",
          "its gradient_accumulation_kwargs would change the accumulation behind the plan; its data-loader "
          "settings do not apply (the planned loader is not prepared by accelerate)",
          lambda v: getattr(v, "gradient_accumulation_kwargs", None) is None,
          "gradient_accumulation_kwargs=None"),
    _rule("ddp_find_unused_parameters", "ignore", _DISTRIBUTED),
    _rule("ddp_bucket_cap_mb", "ignore", _DISTRIBUTED),
    _rule("ddp_broadcast_buffers", "ignore", _DISTRIBUTED),
    _rule("ddp_static_graph", "ignore", _DISTRIBUTED),
    _rule("ddp_backend", "ignore", _DISTRIBUTED),
    _rule("ddp_timeout", "ignore", _DISTRIBUTED),
    _rule("local_rank", "ignore", _DISTRIBUTED),
    _rule("n_gpu", "refuse",
          "more than one visible GPU makes Trainer wrap the model in nn.DataParallel, whose per-GPU replicas "
          "are not the hooked layers; make one GPU visible (CUDA_VISIBLE_DEVICES)", lambda v: v <= 1, "0 or 1",
          PROPERTY),
    _rule("world_size", "map",
          "under torchrun or accelerate launch the plan splits each planned batch across the ranks (make_private's "
          "replicated run: the clipped sums are all-reduced and the noise added once); the planned batch is "
          "per_device_train_batch_size x gradient_accumulation_steps x world_size; Trainer's DDP wrap is kept from "
          "synchronizing gradients (no_sync), so it never averages unclipped ones", where=PROPERTY),
    _rule("mixed_precision", "refuse",
          "set from fp16/bf16 or the ACCELERATE_MIXED_PRECISION environment variable; fp16 is refused (see "
          "fp16)", lambda v: _plain(v) in ("no", "bf16"), "'no' or 'bf16'", PROPERTY),
    _rule("use_cpu", "pass", "device choice"),
    _rule("torch_empty_cache_steps", "ignore", "DPTrainer's training_step (micro-batches) does not empty the "
          "device cache; harmless to privacy"),
    _rule("use_cache", "pass", "the model's key-value cache setting"),
    _rule("debug", "pass", "debugging aids"),
    _rule("skip_memory_metrics", "pass", "memory metrics"),
    # -- logging ---------------------------------------------------------------------------------
    _rule("logging_strategy", "pass", _LOGS),
    _rule("logging_steps", "pass", _LOGS),
    _rule("logging_first_step", "pass", _LOGS),
    _rule("log_on_each_node", "pass", _LOGS),
    _rule("logging_nan_inf_filter", "pass", _LOGS),
    _rule("include_num_input_tokens_seen", "pass", _LOGS),
    _rule("report_to", "pass", _LOGS),
    _rule("run_name", "pass", _LOGS),
    _rule("project", "pass", _LOGS),
    _rule("trackio_space_id", "pass", _LOGS),
    _rule("trackio_bucket_id", "pass", _LOGS),
    _rule("trackio_static_space_id", "pass", _LOGS),
    _rule("log_level", "pass", "verbosity"),
    _rule("log_level_replica", "pass", "verbosity"),
    _rule("disable_tqdm", "pass", "progress bars"),
    # -- evaluation ------------------------------------------------------------------------------
    _rule("eval_strategy", "pass", _EVAL),
    _rule("eval_steps", "pass", _EVAL),
    _rule("eval_delay", "pass", _EVAL),
    _rule("per_device_eval_batch_size", "pass", _EVAL),
    _rule("prediction_loss_only", "pass", _EVAL),
    _rule("eval_on_start", "pass", _EVAL),
    _rule("eval_do_concat_batches", "pass", _EVAL),
    _rule("eval_use_gather_object", "pass", _EVAL),
    _rule("eval_accumulation_steps", "pass", _EVAL),
    _rule("include_for_metrics", "pass", _EVAL),
    _rule("batch_eval_metrics", "pass", _EVAL),
    _rule("label_names", "pass", "which inputs are labels (evaluation)"),
    _rule("load_best_model_at_end", "pass",
          "chooses among saved (noised) models by an evaluation metric: post-processing when eval_dataset "
          "is not the private training data"),
    _rule("metric_for_best_model", "pass", "as load_best_model_at_end"),
    _rule("greater_is_better", "pass", "as load_best_model_at_end"),
    # -- checkpoints and the hub -----------------------------------------------------------------
    _rule("output_dir", "pass", "where checkpoints go; each holds the run's noise state (opake_private.pt)"),
    _rule("save_strategy", "pass", "every checkpoint also saves the noise state"),
    _rule("save_steps", "pass", "as save_strategy"),
    _rule("save_total_limit", "pass", "as save_strategy"),
    _rule("save_on_each_node", "pass", "as save_strategy"),
    _rule("save_only_model", "pass",
          "checkpoints then hold no optimizer or noise state and cannot be resumed (as in Trainer)"),
    _rule("enable_jit_checkpoint", "pass", "the SIGTERM checkpoint is the same save, noise state included"),
    _rule("restore_callback_states_from_checkpoint", "pass", "callback state"),
    _rule("resume_from_checkpoint", "pass",
          _SCRIPT + "; trainer.train(resume_from_checkpoint=...) resumes the run's last complete checkpoint by "
          "replaying its draws; any other checkpoint needs draws='replay' or fresh_key=k"),
    _rule("push_to_hub", "pass", "uploads the trained (noised) model; see hub_strategy"),
    _rule("hub_strategy", "refuse",
          "'checkpoint' and 'all_checkpoints' upload checkpoint folders, whose opake_private.pt holds the "
          "noise key and state: with them anyone can subtract the noise from the released model",
          lambda v: _plain(v) in ("every_save", "end"), "'every_save' or 'end'"),
    _rule("hub_token", "pass", "hub access"),
    _rule("hub_private_repo", "pass", "hub access"),
    _rule("hub_model_id", "pass", "hub access"),
    _rule("hub_always_push", "pass", "hub access"),
    _rule("hub_revision", "pass", "hub access"),
    # -- seeds and scripts -----------------------------------------------------------------------
    _rule("seed", "pass",
          "seeds torch (model initialization, dropout); the plan's batches and noise come from key= instead"),
    _rule("full_determinism", "pass", "deterministic kernels"),
    _rule("do_train", "pass", _SCRIPT),
    _rule("do_eval", "pass", _SCRIPT),
    _rule("do_predict", "pass", _SCRIPT),
    # -- the Trainer constructor -----------------------------------------------------------------
    _rule("train_dataset", "map",
          "make_private(dataset=): indexed by the plan's sampler; its length is treated as public (it fixes "
          "the bins)", _map_style, "a map-style dataset (len and indexing)", CONSTRUCTOR),
    _rule("data_collator", "map",
          "collates the planned batches; an empty planned batch is collated as one example's structure cut to "
          "zero rows", where=CONSTRUCTOR),
    _rule("model_init", "refuse",
          "Trainer would build a new model in train() (and in hyperparameter search), one make_private never "
          "hooked; pass model=", lambda v: v is None, "None", CONSTRUCTOR),
    _rule("compute_loss_func", "refuse",
          "it replaces the per-example loss opake installs, and its form cannot be checked (a mean over the "
          "batch's tokens lets one example rescale the others' gradients); see docs/transformers.md for "
          "per-example losses in a DPTrainer subclass", lambda v: v is None, "None", CONSTRUCTOR),
    _rule("optimizers", "pass",
          "an optimizer over the model's parameters (wrapped by DPOptimizer) and its scheduler, whose learning "
          "rates also shape the strategy for torch SGD", where=CONSTRUCTOR),
    _rule("optimizer_cls_and_kwargs", "pass", "the optimizer DPOptimizer wraps", where=CONSTRUCTOR),
    _rule("eval_dataset", "pass", _EVAL, where=CONSTRUCTOR),
    _rule("compute_metrics", "pass", _EVAL, where=CONSTRUCTOR),
    _rule("preprocess_logits_for_metrics", "pass", _EVAL, where=CONSTRUCTOR),
    _rule("callbacks", "pass", "called as in Trainer; they see logs (see logging)", where=CONSTRUCTOR),
    _rule("processing_class", "pass", "the tokenizer, saved with the model", where=CONSTRUCTOR),
)

def _by_name(rules) -> dict:
    by_name = {rule.name: rule for rule in rules}
    if len(by_name) != len(rules):  # pragma: no cover - a table edit that repeats a row
        raise InvalidStateError("an argument table names a field twice")
    return by_name


_BY_NAME = _by_name(ARGUMENT_RULES)
CONSTRUCTOR_ARGUMENTS = tuple(rule.name for rule in ARGUMENT_RULES if rule.where == CONSTRUCTOR)


def is_property_rule(rule: ArgumentRule) -> bool:
    """Whether ``rule`` is about a derived property of the arguments (``n_gpu``, ``world_size``)."""
    return rule.where.startswith(PROPERTY)


def is_constructor_rule(rule: ArgumentRule) -> bool:
    """Whether ``rule`` is about an argument of a trainer's constructor (``"... argument"``), not a
    field or property of its TrainingArguments (or of a TRL config)."""
    return rule.where.endswith(" argument")


def rule_for(name: str) -> ArgumentRule:
    """The table's row for ``name``."""
    return _BY_NAME[name]


def _violations(values: dict, by_name: dict, wanted) -> list[str]:
    """The refusals of ``values`` (name -> value) by the rows of ``by_name`` that ``wanted(rule)``."""
    problems = []
    for name, value in values.items():
        rule = by_name.get(name)
        if rule is None or not wanted(rule):
            continue
        try:
            accepted = bool(rule.accepts(value))
        except TypeError:
            accepted = False
        if not accepted:
            shown = f"{value!r}" if len(repr(value)) < 80 else type(value).__name__
            problems.append(f"{rule.where} {name}={shown}: accepted {rule.accepted}, because {rule.reason}")
    return problems


def _combinations(args, fsdp=None, activation_checkpointing=None) -> list[str]:
    """Refusals of two fields together, which the one-field rows cannot state."""
    fsdp = args.fsdp if fsdp is None else fsdp
    activation_checkpointing = args.activation_checkpointing if activation_checkpointing is None \
        else activation_checkpointing
    if fsdp and activation_checkpointing:
        return ["TrainingArguments fsdp with activation_checkpointing=True: FSDP2's unsharding around recomputed "
                "layers has not been tested with the per-example hooks; train sharded without activation "
                "checkpointing, or checkpoint in one process"]
    if fsdp and _plain(getattr(args, "save_strategy", "no")) != "no" and not getattr(args, "save_only_model", False):
        return ["TrainingArguments fsdp with save_strategy=" + repr(_plain(args.save_strategy)) + " and "
                "save_only_model=False: Trainer cannot checkpoint the optimizer state of a model DPTrainer shards "
                "itself (transformers refuses such a run); pass save_only_model=True: DPTrainer then writes the "
                "whole model and, per rank, its shards of the model and optimizer state, its part of the noise "
                "state and the scheduler's state, and the run resumes from them (or save_strategy='no')"]
    return []


def check_arguments(args, constructor: dict | None = None, *, rules=ARGUMENT_RULES) -> None:
    """Raise ``UnsupportedTrainingArgumentError`` naming every value DPTrainer cannot honour.

    ``args`` is a ``TrainingArguments`` (or a subclass: a TRL config); ``constructor`` the trainer
    constructor's arguments by name (those the table has rows for); ``rules`` the table
    (``ARGUMENT_RULES``, plus a TRL config's rows for a TRL trainer). A field the table does not
    know (from a transformers or TRL newer than this table) is refused unless it has its default value.
    """
    by_name = _by_name(rules)
    fields = {field.name: field for field in dataclasses.fields(args)}
    values = {name: getattr(args, name) for name in fields}
    problems = _violations(values, by_name, lambda rule: not is_property_rule(rule) and not is_constructor_rule(rule))
    properties = {rule.name: getattr(args, rule.name) for rule in rules if is_property_rule(rule)}
    problems += _violations(properties, by_name, is_property_rule)
    problems += _violations(constructor or {}, by_name, is_constructor_rule)
    problems += _combinations(args)
    defaults = _default_arguments(type(args))
    kind = type(args).__name__
    for name in fields:
        if name not in by_name and fields[name].init and getattr(args, name) != getattr(defaults, name, None):
            problems.append(
                f"{kind} {name}={getattr(args, name)!r}: opake does not know this field (a transformers or TRL "
                f"newer than opake's table), so it accepts only its default {getattr(defaults, name, None)!r}"
            )
    if problems:
        raise UnsupportedTrainingArgumentError(
            "DPTrainer cannot honour these arguments privately:\n  - " + "\n  - ".join(problems)
            + "\n(the full table: opake.transformers.arguments_table(), docs/transformers.md)"
        )


def _flag(environ, name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


# accelerate's sharding strategies (by name or number) -> FSDP2's reshard_after_forward; the
# others (NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2) are not a dim-0 split on one mesh.
_RESHARD_BY_STRATEGY = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False,
                        "TRUE": True, "FALSE": False}


def with_launcher_settings(args, environ=None):
    """``args`` with the parallelism ``accelerate launch`` put in the environment made explicit.

    ``accelerate launch --use_fsdp`` (or a config file with FSDP) leaves ``TrainingArguments.fsdp``
    empty and sets ``ACCELERATE_USE_FSDP`` and ``FSDP_*`` variables, which the Accelerator that
    Trainer builds reads to wrap the model after DPTrainer has planned (on GPUs; on CPU accelerate
    ignores them). Returned as ``fsdp`` / ``fsdp_config``, they go through the same rows as
    ``TrainingArguments(fsdp=...)``: DPTrainer shards the model itself, a TRL trainer refuses.
    ``ACCELERATE_USE_DEEPSPEED`` (from which TrainingArguments builds a DeepSpeed plugin) is refused
    for the deepspeed row's reason. One process needs no sharding: the variables are left to the caller.
    """
    environ = os.environ if environ is None else environ
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED") or getattr(args, "deepspeed_plugin", None) is not None:
        raise UnsupportedTrainingArgumentError(
            f"accelerate launch with DeepSpeed (ACCELERATE_USE_DEEPSPEED): refused because "
            f"{rule_for('deepspeed').reason}; launch with torchrun, or with accelerate launch without DeepSpeed "
            f"(FSDP is supported: --use_fsdp)")
    if args.fsdp or not _flag(environ, "ACCELERATE_USE_FSDP") or args.world_size == 1:
        return args
    strategy = environ.get("FSDP_RESHARD_AFTER_FORWARD") or environ.get("FSDP_SHARDING_STRATEGY") or "FULL_SHARD"
    if strategy.strip().upper() not in _RESHARD_BY_STRATEGY:
        raise UnsupportedTrainingArgumentError(
            f"accelerate launch with FSDP sharding {strategy!r}: DPTrainer shards with FSDP2's fully_shard on one "
            f"mesh (FULL_SHARD or SHARD_GRAD_OP); hybrid sharding and NO_SHARD are not supported: choose one of "
            f"those, or launch without FSDP (replicated)")
    config = {"reshard_after_forward": _RESHARD_BY_STRATEGY[strategy.strip().upper()]}
    if _flag(environ, "FSDP_OFFLOAD_PARAMS"):
        config["cpu_offload"] = True  # refused by the fsdp_config row, with its reason
    if environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        config["transformer_layer_cls_to_wrap"] = [name.strip() for name in
                                                   environ["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",") if name.strip()]
    if _flag(environ, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise UnsupportedTrainingArgumentError(_combinations(args, fsdp=True, activation_checkpointing=True)[0])
    return dataclasses.replace(args, fsdp="full_shard", fsdp_config=config)


_DEFAULTS: dict = {}


def _default_arguments(cls):
    """A default instance of ``cls`` (post-processed as TrainingArguments does), built once. bf16 is
    given (False): TRL's configs default it to True, which TrainingArguments refuses on a machine
    without bfloat16, and the table's own bf16 row decides it anyway."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = cls(output_dir="opake_default_arguments", bf16=False)
    return _DEFAULTS[cls]


def arguments_table(rules=ARGUMENT_RULES) -> str:
    """The table as Markdown (docs/transformers.md carries exactly this text)."""
    lines = ["| argument | where | treatment | accepted | reason |", "|---|---|---|---|---|"]
    for rule in rules:
        reason = rule.reason.replace("|", "\\|")
        lines.append(f"| `{rule.name}` | {rule.where} | {rule.treatment} | {rule.accepted} | {reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m opake.transformers.arguments > the table for the docs
    print(arguments_table(), end="")
