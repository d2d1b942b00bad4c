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
buffers each leaf uses, and how the columns are cut for the inverse) depends only on the
template and the compute dtype and is computed once (``engine.segments``).

Many tensors. What a step does per tensor is kept to what the contract requires: one keyed
draw per noise block (z is a pure function of key, step, path and element index, so each block
seeds its own generator, ``engine.draws``) and one ``gradient + scale * x`` (into the leaf's
output view; the gradients are separate tensors and the memory target leaves no room to gather
them next to x). Everything else is batched: the structure, shape, device, dtype and layout
checks are whole-list comparisons (the leaf-by-leaf walk runs only to name an offender); the
NaN/inf check of many small leaves gathers them into the output vector (free until the draws)
with one op and decides with one reduction and one host sync (``_check_finite``); the output
views come from one op per output vector; the buffer columns of many small leaves advance in
one inverse call per cache-sized stretch; the BLT's per-step scalars come from a table
computed once per 64 steps (``engine.streaming``).

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

from opake.dpftrl.noise.engine.draws import BlockSampler, PerDrawKey
from opake.dpftrl.noise.engine.layout import Layout, path_text
from opake.dpftrl.noise.engine.pages import OutputVectors
from opake.dpftrl.noise.engine.segments import plan_step, stretches
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
_GRADIENT_DTYPES_SET = frozenset(_GRADIENT_DTYPES)
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


# torch's C++ loop that cuts a flat tensor into views shaped like a list of tensors (behind
# torch._utils._unflatten_dense_tensors); absent, the views are made one by one.
_UNFLATTEN = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)


