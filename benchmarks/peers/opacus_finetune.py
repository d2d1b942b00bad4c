"""Opacus peer for benchmarks/finetune_step.py; runs in ../peer-opacus's interpreter, never imported.

    ../peer-opacus/bin/python benchmarks/peers/opacus_finetune.py gpt2 --repeats 7

Builds the same model, data and loss as finetune_step.py (sum of the examples' token-mean
cross-entropies, ``loss_reduction="sum"``), with AdamW, makes them private with Opacus'
per-sample hooks (fixed batches of the nominal size, no Poisson sampling, so the step is the
same work; layers without an Opacus rule, such as transformers' Conv1D and LlamaRMSNorm, go
through its functorch fallback), times its DP step and the non-private step of a copy of the
model on the same batches, alternating, and prints one JSON line: the best step times
(seconds, DP and non-private), the peak of torch's live tensors over two steady-state steps (of the sizes ``--sizes`` gives:
those of finetune_step.py's DP worker) counted from before the dataset and model (``finetune_step.LiveMemory``, as finetune_step.py measures it),
one step's rise above its start, and notes.

GPT-2 passes ``position_ids`` of shape (1, T), broadcast over the batch; Opacus' per-sample
hook on the position embedding needs the batch on dimension 0, so for full GPT-2 fine-tuning
this script passes them expanded to (B, T) (the same embedding rows; a note says so). Opacus
errors are reported in the JSON, not raised.
"""

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune_step import (  # noqa: E402
    WARMUP, LiveMemory, adamw, build_model, per_example_loss, sizes, token_data, trainable,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default="", help="batch sizes of the two memory steps (default: nominal)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    notes = []
    try:
        import opacus
        from opacus import PrivacyEngine

        notes.append(f"opacus {opacus.__version__}, grad_sample_mode='hooks'")
        batch = sizes(args.quick)["batch"]
        with LiveMemory("cpu") as meter:  # live tensors from the dataset on, as finetune_step.py counts
            dataset = token_data(args.quick)
            tokens = dataset.tensors[0]
            model = build_model(args.model, args.quick)
            optimizer = adamw(model)
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch)
            model, optimizer, loader = PrivacyEngine().make_private(
                module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                grad_sample_mode="hooks", poisson_sampling=False, loss_reduction="sum",
            )
            position_ids = None
            if args.model == "gpt2":
                position_ids = torch.arange(tokens.shape[1]).repeat(batch, 1)
                notes.append("position_ids passed expanded to (batch, sequence): Opacus' hook on GPT-2's "
                             "position embedding rejects the broadcast (1, sequence) ids")

            def step(index=[0], model=model, optimizer=optimizer, position_ids=position_ids, size=batch):
                start = (index[0] % (len(tokens) // batch)) * batch
                index[0] += 1
                optimizer.zero_grad()
                positions = None if position_ids is None else position_ids[:1].expand(size, -1).contiguous()
                rows = tokens[start:start + size] if start + size <= len(tokens) else tokens[:size]
                per_example_loss(model, rows, positions).backward()
                optimizer.step()

            for _ in range(WARMUP):
                step()
            # The memory steps take the batch sizes of finetune_step.py's DP worker, so the peaks compare.
            for size in [int(n) for n in args.sizes.split(",") if n] or [batch, batch]:
                meter.step(partial(step, size=size))
        # The non-private step of a copy, on the same batches, alternating (as finetune_step.py
        # times ours), so that Opacus' own ratio does not depend on the load of another moment.
        plain_model = build_model(args.model, args.quick)  # the same weights (seed 0), after the memory count
        plain_step = partial(step, [0], plain_model, adamw(plain_model), None, batch)
        plain_step()
        best = {"dp": math.inf, "plain": math.inf}
        for repeat in range(args.repeats):
            for side in (("dp", "plain") if repeat % 2 == 0 else ("plain", "dp")):
                start = time.perf_counter()
                (step if side == "dp" else plain_step)()
                best[side] = min(best[side], time.perf_counter() - start)
        result = {"seconds": best["dp"], "plain_seconds": best["plain"], "peak": meter.peak, "step": meter.step_peak,
                  "parameters": sum(p.numel() * p.element_size() for p in trainable(model)), "notes": notes}
    except Exception as error:  # the benchmark prints why and goes on
        result = {"error": f"{type(error).__name__}: {str(error)[:400]}", "notes": notes}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
