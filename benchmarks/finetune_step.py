"""The DP fine-tuning step of tiny Hugging Face models against the non-private step, in one run.

For each model (built from a config: nothing is downloaded), in one process, one training step
``zero_grad(); loss.backward(); step()`` with AdamW:

- ``gpt2``: GPT-2 (``GPT2LMHeadModel``, 4 layers, width 128, 4 heads, vocabulary 2048, tied
  input and output embeddings), every parameter trained;
- ``gpt2-lora``: the same GPT-2 with PEFT LoRA (rank 8 on ``c_attn`` and both ``c_proj``), only
  the adapters trained;
- ``llama``: ``LlamaForCausalLM`` (4 layers, width 128, MLP 352, vocabulary 2048), every
  parameter trained;
- ``gpt2-768``: GPT-2 at its real width (2 layers, width 768, 12 heads, vocabulary 2048),
  sequence 256, batch 4 (issue 38; its sizes are its own: ``sizes(quick, name)``);

the others at sequence 64, batch 16 (``--quick``, every model: a smoke test of every path in
seconds, 1 layer, width 32, sequence 16, batch 4, 2 repeats, memory in this process, no peer).
The DP step goes through
``opake.torch.make_private`` (per-example clipping in backward, BLT noise in ``step``) and is fed
by ``private.run_data_loader()`` (balls in bins: the batch sizes vary around the nominal one,
and ``step()`` refuses batches the planned loader did not serve); the
non-private step of an identical copy of the model, with the same AdamW, takes the same batch
right before or after it (the order alternates, so a burst of load elsewhere slows both sides).
The loss is the sum over examples of each example's token-mean cross-entropy, computed from the
logits (``loss_reduction="sum"``); Hugging Face's ``outputs.loss`` divides by the batch's token
count, which couples the examples and is not a valid DP loss.

Throughput: best of ``--repeats`` (15) of the time per example, times the nominal batch size
(so steps of different sizes compare), on each side; ratio = non-private / DP time (throughput
ratio), from the wall clock, and beside it the same from process CPU time (with one thread, less
moved by other work on a shared machine) and the median of the per-batch wall ratios.

Memory, in a fresh subprocess per configuration (so one model's tensors never count in
another's), both DP against non-private on batches of the same sizes:

- ``peak``: the peak of torch's live tensors over two steady-state steps (after two warm-up
  steps), counted from before the dataset and model were built: weights, gradients, AdamW
  state, the noise buffers, activations and the clipper's tensors. This is the targets'
  measure. On CPU it comes from the profiler's ordered record of every allocation and release
  (``LiveMemory``); on CUDA from ``torch.cuda.max_memory_allocated``. The peak resident set was
  tried and rejected: in a fresh process the first steps touch about 150 MiB of library code
  pages and allocator state, which dwarfs these models' 15-60 MiB of tensors and moves by
  more than the difference being measured.
- ``step``: the peak of one step's live tensors above those live when it began (what
  ``training_step.py`` reports), which leaves out weights, optimizer state and noise buffers.

Targets (issue 38; ``TARGETS``): throughput ratio GPT-2 >= 0.8 (tiny) and >= 0.9 (width 768),
Llama >= 0.8, LoRA >= 0.95; peak memory <= 1.1x for every model. Opacus 1.6 runs the same models
and loss when ``../peer-opacus`` (or ``$OPAKE_PEER_OPACUS``) holds it with transformers and peft,
through ``peers/opacus_finetune.py``
in that interpreter (never imported), which times Opacus' DP step against a non-private copy
alternating in its own process (that ratio is the comparable one; ours against its time is
printed too but moves with the load of another moment). ``--profile`` breaks the DP step down
(forward, backward, the clipping passes by layer type and rule method, noise, AdamW, in process
CPU time; the profiler's top operators and allocations; what the clipper holds), each stage
against its floor (``stage_profile``, which ``training_step.py --profile`` uses too).

    python benchmarks/finetune_step.py                  # all three models, peers if installed
    python benchmarks/finetune_step.py --quick --peers none
    python benchmarks/finetune_step.py --profile --models gpt2
    python benchmarks/finetune_step.py --models gpt2-768 --peers none --repeats 7
    python benchmarks/finetune_step.py --device cuda --peers none
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
PEER_OPACUS = Path(os.environ.get("OPAKE_PEER_OPACUS", ROOT.parent.parent / "peer-opacus"))
MODELS = ("gpt2", "gpt2-lora", "llama", "gpt2-768")
# name -> (throughput ratio at least, peak-memory ratio at most); None: no target (issue 38).
TARGETS = {"gpt2": (0.8, 1.1), "gpt2-lora": (0.95, 1.1), "llama": (0.8, 1.1), "gpt2-768": (0.9, 1.1)}
PEER_MODELS = ("gpt2", "gpt2-lora", "llama")  # peers/opacus_finetune.py builds these at the default sizes
VOCABULARY = 2048
BINS = 4  # dataset = BINS nominal batches: one epoch of balls in bins is BINS steps
WARMUP = 2  # the first DP step also checks the hooks' coverage (autograd's weight gradients)


def sizes(quick: bool, name: str | None = None) -> dict:
    """Model and batch sizes (of model ``name``: GPT-2 at width 768 has its own); one full-size
    step takes 50-500 ms on one thread of this machine (``gpt2-768``: 2-4 s)."""
    if quick:  # a smoke test of every path (seconds), not a measurement
        return {"layers": 1, "width": 32, "heads": 2, "sequence": 16, "batch": 4}
    if name == "gpt2-768":
        return {"layers": 2, "width": 768, "heads": 12, "sequence": 256, "batch": 4}
    return {"layers": 4, "width": 128, "heads": 4, "sequence": 64, "batch": 16}


def build_model(name: str, quick: bool):
    """The model ``name`` with weights from ``torch.manual_seed(0)``, built from its config."""
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny vocabulary does not hold GPT-2's token ids
    s = sizes(quick, name)
    torch.manual_seed(0)
    if name in ("gpt2", "gpt2-lora", "gpt2-768"):
        config = transformers.GPT2Config(n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"],
                                         vocab_size=VOCABULARY, n_positions=max(128, s["sequence"]),
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        if name == "gpt2-lora":
            import peft

            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
            model = peft.get_peft_model(model, lora)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["width"],
                                          intermediate_size=int(2.75 * s["width"]), num_attention_heads=s["heads"],
                                          num_key_value_heads=s["heads"], vocab_size=VOCABULARY,
                                          max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model.train()


def token_data(quick: bool, name: str | None = None) -> torch.utils.data.TensorDataset:
    """BINS nominal batches of random token sequences (one tensor: the inputs are the targets)."""
    s = sizes(quick, name)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randint(0, VOCABULARY, (BINS * s["batch"], s["sequence"]), generator=generator))


def per_example_loss(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the examples of each one's mean next-token cross-entropy (a valid DP sum loss)."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    logits = model(input_ids=tokens, **extra).logits[:, :-1]
    targets = tokens[:, 1:]
    token_losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return token_losses.view(targets.shape).mean(dim=1).sum()


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def adamw(model):
    return torch.optim.AdamW(trainable(model), lr=1e-4)


def make_run(model, dataset, quick: bool, steps: int):
    """``make_private`` over ``model`` with AdamW, planned for at least ``steps`` steps.

    The unamplified accountant (``amplification=False``): the step is the same either way, and
    its epsilon takes milliseconds where the amplified bound takes about a second.
    """
    from opake.random import key
    from opake.torch import make_private

    return make_private(module=model, optimizer=adamw(model), dataset=dataset, batch_size=len(dataset) // BINS,
                        epochs=math.ceil(steps / BINS) + 1, noise_multiplier=1.0, target_delta=1e-5,
                        max_grad_norm=1.0, key=key(0), loss_reduction="sum", amplification=False)


def private_batches(private):
    """The DP run's batches, from the loader ``step()`` accepts (``run_data_loader()`` if there is one)."""
    loader = private.run_data_loader() if callable(getattr(private, "run_data_loader", None)) else private.data_loader
    for batch in loader:
        yield batch[0] if isinstance(batch, (list, tuple)) else batch


