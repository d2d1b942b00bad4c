"""A tiny word-level task for the tests of opake.transformers' TRL trainers (and the docs' TRL blocks).

A word-level tokenizer over a small vocabulary, prompts and completions (SFT) or preference pairs
(DPO) made from it, and Llama and GPT-2 of one layer built from configs (nothing downloads).
"""

from __future__ import annotations

import random

import tokenizers
import torch
import transformers

WORDS = "the cat dog bird sat ran saw ate on under near a mat tree log big small red".split()


def tokenizer():
    vocabulary = {word: index for index, word in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def sentence(rng, shortest=2, longest=6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest)))


def sft_rows(count, seed=0):
    rng = random.Random(seed)
    return {"prompt": [sentence(rng) for _ in range(count)], "completion": [" " + sentence(rng) for _ in range(count)]}


def preference_rows(count, seed=0):
    rng = random.Random(seed)
    return {"prompt": [sentence(rng) for _ in range(count)], "chosen": [" " + sentence(rng) for _ in range(count)],
            "rejected": [" " + sentence(rng) for _ in range(count)]}


def llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.LlamaForCausalLM(config)


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=len(WORDS) + 3, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.GPT2LMHeadModel(config)
