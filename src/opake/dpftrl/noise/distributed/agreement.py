"""Checks that every rank runs the same noise configuration, and the process-group lookup.

At construction each rank gathers (once, with ``all_gather_object``) a short hash of every
input that determines the noise: key, mechanism, parameters (paths, shapes, dtypes), horizon
and participation, noise multiplier, compute dtype, ownership mode. A difference raises
``RankDisagreementError`` naming the inputs that differ and the ranks, on every rank, before
any noise is drawn. Per step, the distributed stage folds the step counter and the noise
scale of each rank into the data it gathers anyway (see ``gathered``).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from opake.errors import OpakeError

__all__ = ["ProcessGroupError", "RankDisagreementError", "check_agreement", "disagreements",
           "fingerprint_components", "group_rank_and_size"]


class ProcessGroupError(OpakeError, RuntimeError):
    """torch.distributed is unavailable or no process group was initialized."""


class RankDisagreementError(OpakeError, RuntimeError):
    """Ranks were given different noise configurations, steps or scales."""


def group_rank_and_size(process_group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError(
            "the distributed noise stage needs a torch.distributed process group, and none is "
            "initialized; call torch.distributed.init_process_group(...) first (e.g. backend "
            "'gloo' on CPU, 'nccl' on GPUs), or use mf_gaussian_noise for one process"
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _short_hash(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def check_agreement(components: dict, process_group) -> None:
    """Raise ``RankDisagreementError`` unless every rank passed equal ``components``.

    ``components`` maps a readable name (e.g. "key") to a value whose ``repr`` determines it;
    only short hashes travel (the key itself never leaves the rank).
    """
    mine = {name: _short_hash(value) for name, value in components.items()}
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    differing = [f"{name} (ranks grouped by value: {sorted(groups.values())})"
                 for name, groups in disagreements(everyone, mine).items()]
    if differing:
        raise RankDisagreementError(
            f"the ranks disagree on {', '.join(differing)}; every rank must build the distributed "
            f"noise stage with the same grad_template, strategy, n_steps, min_sep, "
            f"max_participations, noise_multiplier, key, dtype and ownership, otherwise they "
            f"would add different noise"
        )


def disagreements(everyone: list, names) -> dict:
    """For each of ``names`` on which the gathered dicts ``everyone`` (one per rank) differ: the
    ranks grouped by the ``repr`` of their value (value -> ranks, in rank order)."""
    found = {}
    for name in names:
        groups: dict = {}
        for rank, values in enumerate(everyone):
            groups.setdefault(repr(values.get(name) if isinstance(values, dict) else None), []).append(rank)
        if len(groups) > 1:
            found[name] = groups
    return found


def fingerprint_components(layout, mechanism_fingerprint: str, inverse, participation, noise_multiplier: float,
                           key, dtype: torch.dtype, ownership: str) -> dict:
    """The inputs that determine the noise, by readable name (for ``check_agreement``)."""
    return {
        "key": key.hex(),
        "strategy": (mechanism_fingerprint, inverse.describe()),
        "parameters (paths, shapes, dtypes)": (
            layout.fingerprint, tuple(str(slot.dtype) for slot in layout.leaves)),
        "n_steps/min_sep/max_participations": repr(participation),
        "noise_multiplier": repr(float(noise_multiplier)),
        "dtype": str(dtype),
        "ownership": ownership,
    }
