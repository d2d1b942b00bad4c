"""PerExampleClipper against the torch.func oracle, layer family by layer family, then models."""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opake.dpftrl.clipping import NonFiniteGradientError
from opake.torch.per_example import (
    BatchDimensionError,
    ClipperUsageError,
    FallbackWarning,
    PerExampleClipper,
    UnsupportedModuleError,
)
from opake.torch.per_example import bookkeeping
from opake.torch.per_example.rules import conv as conv_rules
from opake.torch.per_example.rules import embedding as embedding_rules
from opake.torch.per_example.rules import linear as linear_rules
from opake.torch.per_example.rules import tied as tied_rules
from tests.torch_per_example_support import (
    assert_sums_close,
    check_against_reference,
    clipper_sums,
    reference,
    squared_error,
)

F64 = torch.float64


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _targets_like(model, inputs, seed=1):
    with torch.no_grad():
        shape = model(inputs).shape
    return torch.randn(shape, generator=_seeded(seed), dtype=inputs.dtype if inputs.is_floating_point() else F64)


# Layer families ------------------------------------------------------------------------------


@given(
    batch=st.integers(1, 5),
    length=st.sampled_from([None, 1, 2, 7]),
    width_in=st.integers(1, 4),
    width_out=st.integers(1, 4),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_linear_matches_reference(batch, length, width_in, width_out, bias, reduction):
    # length None/1: the outer-product norms; 2 and 7 take the ghost or the direct route by widths.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width_in, width_out, bias=bias), nn.Tanh()).to(F64)
    shape = (batch, width_in) if length is None else (batch, length, width_in)
    inputs = torch.randn(shape, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs), loss_reduction=reduction)


@pytest.mark.parametrize("route", ["ghost", "direct"])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 5, 2), (1, 6, 2, 3), (4, 2, 3, 3), (3, 4, 2, 9)])
def test_linear_routes_match_reference(shape, route, kept):
    # Each route forced on every shape, its per-example gradients kept for the sum pass or not,
    # with chunks of one example.
    batch, length, width_in, width_out = shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width_in, width_out), nn.Tanh()).to(F64)
    inputs = torch.randn(batch, length, width_in, dtype=F64)
    with (
        mock.patch.object(linear_rules, "_weight_route", lambda stored, grad: route),
        mock.patch.object(linear_rules, "example_chunks",
                          lambda count, size: (slice(i, i + 1) for i in range(count))),
        mock.patch.object(linear_rules.LinearRule, "materialized",
                          lambda self, module, stored, grads, names: names if kept else ()),
    ):
        check_against_reference(model, inputs, _targets_like(model, inputs))


