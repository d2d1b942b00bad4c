"""Workers of tests/torch/test_fsdp.py: make_private on FSDP2 (fully_shard) and replicated runs,
in gloo process groups on CPU (spawned), and the one-process runs they are compared with."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from opake.random import key
from opake.torch import make_private

STEPS = 4
CONFIGS = [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True), ("qwen2", False), ("qwen2", True)]


def hf_model(kind: str, lora: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if lora:
        import peft

        targets = ["c_attn"] if kind == "gpt2" else ["q_proj", "v_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           lora_dropout=0.0, fan_in_fan_out=kind == "gpt2"))
        with torch.no_grad():  # lora_B starts at zero, which would zero lora_A's gradient
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.02)
    return model


def blocks(model, kind: str, lora: bool) -> list:
    base = model.base_model.model if lora else model
    return list(base.transformer.h) if kind == "gpt2" else list(base.model.layers)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 24, seed: int = 1):
        self.ids = torch.randint(0, 64, (count, 10), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def state_bytes(private, model) -> int:
    """This rank's bytes of parameters, optimizer state and noise state (local shards only)."""
    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in private.optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    buffers = private.optimizer.noise_state.buffers
    return total + buffers.numel() * buffers.element_size()


def train_hf(kind: str, lora: bool, shard: bool, bf16: bool = False, batch_size: int = 4) -> dict:
    """A few planned steps of AdamW; every rank runs forward and backward at every step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = hf_model(kind, lora)
    if shard:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        for block in blocks(model, kind, lora):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private = make_private(module=model, optimizer=optimizer, dataset=Tokens(), batch_size=batch_size, epochs=1,
                               noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0, key=key(5))
    examples = []
    for step, batch in enumerate(private.data_loader):
        private.optimizer.zero_grad()
        if shard or len(batch["input_ids"]):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and not shard):
                loss = model(**batch).loss
            loss.backward()
            assert all(p.grad is None for p in model.parameters()), "an unclipped gradient reached .grad"
        private.optimizer.step()
        examples.append(private.optimizer.last_step_examples)
        if step + 1 == STEPS:
            break
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in model.named_parameters() if p.requires_grad}
    return {"params": params, "epsilon": private.epsilon, "examples": examples, "bytes": state_bytes(private, model)}


def _refusals(rank: int, world_size: int) -> dict:
    """Negative controls, each caught on every rank before anything is released."""
    from torch.distributed.fsdp import fully_shard

    out = {}

    def attempt(name, function):
        try:
            function()
            out[name] = None
        except Exception as error:  # the type and message are the result
            out[name] = f"{type(error).__name__}: {error}"

    def net(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def data(seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.utils.data.TensorDataset(torch.randn(32, 4, generator=generator),
                                              torch.randint(0, 2, (32,), generator=generator))

    def plan(model, dataset):
        return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                            batch_size=4, epochs=1, noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                            key=key(0))

    # replicated: different initial weights are replaced by rank 0's (as DDP does)
    model = net(seed=rank)
    before = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(before, model[0].weight.sum().reshape(1))
    plan(model, data())
    after = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(after, model[0].weight.sum().reshape(1))
    out["weights"] = (len({float(t) for t in before}), len({float(t) for t in after}))
    attempt("different_data", lambda: plan(net(), data(seed=1 + rank)))

    def ddp_after_planning():
        model = net()
        private = plan(model, data())
        x, y = next(iter(private.data_loader))
        F.cross_entropy(nn.parallel.DistributedDataParallel(model)(x), y).backward()

    attempt("ddp", ddp_after_planning)

    def partly_sharded():
        model = net()
        fully_shard(model[0])  # a block, but not the root: model[2]'s parameters stay plain tensors
        plan(model, data())

    attempt("partly_sharded", partly_sharded)

    solo = dist.new_group([0])  # every rank takes part in creating a group

    def sharded_on_one_rank_only():
        model = net()
        if rank == 0:
            from torch.distributed.device_mesh import DeviceMesh

            fully_shard(model, mesh=DeviceMesh.from_group(solo, "cpu"))
        plan(model, data())

    attempt("sharded_on_one_rank", sharded_on_one_rank_only)

    def one_rank_fails_a_step():
        model = net()
        private = plan(model, data())
        for x, y in private.data_loader:
            private.optimizer.zero_grad()
            if rank == 0 and len(y):
                F.cross_entropy(model(x), y).backward()
            private.optimizer.step()  # rank 1 steps without a backward pass on a part that has examples

    attempt("failed_step", one_rank_fails_a_step)
    return out


def bucketed_reduction(rank: int, world_size: int) -> dict:
    """``Sharded.reduce`` of the same clipped sums in buckets of several sizes (one parameter each,
    a few parameters, one bucket), and the reference: the all-reduced sums' rows of this rank."""
    from torch.distributed.fsdp import fully_shard

    from opake.torch.reduction import Sharded

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 7 and 3 rows: padded chunks
    fully_shard(model)
    parameters = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(rank)
    sums = {name: torch.randn(p.shape, generator=generator) for name, p in parameters.items()}
    reduction = Sharded(parameters, None, rank, world_size)
    reference = {}
    for name, tensor in sums.items():
        total = tensor.clone()
        dist.all_reduce(total)
        start, stop = reduction.rows[name]
        reference[name] = total[start:stop].reshape(-1)
    shards, handed_over = {}, True
    for bucket_elements in (1, 40, reduction.bucket_elements):
        given = {name: tensor.clone() for name, tensor in sums.items()}
        shards[bucket_elements] = Sharded(parameters, None, rank, world_size, bucket_elements).reduce(given)
        handed_over = handed_over and not given  # every full-size sum was taken out once sent
    return {"shards": shards, "reference": reference, "handed_over": handed_over}


