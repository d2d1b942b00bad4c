"""Private LoRA fine-tuning of a small causal language model with transformers.Trainer (DPTrainer).

The usual set-up for private fine-tuning: a model trained on public text (here a tiny GPT-2,
built from a config and trained for a few seconds on public-style sentences, so nothing
downloads), then LoRA adapters fine-tuned on private sentences under BLT correlated noise,
through ``opake.transformers.DPTrainer``, which takes Trainer's usual arguments. Prints the
plan (epsilon, noise multiplier, steps) and the validation loss on held-out private-style
sentences before and after.

``--quick`` (or the environment variable ``OPAKE_EXAMPLE_STEPS``, set by the examples' test)
runs smaller sizes for a smoke test.
"""

import os
import random
import sys
import tempfile
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from opake.random import key
from opake.transformers import DPTrainer

QUICK = "--quick" in sys.argv or "OPAKE_EXAMPLE_STEPS" in os.environ
torch.set_num_threads(1)  # a small model: one thread is fastest (and fair on a shared machine)
transformers.logging.set_verbosity_error()

# -- text and a character-level tokenizer ------------------------------------------------------
CHARACTERS = "abcdefghijklmnopqrstuvwxyz ."
PAD = 0  # characters are 1..28


def encode(text: str) -> list[int]:
    return [CHARACTERS.index(c) + 1 for c in text]


def public_sentence(rng: random.Random) -> str:  # the "pretraining" distribution: loose word salad
    words = "the a cat dog bird fish man girl tree sun sea sky red big old new runs sees eats has".split()
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) + "."


def private_sentence(rng: random.Random) -> str:  # the private data: one template with its own habits
    colour, animal = rng.choice(["red", "blue", "green"]), rng.choice(["cat", "dog", "bird", "fish"])
    place = rng.choice(["the garden", "the house", "the river", "the park"])
    return f"my {colour} {animal} sleeps in {place}."


class Sentences(torch.utils.data.Dataset):
    def __init__(self, texts):
        self.items = [torch.tensor(encode(text)) for text in texts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return {"input_ids": self.items[index]}


def collate(features):
    """Right-pads a batch; labels are the inputs, -100 on padding (Trainer's usual causal-LM batch)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), PAD)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, :len(f["input_ids"])], mask[row, :len(f["input_ids"])] = f["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


rng = random.Random(0)
public = Sentences([public_sentence(rng) for _ in range(400 if QUICK else 1500)])
private_train = Sentences([private_sentence(rng) for _ in range(128 if QUICK else 512)])
private_validation = Sentences([private_sentence(rng) for _ in range(64)])

# -- a small model "pretrained" on public text (ordinary, non-private training) ----------------
torch.manual_seed(0)
config = GPT2Config(vocab_size=len(CHARACTERS) + 1, n_positions=48, n_embd=64, n_layer=2, n_head=4,
                    bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
model = GPT2LMHeadModel(config)
started = time.perf_counter()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = torch.utils.data.DataLoader(public, batch_size=32, shuffle=True, collate_fn=collate)
model.train()
for _ in range(1 if QUICK else 2):
    for batch in loader:
        optimizer.zero_grad(); model(**batch).loss.backward(); optimizer.step()
print(f"pretrained on {len(public)} public sentences in {time.perf_counter() - started:.1f} s")

# -- private LoRA fine-tuning through Trainer --------------------------------------------------
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                                         fan_in_fan_out=True, lora_dropout=0.0))
epochs = 1 if QUICK else 4
with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=32, gradient_accumulation_steps=2,  # 64 per step
        num_train_epochs=epochs, learning_rate=2e-2, lr_scheduler_type="constant", max_grad_norm=1.0,
        logging_steps=4, eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_pin_memory=False, use_cpu=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=private_train, eval_dataset=private_validation,
                        data_collator=collate, target_epsilon=8.0, target_delta=1e-5,
                        key=key(0))  # key: reproducible here; omit it for a run you publish
    plan = trainer.private.plan
    print(f"plan: {plan.participation.n_steps} steps of ~{plan.expected_batch_size:.0f} examples "
          f"({plan.epochs} epochs), {plan.choice.chosen.name} ({plan.sampling}, {plan.accounting}), noise "
          f"multiplier {plan.noise_multiplier:.3f}, epsilon {trainer.private.epsilon:.2f} at delta {plan.delta:g}")
    print(f"why: {plan.choice.reason}")
    print(f"trainable parameters: {sum(p.numel() for p in model.parameters() if p.requires_grad)} LoRA "
          f"of {sum(p.numel() for p in model.parameters())}")
    before = trainer.evaluate()["eval_loss"]
    started = time.perf_counter()
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "epsilon" in entry]
print(f"fine-tuned in {time.perf_counter() - started:.1f} s; epsilon in the logs: {logged[-1]:.2f}")
print(f"validation loss before {before:.3f}, after {after:.3f}")
