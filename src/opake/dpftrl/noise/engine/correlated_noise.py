"""The correlated-noise engine: ``mf_gaussian_noise`` streams sigma * clip / norm * C^{-1} z.

``mf_gaussian_noise(grad_template, strategy, n_steps=..., noise_multiplier=..., key=...)``
resolves the strategy for the run's participation context and returns ``(noise_fn, state)``.
``noise_fn(clipped, state)`` returns ``(NoisedPytree, new_state)``: at step t it adds

    noise_multiplier * clipped.l2_bound / clipped.normalization * x_t,    x = C^{-1} z,

with z_t ~ N(0, I_d) i.i.d. over steps and elements (see ``engine.draws``), x computed by the
strategy's streaming inverse (``engine.streaming``) from a (B, d) buffer state
(``engine.state``).

Memory and passes. All parameters share one flat (B, d) buffer tensor in the compute dtype
(float32 by default, float64 on request), whatever the gradients' dtypes. A step allocates one
d-vector: the output, in grad_template's dtype(s), whose zero-copy views are the leaves of the
returned pytree (on CPU the last step's, once the caller no longer references it, else a new
one hinted to huge pages, see ``engine.pages``). Gradients may come in
any floating dtype (``clipped_grad`` returns float32 sums for half-precision parameters, so
that clipping holds to float32 rounding); ``gradient + scale * x`` is formed in the wider of
the gradient's and the compute dtype and rounded once to the template's dtype, which is
post-processing of the noised value. z is drawn straight into that output (or, when the
template's dtype differs from the compute dtype, into a scratch of at most one noise block),
turned into x in place, folded into the buffers with fused in-place torch ops (for a BLT two
passes: a matrix-vector product and a broadcast multiply-add, see ``engine.streaming``;
cache-blocked when single-threaded, see ``columns_per_advance``), and
finally overwritten by ``gradient + scale * x``. Python loops run over leaves, noise blocks and
cache blocks only, never over elements. The step plan (which stretch of the output and the
buffers each leaf uses) depends only on the template and the compute dtype and is computed
once (``engine.segments``).

Purity. The returned state takes over the buffers (updated in place) and the state passed in
is retired: using it again raises ``RetiredStateError`` instead of giving different noise.
``state.copy(draws="replay")`` or ``state.copy(fresh_key=k)`` keeps a second state; the choice
is required because releasing a step twice costs privacy either way (replayed noise cancels
between two different gradients; fresh noise is a second release to account for; see
``engine.state``). The alternative, returning fresh buffers every step, would double the memory
of the largest object in the engine (B x d) and the traffic of every step. Every check (types,
structure, shapes, dense layout, dtypes, devices, finiteness, horizon) runs before the buffers
are touched, so a call that raises leaves its state usable.

Draw keys. A state draws with its ``draw_key``: the engine's key, or after a fresh-key copy or
restore a key derived from the fresh key. The engine keeps one ``BlockSampler`` for its own key
and a few more, cached, for other draw keys, so the common path is one key comparison.

>>> import torch
>>> from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
>>> from opake.random import key
>>> from opake.types import clipped
>>> params = {"w": torch.zeros(3)}
>>> noise_fn, state = mf_gaussian_noise(params, identity_strategy(), n_steps=2,
...                                     noise_multiplier=1.0, key=key(0))
>>> noisy, state = noise_fn(clipped({"w": torch.ones(3)}, l2_bound=1.0), state)
>>> noisy.pytree["w"].shape, state.step
(torch.Size([3]), 1)
"""

from __future__ import annotations

import math

import torch

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler, PerDrawKey
from opake.dpftrl.noise.engine.layout import Layout, path_text
from opake.dpftrl.noise.engine.pages import OutputVectors
from opake.dpftrl.noise.engine.segments import plan_step
from opake.dpftrl.noise.engine.state import check_state_for, NoiseState
from opake.dpftrl.noise.engine.variance import step_noise_variance
from opake.dpftrl.noise.engine.streaming import streaming_inverse
from opake.dpftrl.noise.priced import check_noise_priced
from opake._checks import positive_finite
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.random import RngKey
from opake.types import ClippedPytree, NoisedPytree

__all__ = ["CorrelatedNoise", "mf_gaussian_noise"]