def step_function(model, optimizer, sync):
    def step(tokens):
        optimizer.zero_grad()
        per_example_loss(model, tokens).backward()
        optimizer.step()
        sync()

    return step


def _sync(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


# -- memory ----------------------------------------------------------------------------------


class LiveMemory:
    """Torch's live tensor bytes, counted from ``__enter__``: the peak over the steps run through
    ``step()``, and each such step's rise above what was live when it began.

    CPU: the profiler's ordered record of every allocation and release (torch's CPU allocator is
    invisible to tracemalloc); each measured step is a ``record_function`` window. CUDA: the
    caching allocator's ``memory_allocated`` / ``max_memory_allocated``.
    """

    WINDOW = "finetune_step.measured"

    def __init__(self, device: str = "cpu"):
        self.cuda = device.startswith("cuda")
        self.peak = self.step_peak = 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def step(self, function) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            function()
            torch.cuda.synchronize()
            top = torch.cuda.max_memory_allocated()
            self.peak, self.step_peak = max(self.peak, top - self._base), max(self.step_peak, top - start)
        else:
            with torch.profiler.record_function(self.WINDOW):
                function()

    def __exit__(self, *exc):
        if self.cuda:
            return False
        self._profiler.__exit__(*exc)
        events = list(self._profiler.profiler.kineto_results.events())
        windows = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == self.WINDOW)
        memory = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"))
        live, index = 0, 0
        for begin, end in windows:
            while index < len(memory) and memory[index][0] < begin:
                live += memory[index][1]
                index += 1
            at_start = top = live
            while index < len(memory) and memory[index][0] <= end:
                live += memory[index][1]
                top = max(top, live)
                index += 1
            self.peak, self.step_peak = max(self.peak, top), max(self.step_peak, top - at_start)
        return False