@pytest.mark.parametrize(("width_in", "width_out", "transposed"), [(2, 9, True), (2, 8, True), (16, 64, True), (3, 11, False), (9, 2, False), (17, 80, False)])
def test_narrow_input_weight_gradients_are_a_transposed_view_with_the_loop_values(width_in, width_out, transposed):
    # in <= 16 and <= out / 4 (LoRA's B): formed as A^T G and returned transposed; norms and sums read it
    # in storage order, and its values are the per-example products of a loop.
    torch.manual_seed(0)
    rows_a, rows_g = torch.randn(3, 5, width_in, dtype=F64), torch.randn(3, 5, width_out, dtype=F64)
    grads = linear_rules.RULE._weight_grads(rows_a, rows_g)
    assert grads.shape == (3, width_out, width_in) and grads.is_contiguous() is not transposed
    loop = torch.stack([rows_g[i].t() @ rows_a[i] for i in range(3)])
    torch.testing.assert_close(grads, loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bookkeeping.squared_frobenius(grads), (loop**2).sum(dim=(1, 2)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("length", "width_in", "width_out", "route", "kept"),
    [
        (1, 64, 64, "outer", False),
        # norms alone: ghost when T (in + out) < in * out; kept for both passes when
        # T^2 (in + out) >= 16 in * out (KEPT_COST, rules/linear.py)
        (32, 32, 96, "direct", True),  # 32 x 128 >= 3072; 1024 x 128 >= 16 x 3072
        (9, 32, 96, "ghost", False),  # 9 x 128 < 3072; 81 x 128 < 16 x 3072
        (64, 128, 512, "ghost", True),  # GPT-2 c_fc at T = 64: 64 x 640 < 65536; 4096 x 640 >= 16 x 65536
        (16, 768, 768, "ghost", False),  # 16 x 1536 < 768^2; 256 x 1536 < 16 x 768^2
        (128, 768, 768, "ghost", True),  # 128 x 1536 < 768^2; 16384 x 1536 >= 16 x 768^2
        (2, 2, 2, "direct", False),  # 2 x 4 >= 4; 4 x 4 < 16 x 4
        (1024, 768, 3072, "direct", True),  # 1024 x 3840 >= 768 x 3072
    ],
)
def test_linear_route_is_chosen_by_multiply_adds(length, width_in, width_out, route, kept):
    stored, grad = torch.zeros(2, length, width_in), torch.zeros(2, length, width_out)
    assert linear_rules._weight_route(stored, grad) == route
    offered = linear_rules.RULE.materialized(None, stored, [grad], ("weight", "bias"))
    assert offered == (("bias", "weight") if kept else ("bias",))


@given(
    spatial=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same", "valid"]),
    padding_mode=st.sampled_from(["zeros", "reflect", "circular"]),
    size=st.integers(5, 7),
    bias=st.booleans(),
)
@pytest.mark.slow   # 50 convolutions of every padding, stride and dilation kind
def test_conv_matches_reference(spatial, groups, stride, dilation, padding, padding_mode, size, bias):
    if padding == "same":
        stride = 1  # torch refuses "same" with strides
    torch.manual_seed(0)
    conv_type = nn.Conv1d if spatial == 1 else nn.Conv2d
    conv = conv_type(2 * groups, 2 * groups, 3, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=bias, padding_mode=padding_mode)
    model = nn.Sequential(conv, nn.Tanh()).to(F64)
    inputs = torch.randn((3, 2 * groups) + (size,) * spatial, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


def test_conv_ghost_branch_is_taken_and_matches():
    # 2x2 output positions against 8 x 8*9 weights: L^2 = 16 < 576, the Gram-matrix route.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, stride=3), nn.Flatten(), nn.Linear(32, 2)).to(F64)
    inputs = torch.randn(4, 8, 6, 6, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


# The three routes to a convolution weight's norms, and the materialized path, each forced on
# every configuration (the route chosen by shape is checked separately below).
_CONV_CASES = [
    # (spatial, in, out, kernel, layer keywords, input size, batch)
    (2, 3, 4, 3, {}, 6, 3),
    (2, 3, 4, 3, {"stride": 2, "padding": 1}, 7, 2),
    (2, 2, 4, 3, {"dilation": 2, "padding": 2, "bias": False}, 7, 3),
    (2, 4, 6, 3, {"groups": 2, "stride": (2, 1), "padding": (1, 0)}, 6, 2),
    (2, 4, 4, 3, {"groups": 4, "padding": "same"}, 5, 3),  # depthwise
    (2, 2, 3, (2, 3), {"padding": 1, "padding_mode": "reflect", "dilation": (1, 2)}, 6, 2),
    (2, 3, 5, 1, {"stride": 2}, 5, 3),  # 1x1: the patches are a view of the input
    (2, 1, 8, 5, {"padding": 2}, 8, 1),  # a first layer, batch 1
    (2, 2, 2, 3, {"padding": "same", "padding_mode": "circular"}, 5, 1),
    (1, 3, 4, 3, {"stride": 2, "padding": 1, "dilation": 2}, 9, 3),
    (1, 4, 4, 2, {"groups": 2, "padding": "same", "padding_mode": "replicate"}, 7, 2),
]


@pytest.mark.parametrize("route", ["ghost", "unfold", "grouped"])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("case", _CONV_CASES)
def test_conv_routes_match_reference(case, route, kept):
    spatial, channels_in, channels_out, kernel, keywords, size, batch = case
    torch.manual_seed(0)
    conv_type = nn.Conv1d if spatial == 1 else nn.Conv2d
    model = nn.Sequential(conv_type(channels_in, channels_out, kernel, **keywords), nn.Tanh()).to(F64)
    inputs = torch.randn((batch, channels_in) + (size,) * spatial, dtype=F64)
    targets = _targets_like(model, inputs)
    rule = conv_rules.RULE
    with (
        mock.patch.object(conv_rules, "_weight_route", lambda module, grad: route),
        mock.patch.object(conv_rules, "CHUNK_ELEMENTS", 1 if batch > 2 else conv_rules.CHUNK_ELEMENTS),
        mock.patch.object(type(rule), "materialized", lambda self, module, stored, grads, names: names if kept else ()),
    ):
        norms = check_against_reference(model, inputs, targets)
        # float32 to float32 rounding against the float64 truth
        check_against_reference(copy.deepcopy(model).float(), inputs.float(), targets.float(), rtol=1e-5,
                                max_grad_norm=float(norms.median()) * 0.5, truth=model)


@pytest.mark.parametrize("route", ["ghost", "unfold", "grouped"])
def test_conv_routes_on_a_channels_last_input(route):
    # The patches are a strided view built from the input's own strides, whatever its layout.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh()).to(F64)
    inputs = torch.randn(3, 3, 7, 7, dtype=F64).contiguous(memory_format=torch.channels_last)
    with (
        mock.patch.object(conv_rules, "_weight_route", lambda module, grad: route),
        mock.patch.object(conv_rules.ConvRule, "materialized", lambda self, module, stored, grads, names: ()),
    ):
        check_against_reference(model, inputs, _targets_like(model, inputs))


@pytest.mark.parametrize(
    ("layer", "shape", "route"),
    [
        (nn.Conv2d(1, 16, 5, padding=2), (28, 28), "unfold"),  # the CNN
        (nn.Conv2d(16, 32, 5, padding=2), (14, 14), "grouped"),
        (nn.Conv2d(64, 64, 3, padding=1), (32, 32), "grouped"),
        (nn.Conv2d(128, 128, 3, padding=1), (16, 16), "grouped"),
        (nn.Conv2d(64, 64, 3, padding=1, groups=64), (32, 32), "grouped"),
        (nn.Conv2d(64, 128, 1), (16, 16), "unfold"),
        (nn.Conv2d(256, 256, 3, padding=1), (8, 8), "ghost"),
        (nn.Conv1d(64, 64, 5, padding=2), (256,), "grouped"),
    ],
)
def test_conv_route_is_chosen_from_the_shapes(layer, shape, route):
    # What the cost model in rules/conv.py picks (its docstring has the measurements); a weight
    # is offered for keeping unless its route is ghost, a bias always.
    with torch.no_grad():
        grad = layer(torch.zeros((2, layer.in_channels) + shape))
    assert conv_rules._weight_route(layer, grad) == route
    offered = conv_rules.RULE.materialized(layer, None, [grad], ("weight", "bias"))
    assert offered == (("bias",) if route == "ghost" else ("weight", "bias"))


def test_kept_layers_release_their_tensors_and_return_them_to_the_budget():
    # The hooks hold B x (8 + 4 + 3) x 16 output gradients: the budget. The first layer keeps its
    # B x 80 gradients and drops its stored input and output gradients (B x (16 + 128)), which
    # returns them to the budget, so the second layer's B x 292 fit too, and then the third's; the
    # sums still equal the oracle's.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 1),
    ).to(F64)
    inputs = torch.randn(3, 1, 4, 4, dtype=F64)
    kept, released = [], []
    per_example_grads = conv_rules.ConvRule.per_example_grads
    release = bookkeeping.release

    def spy(self, module, stored, grads, names, dtype):
        kept.append((module.in_channels, tuple(names)))
        return per_example_grads(self, module, stored, grads, names, dtype)

    def spy_release(call):
        released.append(call.layer.module.in_channels)
        release(call)
        assert call.stored is None and all(grad is None for grad in call.grads)

    with mock.patch.object(conv_rules.ConvRule, "per_example_grads", spy), \
            mock.patch.object(bookkeeping, "release", spy_release):
        check_against_reference(model, inputs, _targets_like(model, inputs))
    assert sorted(kept) == [(1, ("weight", "bias")), (4, ("weight", "bias")), (8, ("weight", "bias"))]
    assert sorted(released) == [1, 4, 8]


def test_kept_gradients_stay_within_the_budget():
    # Every parameter offered. The hooks hold B x (32 + 64) output gradients; the first layer keeps
    # its B x 4 and releases B x (16 + 32), leaving B x 140: the second layer's weight (B x 200)
    # does not fit, its bias does, and the weight goes through its ghost norms and a weighted
    # convolution backward; the sums still equal the oracle's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.Tanh(), nn.Conv2d(2, 4, 5, padding=2)).to(F64)
    inputs = torch.randn(3, 1, 4, 4, dtype=F64)
    kept = []
    per_example_grads = conv_rules.ConvRule.per_example_grads

    def spy(self, module, stored, grads, names, dtype):
        kept.append((module.in_channels, tuple(names)))
        return per_example_grads(self, module, stored, grads, names, dtype)

    with mock.patch.object(conv_rules.ConvRule, "per_example_grads", spy), \
            mock.patch.object(conv_rules.ConvRule, "materialized", lambda self, module, stored, grads, names: names):
        check_against_reference(model, inputs, _targets_like(model, inputs))
    assert sorted(kept) == [(1, ("weight", "bias")), (2, ("bias",))]


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 0, 3])
@pytest.mark.parametrize("token_shape", [(), (6,), (2, 3)])
def test_embedding_with_repeated_and_padding_tokens(padding_idx, token_shape, kept):
    # Both routes: ghost norms with the index_add sum, and the per-example tables kept.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, padding_idx=padding_idx), nn.Tanh()).to(F64)
    tokens = torch.randint(0, 5, (4, *token_shape), generator=_seeded(2))  # vocab 5: repeats
    tokens.view(-1)[::4] = 0 if padding_idx is None else padding_idx
    with mock.patch.object(embedding_rules.EmbeddingRule, "materialized",
                           lambda self, module, stored, grads, names: tuple(names) if kept else ()):
        check_against_reference(model, tokens, _targets_like(model, tokens))


