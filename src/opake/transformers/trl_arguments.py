"""What ``DPSFTTrainer`` and ``DPDPOTrainer`` do with every field TRL's configs add: a second table.

``SFTConfig`` and ``DPOConfig`` are ``TrainingArguments`` with more fields. Their
TrainingArguments fields follow the first table (``opake.transformers.arguments``); the rows here
cover the fields TRL adds, the TRL trainers' own constructor arguments, and the few
TrainingArguments rows a preference trainer must decide differently (they replace the first
table's row of the same name). Same form, same treatments (pass, map, ignore, refuse), same
check: ``check_arguments(config, ..., rules=SFT_ARGUMENT_RULES)`` refuses every value a row does
not accept, and a field neither table knows (a newer TRL) unless it has its default.

This module reads no TRL code: the rows are data, so that the table (and its copy in
docs/transformers.md, which a test keeps identical) exists without TRL installed.
"""

from __future__ import annotations

from opake.transformers.arguments import ARGUMENT_RULES, FIELD, PROPERTY, ArgumentRule, _rule, arguments_table
from opake.transformers.preference import PAIRWISE_LOSSES

__all__ = ["DPO_ARGUMENT_RULES", "DPO_ROWS", "SFT_ARGUMENT_RULES", "SFT_ROWS", "trl_arguments_table"]

SFT_CONFIG, DPO_CONFIG = "SFTConfig", "DPOConfig"
SFT_CONSTRUCTOR, DPO_CONSTRUCTOR = "DPSFTTrainer argument", "DPDPOTrainer argument"
DPO_FIELD, DPO_PROPERTY = f"{FIELD} (DPDPOTrainer)", f"{PROPERTY} (DPDPOTrainer)"



def _none_or_zero(value) -> bool:
    return value is None or value == 0


def _pairwise(value) -> bool:
    types = [value] if isinstance(value, str) else list(value)
    return bool(types) and all(loss_type in PAIRWISE_LOSSES for loss_type in types)


def _preference_collator(value) -> bool:
    return value is None or any(cls.__name__ == "DataCollatorForPreference" for cls in type(value).__mro__)


_MODEL = "how a model named by a string is loaded; make_private then checks and hooks the loaded model as any other"
_PREPARE = "how each example is turned into tokens, one example at a time (before the plan draws any batch)"
_MOE = ("a Mixture-of-Experts load-balancing loss averages the router's statistics over every token of the batch, "
        "so one example changes the others' gradients; the trainer also refuses a model whose config turns it on "
        "(set router_aux_loss_coef=0.0)")
_OFFLOAD = ("moves the tensors autograd saves to the CPU through saved-tensor hooks, around the per-example hooks' "
            "own references to the layers' inputs; not tested with them, refused until it is")
_PADDING_FREE = ("flattens every example of a batch into one row (positions restarting per example): the "
                 "per-example hooks would see one row, and no example could be clipped on its own")
_TOKENIZER = "a tokenizer setting"

