"""opake.torch.DPLSTM / DPGRU / DPRNN: nn.LSTM's interface with per-example gradients opake forms exactly.

References: torch's own fused nn.LSTM / nn.GRU / nn.RNN (the outputs, with the weights copied by
``from_module``), and a loop of batch-size-1 backward passes (the clipped per-example sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from opake.random import key
from opake.torch import DPGRU, DPLSTM, DPRNN, fix_model, make_private
from opake.torch.per_example import PerExampleClipper
from opake.torch.recurrent import UnsupportedRecurrentInputError, from_module

TORCH_LAYERS = [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {"nonlinearity": "relu"}), (nn.RNN, {})]


@pytest.mark.parametrize("kind, extra", TORCH_LAYERS, ids=["LSTM", "GRU", "RNN-relu", "RNN-tanh"])
@pytest.mark.parametrize("batch_first, bidirectional", [(True, True), (False, False)])
def test_the_same_outputs_as_torchs_fused_layer(kind, extra, batch_first, bidirectional):
    torch.manual_seed(0)
    fused = kind(5, 4, num_layers=2, batch_first=batch_first, bidirectional=bidirectional, **extra).double()
    ours = from_module(fused)
    x = torch.randn(3, 6, 5, dtype=torch.float64)
    expected, expected_state = fused(x)
    got, got_state = ours(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for a, b in zip(expected_state if isinstance(expected_state, tuple) else (expected_state,),
                    got_state if isinstance(got_state, tuple) else (got_state,)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    unbatched = torch.randn(6, 5, dtype=torch.float64)
    torch.testing.assert_close(ours(unbatched)[0], fused(unbatched)[0], rtol=0, atol=1e-12)


class Classifier(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.embedding, self.rnn, self.head = nn.Embedding(20, 5), layer, nn.Linear(8, 3)

    def forward(self, tokens):
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", [DPLSTM, DPGRU, DPRNN])
def test_clipped_per_example_gradients_equal_a_loop_of_single_examples(kind):
    torch.manual_seed(0)
    model = Classifier(kind(5, 4, num_layers=2, batch_first=True, bidirectional=True)).double()
    tokens, labels = torch.randint(0, 20, (6, 7)), torch.randint(0, 3, (6,))
    clip = 0.05
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    norms = []
    for i in range(6):
        model.zero_grad()
        F.cross_entropy(model(tokens[i:i + 1]), labels[i:i + 1]).backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        norms.append(norm.item())
        for name, p in model.named_parameters():
            expected[name] += min(1.0, clip / norm.item()) * p.grad
    assert min(norms) > clip                        # every example is clipped: the norms matter
    model.zero_grad()
    clipper = PerExampleClipper(model, max_grad_norm=clip, loss_reduction="sum")
    F.cross_entropy(model(tokens), labels, reduction="sum").backward()
    got = clipper.clipped_sum()
    clipper.remove()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12)


def test_make_private_trains_a_fixed_lstm_model_and_refuses_the_fused_one():
    torch.manual_seed(0)
    fused = Classifier(nn.LSTM(5, 4, batch_first=True, bidirectional=True))
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 20, (64, 7)), torch.randint(0, 3, (64,)))
    with pytest.raises(ValueError, match=r"rnn \(LSTM\): a recurrent layer"):
        make_private(module=fused, optimizer=torch.optim.SGD(fused.parameters(), lr=0.1), dataset=dataset,
                     batch_size=16, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0, key=key(0))
    model = fix_model(fused)
    assert isinstance(model.rnn, DPLSTM)
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                           batch_size=16, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                           key=key(0))
    for tokens, labels in private.data_loader:       # the first step checks the hooks saw every use
        private.optimizer.zero_grad()
        if len(labels):
            F.cross_entropy(model(tokens), labels).backward()
        private.optimizer.step()
    assert private.steps_taken == 4


def test_unsupported_inputs_are_refused_with_the_fix():
    layer = DPLSTM(5, 4, batch_first=True)
    packed = pack_padded_sequence(torch.randn(2, 3, 5), [3, 2], batch_first=True)
    with pytest.raises(UnsupportedRecurrentInputError, match=r"pad the batch"):
        layer(packed)
    with pytest.raises(UnsupportedRecurrentInputError, match=r"proj_size=2.*nn.Linear"):
        DPLSTM(5, 4, proj_size=2)


class _SequenceFirstTagger(nn.Module):
    """(T, B) tokens -> (B, 2): an Embedding and a DPLSTM with batch_first=False, a Linear on h_n."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(12, 5)
        self.rnn = kind(5, 6, num_layers=2, batch_first=False)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens):
        _, state = self.rnn(self.emb(tokens))
        hidden = state[0] if isinstance(state, tuple) else state
        return self.head(hidden[-1])


@pytest.mark.parametrize("kind", [DPLSTM, DPGRU, DPRNN])
def test_batch_first_false_in_opacus_make_private_clips_each_sequence(kind):
    import warnings

    from opake.torch import PrivacyEngine

    tokens = torch.randint(0, 12, (32, 7), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(1))
    collate = (lambda rows: (torch.stack([r[0] for r in rows]).transpose(0, 1), torch.stack([r[1] for r in rows])))
    model = _SequenceFirstTagger(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=8,
                                                    collate_fn=collate),
            max_grad_norm=0.05, batch_first=False, poisson_sampling=False)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain = _SequenceFirstTagger(kind)                       # the same weights, no hooks
    own = [torch.autograd.grad(F.cross_entropy(plain(x[:, i:i + 1]), y[i:i + 1]), list(plain.parameters()))
           for i in range(x.shape[1])]
    norms = [torch.sqrt(sum(g.square().sum() for g in grads)) for grads in own]
    for index, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad_sample, torch.stack([grads[index] for grads in own]), rtol=1e-4, atol=1e-6)
        clipped = sum(min(1.0, 0.05 / float(n)) * grads[index] for n, grads in zip(norms, own))
        torch.testing.assert_close(p.summed_grad, clipped, rtol=1e-4, atol=1e-7)