@pytest.mark.parametrize(
    ("table", "length", "offered"),
    [
        ((32, 32), 32, True),  # 16 x 1024 <= 32^2 x 33
        ((128, 128), 64, True),  # tiny GPT-2's positions: 16 x 16384 <= 64^2 x 129
        ((2048, 128), 64, False),  # tiny Llama's tokens: 16 x 262144 > 64^2 x 129
        ((50257, 768), 128, False),
        ((5, 3), 8, True),  # 16 x 15 <= 64 x 4
        ((5, 3), 6, False),  # 16 x 15 > 36 x 4
        ((5, 3), 1, False),
    ],
)
def test_embedding_small_tables_are_formed_per_example(table, length, offered):
    # 16 vocab x dim (KEPT_COST per element kept) against T^2 (dim + 1): GPT-2's position table
    # at its length, not its tokens.
    layer = nn.Embedding(*table, device="meta")
    tokens = torch.zeros(2, length, dtype=torch.long)
    assert embedding_rules.RULE.materialized(layer, tokens, [None], ("weight",)) == (("weight",) if offered else ())


@pytest.mark.parametrize("normalized_shape", [(4,), (3, 4)])
def test_layer_norm(normalized_shape):
    torch.manual_seed(0)
    norm = nn.LayerNorm(normalized_shape)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    model = nn.Sequential(norm, nn.Tanh()).to(F64)
    inputs = torch.randn(5, 2, 3, 4, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


@pytest.mark.parametrize("spatial", [(5,), (3, 4)])
def test_group_norm(spatial):
    torch.manual_seed(0)
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.Tanh()).to(F64)
    with torch.no_grad():
        model[0].weight.normal_()
    inputs = torch.randn(5, 4, *spatial, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


def test_fallback_prelu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.PReLU(3), nn.Flatten(), nn.Linear(12, 2)).to(F64)
    with torch.no_grad():
        model[1].weight.uniform_(-1, 1)
    inputs = torch.randn(5, 2, 4, 4, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


class _CellLoop(nn.Module):
    """An LSTMCell called at every time step: two outputs, h computed inside the layer from c."""

    def __init__(self, steps: int):
        super().__init__()
        self.cell, self.head, self.steps = nn.LSTMCell(3, 4), nn.Linear(4, 2), steps

    def forward(self, x):
        state = (x.new_zeros(x.shape[0], 4), x.new_zeros(x.shape[0], 4))
        for t in range(self.steps):
            state = self.cell(x[:, t], state)
        return self.head(state[0])


@pytest.mark.parametrize("steps", [1, 3])
def test_fallback_layer_whose_output_feeds_its_other_output(steps):
    """A hook on LSTMCell's c also sees the gradient that reaches c through the cell's own h; the
    replay must get only the gradient from outside (negative control: that total as cotangent
    doubles the c path: the clipped sum of one call was 2x autograd's, silently)."""
    torch.manual_seed(0)
    model = _CellLoop(steps).to(F64)
    inputs = torch.randn(5, steps, 3, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        check_against_reference(model, inputs, _targets_like(model, inputs))
        check_against_reference(model, inputs, _targets_like(model, inputs), max_grad_norm=1e9)


class _Attention(nn.Module):
    def __init__(self, causal_mask: bool, padding_mask: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.causal_mask = causal_mask
        self.padding_mask = padding_mask

    def forward(self, x):
        length = x.shape[1]
        attn_mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if self.causal_mask else None
        padding = (x[..., 0] > 1.0) if self.padding_mask else None
        if padding is not None:
            padding[:, 0] = False  # every query keeps one key
        output, _ = self.attention(x, x, x, key_padding_mask=padding, attn_mask=attn_mask)
        return output


@pytest.mark.parametrize("causal_mask,padding_mask", [(False, False), (True, False), (True, True)])
def test_fallback_multihead_attention(causal_mask, padding_mask):
    torch.manual_seed(0)
    model = _Attention(causal_mask, padding_mask).to(F64)
    inputs = torch.randn(4, 5, 4, dtype=F64)  # batch 4 == not the sequence length 5
    check_against_reference(model, inputs, _targets_like(model, inputs))


@pytest.mark.parametrize("normalized_shape,eps", [((4,), None), ((3, 4), 1e-5)])
def test_rms_norm(normalized_shape, eps):
    torch.manual_seed(0)
    norm = nn.RMSNorm(normalized_shape, eps=eps)
    with torch.no_grad():
        norm.weight.normal_()
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Tanh()).to(F64)
    inputs = torch.randn(5, 2, 3, 4, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


# Models --------------------------------------------------------------------------------------


def _small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 3),
    )


def _cross_entropy(output, target):
    return F.cross_entropy(output, target, reduction="none")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_small_cnn_float64(reduction):
    torch.manual_seed(0)
    model = _small_cnn().to(F64)
    inputs = torch.randn(6, 1, 10, 10, dtype=F64)
    labels = torch.randint(0, 3, (6,), generator=_seeded(3))
    check_against_reference(model, inputs, labels, loss=_cross_entropy, loss_reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_small_cnn_float32_against_float64_truth(reduction):
    torch.manual_seed(0)
    model = _small_cnn()
    inputs = torch.randn(6, 1, 10, 10)
    labels = torch.randint(0, 3, (6,), generator=_seeded(3))
    check_against_reference(model, inputs, labels, loss=_cross_entropy, loss_reduction=reduction,
                            rtol=1e-5, truth=copy.deepcopy(model).to(F64))


class _TinyTransformer(nn.Module):
    """Token and position embeddings, causal attention from Linear layers, an MLP, a head."""

    def __init__(self, vocabulary=7, width=8, length=5, tie=False, shared_positions=False):
        super().__init__()
        self.shared_positions = shared_positions  # positions of shape (1, T), as Hugging Face models pass
        self.tokens = nn.Embedding(vocabulary, width, padding_idx=0)
        self.positions = nn.Embedding(length, width)
        self.norm1 = nn.LayerNorm(width)
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.project = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, vocabulary, bias=False)
        if tie:
            self.head.weight = self.tokens.weight

    def forward(self, tokens):
        length = tokens.shape[1]
        if self.shared_positions:
            h = self.tokens(tokens) + self.positions(torch.arange(length)[None])
        else:
            h = self.tokens(tokens) + self.positions(torch.arange(length)).unsqueeze(0)
        x = self.norm1(h)
        scores = self.query(x) @ self.key(x).transpose(1, 2) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(length, length, dtype=torch.bool), 1), float("-inf"))
        h = h + self.project(scores.softmax(-1) @ self.value(x))
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


