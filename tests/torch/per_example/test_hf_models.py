"""PerExampleClipper on tiny Hugging Face models (built from configs, nothing downloaded).

Every model is compared with a loop of batch-size-1 backward passes (tests/torch_hf_support.py):
each example's gradient clipped by hand and summed. Inputs are padded on the right with attention
masks and labels -100 on the pads; the loss is the sum over examples of each example's own mean
token loss, computed from the logits (``outputs.loss`` would divide by the batch's token count,
which is not a per-example loss).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from opake.torch.per_example import FallbackWarning, PerExampleClipper  # noqa: E402
from opake.torch.per_example.rules import embedding as embedding_rules  # noqa: E402
from opake.torch.per_example.rules import functional as functional_rules  # noqa: E402
from opake.torch.per_example.rules import linear as linear_rules  # noqa: E402
from opake.torch.per_example.rules import normalization as normalization_rules  # noqa: E402
from opake.torch.per_example.rules import registered_rule  # noqa: E402
from tests.torch_hf_support import largest_relative_error, loop_reference  # noqa: E402
from tests.torch_per_example_support import check_against_reference  # noqa: E402

transformers.logging.set_verbosity_error()

# transformers 5 renames gradient checkpointing to activation checkpointing; peft and these tests
# still call the old names, which is what users do.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

F64 = torch.float64
BATCH, LENGTH, VOCABULARY = 4, 9, 97
AUTOCAST = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCABULARY, (BATCH, LENGTH), generator=generator)
    lengths = torch.tensor([LENGTH, LENGTH - 3, 5, LENGTH - 1])
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _token_mean_losses(logits, labels):
    """(B,) each example's mean next-token loss over its own labelled tokens."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.dtype != F64:
        logits = logits.float()  # bfloat16 logits: the loss in float32, as training code does
    losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return losses.sum(dim=1) / (labels != -100).sum(dim=1)


def _language_model_loss(model, context=contextlib.nullcontext, seed=0):
    ids, mask, labels = _inputs(seed)

    def loss(part):
        with context():
            logits = model(ids[part], attention_mask=mask[part]).logits
        return _token_mean_losses(logits, labels[part]).sum()

    return loss


def _gpt2(**overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides,
    )
    return transformers.GPT2LMHeadModel(config).train()


def _llama(tie=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config).train()
    with torch.no_grad():  # RMSNorm weights start at one; make their gradient depend on them
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.normal_(1.0, 0.5)
    return model


def _lora_gpt2():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(_gpt2().to(F64), config)
    with torch.no_grad():  # lora_B starts at zero, which would zero lora_A's gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    return model.train()


def _clip(model, loss, max_grad_norm, *, coverage=False):
    clipper = PerExampleClipper(model, max_grad_norm=max_grad_norm, loss_reduction="sum")
    clipper.track_coverage(coverage)
    model.zero_grad(set_to_none=True)
    loss(slice(None)).backward()
    sums = clipper.clipped_sum()
    if coverage:
        clipper.check_coverage()
    result = (sums, clipper.examples, clipper.clipped_examples)
    clipper.remove()
    return result


def _against_loop(model, loss, *, truth=None, truth_loss=None, rtol=1e-8, coverage=True):
    """Clip with the clipper, compare with the loop reference; C between the 2nd and 3rd norm."""
    truth, truth_loss = (model, loss) if truth is None else (truth, truth_loss)
    _, norms = loop_reference(truth, truth_loss, BATCH, math.inf)
    ordered = sorted(norms)
    assert ordered[1] < ordered[2]
    bound = 0.5 * (ordered[1] + ordered[2])
    expected, _ = loop_reference(truth, truth_loss, BATCH, bound)
    sums, examples, clipped = _clip(model, loss, bound, coverage=coverage)
    assert examples == BATCH
    assert clipped == sum(norm > bound for norm in norms) == 2
    assert largest_relative_error(sums, expected) < rtol
    return sums


