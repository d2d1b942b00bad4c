"""A tiny causal language-model task for the tests of opake.transformers (and the scripts they launch).

Tiny GPT-2 models built from configs (nothing downloads), trained on synthetic sentences
tokenized by a character-level tokenizer written here; ``arguments`` are the TrainingArguments the
tests start from, ``dp_trainer`` a DPTrainer on the fixed plan ``PLAN``. Importable by test modules
(tests/ is on sys.path: tests/conftest.py), by spawned workers and by scripts run under torchrun.
"""

from __future__ import annotations

import random

import torch
import transformers

import opake.random
from opake.transformers import DPTrainer

CHARACTERS = "abcdefghijklmnopqrstuvwxyz ."
PAD = 0  # ids 1.. are the characters
VOCAB = len(CHARACTERS) + 1
WORDS = ("the cat dog bird sat ran saw ate on under near a mat tree log big small red".split())


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) + "." for _ in range(count)]


def encode(text: str) -> list[int]:
    return [CHARACTERS.index(c) + 1 for c in text]


class CharDataset(torch.utils.data.Dataset):
    def __init__(self, texts):
        self.items = [torch.tensor(encode(t)) for t in texts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return {"input_ids": self.items[index]}


def collate(features):
    """Right-pads to the batch's longest sentence; labels -100 on padding. position_ids are given
    per example: GPT-2 otherwise broadcasts (1, T) positions over the batch, which its learned
    position embedding cannot clip per example."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), PAD)
    mask = torch.zeros((len(features), longest), dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, :len(f["input_ids"])] = f["input_ids"]
        mask[row, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    positions = torch.arange(longest).expand(len(features), longest).clone()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": positions}


def gpt2(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    return transformers.GPT2LMHeadModel(config)


def arguments(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_train_epochs=2,
                    learning_rate=0.05, optim="sgd", report_to="none", save_strategy="no", logging_steps=2,
                    disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True, seed=0)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


PLAN = dict(noise_multiplier=0.8, target_delta=1e-5)


def dp_trainer(model, args, dataset, seed=3, **plan):
    return DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                     key=opake.random.key(seed), **{**PLAN, **plan})


def parameters(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same(first: dict, second: dict):
    assert first.keys() == second.keys()
    different = [name for name in first if not torch.equal(first[name], second[name])]
    assert not different, f"parameters differ: {different}"