def _next_token_loss(logits, tokens):
    return F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none").sum(dim=1)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiny_transformer(tie, reduction):
    torch.manual_seed(0)
    model = _TinyTransformer(tie=tie).to(F64)
    tokens = torch.randint(0, 7, (4, 5), generator=_seeded(4))
    # The positions embedding is called with a batch of one; the clipper refuses it (see below),
    # so freeze it here and test the rest.
    model.positions.weight.requires_grad_(False)
    check_against_reference(model, tokens, tokens, loss=_next_token_loss, loss_reduction=reduction)


def test_positions_embedding_without_batch_dimension_is_refused():
    model = _TinyTransformer().to(F64)
    clipper = PerExampleClipper(model, 1.0)
    tokens = torch.randint(0, 7, (4, 5))
    with pytest.raises(BatchDimensionError, match=r"'positions'.*leading dimension of 5.*batch size 4.*shape \(1, T\)"):
        _next_token_loss(model(tokens), tokens).mean().backward()
    clipper.remove()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_shared_position_indices_are_expanded_to_the_batch(tie, reduction):
    # Positions of shape (1, T), broadcast against the tokens: the Embedding's input is expanded
    # to the batch, so its output gradient is per example and the positions weight is clipped too.
    torch.manual_seed(0)
    model = _TinyTransformer(tie=tie, shared_positions=True).to(F64)
    tokens = torch.randint(0, 7, (4, 5), generator=_seeded(4))
    check_against_reference(model, tokens, tokens, loss=_next_token_loss, loss_reduction=reduction)


