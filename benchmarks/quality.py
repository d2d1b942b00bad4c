"""Model quality at equal privacy, on real text: private fine-tuning of a small language model.

The usual job, on text every machine has: the docstrings of Python's standard library (the
modules in ``MODULES``, read with ``inspect`` at run time, split into paragraphs). The paragraphs
of the public modules pretrain a tiny GPT-2 (2 layers, width 128, a 512-token byte-level BPE
trained on the same public text) without privacy; the private modules' paragraphs (a fixed
hash split into training, validation and test) fine-tune it privately, batch 64, 3 epochs,
AdamW, clip norm 1, delta 1e-5, at epsilon 1, 3 and 8. Each method's learning rate is chosen on
validation loss from ``LEARNING_RATES`` with seed 0; seeds 0, 1, 2 then give the test loss
(mean token cross-entropy of each paragraph, averaged over paragraphs; nats) at that rate. A seed
changes the batches and the noise, not the split or the pretrained model.

Methods (every private one priced by the bound proven for adaptively chosen gradients):

* non-private: the same fine-tuning, no clipping, no noise (the floor);
* opake default: ``make_private`` without a strategy (the least-noise mechanism for AdamW at the
  budget, ``opake.planner.choice``; its pick is printed), AdamW's second moment corrected for the
  noise (DP-AdamBC floored at the noise's variance, on by default for AdamW), and the same with
  ``noise_correction=False`` ("uncorrected");
* opake default + DP-AdamW 1e-2 (``opake.torch.DPAdamW`` with the constant floor 1e-2 and its own
  learning rates ``DPADAMW_RATES``) and + automatic clipping (``clipping="automatic"``, AUTO-S);
* BLT (balls in bins, unamplified), BandMF (cyclic Poisson, bands by ``cyclic_poisson_bands``),
  DP-SGD (Poisson, PLD), each named explicitly;
* for reference, a BLT priced by the amplified balls-in-bins bound, which is NOT proven for
  adaptively chosen gradients (what such a theorem would be worth here; never a default);
* Opacus DP-SGD (its ``make_private_with_epsilon``, Poisson sampling, its PRV accountant), in its
  own interpreter (``OPAKE_PEER_OPACUS`` or ../peer-opacus), when installed
  (benchmarks/peers/opacus_quality.py).

Prints mean +- std of the test loss per (epsilon, method), the difference to Opacus DP-SGD (or
to opake's DP-SGD without Opacus) in units of their pooled std, and the share of the gap between
DP-SGD and non-private that each method closes. ``--quick``: one epsilon, tiny sizes, seconds.

    .venv/bin/python benchmarks/quality.py [--quick] [--epsilons 1 3 8] [--seeds 0 1 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

MODULES = ("argparse", "ast", "asyncio", "base64", "bisect", "calendar", "codecs", "collections", "configparser",
           "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum",
           "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
           "http.client", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox",
           "math", "mimetypes", "multiprocessing", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
           "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "random", "re", "sched", "secrets",
           "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "ssl",
           "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
           "timeit", "tkinter", "tokenize", "traceback", "turtle", "typing", "unittest", "urllib.parse",
           "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree",
           "zipfile", "zoneinfo")
LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
# DPAdamW divides by sqrt(max(v - noise variance, floor)): with the floor at 1e-2 its steps are
# about lr / 0.1 where AdamW's are lr / sqrt(v); its best rates sit near 0.3 sqrt(floor)
# (benchmarks/adam_noise_correction.py), so it gets its own grid.
DPADAMW_FLOOR = 1e-2
DPADAMW_RATES = (3e-3, 1e-2, 3e-2, 1e-1)
PEER = Path(__file__).resolve().parent / "peers" / "opacus_quality.py"


@dataclass(frozen=True)
class Sizes:
    vocab: int = 512
    width: int = 128
    layers: int = 2
    heads: int = 4
    tokens: int = 64
    batch: int = 64
    epochs: int = 3
    pretrain_epochs: int = 2
    public_share: int = 3       # modules with hash % public_share == 0 are public
    limit: int | None = None    # cap on private training paragraphs (quick mode)


QUICK = Sizes(vocab=300, width=16, layers=1, heads=2, tokens=24, batch=16, epochs=1, pretrain_epochs=1, limit=96)
QUICK_RATES = (3e-3,)


def paragraphs() -> dict[str, list[str]]:
    """Docstring paragraphs by module, deterministic for a given Python (whitespace normalized)."""
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # a module this Python lacks (tkinter without Tk): skipped
                continue
            texts = []
            objects = [module] + [value for _, value in sorted(vars(module).items())
                                  if (inspect.isclass(value) or inspect.isfunction(value))
                                  and getattr(value, "__module__", None) == module.__name__]
            for obj in objects:
                doc = inspect.getdoc(obj) or ""
                for paragraph in doc.split("\n\n"):
                    text = " ".join(paragraph.split())
                    if 40 <= len(text) <= 600:
                        texts.append(text)
            found[name] = sorted(set(texts))
    return found


def _bucket(text: str, modulus: int) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % modulus


def split(sizes: Sizes) -> dict[str, list[str]]:
    """Public paragraphs (pretraining) and the private modules' train / validation / test splits."""
    by_module = paragraphs()
    public, private = [], []
    for name, texts in by_module.items():
        (public if _bucket(name, sizes.public_share) == 0 else private).extend(texts)
    parts = {"public": public, "train": [], "validation": [], "test": []}
    for text in private:
        bucket = _bucket(text, 10)
        parts["validation" if bucket == 0 else "test" if bucket == 1 else "train"].append(text)
    if sizes.limit:
        parts = {name: texts[: sizes.limit if name in ("train", "public") else sizes.limit // 4]
                 for name, texts in parts.items()}
    return parts


def tokenizer(public: list[str], sizes: Sizes):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(public, vocab_size=sizes.vocab, min_frequency=2, special_tokens=["<pad>"],
                            show_progress=False)
    if bpe.get_vocab_size() > sizes.vocab:  # byte-level BPE starts from 256 bytes and the special token
        raise ValueError(f"the tokenizer has {bpe.get_vocab_size()} tokens, more than the model's {sizes.vocab}")
    return bpe


class Paragraphs(torch.utils.data.Dataset):
    """Token ids (truncated, right-padded) and labels (-100 on padding) of each paragraph."""

    def __init__(self, texts: list[str], bpe, sizes: Sizes):
        ids = torch.full((len(texts), sizes.tokens), 0, dtype=torch.long)
        labels = torch.full((len(texts), sizes.tokens), -100, dtype=torch.long)
        for row, encoding in enumerate(bpe.encode_batch(texts)):
            tokens = encoding.ids[: sizes.tokens]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, : len(tokens)] = torch.tensor(tokens)
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index],
                "attention_mask": (self.labels[index] != -100).long()}


