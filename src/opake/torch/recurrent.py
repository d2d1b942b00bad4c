"""Recurrent layers whose per-example gradients opake forms exactly: ``DPLSTM``, ``DPGRU``, ``DPRNN``.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run a fused multi-step kernel, and ``nn.LSTMCell`` (and
Opacus' ``DPLSTM``, whose gates are ``nn.Linear`` subclasses) is one layer called at every time
step: opake's per-example rules cannot split those gradients by example, so ``validate_model``
names them and ``make_private`` refuses them (``opake.torch.validation``). These layers keep
nn.LSTM's (nn.GRU's, nn.RNN's) constructor and call, ``(output, h_n)`` or ``(output, (h_n,
c_n))``, but compute each gate with plain ``nn.Linear`` layers, one input and one hidden
projection per layer and direction, called once per time step. The Linear rule sums an
example's gradient over the calls, so the clipped per-example gradients are exact (tested
against a loop of batch-size-1 backward passes, tests/torch/test_recurrent.py).

``from_module(rnn)`` builds one from an ``nn.LSTM``/``nn.GRU``/``nn.RNN`` with the same weights
(same outputs); ``fix_model`` uses it. Not supported: ``PackedSequence`` inputs and
``proj_size`` (refused with the fix). The per-step Python loop costs speed against the fused
kernel: these layers are for privacy, not for throughput.

``batch_first=False`` (nn.LSTM's default): the input is (T, B, features) and is transposed before
the gates, which always see (B, features); a sequence-first model is made private with Opacus'
``PrivacyEngine.make_private(batch_first=False)``, under which the clipper reads the model's other
layers (an ``nn.Embedding`` of (T, B) tokens, an ``nn.Linear`` on (T, B, d)) with the batch on
dimension 1 and these layers' gates as they are (``BATCH_FIRST_INSIDE``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "UnsupportedRecurrentInputError", "from_module", "from_parameters"]

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


class UnsupportedRecurrentInputError(OpakeError, ValueError):
    """A recurrent layer was asked for something it does not implement; the message says instead what."""


class _Direction(nn.Module):
    """One layer and direction: the input and hidden projections of every gate (nn.Linear)."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, bias: bool):
        super().__init__()
        gates = _GATES[mode] * hidden_size
        self.ih = nn.Linear(input_size, gates, bias=bias)
        self.hh = nn.Linear(hidden_size, gates, bias=bias)