def test_a_batch_of_one_through_another_layer_is_refused_with_the_fix():
    class SharedBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(1, 5, 3))
            self.project = nn.Linear(3, 3)
            self.head = nn.Linear(3, 1)

        def forward(self, x):
            return self.head(x + self.project(self.table))  # (1, 5, 3) broadcast against (B, 5, 3)

    model = SharedBias()
    PerExampleClipper(model, 1.0)
    with pytest.raises(BatchDimensionError, match=r"'project' was called on a batch of one.*x\.expand\(4, "):
        model(torch.randn(4, 5, 3)).sum().backward()


def test_tied_weights_are_one_parameter_with_summed_contributions():
    torch.manual_seed(0)
    model = _TinyTransformer(tie=True).to(F64)
    model.positions.weight.requires_grad_(False)
    clipper = PerExampleClipper(model, 1.0)
    tokens = torch.randint(0, 7, (4, 5), generator=_seeded(4))
    _next_token_loss(model(tokens), tokens).mean().backward()
    sums = clipper.clipped_sum()
    clipper.remove()
    # One Parameter, one entry, under its first name; its gradient sums both layers' parts.
    assert "tokens.weight" in sums and "head.weight" not in sums
    expected, _, _ = reference(model, _next_token_loss, tokens, tokens, 1.0)
    assert_sums_close(sums, expected, 1e-10)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_tied_table_per_example_gradients_match_a_loop(padding_idx):
    # rules/tied.py per_example_grads against autograd's gradient of the shared table, one example
    # at a time: embedding (padding_idx kept out), a tanh, then the head multiplying by the table.
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 3, padding_idx=padding_idx).to(F64)
    head = nn.Linear(3, 7, bias=False).to(F64)
    head.weight = embedding.weight
    tokens = torch.randint(0, 7, (4, 5), generator=_seeded(5))
    tokens[0, :3] = 2  # a repeated token (the padding index where there is one)

    def loss_of(looked_up):
        hidden = torch.tanh(looked_up)
        logits = head(hidden)
        return hidden, logits, (logits.sin() * torch.arange(1.0, 8.0, dtype=F64)).sum()

    looked_up = embedding(tokens)
    hidden, logits, loss = loss_of(looked_up)
    grad_embedding, grad_logits = torch.autograd.grad(loss, (looked_up, logits))
    formed = tied_rules.per_example_grads(
        embedding, tokens, [grad_embedding], hidden.detach(), [grad_logits], F64
    )
    for i in range(tokens.shape[0]):
        expected, = torch.autograd.grad(loss_of(embedding(tokens[i : i + 1]))[2], embedding.weight)
        torch.testing.assert_close(formed[i], expected, rtol=1e-12, atol=1e-12)