SFT_ROWS: tuple[ArgumentRule, ...] = (
    _rule("model_init_kwargs", "pass", _MODEL, where=SFT_CONFIG),
    _rule("trust_remote_code", "pass", _MODEL, where=SFT_CONFIG),
    _rule("router_aux_loss_coef", "refuse", _MOE, _none_or_zero, "None or 0", SFT_CONFIG),
    _rule("chat_template_path", "pass", _PREPARE, where=SFT_CONFIG),
    _rule("dataset_text_field", "pass", _PREPARE, where=SFT_CONFIG),
    _rule("dataset_kwargs", "pass",
          "skip_prepare_dataset uses the rows as given: each row must then be one example with its labels "
          "(-100 where it is not trained on)", where=SFT_CONFIG),
    _rule("dataset_num_proc", "pass", _PREPARE, where=SFT_CONFIG),
    _rule("eos_token", "pass", _PREPARE, where=SFT_CONFIG),
    _rule("max_length", "pass", "each example is truncated on its own", where=SFT_CONFIG),
    _rule("truncation_mode", "pass", "each example is truncated on its own", where=SFT_CONFIG),
    _rule("shuffle_dataset", "pass",
          "reorders the rows once before training; the plan's sampler draws the batches from the rows whatever "
          "their order", where=SFT_CONFIG),
    _rule("packing", "refuse",
          "packing puts several examples in one row (and 'bfd_split' or 'wrapped' one example across rows): the "
          "plan samples rows, so one row's clipped gradient would hold several examples, and one example could "
          "reach several rows; which examples share a row is decided over the whole data set (best-fit "
          "decreasing by length, or one concatenated stream), so adding one example re-packs others. Clipping "
          "each example inside a packed row would need gradients per segment of a row, which the per-example "
          "hooks do not form; pack nothing, and keep max_length for memory", lambda v: not v, "False",
          SFT_CONFIG),
    _rule("packing_strategy", "ignore", "used only with packing, refused", where=SFT_CONFIG),
    _rule("padding_free", "refuse", _PADDING_FREE, lambda v: not v, "False", SFT_CONFIG),
    _rule("pad_to_multiple_of", "pass",
          "padded positions have attention mask 0 and label -100: no example's token mean changes", where=SFT_CONFIG),
    _rule("eval_packing", "pass", "evaluation only: it runs without gradients and never steps the plan",
          where=SFT_CONFIG),
    _rule("completion_only_loss", "map",
          "the prompt's labels are -100, so each example's loss is the mean over its own completion tokens "
          "(opake's per-example token mean), never over the batch's tokens", where=SFT_CONFIG),
    _rule("assistant_only_loss", "map",
          "as completion_only_loss: each example's mean over its own assistant tokens", where=SFT_CONFIG),
    _rule("loss_type", "refuse",
          "the trained loss is each example's token-mean negative log-likelihood (installed by make_private, "
          "formed from the model's logits); DFT's probability-weighted form is not formed per example",
          lambda v: v == "nll", "'nll'", SFT_CONFIG),
    _rule("activation_offloading", "refuse", _OFFLOAD, lambda v: not v, "False", SFT_CONFIG),
    _rule("pad_token", "pass", _TOKENIZER, where=SFT_CONFIG),
    _rule("peft_config", "map",
          "TRL wraps the model with the adapters before make_private, so only the adapters are trainable, clipped "
          "and noised (the frozen base gets no hooks)", where=SFT_CONSTRUCTOR),
    _rule("formatting_func", "pass", "formats each example on its own", where=SFT_CONSTRUCTOR),
    _rule("quantization_config", "pass",
          "loads a model named by a string quantized and frozen; the trainable adapters are checked and hooked "
          "by make_private", where=SFT_CONSTRUCTOR),
)