def _views_of(flat: torch.Tensor, sizes: tuple, shapes) -> list:
    """Consecutive views of ``flat``: 1-D of ``sizes`` (``shapes`` None), else shaped like the
    tensors in ``shapes`` (meta tensors, only their shapes are read)."""
    if shapes is None:
        return list(flat.split(sizes))
    if _UNFLATTEN is not None:
        return list(_UNFLATTEN(flat, shapes))
    return [piece.view(shape.shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _finite_probe(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whose sum is NaN or +-inf when ``tensor`` has a NaN or inf (see
    ``CorrelatedNoise._check_finite``): its sum for float32/64 (0-d), else its min and max."""
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor.sum()
    return torch.stack(torch.aminmax(tensor))


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
        self._cuts: dict = {}  # (segment number, chunk) -> its stretches
        self._all_flat = all(len(slot.shape) == 1 for slot in layout.leaves)
        self._view_groups = tuple(
            (dtype, members, sizes,
             None if all(len(layout.leaves[index].shape) == 1 for index in members) else
             [torch.empty(layout.leaves[index].shape, device="meta") for index in members])
            for dtype, members, sizes in self._plan.output_groups
        )
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

    def _check_gradients(self, clipped) -> tuple[list[torch.Tensor], set]:
        """The gradient leaves and the set of their (dtype, layout, contiguous) kinds."""
        if not isinstance(clipped, ClippedPytree):
            raise InvalidTypeError(
                f"noise_fn needs an opake.types.ClippedPytree, which carries the L2 bound that "
                f"scales the noise; got {type(clipped).__name__}. Wrap gradients you clipped "
                f"yourself with opake.types.clipped(pytree, l2_bound=..., normalization=...)"
            )
        leaves, kinds = self.layout.flatten_gradients_with_kinds(clipped.pytree)
        # One look at the set of kinds; the leaf-by-leaf walk only to name an offender.
        if not all(layout == torch.strided and dtype in _GRADIENT_DTYPES_SET for dtype, layout, _ in kinds):
            for slot, leaf in zip(self.layout.leaves, leaves):
                check_dense_gradient(path_text(slot.path), leaf)
        return leaves, kinds

    def _check_finite(self, leaves: list, kinds: set, outputs: list, flats: dict) -> None:
        """Refuse NaN or inf gradients with one host sync, before any buffer is written.

        Many small leaves (the cost is then one op per leaf, not the data): they are gathered
        into this step's output vectors (free until the draws; one ``torch.cat`` when every leaf
        is 1-D and in the output's dtype, else one ``_foreach_copy_``) and one reduction per
        vector decides. Large leaves: one reduction per leaf, no copy. For float32/64 the
        reduction is a sum, NaN or +-inf when an element is, and otherwise finite unless it
        overflows, which only sends us to the exact check; float16/bfloat16 use min and max (no
        float32 temporary), NaN or +-inf exactly when an element is. A leaf copied into a
        narrower output dtype can only turn a finite value into inf, which also sends us to the
        exact check. No d-sized temporary either way.
        """
        if self._plan.gather_check:
            flat = next(iter(flats.values()))
            if self._all_flat and len(flats) == 1 and kinds == {(flat.dtype, torch.strided, True)}:
                torch.cat(leaves, out=flat)
            else:
                torch._foreach_copy_(outputs, leaves)
            probes = [_finite_probe(flat) for flat in flats.values() if flat.numel()]
        else:
            probes = [_finite_probe(leaf) for leaf in leaves if leaf.numel()]
        if not probes:
            return
        probe = probes[0] if len(probes) == 1 else torch.cat([probe.reshape(-1) for probe in probes])
        if math.isfinite((probe.sum() if probe.dim() else probe).item()):
            return
        # Exact check, leaf by leaf (only after the probe failed): name the offending leaves.
        bad = [path_text(slot.path) for slot, leaf in zip(self.layout.leaves, leaves)
               if leaf.numel() and not all(math.isfinite(v.item()) for v in torch.aminmax(leaf))]
        if bad:
            raise InvalidArgumentError(
                f"the gradients contain NaN or inf (in {bad}); noise cannot make them "
                f"private. Check the loss and the clipping before calling noise_fn"
            )

    # -- the step -----------------------------------------------------------------------------

    def __call__(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        with torch.no_grad():
            return self._step(clipped, state)

    def _step(self, clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        self._check_state(state)
        leaves, kinds = self._check_gradients(clipped)
        scale = self.noise_multiplier * clipped.l2_bound / clipped.normalization
        plan = self._plan
        # Allocate before touching the buffers: an out-of-memory error leaves them intact.
        flats = {dtype: self._outputs.get(dtype, total) for dtype, total in plan.totals}
        outputs = self._output_views(flats)
        self._check_finite(leaves, kinds, outputs, flats)
        scratch = None
        if plan.scratch_length:
            scratch = torch.empty(plan.scratch_length, dtype=self.dtype, device=self.device)
        sampler = self._samplers(state.draw_key)
        storage, step = state._storage, state.step
        storage.step = -1
        try:
            self._advance(leaves, kinds, outputs, flats, scratch, storage.buffers, step, scale, sampler)
        except BaseException:
            storage.corrupted_at = step
            raise
        storage.step = step
        return (NoisedPytree(pytree=self.layout.treespec.unflatten(outputs), step=step,
                             noise_variance=step_noise_variance(self.mechanism, step, scale)), state.advanced())

    def _output_views(self, flats: dict) -> list:
        """Per leaf, its stretch of this step's output in the leaf's shape: the leaves of the
        returned pytree. One op per output vector: a split when every leaf is 1-D, else torch's
        ``unflatten_dense_tensors`` (views shaped like the template, made in one C++ loop)."""
        groups = self._view_groups
        if len(groups) == 1:
            (dtype, _, sizes, shapes), = groups
            return _views_of(flats[dtype], sizes, shapes)
        outputs = [None] * len(self.layout.leaves)
        for dtype, members, sizes, shapes in groups:
            for index, piece in zip(members, _views_of(flats[dtype], sizes, shapes)):
                outputs[index] = piece
        return outputs

    def _stretches(self, number: int, segment, chunk):
        found = self._cuts.get((number, chunk))
        if found is None:
            found = self._cuts[(number, chunk)] = stretches(segment, self.layout, chunk)
        return found

    def _advance(self, leaves, kinds, outputs, flats, scratch, buffers, step: int, scale: float, sampler) -> None:
        """Fill x with z, turn it into x_t, fold it into the buffers, write gradient + scale x.

        For each segment: all its draws first (measured faster than drawing between the
        stretches, whose dirty buffer lines the draws would then write back), then its
        stretches (see ``segments.stretches``) go through the inverse and the final adds.
        Single-threaded on a CPU the stretches are cache-sized (``columns_per_advance``), so
        the adds read x while it is in cache; elsewhere a segment is one stretch.

        A whole leaf whose gradient is contiguous and in the compute dtype is added in the
        leaf's shape, straight into its output view (no view of the gradient is made); any
        other add goes 1-D through ``add_noise``, on a flattened copy (``reshape``) of a
        gradient of two or more dimensions, as the values were always formed.
        """
        chunk = columns_per_advance(self.device)
        coefficients = self.inverse.at_step(self._coefficients, step)  # once, for every stretch
        advance = self.inverse.advance
        fill = sampler.fill
        add = torch.add
        plain = kinds == {(self.dtype, torch.strided, True)}  # every leaf: the one-op add
        flattened: dict[int, torch.Tensor] = {}

        def flat_gradient(index: int) -> torch.Tensor:
            gradient = flattened.get(index)
            if gradient is None:
                leaf = leaves[index]
                gradient = flattened[index] = leaf if leaf.dim() == 1 else leaf.reshape(-1)
            return gradient

        def flat_output(index: int) -> torch.Tensor:
            output = outputs[index]
            return output if output.dim() == 1 else output.view(-1)

        def add_whole(index: int, noise: torch.Tensor | None) -> None:
            leaf = leaves[index]
            if noise is None and leaf.dtype == self.dtype and leaf.is_contiguous():
                out = outputs[index]
                add(leaf, out, alpha=scale, out=out)
            else:
                out = flat_output(index)
                add_noise(flat_gradient(index), out if noise is None else noise, out, scale)

        for number, segment in enumerate(self._plan.segments):
            if segment.direct:
                x = flats[segment.output_dtype].narrow(0, segment.output_offset, segment.length)
                for index, block, code, begin, length, whole in segment.draws:        # x <- z
                    # A whole leaf's output view is contiguous: normal_ fills it in memory order.
                    fill(outputs[index] if whole else flat_output(index).narrow(0, begin, length), step, code, block)
            else:
                x = scratch if scratch.numel() == segment.length else scratch.narrow(0, 0, segment.length)
                (index, block, code, _, _, _), = segment.draws
                fill(x, step, code, block)                                            # x <- z
            cut = self._stretches(number, segment, chunk)
            columns = buffers.narrow(1, segment.column, segment.length)
            if len(cut.lengths) == 1:
                parts, column_parts = (x,), (columns,)
            else:  # one split each instead of a narrow per stretch
                parts, column_parts = x.split(cut.lengths), columns.split(cut.lengths, 1)
            for part, column_part, (first, stop), partial in zip(parts, column_parts, cut.wholes, cut.partial):
                advance(part, column_part, coefficients)                              # x <- (C^{-1} z)_t
                if not segment.direct:
                    if partial is None:
                        add_whole(first, part)
                    else:
                        index, leaf_begin, length = partial
                        add_noise(flat_gradient(index).narrow(0, leaf_begin, length), part,
                                  flat_output(index).narrow(0, leaf_begin, length), scale)
                elif partial is not None:  # a part of a large leaf: the whole stretch
                    index, leaf_begin, length = partial
                    add_noise(flat_gradient(index).narrow(0, leaf_begin, length), part, part, scale)
                elif plain:
                    for index in range(first, stop):
                        out = outputs[index]
                        add(leaves[index], out, alpha=scale, out=out)
                else:
                    for index in range(first, stop):
                        add_whole(index, None)


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