def memory_worker(name: str, mode: str, quick: bool, device: str, batch_sizes: list[int]) -> dict:
    """One configuration in a fresh process: its peak of live tensors and one step's rise.

    Everything from the dataset on is counted (the model, AdamW state, noise buffers). After
    WARMUP steps two steps are measured. ``dp`` iterates the private loader and reports the
    sizes of the measured batches; ``plain`` runs batches of the sizes given (the DP worker's).
    """
    sync = _sync(device)
    with LiveMemory(device) as meter:
        dataset = token_data(quick, name)
        tokens = dataset.tensors[0]
        model = build_model(name, quick).to(device)
        if mode == "dp":
            private = make_run(model, dataset, quick, WARMUP + 2)
            step = step_function(model, private.optimizer, sync)
            batches = private_batches(private)
        else:
            step = step_function(model, adamw(model), sync)
            nominal = sizes(quick, name)["batch"]
            batches = iter([tokens[:nominal]] * WARMUP + [tokens[:n] for n in batch_sizes])
        for _ in range(WARMUP):
            step(next(batches).to(device))
        measured = []
        for _ in range(2):  # one batch at a time: a DP step must take the batch served last
            measured.append(next(batches).to(device))
            meter.step(lambda: step(measured[-1]))
    result = {"peak": meter.peak, "step": meter.step_peak, "sizes": [len(batch) for batch in measured],
              "parameters": sum(p.numel() * p.element_size() for p in trainable(model))}
    if mode == "dp":
        buffers = private.optimizer.noise_state.buffers
        result["noise_buffers"] = buffers.numel() * buffers.element_size()
    return result


def run_memory_worker(name: str, mode: str, args, batch_sizes=()) -> dict:
    if args.quick:  # the smoke test runs the worker in this process (its figures then count what is live here)
        return memory_worker(name, mode, True, args.device, list(batch_sizes))
    command = [sys.executable, __file__, "--memory-worker", name, mode, "--threads", str(args.threads),
               "--device", args.device, "--sizes", ",".join(map(str, batch_sizes))]
    if args.quick:
        command.append("--quick")
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT.parent)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- throughput ------------------------------------------------------------------------------


def time_model(name: str, quick: bool, repeats: int, device: str) -> dict:
    """DP and non-private steps on the same batches, alternating; per-example best and ratios."""
    sync = _sync(device)
    dataset = token_data(quick, name)
    dp_model = build_model(name, quick).to(device)
    plain_model = copy.deepcopy(dp_model)
    private = make_run(dp_model, dataset, quick, WARMUP + repeats)
    dp_step = step_function(dp_model, private.optimizer, sync)
    plain_step = step_function(plain_model, adamw(plain_model), sync)
    pairs = []  # (examples, {side: wall seconds}, {side: CPU seconds})
    for index, batch in enumerate(private_batches(private)):
        if index == WARMUP + repeats:
            break
        batch = batch.to(device)
        wall, cpu = {}, {}
        for side in (("dp", "plain") if index % 2 == 0 else ("plain", "dp")):
            start, start_cpu = time.perf_counter(), time.process_time()
            (dp_step if side == "dp" else plain_step)(batch)
            wall[side], cpu[side] = time.perf_counter() - start, time.process_time() - start_cpu
        if index >= WARMUP and len(batch):
            pairs.append((len(batch), wall, cpu))
    nominal = sizes(quick, name)["batch"]

    def best(clock: int, side: str) -> float:
        return min(pair[clock][side] / pair[0] for pair in pairs) * nominal

    return {"plain_s": best(1, "plain"), "dp_s": best(1, "dp"), "ratio": best(1, "plain") / best(1, "dp"),
            "cpu_ratio": best(2, "plain") / best(2, "dp"),
            "median_ratio": statistics.median(wall["plain"] / wall["dp"] for _, wall, _ in pairs),
            "sizes": [pair[0] for pair in pairs], "noise_multiplier": private.noise_multiplier}