_COMPUTE_DTYPES = (torch.float32, torch.float64)
# Gradient and template dtypes the step supports end to end (draws, finiteness check, the mixed
# add): float8 and other exotic floating types fail inside torch's kernels, after the checks.
_GRADIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CAST_PIECE = 2**16
_CPU_CHUNK = 2**16


def columns_per_advance(device: torch.device) -> int | None:
    """How many buffer columns one call of the streaming inverse processes (None: all).

    A BLT inverse makes two passes over its (B, n) columns (the sum over buffers, then the
    multiply-add of x), a banded one a sum and a row copy. Single-threaded on a CPU, cutting the
    columns into cache-sized pieces (2**16 columns, at most 2 MiB of float32 buffers for B = 8)
    lets the second pass, and the final gradient + scale * x, hit the cache, so DRAM sees one
    read and one write of the buffers, as in the floor (mixed-dtype adds then also work on
    pieces of this size). With several threads
    each torch op is parallel, and many small parallel regions cost more than they save, so
    the whole span goes at once; on GPUs too. The values do not depend on this choice: every
    op is elementwise over columns (tests check the two give bit-identical noise).
    """
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return _CPU_CHUNK
    return None


def add_noise(gradient: torch.Tensor, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """out = gradient + scale * x, formed in the wider dtype of gradient and x, rounded once to
    out's. Mixed-dtype adds make torch allocate casting buffers the size of their operands, so
    those go in 64K-element pieces (512 KiB of buffers); uniform dtypes are one op."""
    if gradient.dtype == x.dtype == out.dtype:
        torch.add(gradient, x, alpha=scale, out=out)
        return
    length = x.numel()
    for begin in range(0, length, _CAST_PIECE):
        size = min(_CAST_PIECE, length - begin)
        torch.add(gradient.narrow(0, begin, size), x.narrow(0, begin, size), alpha=scale,
                  out=out.narrow(0, begin, size))


def check_dense_gradient(where: str, leaf: torch.Tensor) -> None:
    """Refuse a gradient the step cannot add noise to element by element (before any buffer is
    written): sparse or otherwise non-strided layouts, and floating dtypes other than float16,
    bfloat16, float32 and float64. Shared by the engine and the distributed stages."""
    if leaf.layout != torch.strided:
        raise InvalidTypeError(
            f"gradient {where!r} has layout {leaf.layout}; the noise engine adds noise to every "
            f"element, so it needs a dense tensor: pass {where!r} as gradient.to_dense()"
        )
    if leaf.dtype not in _GRADIENT_DTYPES:
        raise InvalidTypeError(
            f"gradient {where!r} has dtype {leaf.dtype}; the noise engine supports float16, "
            f"bfloat16, float32 and float64 gradients: convert it, e.g. gradient.float()"
        )


def _resolve(strategy, participation: Participation):
    """The Mechanism for this context: from a recipe's ``resolve`` or a resolved Mechanism."""
    if hasattr(strategy, "resolve"):
        return strategy.resolve(participation.n_steps, participation.min_sep, participation.max_participations)
    if all(hasattr(strategy, name) for name in ("theta", "omega", "participation", "fingerprint")):
        if strategy.participation != participation:
            raise InvalidArgumentError(
                f"the mechanism was resolved for ({strategy.participation}) but the noise is asked for "
                f"({participation}); accounting and noise must use the same context"
            )
        return strategy
    raise InvalidTypeError(
        f"strategy must be a recipe such as blt_strategy(...) or identity_strategy() (or a resolved "
        f"Mechanism), got {type(strategy).__name__}"
    )


class CorrelatedNoise:
    """``noise_fn``: a callable ``(clipped, state) -> (NoisedPytree, state)`` (see module doc).

    Attributes: ``mechanism`` (the resolved strategy), ``participation``, ``noise_multiplier``,
    ``key``, ``dtype`` (compute dtype), ``device``, ``size`` (d), ``inverse``.
    """

    def __init__(self, layout: Layout, mechanism, participation: Participation,
                 noise_multiplier: float, key: RngKey, dtype: torch.dtype):
        self.layout = layout
        self.mechanism = mechanism
        self.participation = participation
        self.noise_multiplier = noise_multiplier
        self.key = key
        self.dtype = dtype
        self.device = layout.device
        self.size = layout.size
        self.inverse = streaming_inverse(mechanism)
        self.inverse.check_dtype(dtype)
        self._coefficients = self.inverse.coefficients(dtype, self.device)
        self._samplers = PerDrawKey(key, lambda draw_key: BlockSampler(draw_key, self.device))
        self._fingerprint = str(getattr(mechanism, "fingerprint", ""))
        self._plan = plan_step(layout, dtype)
        self._outputs = OutputVectors(self.device)

    def check_accounted_by(self, process) -> None:
        """Raise unless ``process`` priced exactly this noise: same mechanism, context, multiplier.

        ``process`` is any accountant of ``opake.dpftrl.accounting`` (a bound ``mf_gaussian``,
        ``balls_in_bins`` with any method, ``poisson``): each states the noise it priced as
        ``priced_noise``. Different recipes, participation contexts or learning-rate schedule
        values give different mechanism fingerprints; an epsilon computed for another
        mechanism or noise multiplier is not this run's guarantee. The comparison is
        ``opake.dpftrl.noise.priced.check_noise_priced``; it raises an ``AccountingMismatchError``
        (a ValueError) naming every difference.
        """
        check_noise_priced(process, mechanism=self.mechanism, participation=self.participation,
                           noise_multiplier=self.noise_multiplier)

    def init(self) -> NoiseState:
        """A fresh state: zero buffers, step 0."""
        return NoiseState.fresh(self, self.size, self._fingerprint, self.layout.fingerprint)

    # -- checks (all run before any buffer is written) ----------------------------------------

    def _check_state(self, state) -> None:
        check_state_for(self, state, mechanism=self._fingerprint, layout=self.layout.fingerprint,
                        columns=self.size, returned_by="mf_gaussian_noise or by the previous noise_fn call")

    def _check_gradients(self, clipped) -> list[torch.Tensor]:
        if not isinstance(clipped, ClippedPytree):
            raise InvalidTypeError(
                f"noise_fn needs an opake.types.ClippedPytree, which carries the L2 bound that "
                f"scales the noise; got {type(clipped).__name__}. Wrap gradients you clipped "
                f"yourself with opake.types.clipped(pytree, l2_bound=..., normalization=...)"
            )
        leaves = self.layout.flatten_gradients(clipped.pytree)
        for slot, leaf in zip(self.layout.leaves, leaves):
            check_dense_gradient(path_text(slot.path), leaf)
        # Finiteness with one reduction per leaf and no d-sized temporary. For float32/64 a
        # sum is NaN or +-inf when an element is, and otherwise finite unless it overflows,
        # which only sends us to the exact check below; one sync per dtype. Half-precision
        # sums would first cast the leaf to float32 (a temporary), so those leaves use their
        # min and max, which are NaN or +-inf exactly when an element is.
        finite = True
        for dtype in {leaf.dtype for leaf in leaves}:
            group = [leaf for leaf in leaves if leaf.dtype == dtype and leaf.numel()]
            if not group:
                continue
            if dtype in (torch.float32, torch.float64):
                reduced = [leaf.sum() for leaf in group]
            else:
                reduced = [value for leaf in group for value in torch.aminmax(leaf)]
            if not math.isfinite((reduced[0] if len(reduced) == 1 else torch.stack(reduced).sum()).item()):
                finite = False
        if not finite:
            bad = [path_text(slot.path) for slot, leaf in zip(self.layout.leaves, leaves)
                   if leaf.numel() and not all(math.isfinite(v.item()) for v in torch.aminmax(leaf))]
            if bad:
                raise InvalidArgumentError(
                    f"the gradients contain NaN or inf (in {bad}); noise cannot make them "
                    f"private. Check the loss and the clipping before calling noise_fn"
                )
        return leaves

    # -- the step -----------------------------------------------------------------------------

    def __call__(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        with torch.no_grad():
            return self._step(clipped, state)

    def _step(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        self._check_state(state)
        leaves = self._check_gradients(clipped)
        scale = self.noise_multiplier * clipped.l2_bound / clipped.normalization
        plan = self._plan
        # Allocate before touching the buffers: an out-of-memory error leaves them intact.
        flats = {dtype: self._outputs.get(dtype, total) for dtype, total in plan.totals}
        scratch = None
        if plan.scratch_length:
            scratch = torch.empty(plan.scratch_length, dtype=self.dtype, device=self.device)
        sampler = self._samplers(state.draw_key)
        storage, step = state._storage, state.step
        storage.step = -1
        try:
            self._advance(plan, leaves, flats, scratch, storage.buffers, step, scale, sampler)
        except BaseException:
            storage.corrupted_at = step
            raise
        storage.step = step
        outputs = [None] * len(leaves)
        for dtype, members, sizes in plan.output_groups:
            for index, piece in zip(members, flats[dtype].split(sizes)):
                shape = self.layout.leaves[index].shape
                outputs[index] = piece if piece.shape == shape else piece.view(shape)
        return (NoisedPytree(pytree=self.layout.treespec.unflatten(outputs), step=step,
                             noise_variance=step_noise_variance(self.mechanism, step, scale)), state.advanced())

    def _advance(self, plan, leaves, flats, scratch, buffers, step: int, scale: float, sampler) -> None:
        """Fill x with z, turn it into x_t, fold it into the buffers, write gradient + scale x."""
        gradients = [leaf if leaf.dim() == 1 else leaf.reshape(-1) for leaf in leaves]
        chunk = columns_per_advance(self.device)
        coefficients = self.inverse.at_step(self._coefficients, step)  # once, for every stretch
        for segment in plan.segments:
            if segment.direct:
                x = flats[segment.output_dtype].narrow(0, segment.output_offset, segment.length)
            else:
                x = scratch if scratch.numel() == segment.length else scratch.narrow(0, 0, segment.length)
            if chunk is None:
                self._advance_whole(segment, x, gradients, flats, buffers, step, scale, coefficients, sampler)
            else:
                self._advance_blocked(segment, x, gradients, flats, buffers, step, scale, coefficients, chunk,
                                      sampler)

    def _advance_whole(self, segment, x, gradients, flats, buffers, step, scale, coefficients, sampler) -> None:
        """Few large ops (for several threads or a GPU): all draws, one inverse call, the adds."""
        slots = self.layout.leaves
        pieces = x.split(segment.draw_lengths) if len(segment.draws) > 1 else (x,)
        for (index, block), piece in zip(segment.draws, pieces):
            sampler.fill(piece, step, slots[index].code, block)                       # x <- z
        columns = buffers.narrow(1, segment.column, segment.length)
        self.inverse.advance(x, columns, coefficients)                               # x <- (C^{-1} z)_t
        if segment.direct:
            # x is the output: overwrite each leaf's stretch with gradient + scale * x.
            outs = x.split([length for _, _, length, _ in segment.adds]) if len(segment.adds) > 1 else (x,)
            for (index, _, _, _), out in zip(segment.adds, outs):
                add_noise(gradients[index], out, out, scale)
        else:
            (index, leaf_begin, length, output_offset), = segment.adds
            out = flats[segment.output_dtype].narrow(0, output_offset, length)
            add_noise(gradients[index].narrow(0, leaf_begin, length), x, out, scale)

    def _advance_blocked(self, segment, x, gradients, flats, buffers, step, scale, coefficients, chunk,
                         sampler) -> None:
        """Cache-blocked (single-threaded CPU): all draws first (measured faster than drawing
        between the stretches, whose dirty buffer lines the draws would then write back), then
        stretches of about ``chunk`` columns go through the inverse and the final add while in
        cache. A noise block longer than ``chunk`` is cut into chunks; shorter ones (small
        leaves) are grouped until they fill one, so a model of many small tensors still makes
        one inverse call per chunk. Views come from one ``split`` per segment (per-view
        ``narrow`` calls cost more than the small leaves' arithmetic)."""
        slots = self.layout.leaves
        pieces = x.split(segment.draw_lengths) if len(segment.draws) > 1 else (x,)
        pending = []        # (gradient, x, out) views awaiting the inverse, in order along x
        pending_start = 0   # where the pending stretch starts in x

        def finish(stop: int) -> None:
            # Inverse over x[pending_start:stop], then gradient + scale * x for its views.
            length = stop - pending_start
            self.inverse.advance(x.narrow(0, pending_start, length),
                                 buffers.narrow(1, segment.column + pending_start, length),
                                 coefficients)                                      # x <- (C^{-1} z)_t
            for gradient, x_part, out in pending:
                add_noise(gradient, x_part, out, scale)
            pending.clear()

        for (index, block), piece in zip(segment.draws, pieces):
            sampler.fill(piece, step, slots[index].code, block)                      # x <- z
        start = 0  # where the current noise block starts in x
        for (index, block), piece in zip(segment.draws, pieces):
            length = piece.numel()
            gradient = gradients[index]
            if length != gradient.numel():
                gradient = gradient.narrow(0, block * BLOCK_ELEMENTS, length)
            if segment.direct:
                out = piece
            else:
                out = flats[segment.output_dtype].narrow(0, segment.output_offset + start, length)
            if length >= chunk:
                if pending:
                    finish(start)
                parts = zip(gradient.split(chunk), piece.split(chunk), out.split(chunk))
                for number, part in enumerate(parts):
                    pending_start = start + number * chunk
                    pending.append(part)
                    finish(pending_start + part[1].numel())
            else:
                if not pending:
                    pending_start = start
                pending.append((gradient, piece, out))
                if start + length - pending_start >= chunk:
                    finish(start + length)
            start += length
        if pending:
            finish(start)


def mf_gaussian_noise(
    grad_template,
    strategy,
    *,
    n_steps: int,
    min_sep: int = 1,
    max_participations: int | None = None,
    noise_multiplier: float,
    key: RngKey,
    dtype: torch.dtype = torch.float32,
) -> tuple[CorrelatedNoise, NoiseState]:
    """Correlated Gaussian noise for DP-FTRL: returns ``(noise_fn, initial_state)``.

    grad_template: a pytree of tensors shaped like the gradients (usually the parameters, e.g.
      ``dict(model.named_parameters())``); only shapes, dtypes, device and paths are used.
    strategy: ``blt_strategy(...)``, ``identity_strategy()``, or a resolved Mechanism; it is
      resolved for (n_steps, min_sep, max_participations), the context the accounting must use.
    noise_multiplier: sigma (> 0); the noise on step t is
      sigma * l2_bound / normalization * (C^{-1} z)_t.
    key: an ``opake.random.RngKey``; required, no default seed.
    dtype: compute dtype of the buffers and of x, torch.float32 (default) or torch.float64,
      independent of the gradients' dtype. Gradients may come in any floating dtype; the
      noised gradients come back in grad_template's dtypes (bf16 parameters get bf16 noisy
      gradients, rounded once from gradient + scale * x formed in float32 or wider).

    ``noise_fn(clipped, state)`` refuses step n_steps + 1 (``NoiseHorizonError``).
    """
    layout, mechanism, participation, sigma = validated_arguments(
        grad_template, strategy, n_steps, min_sep, max_participations, noise_multiplier, key, dtype
    )
    noise_fn = CorrelatedNoise(layout, mechanism, participation, sigma, key, dtype)
    return noise_fn, noise_fn.init()


def validated_arguments(grad_template, strategy, n_steps, min_sep, max_participations, noise_multiplier,
                        key, dtype):
    """The checked (layout, mechanism, participation, noise multiplier) of a noise stage."""
    if not isinstance(key, RngKey):
        raise InvalidTypeError(
            f"key must be an opake.random.RngKey, e.g. key=opake.random.key(42); got {type(key).__name__}"
        )
    if dtype not in _COMPUTE_DTYPES:
        raise InvalidArgumentError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    sigma = positive_finite("noise_multiplier", noise_multiplier,
                            "calibrate it to the privacy budget with opake.accounting.calibrate")
    participation = Participation(n_steps, min_sep, max_participations)
    layout = Layout.from_template(grad_template)
    for slot in layout.leaves:
        if slot.dtype not in _GRADIENT_DTYPES:
            raise InvalidTypeError(
                f"grad_template leaf {path_text(slot.path)!r} has dtype {slot.dtype}; the noise "
                f"engine supports float16, bfloat16, float32 and float64 parameters"
            )
    return layout, _resolve(strategy, participation), participation, sigma