def test_tied_table_is_kept_by_the_heads_cost_model():
    # tiny GPT-2's head at T = 64: 64^2 x (128 + 2048) >= 16 x 128 x 2048; not at T = 8.
    stored, grad = torch.zeros(2, 64, 128), torch.zeros(2, 64, 2048)
    assert tied_rules.keeps_per_example(stored, [grad])
    assert not tied_rules.keeps_per_example(stored[:, :8], [grad[:, :8]])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tied_table_kept_per_example_matches_the_ghost_route_and_the_loop(reduction, monkeypatch):
    # At T = 12 the head's cost model keeps the tied table's per-example gradients (formed once
    # for both layers, rules/tied.py); the clipped sums must equal the batch-size-1 loop, as the
    # ghost route with its cross term does (forced below), padding tokens included.
    torch.manual_seed(0)
    model = _TinyTransformer(tie=True, length=12, shared_positions=True).to(F64)
    tokens = torch.randint(0, 7, (4, 12), generator=_seeded(6))
    tokens[1, 8:] = 0  # padding_idx
    stored, grad = torch.zeros(1, 12, 8), torch.zeros(1, 12, 7)
    assert tied_rules.keeps_per_example(stored, [grad])
    formed = []
    original = tied_rules.per_example_grads
    monkeypatch.setattr(tied_rules, "per_example_grads", lambda *a: formed.append(1) or original(*a))
    check_against_reference(model, tokens, tokens, loss=_next_token_loss, loss_reduction=reduction)
    assert formed, "the tied table was not kept per example"
    monkeypatch.setattr(tied_rules, "keeps_per_example", lambda *a: False)
    formed.clear()
    check_against_reference(model, tokens, tokens, loss=_next_token_loss, loss_reduction=reduction)
    assert not formed


def test_layer_called_twice_in_one_pass():
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x):
            return self.layer(torch.tanh(self.layer(x)))

    model = Twice().to(F64)
    inputs = torch.randn(5, 3, dtype=F64)
    check_against_reference(model, inputs, _targets_like(model, inputs))


def test_frozen_parameters_get_no_hooks_and_no_result():
    torch.manual_seed(0)
    model = _small_cnn().to(F64)
    for param in model[0].parameters():
        param.requires_grad_(False)
    model[7].bias.requires_grad_(False)
    clipper = PerExampleClipper(model, 1.0)
    assert not model[0]._forward_hooks
    inputs = torch.randn(6, 1, 10, 10, dtype=F64)
    labels = torch.randint(0, 3, (6,), generator=_seeded(3))
    _cross_entropy(model(inputs), labels).mean().backward()
    sums = clipper.clipped_sum()
    assert set(sums) == {"1.weight", "1.bias", "4.weight", "4.bias", "7.weight"}
    clipper.remove()
    assert not any(module._forward_hooks for module in model.modules())
    check_against_reference(model, inputs, labels, loss=_cross_entropy)


