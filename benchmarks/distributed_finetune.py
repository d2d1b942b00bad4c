"""Private fine-tuning on several processes: one process, replicated (DDP-style) and FSDP2.

A tiny Llama (built from a config, untied embeddings) is fine-tuned in full with AdamW through
``make_private`` for W = 1, 2 and 4 processes (gloo on CPU; ``--device cuda`` uses nccl, one GPU
per rank): one process; W replicas, each clipping its part of every planned batch; W ranks of a
model sharded with ``fully_shard`` (each decoder layer, then the root). For each, per rank: the
median step time over the measured steps (after a warm-up that includes the first step's
coverage check), the peak of torch's live tensors during the measured steps (``LiveMemory`` of
finetune_step.py: the profiler's allocation record on CPU, the caching allocator on CUDA, counted
from before the model was built), and the bytes of parameters, optimizer state and noise state
this rank holds. Ratios are against the one-process run of the same size, measured in the same
invocation. With Opacus installed in its own interpreter (``OPAKE_PEER_OPACUS`` or
../peer-opacus), its FSDP2 ghost clipping (``FSDP2Wrapper``, ``grad_sample_mode="ghost_fsdp"``) runs
the same model and batches beside it (benchmarks/peers/opacus_fsdp.py).

Run: .venv/bin/python benchmarks/distributed_finetune.py [--quick] [--ranks 1 2 4] [--steps 4]
     (``--quick``: tiny sizes, W = 1 and 2, 2 steps, replicated and FSDP2 in one start-up of the ranks)
     [--device cuda]
On a machine with fewer cores than ranks the ranks share cores: step times then measure the
oversubscription, not the scaling; the memory columns are exact either way.
Targets at W = 2: FSDP2 per-rank state <= 0.6x one process; its step no slower than Opacus'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_step import LiveMemory  # noqa: E402

PEER = Path(__file__).resolve().parent / "peers" / "opacus_fsdp.py"
WARMUP = 2


def sizes(quick: bool) -> dict:
    if quick:
        return dict(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, batch=4, tokens=16, examples=64)
    return dict(vocab=2048, hidden=256, intermediate=688, layers=4, heads=4, batch=16, tokens=64, examples=1024)


def build_model(size: dict):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                      intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                                      num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                                      max_position_embeddings=size["tokens"], tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: dict):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, size["vocab"], (size["examples"], size["tokens"]), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def state_bytes(model, optimizer, noise_state=None) -> int:
    """Bytes this rank holds of parameters, optimizer state and noise state (local shards only;
    the Opacus peer has no noise state)."""
    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    if noise_state is not None:
        total += noise_state.buffers.numel() * noise_state.buffers.element_size()
    return total


def timed_steps(meter, batches, one_step, steps: int) -> float:
    """Median seconds of ``one_step(batch)`` over ``steps`` batches after ``WARMUP`` (the first
    step's checks included there); the measured steps run inside ``meter``."""
    times = []
    for step in range(WARMUP + steps):
        batch = next(batches)
        start = time.perf_counter()
        if step < WARMUP:
            one_step(batch)
        else:
            meter.step(lambda: one_step(batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def run(mode: str, size: dict, steps: int, device: str) -> dict:
    """This process's part of one configuration: times, live-tensor peak and state bytes."""
    from torch.distributed.fsdp import fully_shard

    from opake.random import key
    from opake.torch import make_private

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with LiveMemory(device) as meter:
        model = build_model(size).to(device)
        if mode == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private = make_private(module=model, optimizer=optimizer, dataset=Tokens(size), batch_size=size["batch"],
                                   epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0, key=key(0))
        batches = ({name: value.to(device) for name, value in batch.items()} for batch in private.run_data_loader())

        def one_step(batch):
            private.optimizer.zero_grad()
            model(**batch).loss.backward()
            private.optimizer.step()
            sync()

        seconds = timed_steps(meter, batches, one_step, steps)
    return {"step": seconds, "peak": meter.peak, "state": state_bytes(model, optimizer, private.optimizer.noise_state)}


def worker(rank: int, world_size: int, modes: list, size: dict, steps: int, device: str, init: str, out: str):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="file://" + init, rank=rank,
                            world_size=world_size)
    try:
        results = {}
        for mode in modes:
            result = run(mode, size, steps, f"cuda:{rank}" if device == "cuda" else "cpu")
            everyone = [None] * world_size
            dist.all_gather_object(everyone, result)
            results[mode] = everyone
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def measure(mode: str, world_size: int, size: dict, steps: int, device: str) -> list[dict]:
    if world_size == 1 and mode == "single":
        torch.set_num_threads(1)
        return [run("single", size, steps, "cuda:0" if device == "cuda" else "cpu")]
    return measure_modes([mode], world_size, size, steps, device)[mode]


def measure_modes(modes: list, world_size: int, size: dict, steps: int, device: str) -> dict:
    """Each mode in turn on the same ``world_size`` processes (``--quick``: one start-up for both)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        mp.spawn(worker, args=(world_size, modes, size, steps, device, os.path.join(folder, "init"), out),
                 nprocs=world_size)
        return json.loads(Path(out).read_text())


def opacus_interpreter() -> str | None:
    candidate = Path(os.environ.get("OPAKE_PEER_OPACUS") or Path(__file__).resolve().parents[2] / "peer-opacus")
    candidate = candidate / "bin" / "python" if candidate.is_dir() else candidate  # an environment, or its python
    return str(candidate) if candidate.exists() else None


def measure_opacus(world_size: int, size: dict, steps: int, device: str) -> list[dict] | str:
    python = opacus_interpreter()
    if python is None:
        return "not installed (../peer-opacus or OPAKE_PEER_OPACUS)"
    command = [python, str(PEER), "--ranks", str(world_size), "--steps", str(steps), "--device", device,
               "--size", json.dumps(size)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{") or line.startswith("[")]
    if done.returncode != 0 or not lines:
        return f"failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    result = json.loads(lines[-1])
    return result if isinstance(result, list) else result.get("error", "failed")


def _mib(value: float) -> str:
    return f"{value / 2**20:8.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (a smoke test)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-opacus", action="store_true")
    args = parser.parse_args(argv)
    size = sizes(args.quick)
    ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4])
    steps = args.steps or (2 if args.quick else 4)
    if args.device == "cuda" and torch.cuda.device_count() < max(ranks):
        print(f"--device cuda needs {max(ranks)} GPUs, {torch.cuda.device_count()} found")
        return 1
    print(f"tiny Llama, {size['layers']} layers, width {size['hidden']}, vocab {size['vocab']}; batch {size['batch']} "
          f"x {size['tokens']} tokens; AdamW; {steps} measured steps after {WARMUP}; device {args.device}, "
          f"one thread per rank, torch {torch.__version__}, {os.cpu_count()} cores")
    single = measure("single", 1, size, steps, args.device)[0]
    rows = [("one process", 1, [single])]
    for world_size in ranks:
        if world_size == 1:
            continue
        if args.quick:  # one start-up of the processes for both (each mode cleans up after itself)
            both = measure_modes(["replicated", "fsdp2"], world_size, size, steps, args.device)
        else:  # fresh processes per mode: nothing of one mode counts in the other's memory
            both = {mode: measure(mode, world_size, size, steps, args.device) for mode in ("replicated", "fsdp2")}
        rows.append(("replicated", world_size, both["replicated"]))
        rows.append(("FSDP2", world_size, both["fsdp2"]))
        if not args.no_opacus:
            peer = measure_opacus(world_size, size, steps, args.device)
            rows.append(("Opacus ghost_fsdp", world_size, peer))
    print(f"{'run':<19}{'W':>3}  {'step s (max rank)':>17}  {'x one':>6}  {'peak MiB (max)':>14}  {'x one':>6}  "
          f"{'state MiB (max)':>15}  {'x one':>6}")
    for name, world_size, result in rows:
        if isinstance(result, str):
            print(f"{name:<19}{world_size:>3}  {result}")
            continue
        step = max(r["step"] for r in result)
        peak = max(r["peak"] for r in result)
        state = max(r.get("state", 0) for r in result)
        print(f"{name:<19}{world_size:>3}  {step:17.3f}  {step / single['step']:6.2f}  {_mib(peak):>14}  "
              f"{peak / single['peak']:6.2f}  {_mib(state):>15}  {state / single['state']:6.2f}")
    fsdp = {w: r for name, w, r in rows if name == "FSDP2"}
    if 2 in fsdp:
        ratio = max(r["state"] for r in fsdp[2]) / single["state"]
        print(f"FSDP2 at W = 2: per-rank state {ratio:.2f}x one process (target <= 0.6: "
              f"{'met' if ratio <= 0.6 else 'NOT met'})")
        peer = {w: r for name, w, r in rows if name == "Opacus ghost_fsdp"}.get(2)
        if isinstance(peer, list):
            ours, theirs = max(r["step"] for r in fsdp[2]), max(r["step"] for r in peer)
            print(f"FSDP2 at W = 2: step {ours / theirs:.2f}x Opacus ghost_fsdp's (target <= 1: "
                  f"{'met' if ours <= theirs else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