def build_model(sizes: Sizes):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=sizes.vocab, n_positions=sizes.tokens, n_embd=sizes.width,
                                     n_layer=sizes.layers, n_head=sizes.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def per_paragraph_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) each paragraph's own mean next-token cross-entropy over its tokens (0 for none)."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    return losses.sum(dim=1) / (labels != -100).sum(dim=1).clamp(min=1)


def mean_loss(model, dataset: Paragraphs) -> float:
    """The mean over paragraphs of each paragraph's own token-mean cross-entropy (nats)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(dataset), 128):
            ids = dataset.ids[start: start + 128]
            labels = dataset.labels[start: start + 128]
            logits = model(input_ids=ids, attention_mask=(labels != -100).long()).logits
            losses.append(per_paragraph_losses(logits, labels))
    model.train()
    return float(torch.cat(losses).mean())


def pretrained(parts: dict, bpe, sizes: Sizes):
    model = build_model(sizes)
    data = Paragraphs(parts["public"], bpe, sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(sizes.pretrain_epochs):
        for rows in torch.randperm(len(data), generator=generator).split(sizes.batch):
            optimizer.zero_grad()
            model(input_ids=data.ids[rows], attention_mask=(data.labels[rows] != -100).long(),
                  labels=data.labels[rows]).loss.backward()
            optimizer.step()
    return model


def _optional(name: str):
    import opake.torch

    return getattr(opake.torch, name, None)


def methods(sizes: Sizes) -> dict:
    """name -> the make_private options of each opake method (None: non-private)."""
    from opake.dpftrl.noise import blt_strategy, identity_strategy

    table = {"non-private": None, "opake default": {}, "opake default, uncorrected": {"noise_correction": False}}
    if _optional("DPAdamW") is not None:  # with a floor of 1e-2 and its own learning rates (DPADAMW_RATES)
        table["opake default + DP-AdamW 1e-2"] = {"optimizer": "dpadamw"}
    table["opake default + AUTO-S"] = {"clipping": "automatic"}
    table.update({
        "BLT": {"strategy": blt_strategy(), "sampling": "balls_in_bins"},
        "BandMF": {"strategy": "bands", "sampling": "poisson"},
        "DP-SGD": {"strategy": identity_strategy(), "sampling": "poisson"},
        # For reference only: the amplified bound of a BLT on balls in bins is not proven for
        # adaptively chosen gradients (docs/adaptivity.md); no default ever uses it.
        "BLT amplified (not proven)": {"strategy": blt_strategy(), "sampling": "balls_in_bins",
                                       "amplification": True},
    })
    return table


def fine_tune(base, parts: dict, bpe, sizes: Sizes, options, epsilon: float, learning_rate: float, seed: int) -> dict:
    """Fine-tune a copy of ``base`` privately (``options``) or not; validation and test loss."""
    from opake.planner import cyclic_poisson_bands
    from opake.dpftrl.noise import band_mf_strategy
    from opake.random import key
    from opake.torch import make_private

    model = copy.deepcopy(base)
    train = Paragraphs(parts["train"], bpe, sizes)
    options = dict(options) if options is not None else None
    optimizer_kind = (options or {}).pop("optimizer", "adamw")
    if optimizer_kind == "dpadamw":
        optimizer = _optional("DPAdamW")(model.parameters(), lr=learning_rate, variance_floor=DPADAMW_FLOOR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    torch.manual_seed(seed)
    chose = ""
    if options is None:
        generator = torch.Generator().manual_seed(seed)
        steps = len(train) // sizes.batch
        for _ in range(sizes.epochs):
            order = torch.randperm(len(train), generator=generator)
            for step in range(steps):
                rows = order[step * sizes.batch: (step + 1) * sizes.batch]
                optimizer.zero_grad()
                model(**{k: v for k, v in train[rows].items()}).loss.backward()
                optimizer.step()
        sigma = 0.0
    else:
        if options.get("strategy") == "bands":
            bands = cyclic_poisson_bands(len(train), sizes.batch, sizes.epochs, epsilon, 1e-5)
            options["strategy"] = band_mf_strategy(bands=bands)
            chose = f"{bands} bands"
        options.setdefault("max_grad_norm", 1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private = make_private(module=model, optimizer=optimizer, dataset=train, batch_size=sizes.batch,
                                   epochs=sizes.epochs, target_epsilon=epsilon, target_delta=1e-5,
                                   key=key(1000 + seed), progress=False, **options)
        if private.plan.choice is not None:
            chose = private.plan.choice.chosen.name
        for _ in range(sizes.epochs):
            for batch in private.data_loader:
                private.optimizer.zero_grad()
                if len(batch["input_ids"]):
                    model(**batch).loss.backward()
                private.optimizer.step()
        sigma = private.noise_multiplier
        private.detach()
    return {"validation": mean_loss(model, Paragraphs(parts["validation"], bpe, sizes)),
            "test": mean_loss(model, Paragraphs(parts["test"], bpe, sizes)), "sigma": sigma, "chose": chose}


def opacus_runs(parts_file: str, epsilon: float, sizes: Sizes, seeds) -> dict | str:
    python = os.environ.get("OPAKE_PEER_OPACUS") or str(Path(__file__).resolve().parents[2] / "peer-opacus" / "bin"
                                                         / "python")
    if not Path(python).exists():
        return "not installed (../peer-opacus or OPAKE_PEER_OPACUS)"
    command = [python, str(PEER), "--parts", parts_file, "--epsilon", str(epsilon), "--sizes",
               json.dumps(sizes.__dict__), "--seeds", *map(str, seeds), "--rates", *map(str, LEARNING_RATES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=6 * 3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return "failed: " + " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
    return json.loads(lines[-1])


def tuned(run, seeds, rates=LEARNING_RATES) -> dict:
    """The learning rate with the least validation loss at seeds[0], then every seed at it."""
    first = {rate: run(rate, seeds[0]) for rate in rates}
    rate = min(first, key=lambda r: first[r]["validation"])
    results = [first[rate]] + [run(rate, seed) for seed in seeds[1:]]
    return {"rate": rate, "runs": results, "tests": [r["test"] for r in results],
            "validation_by_rate": {str(r): first[r]["validation"] for r in rates}}


def _in_pooled_sd(difference: float, tests: list, reference_tests: list) -> str:
    """The difference in units of the pooled standard deviation over seeds; none with one seed on either
    side (a standard deviation of one value is not defined), nor when both spreads are zero."""
    if min(len(tests), len(reference_tests)) < 2:
        return "(no sd: 1 seed)"
    pooled = math.sqrt((_summary(tests)[1] ** 2 + _summary(reference_tests)[1] ** 2) / 2)
    return f"({difference / pooled:+.1f} sd)" if pooled > 0 else "(sd 0)"


def _summary(tests: list) -> tuple[float, float]:
    return statistics.fmean(tests), (statistics.stdev(tests) if len(tests) > 1 else 0.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--json", default=None, help="write every run's results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    epsilons = args.epsilons or ([8.0] if args.quick else [1.0, 3.0, 8.0])
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    started = time.perf_counter()
    parts = split(sizes)
    bpe = tokenizer(parts["public"], sizes)
    base = pretrained(parts, bpe, sizes)
    print(f"stdlib docstrings (Python {sys.version.split()[0]}): {len(parts['public'])} public paragraphs "
          f"(pretraining), {len(parts['train'])} / {len(parts['validation'])} / {len(parts['test'])} private "
          f"train / validation / test; GPT-2 {sizes.layers} layers, width {sizes.width}, BPE vocab {sizes.vocab}, "
          f"{sizes.tokens} tokens; batch {sizes.batch}, {sizes.epochs} epochs, AdamW, clip 1, delta 1e-5; "
          f"learning rate from {LEARNING_RATES} on validation (seed {seeds[0]}); seeds {seeds}; torch "
          f"{torch.__version__}, {args.threads} thread(s)")
    print(f"pretrained model: test loss {mean_loss(base, Paragraphs(parts['test'], bpe, sizes)):.3f} nats")
    table = methods(sizes)
    results: dict = {}
    parts_file = None
    for epsilon in epsilons:
        for name, options in table.items():
            if options is None and epsilon != epsilons[0]:
                results[(epsilon, name)] = results[(epsilons[0], name)]
                continue
            rates = DPADAMW_RATES if (options or {}).get("optimizer") == "dpadamw" else LEARNING_RATES
            results[(epsilon, name)] = tuned(
                lambda rate, seed, o=options: fine_tune(base, parts, bpe, sizes, o, epsilon, rate, seed), seeds,
                QUICK_RATES if args.quick else rates)
        if not (args.no_opacus or args.quick):
            if parts_file is None:  # what the peer needs: the same split, tokenizer and pretrained model
                folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"opake_quality_{os.getpid()}"
                folder.mkdir(exist_ok=True)
                parts_file = str(folder / "parts.json")
                Path(parts_file).write_text(json.dumps(parts))
                torch.save(base.state_dict(), folder / "base.pt")
                bpe.save_model(str(folder), "bpe")
            results[(epsilon, "Opacus DP-SGD")] = opacus_runs(parts_file, epsilon, sizes, seeds)
    print(f"\n{'epsilon':>7}  {'method':<30} {'lr':>7} {'test loss mean +- std':>22}  {'vs DP-SGD ref':>14}  "
          f"{'gap closed':>10}  chose")
    for epsilon in epsilons:
        reference = results.get((epsilon, "Opacus DP-SGD"))
        reference_name = "Opacus DP-SGD" if isinstance(reference, dict) else "DP-SGD"
        reference = results[(epsilon, reference_name)]
        floor = _summary(results[(epsilon, "non-private")]["tests"])[0]
        ref_mean, ref_std = _summary(reference["tests"])
        for name in list(table) + ["Opacus DP-SGD"]:
            result = results.get((epsilon, name))
            if result is None:
                continue
            if isinstance(result, str):
                print(f"{epsilon:>7g}  {name:<30} {result}")
                continue
            mean, std = _summary(result["tests"])
            gap = f"{(ref_mean - mean) / (ref_mean - floor):>9.0%}" if ref_mean != floor else f"{'-':>9}"
            chose = next((r.get("chose", "") for r in result["runs"] if r.get("chose")), "")
            spread = f"+- {std:<7.3f}" if len(result["tests"]) > 1 else f"{'(1 seed)':<10}"
            print(f"{epsilon:>7g}  {name:<30} {result['rate']:>7g} {mean:>12.3f} {spread}  "
                  f"{(mean - ref_mean):>+7.3f} {_in_pooled_sd(mean - ref_mean, result['tests'], reference['tests'])}"
                  f"  {gap}  {chose}")
    print(f"\n(vs DP-SGD ref: the difference of test losses to {reference_name}, negative is better, in units of the "
          f"pooled std over seeds; gap closed: the share of the DP-SGD reference's gap to non-private closed)")
    print(f"finished in {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{e}|{n}": r for (e, n), r in results.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
