"""Keyed standard-normal draws: z for (key, step, parameter path, block) and nothing else.

Each parameter tensor (leaf) is cut into fixed blocks of ``BLOCK_ELEMENTS`` consecutive
elements (the last block of a leaf may be shorter). Block j of leaf p at step t is filled by a
torch generator on the tensor's device whose whole state is derived from
``key.derive_bytes("noise", (t, p, j))``; the draw is one ``normal_`` call over the block. So an
element's z depends only on (key, step, leaf path, element index) and the leaf's size, never on
which other leaves exist, their order, how the model is sharded, or where a run was resumed;
a rank that owns some leaves or some blocks reproduces their noise exactly.

Why the whole generator state and not ``manual_seed``: torch's CPU generator (a Mersenne
Twister) keeps only the low 32 bits of a manual seed. A run draws one block per (step, block),
easily 1e5 to 1e8 blocks; with 2**32 seeds some blocks would get the *same* z (birthday bound),
and two coordinates with identical noise leak their difference with no noise at all. The CPU
path therefore writes all 624 words of the Twister's state from 2496 derived bytes (the layout
is checked once against a known seeding, and refused with a clear error if torch changes it).
Other devices (CUDA, ...) use Philox, whose ``manual_seed`` takes the full 64 bits: with 1e8
blocks per run the chance of any seed collision is below 1e-3 of a percent (n^2 / 2^65).

Values differ between device types (different generators) and between compute dtypes (the
float32 and float64 normal kernels differ): the key determines the noise for a given device
type and dtype. On CUDA, torch's normal kernel spreads one Philox stream over a launch grid
whose size depends on the GPU's multiprocessor count once a block needs more thread blocks
than the GPU runs at once, so two GPU models may also give different values. A checkpoint
therefore resumes bit-identically on the same device type (and GPU model); resumed elsewhere it
continues with other draws that are just as independent and standard normal, so the
guarantee is unchanged but the stream is not the same.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from opake.errors import InvalidArgumentError, InvalidStateError, InvalidTypeError
from opake.random import RngKey, encode_parts

__all__ = ["BLOCK_ELEMENTS", "BlockSampler", "path_code"]

BLOCK_ELEMENTS = 2**20
"""Elements per independently seeded block (4 MiB of float32): the sharding granularity."""

_DOMAIN = "opake.dpftrl.noise"

# Layout of torch's CPU generator state (CPUGeneratorImplState, torch >= 1.5): a legacy header
# of the initial seed (u64), `left` (i32), `seeded` (i32), `next` (u64), then the 624 Twister
# words stored one per u64, then the normal-sample caches.
_MT_WORDS = 624
_MT_STATE_BYTES = 5056
_MT_WORDS_OFFSET = 24


def path_code(path: tuple) -> bytes:
    """Canonical bytes for a pytree path (a tuple of dict keys and sequence indices)."""
    for entry in path:
        if isinstance(entry, bool) or not isinstance(entry, (int, str)):
            raise InvalidTypeError(
                f"pytree keys must be str or int to name parameters in the noise derivation; the "
                f"path {path!r} has {entry!r} ({type(entry).__name__}). Use string keys, e.g. "
                f"dict(model.named_parameters())"
            )
    return encode_parts(path)


def _init_genrand_word(seed: int, index: int) -> int:
    # Knuth's initialisation of MT19937 (as in the reference implementation and in torch).
    word = seed & 0xFFFFFFFF
    for i in range(1, index + 1):
        word = (1812433253 * (word ^ (word >> 30)) + i) & 0xFFFFFFFF
    return word


@functools.lru_cache(maxsize=1)
def _cpu_state_template() -> np.ndarray:
    """A valid CPU generator state whose Twister words the sampler overwrites, layout-checked."""
    probe_seed = 0x2545F491
    generator = torch.Generator()
    generator.manual_seed(probe_seed)
    state = generator.get_state().numpy().copy()
    header = state[:_MT_WORDS_OFFSET]
    words = state[_MT_WORDS_OFFSET:_MT_WORDS_OFFSET + 8 * _MT_WORDS].view(np.uint64)
    layout_ok = (
        state.shape == (_MT_STATE_BYTES,)
        and int(header[:8].view(np.uint64)[0]) == probe_seed
        and header[8:16].view(np.int32).tolist() == [1, 1]
        and [int(words[i]) for i in (0, 1, 2, 623)] == [_init_genrand_word(probe_seed, i) for i in (0, 1, 2, 623)]
    )
    if not layout_ok:
        raise InvalidStateError(
            f"torch {torch.__version__} stores its CPU generator state in a layout this opake "
            f"version does not know, so it cannot seed CPU noise with the full key; use the "
            f"torch version opake was tested with or report this"
        )
    return state


class BlockSampler:
    """Fills one block with N(0, 1) draws determined by (key, step, path, block index).

    Holds one reusable ``torch.Generator`` for its device; every call overwrites that
    generator's whole state, so no randomness carries over between calls.
    """

    def __init__(self, key: RngKey, device: torch.device):
        if not isinstance(key, RngKey):
            raise InvalidTypeError(
                f"key must be an opake.random.RngKey (use opake.random.key(seed)), got {type(key).__name__}"
            )
        self.key = key
        self.device = torch.device(device)
        try:
            self._generator = torch.Generator(device=self.device)
        except RuntimeError as exc:
            raise InvalidArgumentError(
                f"cannot draw noise on device {self.device} ({exc}); build the engine from a "
                f"grad_template on a CPU or accelerator device"
            ) from None
        self._cpu = self.device.type == "cpu"
        self._derive = key.deriver(_DOMAIN)
        self._suffixes: dict[tuple[bytes, int], bytes] = {}  # (path, block) -> their encoding
        self._step_code: tuple[int | None, bytes] = (None, b"")  # (step, its encoding)
        if self._cpu:
            self._state = _cpu_state_template().copy()
            self._state_tensor = torch.from_numpy(self._state)  # shares memory with _state
            self._words = self._state[_MT_WORDS_OFFSET:_MT_WORDS_OFFSET + 8 * _MT_WORDS].view(np.uint64)

    def _seed_bytes(self, step: int, path: bytes, block_index: int, size: int) -> bytes:
        # The derivation input is encode_parts((step, path, block_index)); the (path, block)
        # part is cached, since every step reuses it, and so is the current step's part.
        suffix = self._suffixes.get((path, block_index))
        if suffix is None:
            suffix = self._suffixes.setdefault((path, block_index), encode_parts((path, block_index)))
        if self._step_code[0] != step:
            self._step_code = (step, encode_parts((step,)))
        return self._derive.encoded(self._step_code[1] + suffix, size)

    def fill(self, block: torch.Tensor, step: int, path: bytes, block_index: int) -> None:
        """Overwrite the 1-D contiguous ``block`` with its standard normals."""
        if self._cpu:
            self._words[:] = np.frombuffer(self._seed_bytes(step, path, block_index, 4 * _MT_WORDS), dtype=np.uint32)
            # left = 1 in the header makes the generator regenerate (twist) all words before
            # its first output, so every output depends on every derived word.
            self._generator.set_state(self._state_tensor)
        else:
            seed = int.from_bytes(self._seed_bytes(step, path, block_index, 8), "little")
            self._generator.manual_seed(seed)
        block.normal_(generator=self._generator)


class PerDrawKey:
    """One drawing object per draw key: the stage's own key's, built once, and a few others.

    States copied or restored with a fresh key draw with another key (``engine.state``); their
    samplers (or distributed streams) are cached, at most ``CAPACITY``, oldest evicted first,
    so the common path, a state drawing with the stage's own key, is one key comparison.
    ``make(key)`` builds the object for a key.
    """

    CAPACITY = 4

    def __init__(self, key: RngKey, make):
        self.key = key
        self._make = make
        self.own = make(key)
        self._others: dict = {}

    def __call__(self, draw_key: RngKey):
        if draw_key == self.key:
            return self.own
        found = self._others.get(draw_key)
        if found is None:
            if len(self._others) >= self.CAPACITY:
                del self._others[next(iter(self._others))]
            found = self._others[draw_key] = self._make(draw_key)
        return found
