"""Micro-batches of one planned batch, and the collation of an empty planned batch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opake.transformers.batches import EmptyBatchCollator, batch_size_of, micro_batches  # noqa: E402


def batch(size: int) -> dict:
    return {"input_ids": torch.arange(size * 3).view(size, 3), "labels": torch.arange(size)}


@pytest.mark.parametrize(("size", "largest", "expected"),
                         [(0, 4, []), (3, 4, [3]), (4, 4, [4]), (5, 4, [3, 2]), (9, 4, [3, 3, 3]), (11, 8, [6, 5])])
def test_micro_batches_are_balanced_and_at_most_the_largest(size, largest, expected):
    parts = micro_batches(batch(size), size, largest)
    assert [batch_size_of(part) for part in parts] == expected
    if parts:  # together, the parts are the batch, rows in order
        whole = batch(size)
        for name in whole:
            assert torch.equal(torch.cat([part[name] for part in parts]), whole[name])


def test_a_batch_that_cannot_be_cut_is_refused():
    with pytest.raises(TypeError, match="'text'.*dimension 0"):
        micro_batches({**batch(5), "text": ["a"] * 5}, 5, 2)
    assert micro_batches({**batch(2), "text": ["a"] * 2}, 2, 2)[0]["text"] == ["a"] * 2  # one part: uncut


def test_an_empty_planned_batch_collates_to_zero_rows():
    dataset = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    collator = transformers.DataCollatorWithPadding(
        transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), pad_token="[PAD]"))
    with pytest.raises(Exception):
        collator([])  # Hugging Face's collators fail on an empty list
    wrapped = EmptyBatchCollator(collator, dataset)
    empty = wrapped([])
    assert set(empty) == {"input_ids", "attention_mask"} and all(v.shape == (0, 3) for v in empty.values())
    assert batch_size_of(empty) == 0 and micro_batches(empty, 0, 4) == []
    assert torch.equal(wrapped(dataset)["input_ids"], collator(dataset)["input_ids"])


def test_an_empty_batch_of_non_tensors_is_refused():
    wrapped = EmptyBatchCollator(lambda features: {"text": [f["text"] for f in features]}, [{"text": "a"}])
    with pytest.raises(TypeError, match="not a batched tensor"):
        wrapped([])


def _tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"[PAD]": 0, "a": 1}, unk_token="[PAD]"))