# Passes --------------------------------------------------------------------------------------


def test_virtual_batches_equal_one_pass_over_the_concatenation():
    torch.manual_seed(0)
    model = _small_cnn().to(F64)
    inputs = torch.randn(7, 1, 10, 10, dtype=F64)
    labels = torch.randint(0, 3, (7,), generator=_seeded(3))
    clipper = PerExampleClipper(model, 0.5, loss_reduction="mean")
    for part in (slice(0, 3), slice(3, 7)):
        _cross_entropy(model(inputs[part]), labels[part]).mean().backward()
    assert clipper.examples == 7
    ours = clipper.clipped_sum()
    clipper.reset()
    assert clipper.examples == 0
    clipper.remove()
    expected, _, _ = reference(model, _cross_entropy, inputs, labels, 0.5)
    assert_sums_close(ours, expected, 1e-10)


def test_two_forwards_then_one_backward_are_clipped_separately():
    torch.manual_seed(0)
    model = _small_cnn().to(F64)
    inputs = torch.randn(6, 1, 10, 10, dtype=F64)
    labels = torch.randint(0, 3, (6,), generator=_seeded(3))
    clipper = PerExampleClipper(model, 0.5, loss_reduction="sum")
    first = _cross_entropy(model(inputs[:3]), labels[:3]).sum()
    second = _cross_entropy(model(inputs[3:]), labels[3:]).sum()
    (first + second).backward()
    ours = clipper.clipped_sum()
    assert clipper.examples == 6
    clipper.remove()
    expected, _, _ = reference(model, _cross_entropy, inputs, labels, 0.5)
    assert_sums_close(ours, expected, 1e-10)


def test_each_example_alone_is_within_the_bound():
    torch.manual_seed(0)
    model = _small_cnn().to(F64)
    inputs = torch.randn(6, 1, 10, 10, dtype=F64) * 10
    labels = torch.randint(0, 3, (6,), generator=_seeded(3))
    _, norms, _ = reference(model, _cross_entropy, inputs, labels, 1.0)
    bound = float(norms.min()) * 0.5  # every example is clipped
    clipper = PerExampleClipper(model, bound)
    for index in range(6):
        clipper.reset()
        _cross_entropy(model(inputs[index:index + 1]), labels[index:index + 1]).mean().backward()
        total = torch.cat([t.flatten() for t in clipper.clipped_sum().values()]).norm()
        assert float(total) == pytest.approx(bound, rel=1e-10)
        assert clipper.clipped_examples == 1


def test_dropout_matches_reference_with_the_same_masks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 2)).to(F64)
    inputs = torch.randn(8, 4, dtype=F64)
    targets = torch.randn(8, 2, dtype=F64)
    masks = []
    model[2].register_forward_hook(lambda module, args, output: masks.append((output / args[0]).detach()))
    clipper = PerExampleClipper(model, 0.3, loss_reduction="sum")
    squared_error(model(inputs), targets).sum().backward()
    ours = clipper.clipped_sum()
    clipper.remove()
    assert bool((masks[0] == 0).any()) and bool((masks[0] == 2).any())
    replay = _ReplayedDropout(model)
    expected, _, _ = reference(replay, squared_error, torch.cat([inputs, masks[0]], 1), targets, 0.3)
    assert_sums_close(ours, expected, 1e-10)


class _ReplayedDropout(nn.Module):
    """The model above with its dropout mask read from the input's last columns (same names)."""

    def __init__(self, model):
        super().__init__()
        self.add_module("0", model[0])
        self.add_module("3", model[3])

    def forward(self, inputs_and_mask):
        inputs, mask = inputs_and_mask[:, :4], inputs_and_mask[:, 4:]
        return self._modules["3"](torch.tanh(self._modules["0"](inputs)) * mask)


# Numerics ------------------------------------------------------------------------------------


def test_bfloat16_sums_are_float32_and_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    truth = copy.deepcopy(model).to(F64)
    model = model.to(torch.bfloat16)
    truth.load_state_dict({k: v.to(F64) for k, v in model.state_dict().items()})
    inputs = torch.randn(16, 8).to(torch.bfloat16)
    targets = torch.randn(16, 2).to(torch.bfloat16)
    ours = clipper_sums(model, squared_error, inputs, targets, 0.5)
    assert all(t.dtype == torch.float32 for t in ours.values())
    expected, _, _ = reference(truth, squared_error, inputs.to(F64), targets.to(F64), 0.5)
    assert_sums_close(ours, expected, 3e-2)


