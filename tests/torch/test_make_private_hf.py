"""make_private on Hugging Face models as people write it: PEFT LoRA, AdamW over all parameters,
padding with labels=-100, the model's own ``outputs.loss`` (made per-example by make_private)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake.random import key  # noqa: E402
from opake.torch import make_private  # noqa: E402

VOCAB, LENGTH = 41, 10


class _Texts(torch.utils.data.Dataset):
    def __init__(self, count=48, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (count, LENGTH), generator=generator)
        self.lengths = torch.randint(3, LENGTH + 1, (count,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        mask = (torch.arange(LENGTH) < self.lengths[index]).long()
        return {"input_ids": self.ids[index], "attention_mask": mask,
                "labels": self.ids[index].masked_fill(mask == 0, -100)}


def _lora_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=LENGTH)
    base = transformers.GPT2LMHeadModel(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                     fan_in_fan_out=True, lora_dropout=0.0))


def test_lora_with_adamw_over_all_parameters_trains_only_the_adapters():
    model = _lora_gpt2()
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)          # frozen ones included, as people do
    private = make_private(module=model, optimizer=optimizer, dataset=_Texts(), batch_size=8, epochs=2,
                           target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0, key=key(0))
    assert set(private.optimizer.parameters) == adapters
    assert private.optimizer.noise_state.buffers.shape[1] == sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    assert "per-example" not in private.plan.loss or "each example's own" in private.plan.loss
    assert "GPT2LMHeadModel" in private.plan.loss
    model.train()
    for _epoch in range(2):
        for batch in private.data_loader:
            optimizer = private.optimizer
            optimizer.zero_grad()
            model(**batch).loss.backward()
            optimizer.step()
    assert private.steps_taken == private.plan.participation.n_steps
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    assert 0 < private.epsilon_spent() == private.epsilon <= 8.0
