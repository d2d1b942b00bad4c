"""Per-example losses: one added example moves the released clipped sum by at most C.

On a real Hugging Face causal LM with padding (labels = -100 on pads), the model's own loss is
the mean over all valid tokens of the batch, so one added example rescales every other
example's gradient; the per-example token mean that make_private installs does not. The
negative control (the model's own loss) must move the clipped sum by more than C.
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import opake.random  # noqa: E402
from opake.torch import make_private  # noqa: E402
from opake.torch.losses import PerExampleLoss, UnsupportedLossError, loss_form, token_mean_per_example  # noqa: E402
from opake.torch.per_example import PerExampleClipper  # noqa: E402

VOCAB, LENGTH = 31, 12


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def _batch(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), LENGTH), generator=generator)
    mask = torch.zeros(len(lengths), LENGTH, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "position_ids": torch.arange(LENGTH).expand(len(lengths), LENGTH)}


def _clipped_sum(model, batch, max_grad_norm, per_example_loss):
    clipper = PerExampleClipper(model, max_grad_norm=max_grad_norm, loss_reduction="mean")
    hooks = PerExampleLoss(model, "mean") if per_example_loss else None
    try:
        model.zero_grad()
        model(**batch).loss.backward()
        sums = clipper.clipped_sum()
    finally:
        clipper.remove()
        if hooks is not None:
            hooks.remove()
    return torch.cat([s.reshape(-1) for s in sums.values()])


def test_token_mean_per_example_against_a_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 5, (3, 6), generator=generator)
    labels[0, 3:] = -100
    labels[2, 1:] = -100                        # after the shift: no valid token at all
    got = token_mean_per_example(logits, labels)
    for row in range(3):
        terms = [F.cross_entropy(logits[row, t], labels[row, t + 1], reduction="sum")
                 for t in range(5) if labels[row, t + 1] != -100]
        expected = torch.stack(terms).mean() if terms else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(got[row], expected, rtol=1e-12, atol=1e-14)  # float64 logits: float64 losses


def test_installed_loss_is_the_mean_of_per_example_token_means_and_ignores_num_items():
    model = _gpt2()
    batch = _batch([12, 5, 8])
    reference = token_mean_per_example(model(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                       batch["labels"]).mean()
    hooks = PerExampleLoss(model, "mean")
    try:
        assert "GPT2LMHeadModel" in loss_form(model, "mean")
        loss = model(**batch, num_items_in_batch=torch.tensor(3)).loss
    finally:
        hooks.remove()
    torch.testing.assert_close(loss, reference)
    own = model(**batch).loss                   # the model's own batch-wide token mean differs
    assert abs(float(own) - float(reference)) > 1e-3


@pytest.mark.parametrize("per_example_loss", [True, False])
def test_adding_one_example_moves_the_clipped_sum_by_at_most_C(per_example_loss):
    # C above every per-example norm, so that nothing is clipped: a rescaled gradient then shows.
    max_grad_norm = 4.0
    lengths = [3, 4, 3, 4, 3, 4]
    model = _gpt2()
    without = _clipped_sum(model, _batch(lengths), max_grad_norm, per_example_loss)
    added = _batch(lengths + [LENGTH], seed=1)        # the same six examples and one long one
    with_one = _clipped_sum(model, added, max_grad_norm, per_example_loss)
    assert torch.equal(_batch(lengths)["input_ids"], added["input_ids"][:6])
    moved = float((with_one - without).norm())
    if per_example_loss:
        assert moved <= max_grad_norm * (1 + 1e-9)
    else:
        assert moved > 1.1 * max_grad_norm          # the hole the per-example loss closes


def test_an_unknown_head_with_labels_is_refused():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=LENGTH)
    model = transformers.GPT2DoubleHeadsModel(config)
    hooks = PerExampleLoss(model, "mean")
    try:
        with pytest.raises(UnsupportedLossError, match=r"GPT2DoubleHeadsModel was called with labels=.*per-example"):
            model(input_ids=torch.randint(0, VOCAB, (2, 1, 5)), labels=torch.randint(0, VOCAB, (2, 1, 5)))
    finally:
        hooks.remove()


def test_sequence_classification_loss_is_per_example():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=LENGTH, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(1, VOCAB, (4, 6))
    labels = torch.tensor([0, 2, -100, 1])            # an ignored example contributes 0, not a rescaling
    hooks = PerExampleLoss(model, "mean")
    try:
        loss = model(input_ids=ids, labels=labels).loss
    finally:
        hooks.remove()
    logits = model(input_ids=ids).logits
    per_example = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss, per_example.mean())


def test_a_forward_that_raised_leaves_no_labels_behind():
    """An empty batch makes GPT-2's forward raise after the labels were taken out of the call; they
    are taken back on the failure path, so generate() and the next forward work."""
    model = _gpt2()
    data = [_batch([5])["input_ids"][0] for _ in range(8)]
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=data,
                           batch_size=8, epochs=1, max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-5,
                           key=opake.random.key(0))
    hooks = private._loss_hooks
    empty = torch.zeros((0, LENGTH), dtype=torch.long)
    with pytest.raises(RuntimeError):
        model(input_ids=empty, labels=empty)
    assert hooks._pending == {}
    prompt = torch.tensor([[1, 2, 3]])
    generated = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 6)
    for batch in private.data_loader:  # the next training step is the plan's, as if nothing had failed
        private.optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        private.optimizer.step()
    assert private.steps_taken == 1
    # negative control: the stale entry a failed forward used to leave makes the next call fail
    hooks._pending[id(model)] = empty
    with pytest.raises(ValueError, match="expected logits"):
        model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    private.detach()


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_float64_models_keep_float64_clipped_sums(build):
    """make_private's per-example loss on a float64 model: clipped sums equal a loop of batch-size-1
    backward passes to 1e-12 (a loss formed in float32 agrees only to about 1e-8)."""
    from tests.torch_hf_support import largest_relative_error, loop_reference

    torch.manual_seed(0)
    if build == "gpt2":
        model = _gpt2()
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=LENGTH)
        model = transformers.LlamaForCausalLM(config).double()
    batch = _batch([12, 5, 8, 3])
    model_inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}

    def own_loss(rows):  # each example's own token mean, in float64
        return token_mean_per_example(model(**{k: v[rows] for k, v in model_inputs.items()}).logits,
                                      batch["labels"][rows]).sum()

    expected, norms = loop_reference(model, own_loss, 4, max_grad_norm=0.5)
    assert min(norms) > 0.5  # every example clipped: the factors' precision matters too
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           dataset=list(range(4)), batch_size=4, epochs=1, max_grad_norm=0.5, noise_multiplier=1.0,
                           target_delta=1e-5, key=opake.random.key(0))
    model(**model_inputs, labels=batch["labels"]).loss.backward()
    sums = private.optimizer.clipper.clipped_sum()
    assert all(value.dtype == torch.float64 for value in sums.values())
    assert largest_relative_error(sums, expected) < 1e-12
    # negative control: the same loss formed from float32 logits (what the installed loss did)
    private.optimizer.zero_grad()
    logits = model(**model_inputs).logits
    token_mean_per_example(logits.float(), batch["labels"]).mean().backward()
    assert largest_relative_error(private.optimizer.clipper.clipped_sum(), expected) > 1e-10
    private.detach()