def test_nonfinite_gradient_names_the_parameter():
    model = nn.Sequential(nn.Linear(3, 2)).to(F64)
    clipper = PerExampleClipper(model, 1.0)
    inputs = torch.randn(4, 3, dtype=F64)
    inputs[2, 1] = float("inf")
    with pytest.raises(NonFiniteGradientError, match=r"'0\.weight'.*not finite for example 2"):
        squared_error(model(inputs), torch.zeros(4, 2, dtype=F64)).sum().backward()
        clipper.clipped_sum()


def test_large_finite_gradients_are_clipped_not_refused():
    model = nn.Sequential(nn.Linear(3, 2))
    inputs = torch.full((2, 3), 3e12)  # squared norms overflow float32, norms do not
    targets = torch.zeros(2, 2)
    sums = clipper_sums(model, squared_error, inputs, targets, 1.0, "sum")
    total = torch.cat([t.flatten() for t in sums.values()]).norm()
    assert float(total) <= 2.0 * (1 + 1e-6)


def test_empty_batch_gives_zeros():
    model = _small_cnn().to(F64)
    clipper = PerExampleClipper(model, 1.0, loss_reduction="sum")
    _cross_entropy(model(torch.zeros(0, 1, 10, 10, dtype=F64)), torch.zeros(0, dtype=torch.long)).sum().backward()
    sums = clipper.clipped_sum()
    assert clipper.examples == 0
    assert all(bool((t == 0).all()) and t.shape == p.shape for t, p in zip(sums.values(), model.parameters()))


# Errors --------------------------------------------------------------------------------------


def test_batch_norm_is_refused_naming_its_path():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.BatchNorm2d(2)))
    with pytest.raises(UnsupportedModuleError, match=r"BatchNorm2d at '1\.0'.*GroupNorm"):
        PerExampleClipper(model, 1.0)


def test_frozen_batch_norm_in_eval_mode_is_allowed_until_put_in_training_mode():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    model[1].eval()
    model[1].requires_grad_(False)
    clipper = PerExampleClipper(model, 1.0)
    model(torch.randn(2, 1, 5, 5)).sum().backward()
    assert clipper.clipped_sum()["0.weight"].shape == (2, 1, 3, 3)
    model.train()
    with pytest.raises(UnsupportedModuleError, match=r"BatchNorm2d at '1'.*training mode"):
        model(torch.randn(2, 1, 5, 5))


@pytest.mark.parametrize(
    "layer,pattern",
    [
        (nn.MultiheadAttention(4, 2), r"MultiheadAttention at '0'.*batch_first=True"),
        (nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True), r"dropout=0\.1"),
        (nn.LSTM(4, 4), r"LSTM at '0'.*LSTMCell"),
        (nn.Embedding(4, 4, scale_grad_by_freq=True), r"'0'.*scale_grad_by_freq=False"),
    ],
)
def test_unsupported_layers_are_refused(layer, pattern):
    with pytest.raises(UnsupportedModuleError, match=pattern):
        PerExampleClipper(nn.Sequential(layer), 1.0)


def test_clipped_sum_before_any_backward():
    clipper = PerExampleClipper(nn.Linear(2, 2), 1.0)
    with pytest.raises(ClipperUsageError, match=r"before any backward pass.*loss\.backward\(\)"):
        clipper.clipped_sum()


def test_folded_batch_dimension_is_refused():
    class Folding(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def forward(self, x):
            return self.layer(x.reshape(-1, 3))

    model = Folding()
    PerExampleClipper(model, 1.0)
    with pytest.raises(BatchDimensionError, match=r"'layer' saw a leading dimension of 8.*batch size 2"):
        model(torch.randn(2, 4, 3)).sum().backward()


def test_layer_called_outside_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    PerExampleClipper(model, 1.0)
    with pytest.raises(ClipperUsageError, match=r"'1' ran outside a call of the model"):
        model[1](torch.randn(3, 2))


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"max_grad_norm": 0.0}, ValueError, r"max_grad_norm must be finite and > 0"),
        ({"max_grad_norm": "1"}, TypeError, r"max_grad_norm must be a real number"),
        ({"max_grad_norm": 1.0, "loss_reduction": "none"}, ValueError, r"loss_reduction must be one of"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        PerExampleClipper(nn.Linear(2, 2), **kwargs)


def test_no_trainable_parameters():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        PerExampleClipper(model, 1.0)