class _Recurrent(nn.Module):
    mode = "LSTM"
    # Its gates see (batch, features) whatever batch_first says (a sequence-first input is transposed
    # first): the clipper reads them batch first under make_private(batch_first=False).
    BATCH_FIRST_INSIDE = True

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 nonlinearity: str = "tanh", proj_size: int = 0, device=None, dtype=None):
        super().__init__()
        if proj_size:
            raise UnsupportedRecurrentInputError(
                f"proj_size={proj_size} is not implemented by {type(self).__name__}; project the output with "
                f"an nn.Linear after the layer instead"
            )
        if self.mode == "RNN":
            if nonlinearity not in ("tanh", "relu"):
                raise InvalidArgumentError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
            self.mode = "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"
        self.input_size, self.hidden_size, self.num_layers = int(input_size), int(hidden_size), int(num_layers)
        self.bias, self.batch_first, self.bidirectional = bool(bias), bool(batch_first), bool(bidirectional)
        self.dropout = float(dropout)
        directions = 2 if bidirectional else 1
        self.cells = nn.ModuleList(
            _Direction(self.mode, input_size if layer == 0 else hidden_size * directions, hidden_size, bias)
            for layer in range(num_layers) for _ in range(directions)
        )
        self.to(device=device, dtype=dtype)
        self._initialize()

    def _initialize(self) -> None:
        # nn.LSTM's initialization: every weight and bias uniform in +-1/sqrt(hidden_size)
        bound = self.hidden_size ** -0.5
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -bound, bound)

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    def forward(self, input, hx=None):
        if isinstance(input, PackedSequence):
            raise UnsupportedRecurrentInputError(
                f"{type(self).__name__} takes padded tensors, not a PackedSequence: pad the batch "
                f"(torch.nn.utils.rnn.pad_packed_sequence) and read each example's output at its length"
            )
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1 if not self.batch_first else 0)
        if not self.batch_first:
            x = x.transpose(0, 1)  # from here on (batch, time, features)
        batch = x.shape[0]
        h0, c0 = self._initial_state(hx, batch, x, batched)
        finals_h, finals_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self._directions):
                index = layer * self._directions + direction
                sequence, h, c = self._run(self.cells[index], x, h0[index], c0[index] if c0 is not None else None,
                                           reverse=direction == 1)
                outputs.append(sequence)
                finals_h.append(h)
                finals_c.append(c)
            x = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        output = x if self.batch_first else x.transpose(0, 1)
        h_n = torch.stack(finals_h)
        state = (h_n, torch.stack(finals_c)) if self.mode == "LSTM" else h_n
        if not batched:
            output = output.squeeze(0 if self.batch_first else 1)
            state = tuple(s.squeeze(1) for s in state) if self.mode == "LSTM" else state.squeeze(1)
        return output, state

    def _initial_state(self, hx, batch: int, x, batched: bool):
        shape = (self.num_layers * self._directions, batch, self.hidden_size)
        if hx is None:
            zeros = x.new_zeros(shape)
            return zeros, (zeros if self.mode == "LSTM" else None)
        if self.mode == "LSTM":
            h0, c0 = hx
            return (h0, c0) if batched else (h0.unsqueeze(1), c0.unsqueeze(1))
        return (hx if batched else hx.unsqueeze(1)), None

    def _run(self, cell: _Direction, x, h, c, reverse: bool):
        steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
        outputs = [None] * x.shape[1]
        for t in steps:
            h, c = self._step(cell, x[:, t], h, c)
            outputs[t] = h
        return torch.stack(outputs, dim=1), h, c

    def _step(self, cell: _Direction, x_t, h, c):
        if self.mode == "LSTM":
            i, f, g, o = (cell.ih(x_t) + cell.hh(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if self.mode == "GRU":
            r_i, z_i, n_i = cell.ih(x_t).chunk(3, dim=1)
            r_h, z_h, n_h = cell.hh(h).chunk(3, dim=1)
            r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
            n = torch.tanh(n_i + r * n_h)
            return (1 - z) * n + z * h, None
        pre = cell.ih(x_t) + cell.hh(h)
        return (torch.tanh(pre) if self.mode == "RNN_TANH" else torch.relu(pre)), None

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, bias={self.bias}, "
                f"batch_first={self.batch_first}, dropout={self.dropout}, bidirectional={self.bidirectional}")


class DPLSTM(_Recurrent):
    """``nn.LSTM``'s interface with its gates in ``nn.Linear`` layers (module docstring)."""

    mode = "LSTM"


class DPGRU(_Recurrent):
    """``nn.GRU``'s interface with its gates in ``nn.Linear`` layers (module docstring)."""

    mode = "GRU"


class DPRNN(_Recurrent):
    """``nn.RNN``'s interface (``nonlinearity="tanh"`` or ``"relu"``) with ``nn.Linear`` layers."""

    mode = "RNN"


_REPLACEMENTS = {nn.LSTM: DPLSTM, nn.GRU: DPGRU, nn.RNN: DPRNN}


def from_module(rnn: nn.RNNBase) -> _Recurrent:
    """The ``DPLSTM``/``DPGRU``/``DPRNN`` computing what ``rnn`` computes, with its weights copied."""
    kind = _REPLACEMENTS.get(type(rnn))
    if kind is None:
        raise InvalidTypeError(f"from_module takes an nn.LSTM, nn.GRU or nn.RNN, got {type(rnn).__name__}")
    return from_parameters(kind, rnn)


def from_parameters(kind: type, rnn: nn.Module) -> _Recurrent:
    """A ``kind`` layer with the settings and weights of ``rnn``, any layer that names them as
    ``nn.LSTM`` does (``input_size``, ..., ``weight_ih_l0``, ``bias_hh_l1_reverse``; Opacus'
    ``DPLSTM`` and ``DPGRU`` do)."""
    extra = {"nonlinearity": rnn.nonlinearity} if kind is DPRNN else {}
    weight = rnn.weight_ih_l0
    layer = kind(rnn.input_size, rnn.hidden_size, num_layers=rnn.num_layers, bias=rnn.bias,
                 batch_first=rnn.batch_first, dropout=rnn.dropout, bidirectional=rnn.bidirectional,
                 proj_size=getattr(rnn, "proj_size", 0), device=weight.device, dtype=weight.dtype, **extra)
    with torch.no_grad():
        for index, cell in enumerate(layer.cells):
            suffix = f"l{index // layer._directions}" + ("_reverse" if index % layer._directions else "")
            cell.ih.weight.copy_(getattr(rnn, f"weight_ih_{suffix}"))
            cell.hh.weight.copy_(getattr(rnn, f"weight_hh_{suffix}"))
            if rnn.bias:
                cell.ih.bias.copy_(getattr(rnn, f"bias_ih_{suffix}"))
                cell.hh.bias.copy_(getattr(rnn, f"bias_hh_{suffix}"))
    layer.train(rnn.training)
    return layer