def sharded_resume(rank: int, out_dir: str) -> dict:
    """A sharded run checkpointed after 2 of 4 steps (each rank saves ``private.state_dict()``:
    its shards of the model and optimizer state and its part of the noise state) and resumed in a
    new run with the replay choice ends on the uninterrupted run's parameters."""
    from torch.distributed.fsdp import fully_shard

    def build():
        model = hf_model("llama", False)
        for block in blocks(model, "llama", False):
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model, make_private(module=model, optimizer=optimizer, dataset=Tokens(), batch_size=4, epochs=1,
                                       noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0, key=key(5))

    def steps(model, private, count, checkpoint=None):
        for step, batch in enumerate(private.run_data_loader()):
            private.optimizer.zero_grad()
            model(**batch).loss.backward()
            private.optimizer.step()
            if checkpoint is not None and step + 1 == checkpoint:
                torch.save(private.state_dict(), os.path.join(out_dir, f"private-rank{rank}.pt"))
            if step + 1 == count:
                break
        return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}

    model, private = build()
    uninterrupted = steps(model, private, 4, checkpoint=2)
    model, private = build()
    private.load_state_dict(torch.load(os.path.join(out_dir, f"private-rank{rank}.pt"), weights_only=True),
                            draws="replay")
    resumed = steps(model, private, 2)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "steps": private.steps_taken}


def worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)
    try:
        results = {f"{kind}-{'lora' if lora else 'full'}": train_hf(kind, lora, shard=True) for kind, lora in CONFIGS}
        results["llama-full-bf16"] = train_hf("llama", False, shard=True, bf16=True)
        results["llama-small-batches"] = train_hf("llama", False, shard=True, batch_size=2)
        results["buckets"] = bucketed_reduction(rank, world_size)
        results["resume"] = sharded_resume(rank, out_dir)
        results["refusals"] = _refusals(rank, world_size)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank has saved before any tears gloo down
    finally:
        dist.destroy_process_group()