def _no_fallback(model):
    """Building a clipper raises if any layer would take the torch.func fallback."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        clipper = PerExampleClipper(model, 1.0)
    rules = {type(layer.module).__name__: type(layer.rule).__name__ for layer in clipper._plan.layers}
    clipper.remove()
    return rules


# Full fine-tuning in float64 ------------------------------------------------------------------


def test_gpt2_full_fine_tuning_with_tied_embeddings():
    model = _gpt2().to(F64)
    assert model.lm_head.weight is model.transformer.wte.weight
    sums = _against_loop(model, _language_model_loss(model))
    assert "lm_head.weight" not in sums and "transformer.wpe.weight" in sums


def test_tied_embeddings_form_no_vocabulary_sized_per_example_gradients():
    # The tied table's norm is the two layers' ghost norms and their cross term (rules/tied.py):
    # neither the token Embedding nor the head forms B x vocab x dim per-example gradients.
    model = _gpt2().to(F64)
    formed = []
    embedding_grads = embedding_rules.EmbeddingRule.per_example_grads
    linear_grads = linear_rules.LinearRule.per_example_grads

    def spy(original):
        def record(self, module, stored, grads, names, dtype):
            formed.append(module)
            return original(self, module, stored, grads, names, dtype)
        return record

    with (
        mock.patch.object(embedding_rules.EmbeddingRule, "per_example_grads", spy(embedding_grads)),
        mock.patch.object(linear_rules.LinearRule, "per_example_grads", spy(linear_grads)),
    ):
        _against_loop(model, _language_model_loss(model))
    # At T = 9 the 32 x 32 position table has ghost norms too: 16 x 32^2 > 9^2 x 33 (rules/embedding.py).
    assert model.transformer.wpe not in formed
    assert model.transformer.wte not in formed and model.lm_head not in formed


def test_bert_sequence_classification():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config).to(F64).train()
    ids, mask, _ = _inputs()
    labels = torch.tensor([0, 2, 1, 2])

    def loss(part):
        logits = model(ids[part], attention_mask=mask[part]).logits
        return F.cross_entropy(logits, labels[part], reduction="none").sum()

    _against_loop(model, loss)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_with_rotary_embeddings_and_grouped_query_attention(tie):
    model = _llama(tie).to(F64)
    _against_loop(model, _language_model_loss(model))


def test_closed_form_rules_take_the_hugging_face_layers():
    gpt2_rules = _no_fallback(_gpt2())
    assert gpt2_rules["Conv1D"] == "Conv1DRule"
    llama_rules = _no_fallback(_llama())
    assert llama_rules["LlamaRMSNorm"] == "LlamaRMSNormRule"


def test_gpt2_projections_take_the_ghost_route_at_short_lengths():
    # At T = 9 every Conv1D weight's Gram matrices are cheaper than its gradient (9 x (32 + 96)
    # < 32 x 96, ...): the rule forms per-example gradients of biases only, and the fallback's
    # replay never runs.
    model = _gpt2().to(F64)
    formed = []
    per_example_grads = linear_rules.Conv1DRule.per_example_grads

    def spy(self, module, stored, grads, names, dtype):
        formed.extend(names)
        return per_example_grads(self, module, stored, grads, names, dtype)

    with (
        mock.patch.object(functional_rules.FunctionalRule, "per_example_grads", side_effect=AssertionError),
        mock.patch.object(linear_rules.Conv1DRule, "per_example_grads", spy),
    ):
        _clip(model, _language_model_loss(model), 1.0)
    assert formed and set(formed) == {"bias"}


# LoRA -----------------------------------------------------------------------------------------


def test_gpt2_lora_adapters_get_per_example_gradients_and_frozen_weights_nothing():
    model = _lora_gpt2()
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    sums = _against_loop(model, _language_model_loss(model))
    assert set(sums) == trainable
    clipper = PerExampleClipper(model, 1.0)
    hooked = {layer.path for layer in clipper._plan.layers}
    assert all(".lora_A." in path or ".lora_B." in path for path in hooked) and len(hooked) == 4
    attention = model.base_model.model.transformer.h[0].attn.c_attn
    assert type(attention.base_layer).__name__ == "Conv1D" and not attention.base_layer._forward_hooks
    clipper.remove()
    assert all(param.grad is None for param in model.parameters() if not param.requires_grad)


# Mixed precision ------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_bfloat16_autocast(build):
    # float32 weights, bfloat16 matrix products: against the loop reference run under the same
    # autocast; both round in bfloat16, differently (measured largest error 2e-3 GPT-2, 6e-3 Llama).
    model = build()
    sums = _against_loop(model, _language_model_loss(model, AUTOCAST), rtol=3e-2)
    assert all(t.dtype == torch.float32 for t in sums.values())


def test_bfloat16_weights_pass_the_coverage_check():
    # The first step's check (DPOptimizer calls check_coverage() with its default tolerance)
    # compares a bfloat16 .grad with float32 sums: rounding alone must not raise.
    model = _gpt2().to(torch.bfloat16)
    sums, examples, _ = _clip(model, _language_model_loss(model), 1.0, coverage=True)
    assert examples == BATCH and all(t.dtype == torch.float32 for t in sums.values())


# Gradient checkpointing -----------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("build", [lambda: _gpt2().to(F64), _lora_gpt2], ids=["full", "lora"])
def test_gradient_checkpointing(build, reentrant):
    truth = build()
    model = copy.deepcopy(truth)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    projection = next(module for name, module in model.named_modules() if name.endswith("h.0.attn.c_attn"))
    calls = []
    projection.register_forward_hook(lambda *args: calls.append(1))
    _against_loop(model, _language_model_loss(model), truth=truth, truth_loss=_language_model_loss(truth))
    assert len(calls) == 2  # the forward, and its recomputation in backward (the reference runs on truth)


# The registered class names -------------------------------------------------------------------


@pytest.mark.parametrize("name", normalization_rules.LLAMA_RMS_NORM_CLASSES)
def test_registered_rms_norm_classes_match_the_oracle(name):
    module_name, _, class_name = name.rpartition(".")
    module = pytest.importorskip(module_name)
    layer_type = getattr(module, class_name)
    assert registered_rule(layer_type) is normalization_rules.LLAMA_RMS_NORM
    torch.manual_seed(0)
    norm = layer_type(6, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    model = nn.Sequential(nn.Linear(6, 6), norm, nn.Tanh()).to(F64)
    inputs = torch.randn(5, 3, 6, dtype=F64)
    # These forwards normalize in float32 even in a float64 model, and the oracle's vmapped
    # forward rounds differently from the batched one: agreement to float32 rounding. (The
    # Llama model above agrees to 1e-8: its loop reference rounds as the batch does.)
    check_against_reference(model, inputs, torch.randn(5, 3, 6, dtype=F64), rtol=1e-5)


@pytest.mark.parametrize("length", [None, 2, 7])
def test_conv1d_matches_the_oracle(length):
    # length 7: T^2 = 49 >= 3 x 5, the materialized branch of the Linear rule, transposed.
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(5, 3), nn.Tanh()).to(F64)
    inputs = torch.randn((4, 3) if length is None else (4, length, 3), dtype=F64)
    check_against_reference(model, inputs, torch.randn(inputs.shape[:-1] + (5,), dtype=F64))


def test_conv1d_called_twice_materializes_transposed_gradients():
    from transformers.pytorch_utils import Conv1D

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Conv1D(4, 4)

        def forward(self, x):
            return self.layer(torch.tanh(self.layer(x)))

    torch.manual_seed(0)
    model = Twice().to(F64)
    inputs = torch.randn(5, 3, 4, dtype=F64)
    check_against_reference(model, inputs, torch.randn(5, 3, 4, dtype=F64))


def test_a_subclass_of_a_registered_class_takes_the_fallback():
    from transformers.pytorch_utils import Conv1D

    class Scaled(Conv1D):
        def forward(self, x):
            return 2.0 * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(3, 4), nn.Tanh()).to(F64)
    with pytest.warns(FallbackWarning, match=r"Scaled at '0'.*replayed per example"):
        clipper = PerExampleClipper(model, 1.0)
    assert clipper._plan.layers[0].rule is functional_rules.RULE
    clipper.remove()
    inputs = torch.randn(4, 2, 4, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        check_against_reference(model, inputs, torch.randn(4, 2, 3, dtype=F64))