DPO_ROWS: tuple[ArgumentRule, ...] = (
    _rule("model_init_kwargs", "pass", _MODEL, where=DPO_CONFIG),
    _rule("trust_remote_code", "pass", _MODEL, where=DPO_CONFIG),
    _rule("router_aux_loss_coef", "refuse", _MOE, _none_or_zero, "None or 0", DPO_CONFIG),
    _rule("disable_dropout", "pass", "dropout draws per-example masks either way", where=DPO_CONFIG),
    _rule("dataset_num_proc", "pass", _PREPARE, where=DPO_CONFIG),
    _rule("max_length", "pass",
          "each pair's sequences are truncated on their own; a pair whose prompt alone fills max_length is "
          "dropped by TRL before planning (a per-pair decision)", where=DPO_CONFIG),
    _rule("truncation_mode", "pass", "as max_length", where=DPO_CONFIG),
    _rule("padding_free", "refuse", _PADDING_FREE, lambda v: not v, "False", DPO_CONFIG),
    _rule("pad_to_multiple_of", "pass",
          "padded positions have attention mask 0 and are no completion tokens: no pair's loss changes",
          where=DPO_CONFIG),
    _rule("precompute_ref_log_probs", "pass",
          "each pair's reference log-probabilities, computed once by the frozen reference model before make_private "
          "hooks the policy: a per-pair input, like the tokens", where=DPO_CONFIG),
    _rule("precompute_ref_batch_size", "pass", "as precompute_ref_log_probs", where=DPO_CONFIG),
    _rule("loss_type", "refuse",
          "opake forms these per pair from the policy's logits (opake.transformers.preference); 'aot' and "
          "'aot_unpaired' sort the batch's pairs (one pair's loss depends on the others') and 'sft' averages over "
          "all chosen tokens of the batch", _pairwise, "a list of " + ", ".join(repr(t) for t in PAIRWISE_LOSSES),
          DPO_CONFIG),
    _rule("loss_weights", "pass", "weights of the per-pair loss terms", where=DPO_CONFIG),
    _rule("ld_alpha", "map", "LD-DPO's weight of a pair's tokens beyond its shorter completion: within the pair",
          where=DPO_CONFIG),
    _rule("f_divergence_type", "map", "a function of each pair's own log-ratios", where=DPO_CONFIG),
    _rule("f_alpha_divergence_coef", "map", "as f_divergence_type", where=DPO_CONFIG),
    _rule("label_smoothing", "map", "a constant of the per-pair robust and EXO losses", where=DPO_CONFIG),
    _rule("beta", "map", "a constant of the per-pair losses", where=DPO_CONFIG),
    _rule("use_weighting", "map",
          "WPO weighs each pair by its own (detached) length-normalized probabilities: within the pair",
          where=DPO_CONFIG),
    _rule("discopop_tau", "map", "a constant of the per-pair DiscoPOP loss", where=DPO_CONFIG),
    _rule("activation_offloading", "refuse", _OFFLOAD, lambda v: not v, "False", DPO_CONFIG),
    _rule("sync_ref_model", "pass",
          "TR-DPO mixes the reference model with the trained policy after optimizer steps: a function of released "
          "(noised) models", where=DPO_CONFIG),
    _rule("ref_model_mixup_alpha", "pass", "as sync_ref_model", where=DPO_CONFIG),
    _rule("ref_model_sync_steps", "pass", "as sync_ref_model", where=DPO_CONFIG),
    _rule("pad_token", "pass", _TOKENIZER, where=DPO_CONFIG),
    _rule("ref_model", "map",
          "the frozen reference model: run under torch.no_grad() and never hooked, so it is neither clipped nor "
          "counted (with PEFT and no ref_model, the policy with its adapters disabled, also without gradients)",
          where=DPO_CONSTRUCTOR),
    _rule("peft_config", "map",
          "TRL wraps the model with the adapters before make_private: only the adapters are clipped and noised",
          where=DPO_CONSTRUCTOR),
    _rule("quantization_config", "pass",
          "loads a model named by a string quantized and frozen; the trainable adapters are hooked by make_private",
          where=DPO_CONSTRUCTOR),
    # Rows that replace the first table's for a preference trainer.
    _rule("data_collator", "refuse",
          "DPDPOTrainer clips a pair's two rows together by their place in TRL's layout (all chosen rows, then "
          "the rejected rows in the same order); another collator's layout would pair the wrong rows",
          _preference_collator, "None or a trl DataCollatorForPreference", DPO_CONSTRUCTOR),
    _rule("privacy_unit", "refuse",
          "each preference pair is one privacy unit; several pairs of one user clipped together (user-level DPO) "
          "is not supported yet", lambda v: v is None, "None", DPO_CONSTRUCTOR),
    _rule("fsdp", "refuse",
          "a sharded run's placeholder rows are single rows, not pairs; not supported for preference pairs",
          lambda v: not v, "'' (off)", DPO_FIELD),
    _rule("world_size", "refuse",
          "one process only: the pairs' micro-batches across ranks are not tested", lambda v: v == 1, "1",
          DPO_PROPERTY),
)


def _with_rows(base: tuple[ArgumentRule, ...], rows: tuple[ArgumentRule, ...]) -> tuple[ArgumentRule, ...]:
    """``base`` with each row of ``rows`` replacing the row of the same name, the others appended."""
    replacing = {rule.name: rule for rule in rows}
    kept = tuple(replacing.pop(rule.name, rule) for rule in base)
    return kept + tuple(rule for rule in rows if rule.name in replacing)


SFT_ARGUMENT_RULES = _with_rows(ARGUMENT_RULES, SFT_ROWS)
DPO_ARGUMENT_RULES = _with_rows(ARGUMENT_RULES, DPO_ROWS)


def trl_arguments_table() -> str:
    """The second table as Markdown: the SFT rows, then the DPO rows (docs/transformers.md, "TRL")."""
    return arguments_table(SFT_ROWS + DPO_ROWS)


if __name__ == "__main__":  # python -m opake.transformers.trl_arguments > the table for the docs
    print(trl_arguments_table(), end="")