def run_opacus(name: str, args, batch_sizes=()) -> dict | None:
    python = PEER_OPACUS / "bin" / "python"
    if not python.exists() or name not in PEER_MODELS:
        return None
    command = [str(python), str(ROOT / "peers" / "opacus_finetune.py"), name, "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--sizes", ",".join(map(str, batch_sizes))] + \
        (["--quick"] if args.quick else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT.parent)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as error:
        tail = (done.stderr.strip().splitlines() or [""])[-1] if "done" in locals() else ""
        return {"error": f"{type(error).__name__} {tail}"}


# -- profile ---------------------------------------------------------------------------------


class _Timer:
    """Wraps callables (restored by ``restore``) and adds up their process CPU time under a label,
    and the bytes ``size(args, result)`` says they hold (``sizes``, the largest call's);
    ``before(args)`` runs ahead of each call."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.sizes: dict[str, int] = {}
        self._undo = []

    def wrap(self, owner, attribute: str, label, size=None, before=None):
        original = getattr(owner, attribute)
        totals, sizes_held = self.totals, self.sizes

        def timed(*args, **kwargs):
            if before is not None:
                before(args)
            start = time.process_time()
            key = label(args) if callable(label) else label
            try:
                result = original(*args, **kwargs)
                if size is not None:
                    sizes_held[key] = max(sizes_held.get(key, 0), size(args, result))
                return result
            finally:
                totals[key] = totals.get(key, 0.0) + time.process_time() - start

        instance_attribute = attribute in vars(owner) if not isinstance(owner, type(sys)) else True
        self._undo.append((owner, attribute, original, instance_attribute))
        setattr(owner, attribute, timed)

    def restore(self):
        for owner, attribute, original, instance_attribute in reversed(self._undo):
            if instance_attribute:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        self._undo = []


def _dict_bytes(args, result) -> int:
    return sum(t.numel() * t.element_size() for t in result.values())


def _held_gradient_bytes(args, result) -> int:
    """Bytes of the output gradients that the hooks kept for ``clip_forward_pass(calls, ...)``."""
    return sum(g.numel() * g.element_size() for call in args[0] for g in call.grads if g is not None)


def machine_rates() -> dict:
    """This thread's best rates, the units of the floors: multiply-adds per second of a large
    matrix product (1024^3, float32) and bytes per second of one read pass over 16 MiB (in the
    last-level cache here) and over 128 MiB (memory)."""
    a, b, x, y = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.randn(2**22), torch.randn(2**25)

    def best(function) -> float:  # this thread's CPU time: a loaded machine's waits left out
        times = []
        for _ in range(10):
            start = time.thread_time()
            function()
            times.append(time.thread_time() - start)
        return min(times)

    return {"madds": 1024**3 / best(lambda: a @ b), "bytes": 4 * x.numel() / best(lambda: torch.linalg.vector_norm(x)),
            "memory bytes": 4 * y.numel() / best(lambda: torch.linalg.vector_norm(y))}


def clipping_floor(calls, rates: dict) -> dict:
    """The least time (s) per-example clipping must add to the plain backward for one forward
    pass's hooked layer ``calls`` (bookkeeping.LayerCall, taken before the pass is clipped), by
    layer type. The clipped sum is the plain weight gradient with each example's rows weighted, so
    its floor is the plain backward's own contraction plus one scaling pass; what is added is the
    per-example norms. Per weight of T positions per example, in x out (a convolution: T output
    positions, in = in_channels/groups x kernel), the cheaper of
    - ghost norms: the two T x T Gram matrices, B T^2 (in + out) multiply-adds, plus the scaling
      pass over B T min(in, out);
    - kept per-example gradients (book-keeping): forming them replaces the weight gradient's
      contraction; writing them, reading them for the norms and for the sum: 3 passes over B in out;
    T = 1: ||a|| ||g||, one pass over B (in + out). An Embedding: the cheaper of its ghost norm
    (B T^2 d) and its B T rows, formed and read (2 passes). Other layers (LayerNorm, RMSNorm,
    biases): their B x P per-example gradients written and read twice (3 passes). A lower bound:
    every product at the large product's rate, every pass at one read pass's rate (the cache's up
    to 16 MiB, memory's above), and a tied table's cross term left out."""
    matmul = lambda madds: madds / rates["madds"]  # noqa: E731

    def passes(elements, count):
        return count * 4 * elements / rates["bytes" if 4 * elements <= 2**24 else "memory bytes"]

    floors: dict = {}
    for call in calls:
        grad = next((g for g in call.grads if g is not None), None)
        if grad is None:
            continue
        module, batch = call.layer.module, grad.shape[0]
        kind = type(module).__name__
        names = call.layer.local_names
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) and "weight" in names:
            width = weight.shape[1]
            length = grad[0].numel() // width
            seconds = min(matmul(batch * length**2 * width), passes(batch * length * width, 2))
        elif "weight" in names and weight is not None and weight.dim() >= 2:
            width_out = weight.shape[1] if kind == "Conv1D" else weight.shape[0]
            width_in = weight.numel() // width_out
            length = grad[0].numel() // width_out
            if length == 1:
                seconds = passes(batch * (width_in + width_out), 1)
            else:
                ghost = matmul(batch * length**2 * (width_in + width_out)) + \
                    passes(batch * length * min(width_in, width_out), 2)
                seconds = min(ghost, passes(batch * width_in * width_out, 3))
            seconds += sum(passes(batch * p.numel(), 3) for n, p in zip(names, call.layer.parameters) if n != "weight")
        else:
            seconds = sum(passes(batch * p.numel(), 3) for p in call.layer.parameters)
        floors[kind] = floors.get(kind, 0.0) + seconds
    return floors


STAGES = ("forward", "backward: autograd", "  per-example gradients formed", "  per-example norms",
          "  clipped sums", "backward, all", "noise", "optimizer", "other (step)", "total")


def stage_profile(title: str, private, dp_model, plain_model, plain_optimizer, loss_of, batches, nominal: int,
                  repeats: int) -> dict:
    """The DP step against the plain one by stage, each against its floor (ms per nominal batch,
    process CPU time, best of ``repeats`` per stage), printed and returned.

    The steps alternate on the same planned batches (``batches``: the private run's; ``loss_of(model,
    batch)``). Inside the DP backward, the clipping passes (``bookkeeping.clip_forward_pass``) split
    into pass 1 (``_grant_kept`` and ``_example_squares``: the per-example gradients a rule forms,
    kept or small, and the norms) and pass 2 (the factors and the clipped sums); the DP step's noise
    (``noise_fn``) and optimizer step are timed inside ``step()``. Floors: forward, the plain one;
    the whole backward, the plain one plus ``clipping_floor``; noise, ``noise_engine.py``'s floor
    (``torch.randn`` of the d noised values plus one pass over the (buffers, d) state), measured
    here; optimizer, the plain one. Also prints each wrapped part's best (the "inside" line)."""
    import opake.torch.per_example.bookkeeping as bookkeeping
    import opake.torch.per_example.clipper as clipper_module
    from opake.torch.per_example.rules import rule_for, tied

    def count(batch) -> int:
        return len(batch[-1]) if isinstance(batch, (tuple, list)) else len(batch)

    def step(model, optimizer, batch, clock=None):
        optimizer.zero_grad()
        t0 = time.process_time()
        loss = loss_of(model, batch)
        t1 = time.process_time()
        loss.backward()
        t2 = time.process_time()
        inside_backward = dict(timer.totals)
        optimizer.step()
        t3 = time.process_time()
        return t1 - t0, t2 - t1, t3 - t2, inside_backward

    timer = _Timer()
    rates = machine_rates()
    for _ in range(WARMUP):  # the first DP step checks the hooks' coverage (a backward of its own)
        batch = next(batches)
        step(dp_model, private.optimizer, batch)
        step(plain_model, plain_optimizer, batch)
    optimizer_label = f"{type(private.optimizer.original_optimizer).__name__} step"
    for rule in {id(rule): rule for rule in map(rule_for, dp_model.modules())}.values():
        for method in ("store", "squared_norms", "clipped_sums", "per_example_grads"):
            if hasattr(rule, method):
                size = _dict_bytes if method == "per_example_grads" else None
                timer.wrap(rule, method, lambda args, m=method: f"{type(args[0]).__name__}.{m}", size)
    timer.wrap(tied, "per_example_grads", "tied table.per_example_grads")
    timer.wrap(bookkeeping, "_grant_kept", "pass 1")
    timer.wrap(bookkeeping, "_example_squares", "pass 1")
    floor = {}  # the clipping floor of the last pass, by layer type, and its batch size

    def capture(args):  # before the pass: it drops the stored tensors of the layers it keeps
        calls = [call for call in args[0] if call.received]
        floor.update(by_type=clipping_floor(calls, rates), batch=calls[0].batch_size if calls else nominal)
        held = _held_gradient_bytes(args, None)
        timer.sizes["clipping passes (all)"] = max(timer.sizes.get("clipping passes (all)", 0), held)

    timer.wrap(clipper_module, "clip_forward_pass", "clipping passes (all)", before=capture)
    timer.wrap(private.run, "noise_fn", "noise (noise_fn)")
    timer.wrap(private.optimizer.clipper, "clipped_sum", "clipped_sum() copy")
    timer.wrap(private.optimizer.original_optimizer, "step", optimizer_label)
    # make_private steps a plain AdamW with its second moment corrected for the noise (by default):
    # that step is opake's own function, not the optimizer's step method
    timer.wrap(sys.modules["opake.torch.optimizer"], "corrected_adam_step", optimizer_label)
    best = {"plain": {}, "dp": {}}
    parts: dict[str, float] = {}  # best of the repeats for each wrapped part

    def keep(side, stage, seconds):
        best[side][stage] = min(best[side].get(stage, math.inf), seconds)

    try:
        for _ in range(repeats):
            batch = next(batches)
            examples = count(batch)
            if not examples:  # an empty planned batch: its step releases noise only
                private.optimizer.zero_grad()
                private.optimizer.step()
                continue
            scale = nominal / examples  # per nominal batch, as the main tables
            timer.totals.clear()
            forward, backward, after, inside = step(dp_model, private.optimizer, batch)
            totals = timer.totals
            clipping, pass1 = inside.get("clipping passes (all)", 0.0), inside.get("pass 1", 0.0)
            formed = sum(v for k, v in inside.items() if k.endswith("per_example_grads"))
            noise, optimizer = totals.get("noise (noise_fn)", 0.0), totals.get(optimizer_label, 0.0)
            stages = {"forward": forward, "backward: autograd": backward - clipping,
                      "  per-example gradients formed": formed, "  per-example norms": pass1 - formed,
                      "  clipped sums": clipping - pass1, "backward, all": backward, "noise": noise,
                      "optimizer": optimizer, "other (step)": after - noise - optimizer,
                      "total": forward + backward + after}
            for stage, seconds in stages.items():
                keep("dp", stage, seconds * scale)
            for part, seconds in totals.items():
                parts[part] = min(parts.get(part, math.inf), seconds * scale)
            forward, backward, after, _ = step(plain_model, plain_optimizer, batch)
            for stage, seconds in (("forward", forward), ("backward: autograd", backward), ("backward, all", backward),
                                   ("optimizer", after), ("total", forward + backward + after)):
                keep("plain", stage, seconds * scale)
    finally:
        timer.restore()
    by_type, floor_scale = floor.get("by_type", {}), nominal / max(1, floor.get("batch", nominal))
    clip_floor = sum(by_type.values()) * floor_scale
    buffers = private.optimizer.noise_state.buffers
    state, normals = torch.zeros_like(buffers), torch.empty(buffers.shape[-1])
    noise_floor = math.inf
    for _ in range(max(5, repeats)):
        start = time.process_time()
        torch.randn(normals.shape, out=normals)
        state.add_(normals)
        noise_floor = min(noise_floor, time.process_time() - start)
    plain, dp = best["plain"], best["dp"]
    floors = {"forward": plain["forward"], "backward, all": plain["backward, all"] + clip_floor,
              "noise": noise_floor, "optimizer": plain["optimizer"], "other (step)": 0.0}
    floors["total"] = sum(floors.values())
    print(f"\nstages of {title} (ms per nominal batch of {nominal}; process CPU time, best of {repeats} per "
          f"stage; floor: what the step must do at least)")
    print(f"  {'stage':<32} {'plain':>8} {'DP':>8} {'floor':>8} {'DP-floor':>8}")
    for stage in STAGES:
        cells = [plain.get(stage), dp.get(stage), floors.get(stage)]
        text = " ".join(f"{'-' if v is None else format(v * 1e3, '.1f'):>8}" for v in cells)
        over = f"{(dp[stage] - floors[stage]) * 1e3:>+8.1f}" if stage in floors else ""
        print(f"  {stage:<32} {text} {over}")
    print(f"  backward floor = plain backward + least clipping extra {clip_floor * 1e3:.1f} ms (" + ", ".join(
        f"{kind} {seconds * floor_scale * 1e3:.2f}" for kind, seconds in sorted(by_type.items(), key=lambda kv: -kv[1]))
        + f"); rates: {rates['madds'] * 2e-9:.0f} GFLOP/s, read {rates['bytes'] * 1e-9:.0f} GB/s (cache), "
        f"{rates['memory bytes'] * 1e-9:.0f} GB/s (memory); noise floor over "
        f"{buffers.shape[0]} x {buffers.shape[-1]} buffers")
    print(f"  throughput ratio plain/DP (total): {plain['total'] / dp['total']:.3f}; at the floor: "
          f"{plain['total'] / floors['total']:.3f}")
    print("  inside the DP step (ms, each part's best): " + "; ".join(
        f"{k} {v * 1e3:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])))
    print("  held by the clipper for its passes (MiB): " + "; ".join(
        f"{'output gradients of the hooked calls' if k.startswith('clipping') else k + ' (materialized)'} "
        f"{v / 2**20:.1f}" for k, v in sorted(timer.sizes.items(), key=lambda kv: -kv[1])))
    return {"plain": plain, "dp": dp, "floors": floors, "clip_floor_by_type": by_type, "rates": rates,
            "sizes_held": dict(timer.sizes)}


def profile_model(name: str, quick: bool, repeats: int) -> None:
    """Where the DP step's extra time and memory go, against the non-private step."""
    from torch.profiler import ProfilerActivity, profile

    dataset = token_data(quick, name)
    dp_model = build_model(name, quick)
    plain_model = copy.deepcopy(dp_model)
    private = make_run(dp_model, dataset, quick, 2 * WARMUP + repeats + 2)
    plain_optimizer = adamw(plain_model)
    batches = private_batches(private)
    s = sizes(quick, name)
    stage_profile(f"{name}: {s['layers']} layers, width {s['width']}, sequence {s['sequence']}", private,
                  dp_model, plain_model, plain_optimizer, per_example_loss, batches, s["batch"], repeats)

    batch = next(batches)
    for side, model, optimizer in (("dp", dp_model, private.optimizer), ("plain", plain_model, plain_optimizer)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step_function(model, optimizer, lambda: None)(batch)
        averages = profiler.key_averages()
        top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:12]
        print(f"  {side} step, top operators by self CPU time (ms): " + "; ".join(
            f"{e.key} {e.self_cpu_time_total / 1e3:.1f}" for e in top))
        allocators = sorted(averages, key=lambda e: -e.self_cpu_memory_usage)[:8]
        print(f"  {side} step, top operators by bytes allocated (MiB, net of frees): " + "; ".join(
            f"{e.key} {e.self_cpu_memory_usage / 2**20:.1f}" for e in allocators))
    noise = private.optimizer.noise_state.buffers
    params = sum(p.numel() for p in trainable(dp_model))
    print(f"  held between steps: parameters {params * 4 / 2**20:.1f} MiB, AdamW state {2 * params * 4 / 2**20:.1f} "
          f"MiB, noise buffers {noise.numel() * noise.element_size() / 2**20:.1f} MiB ({noise.shape[0]} buffers)")


# -- report ----------------------------------------------------------------------------------


def _ratio_text(value, floor=None, ceiling=None) -> str:
    """The ratio, with its mark against ``floor`` (at least) or ``ceiling`` (at most), printed with the
    digits that decide the mark: two, or more when two would round it onto the other side of the target
    (0.799 against a floor of 0.80 prints "0.799 MISS", not "0.80 MISS")."""
    if value is None:
        return "-"
    if floor is None and ceiling is None:
        return f"{value:.2f}"

    def meets(x: float) -> bool:
        return x >= floor if floor is not None else x <= ceiling

    digits = 2
    while digits < 6 and meets(round(value, digits)) != meets(value):
        digits += 1
    return f"{value:.{digits}f} {'ok' if meets(value) else 'MISS'}"


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def print_tables(results: dict, s: dict, args) -> None:
    cuda = args.device.startswith("cuda")
    own = sorted({name for name in results if sizes(args.quick, name) != s})
    print(f"{s['layers']} layers, width {s['width']}, sequence {s['sequence']}, batch {s['batch']}" + "".join(
        f"; {name}: {t['layers']} layers, width {t['width']}, {t['heads']} heads, sequence {t['sequence']}, batch "
        f"{t['batch']}" for name, t in ((name, sizes(args.quick, name)) for name in own))
        + f" (the DP batches vary: balls in bins; the non-private step takes the same ones), AdamW, loss: sum of the "
        f"examples' token means; device {args.device}, threads {args.threads}, best of {args.repeats}; load average "
        f"{os.getloadavg()[0]:.1f} (at the end)")
    tunables = {name: value for name, value in os.environ.items() if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES"}
    print("allocator: " + (", ".join(f"{k}={v}" for k, v in sorted(tunables.items())) + " (from the environment)"
                           if tunables else "the C library's defaults"))
    print("\nThroughput. ms: best time per example x the nominal batch (wall clock); ratio = non-private / DP time "
          "(wall; 'CPU': the same from process CPU time, less moved by other load; 'median': of the per-batch "
          "wall ratios). Opacus, in its own process on fixed batches: its DP step's time, its ratio to the "
          "non-private step timed alternating with it there, and 'vs us': our non-private time / its DP time")
    print(f"{'model':<10} {'plain ms':>8} {'DP ms':>8} {'plain/s':>7} {'DP/s':>6} {'ratio':>10} {'CPU':>5} "
          f"{'median':>6} | {'Opacus ms':>9} {'ratio':>6} {'vs us':>6}")
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<10} DP step failed: {result['error'][:400]}")
            continue
        timing, peer = result["timing"], result["opacus"]
        floor = TARGETS.get(name, (None, None))[0]
        if peer is None:
            peer_text = f"{'-':>9} {'-':>6} {'-':>6}"
        elif "error" in peer:
            peer_text = f"failed: {peer['error'][:300]}"
        else:
            peer_text = (f"{peer['seconds'] * 1e3:>9.1f} {peer['plain_seconds'] / peer['seconds']:>6.2f} "
                         f"{timing['plain_s'] / peer['seconds']:>6.2f}")
        print(f"{name:<10} {timing['plain_s'] * 1e3:>8.1f} {timing['dp_s'] * 1e3:>8.1f} {1 / timing['plain_s']:>7.2f} "
              f"{1 / timing['dp_s']:>6.2f} {_ratio_text(timing['ratio'], floor=floor):>10} "
              f"{timing['cpu_ratio']:>5.2f} {timing['median_ratio']:>6.2f} | {peer_text}")
    where = "in this process (--quick)" if args.quick else "fresh process per configuration"
    print(f"\nMemory, {where}. peak: torch's live tensors over 2 steady-state steps, counted "
          "from before the model (" + ("torch.cuda.max_memory_allocated" if cuda else
                                       "the profiler's record of every allocation and release")
          + "): weights, gradients, AdamW state, noise buffers, activations, the clipper's tensors. step: one "
          "step's rise above what was live at its start. MiB")
    print(f"{'model':<10} {'plain':>7} {'DP':>7} {'ratio':>10} | {'step':>7} {'DP step':>7} {'ratio':>5} | "
          f"{'noise buffers':>13} {'params':>7} | {'Opacus':>7} {'step':>7}")
    for name, result in results.items():
        if "error" in result:
            continue
        dp, plain, peer = result["dp_memory"], result["plain_memory"], result["opacus"]
        if "error" in dp or "error" in plain:
            print(f"{name:<10} memory worker failed: {dp.get('error') or plain.get('error')}")
            continue
        ceiling = TARGETS.get(name, (None, None))[1]
        peer_text = f"{_mib(peer['peak']):>7} {_mib(peer['step']):>7}" if peer and "error" not in peer else \
            f"{'-':>7} {'-':>7}"
        print(f"{name:<10} {_mib(plain['peak']):>7} {_mib(dp['peak']):>7} "
              f"{_ratio_text(dp['peak'] / plain['peak'], ceiling=ceiling):>10} | {_mib(plain['step']):>7} "
              f"{_mib(dp['step']):>7} {dp['step'] / plain['step']:>5.2f} | {_mib(dp['noise_buffers']):>13} "
              f"{_mib(dp['parameters']):>7} | {peer_text}")
    notes = {note for result in results.values() for note in ((result.get("opacus") or {}).get("notes") or [])}
    for note in sorted(notes):
        print(f"Opacus: {note}")
    print("targets (issue 38): throughput gpt2 >= 0.8, gpt2-768 >= 0.9, llama >= 0.8, gpt2-lora >= 0.95; "
          "peak memory <= 1.1 for each")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 layer, width 32, sequence 16, batch 4, 2 repeats, no peer: a smoke test (seconds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per side (default 15; quick 2)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--peers", choices=("opacus", "none"), default="opacus")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="break the DP step down instead")
    parser.add_argument("--memory-worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (2 if args.quick else 15)
    if args.memory_worker:
        name, mode = args.memory_worker
        batch_sizes = [int(n) for n in args.sizes.split(",") if n]
        print(json.dumps(memory_worker(name, mode, args.quick, args.device, batch_sizes)))
        return 0
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"skipped: {error} (pip install transformers peft, or opake[transformers])")
        return 0
    models = [m for m in args.models.split(",") if m]
    if args.profile:
        for name in models:
            profile_model(name, args.quick, args.repeats)
        return 0
    s = sizes(args.quick)
    cuda = args.device.startswith("cuda")
    results = {}
    for name in models:
        began = time.perf_counter()
        try:
            timing = time_model(name, args.quick, args.repeats, args.device)
        except Exception as error:  # report and go on: another model may still run
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        dp_memory = run_memory_worker(name, "dp", args)
        plain_memory = run_memory_worker(name, "plain", args, dp_memory.get("sizes", [s["batch"]] * 2))
        wants_peer = args.peers == "opacus" and not cuda and not args.quick
        peer = run_opacus(name, args, dp_memory.get("sizes", ())) if wants_peer else None
        results[name] = {"timing": timing, "dp_memory": dp_memory, "plain_memory": plain_memory, "opacus": peer}
        print(f"[{name} measured in {time.perf_counter() - began:.0f} s]", file=sys.stderr, flush=True)
    print_tables(results, s, args)
    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    (out / f"finetune_step{'_quick' if args.quick else ''}_{args.device.split(':')[0]}.json").write_text(
        json.dumps({"sizes": s, "threads": args.threads, "repeats": args.repeats, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
