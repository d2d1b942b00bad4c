"""Opacus peer for benchmarks/quality.py; runs in ../peer-opacus's interpreter, never imported.

The same split, tokenizer, pretrained model, batch size (64, Poisson sampling), epochs, clip norm
and per-paragraph loss (each paragraph's own token mean, averaged: the same per-example form as
opake's, so Opacus' per-sample gradients are those of one paragraph each) as quality.py, made
private with Opacus' ``make_private_with_epsilon`` (DP-SGD, its PRV accountant) and AdamW. GPT-2's
``position_ids`` are passed expanded to the batch (Opacus' per-sample hook on the position
embedding needs the batch on dimension 0). Learning rate chosen on validation at the first seed,
as quality.py does; prints one JSON line {"rate", "runs", "tests"} or fails with the error.
"""

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quality import Paragraphs, Sizes, build_model, mean_loss, per_paragraph_losses  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", required=True)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from opacus import PrivacyEngine
    from tokenizers import ByteLevelBPETokenizer

    folder = Path(args.parts).parent
    parts = json.loads(Path(args.parts).read_text())
    sizes = Sizes(**json.loads(args.sizes))
    bpe = ByteLevelBPETokenizer(str(folder / "bpe-vocab.json"), str(folder / "bpe-merges.txt"))
    base = build_model(sizes)
    base.load_state_dict(torch.load(folder / "base.pt", weights_only=True))
    train = Paragraphs(parts["train"], bpe, sizes)
    validation, test = Paragraphs(parts["validation"], bpe, sizes), Paragraphs(parts["test"], bpe, sizes)

    def run(rate: float, seed: int) -> dict:
        torch.manual_seed(seed)
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=rate)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train.ids, train.labels),
                                             batch_size=sizes.batch)
        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, epochs=sizes.epochs, target_epsilon=args.epsilon,
            target_delta=1e-5, max_grad_norm=1.0)
        for _ in range(sizes.epochs):
            for ids, labels in loader:
                optimizer.zero_grad()
                if len(ids):
                    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
                    logits = model(input_ids=ids, attention_mask=(labels != -100).long(), position_ids=positions).logits
                    per_paragraph_losses(logits, labels).mean().backward()
                optimizer.step()
        plain = model._module
        return {"validation": mean_loss(plain, validation), "test": mean_loss(plain, test),
                "sigma": optimizer.noise_multiplier, "chose": "", "epsilon": engine.get_epsilon(1e-5)}

    try:
        first = {rate: run(rate, args.seeds[0]) for rate in args.rates}
        rate = min(first, key=lambda r: first[r]["validation"])
        runs = [first[rate]] + [run(rate, seed) for seed in args.seeds[1:]]
    except Exception as error:  # reported, not raised
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"rate": rate, "runs": runs, "tests": [r["test"] for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
