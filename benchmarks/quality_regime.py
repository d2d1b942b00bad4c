"""Model quality at equal privacy in the regime the papers measure: 1000 steps, real text.

The question of issue 37: does correlated noise (BLT, BandMF; opake's default picks between them
and DP-SGD) give a better model than the DP-SGD people run, with about 10^3 steps, 200 steps per
epoch, a few epochs, epsilon 2 to 16? quality.py (72 steps on 1554 paragraphs) cannot tell.

Corpus (text every machine with this venv has, no download): the docstring paragraphs of the
Python sources of the installed packages ``PACKAGES`` (sorted, fixed; each one's version is
recorded) and of the standard library, read with ``ast`` (nothing is imported), whitespace
normalized, 40 to 600 characters, doctest paragraphs (``>>>``) left out, each distinct paragraph
kept once (in the first module, in sorted order, that has it). Each *module* (source file) goes
by a fixed hash of its dotted name to public (4 in 10), private training (4), validation (1) or
test (1), so no paragraph crosses the split; within each part a fixed hash of the text draws
``Sizes.public`` / ``train`` / ``evaluation`` paragraphs. The extraction takes about 30 s and is
cached in benchmarks/out/ (keyed by the packages' versions and Python's).

Model: a tiny causal transformer in plain torch (``benchmarks/lib/step_models.Transformer``, shared
with the Opacus peer: 1 layer, width 32, 2 heads, 32 tokens, a 512-token byte-level BPE trained on
the public text); loss: each paragraph's own mean next-token cross-entropy, averaged over the
batch (the per-example form on both sides; test loss the same, in nats).

Private training: 12,800 paragraphs, batch 64, 5 epochs: 200 steps an epoch, 1000 steps; clip
norm 1, delta 1e-5 (below 1/N = 7.8e-5), epsilon 2, 4, 8, 16 (add/remove adjacency). Settings:
``finetune`` (from a model pretrained without privacy on the public paragraphs, 2 epochs of AdamW)
and ``scratch`` (from the same seeded initialization); optimizers: ``adamw`` (torch.optim.AdamW,
its defaults) and ``sgd`` (torch.optim.SGD, momentum 0.9). Methods:

* non-private: the same training, shuffled batches, no clipping, no noise (the floor);
* opake default: ``make_private`` without a strategy (the planner's least-noise proven mechanism
  for the optimizer's workload; AdamW's noise correction on, as by default);
* BLT (``blt_strategy()``, balls in bins, unamplified), BandMF (cyclic Poisson, bands by
  ``cyclic_poisson_bands``), DP-SGD (opake: identity, Poisson, PLD), each named explicitly;
* Opacus DP-SGD: its ``make_private_with_epsilon`` (Poisson sampling, its PRV accountant) in its
  own interpreter (``OPAKE_PEER_OPACUS``, a python or a venv; default ../peer-opacus),
  benchmarks/peers/opacus_quality_regime.py, which imports nothing of opake.

Learning rates: each (setting, optimizer, epsilon, method) tunes its own on validation loss with
seed 0, on the half-decade grid 1e-5, 3e-5, 1e-4, ..., 3, 10: three rates around a prior (the same
method's best at another epsilon if known, else ``PRIORS``), then one more rate beyond whichever
end holds the best, until the best is inside the rates tried (so no best sits at the grid's
edge). Seeds 1 and 2 then run at the best rate; test loss mean +- std over seeds 0, 1, 2. A seed
changes the batches and the noise (and nothing of the split or the initialization).

Each row also carries the planner's prediction: ``choose_mechanism``'s noise error (sigma times
the root of the worst step's squared norm of W C^-1 for the optimizer's workload; before the
division by the batch size) for that mechanism at the budget, so its ranking can be set against
the models'. Opacus' row scales opake's DP-SGD error by the ratio of the noise multipliers.

Every run (validation and test loss, noise multiplier, seconds) is written to the JSON file
(``--out``, default benchmarks/out/quality_regime.json) as it finishes; a rerun skips what is
there. Work goes in order of importance: fine-tuning with AdamW at every epsilon, then with SGD,
then from scratch. ``--report`` prints the table from the JSON (while a run goes on, too). Stages
may run in separate processes, each with its own ``--out``; ``--report --out A --with B`` prints
them together.

    .venv/bin/python benchmarks/quality_regime.py [--threads 1] [--out F] [--report] [--quick]

Cost (2-core machine, one thread): a private run of 1000 steps takes about 18-23 s of CPU (a
non-private one about 11 s; wall time more while other jobs share the cores); with three rates a
cell at least, one more per edge, and two more seeds, the whole table is about 440 runs, 2.5 hours
of CPU; fine-tuning with AdamW (every epsilon) about the first 40 minutes of it. To measure a fixed
commit of the library while its source changes, put a snapshot of it first on the path:

    mkdir -p benchmarks/out/opake_head && git archive HEAD src/opake | tar -x -C benchmarks/out/opake_head
    git rev-parse HEAD > benchmarks/out/opake_head/COMMIT
    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks/out/opake_head/src nohup nice -n 10 .venv/bin/python \
        benchmarks/quality_regime.py --threads 1 > benchmarks/out/quality_regime.log 2>&1 &

(the JSON records where opake came from, and the commit where the snapshot has it).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "lib"))
from quality import _in_pooled_sd, _summary, per_paragraph_losses  # noqa: E402  (torch and stdlib at import)
from step_models import Transformer  # noqa: E402  (plain torch)

PACKAGES = ("matplotlib", "networkx", "numpy", "pandas", "scipy", "sklearn", "sympy", "torch", "transformers")
EXTRACTION = 1  # bump when the extraction below changes (the cache's key)
OUT = HERE / "out"
PEER = HERE / "peers" / "opacus_quality_regime.py"
DELTA = 1e-5
EPSILONS = (8.0, 16.0, 4.0, 2.0)        # in the order they run (the target's epsilon first)
SEEDS = (0, 1, 2)
STAGES = (("finetune", "adamw"), ("finetune", "sgd"), ("scratch", "adamw"), ("scratch", "sgd"))
METHODS = ("non-private", "opake default", "DP-SGD (opake)", "Opacus DP-SGD", "BLT", "BandMF")
# The half-decade grid: index k is 10^(k/2), written 1e-3, 3e-3, 1e-2, ...
GRID = (-10, 2)   # 1e-5 .. 10
# Where tuning starts (grid index) when no other epsilon has a best yet: AdamW's step is about lr
# whatever the gradient's scale, and its denominator follows the noise, so correlated noise (large
# per-step noise) wants larger rates; SGD with momentum 0.9 moves about 10 lr times the mean clipped
# gradient. (Set after the first runs: non-private fine-tuning with AdamW takes 3e-2 here.)
PRIORS = {("finetune", "adamw", "non-private"): -3, ("finetune", "adamw", "dpsgd"): -3,
          ("finetune", "adamw", "correlated"): -2,
          ("scratch", "adamw", "non-private"): -4, ("scratch", "adamw", "dpsgd"): -4,
          ("scratch", "adamw", "correlated"): -3,
          ("finetune", "sgd", "non-private"): -1, ("finetune", "sgd", "dpsgd"): -1,
          ("finetune", "sgd", "correlated"): -1,
          ("scratch", "sgd", "non-private"): 0, ("scratch", "sgd", "dpsgd"): 0,
          ("scratch", "sgd", "correlated"): 0}


def rate_of(k: int) -> float:
    """Grid index -> learning rate: 10^(k/2) with 3 for sqrt(10) (1e-3, 3e-3, 1e-2, ...)."""
    return float(f"{(1 if k % 2 == 0 else 3)}e{k // 2}")


@dataclass(frozen=True)
class Sizes:
    vocab: int = 512
    width: int = 32
    layers: int = 1
    heads: int = 2
    tokens: int = 32
    batch: int = 64
    epochs: int = 5
    train: int = 12800        # private training paragraphs: 200 steps an epoch at batch 64
    evaluation: int = 1024    # validation and test paragraphs each
    public: int = 25600       # public (pretraining) paragraphs
    pretrain_epochs: int = 2
    pretrain_rate: float = 3e-3
    max_rates: int = 12       # tuning stops there even at an edge (the report flags it)


QUICK = Sizes(vocab=300, width=16, layers=1, heads=2, tokens=16, batch=16, epochs=2, train=256, evaluation=64,
              public=256, pretrain_epochs=1, max_rates=3)
QUICK_PACKAGES = ()
QUICK_STDLIB = ("argparse", "asyncio", "collections", "concurrent", "csv", "email", "http", "importlib", "json",
                "logging", "multiprocessing", "typing", "unittest", "urllib", "xml")


# -- the corpus ---------------------------------------------------------------------------------

def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


def _sources(root: Path, prefix: str, only: tuple = ()):
    """(dotted module name, path) of the .py files under ``root``, sorted; tests and vendored code left out."""
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        folders = relative.parts[:-1]
        if any(p in ("tests", "test", "testing", "site-packages", "idle_test") or p.startswith("_vendor")
               for p in folders):
            continue
        if only and relative.parts[0].removesuffix(".py") not in only:
            continue
        yield prefix + ".".join(relative.with_suffix("").parts), path


def _docstring_paragraphs(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            for paragraph in (doc or "").split("\n\n"):
                text = " ".join(paragraph.split())
                if 40 <= len(text) <= 600 and not text.startswith(">>>"):
                    found.append(text)
    return found


def sources(quick: bool) -> dict:
    """What the corpus is read from: each package's version (None: not installed) and Python's."""
    packages = QUICK_PACKAGES if quick else PACKAGES
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version({"sklearn": "scikit-learn"}.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": sys.version.split()[0], "packages": versions, "stdlib": list(QUICK_STDLIB) if quick else "all",
            "extraction": EXTRACTION}


def corpus(quick: bool, cache: Path | None) -> dict[str, list[str]]:
    """Every distinct paragraph, by part (public / train / validation / test), before the caps."""
    spec = sources(quick)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    file = None if cache is None else cache / f"quality_regime_corpus_{key}.json"
    if file is not None and file.exists():
        return json.loads(file.read_text())
    modules = []
    for name, version in spec["packages"].items():
        if version is None:
            continue
        found = importlib.util.find_spec(name)
        if found is None or found.origin is None:
            continue
        modules.extend(_sources(Path(found.origin).parent, name + "."))
    modules.extend(_sources(Path(sysconfig.get_paths()["stdlib"]), "stdlib.", tuple(QUICK_STDLIB) if quick else ()))
    parts = {"public": [], "train": [], "validation": [], "test": []}
    seen = set()
    for name, path in sorted(modules):
        bucket = _hash(name) % 10
        part = "public" if bucket < 4 else "train" if bucket < 8 else "validation" if bucket == 8 else "test"
        for text in _docstring_paragraphs(path):
            if text not in seen:
                seen.add(text)
                parts[part].append(text)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.with_suffix(".tmp")
        temporary.write_text(json.dumps(parts))
        temporary.replace(file)
    return parts


def drawn(parts: dict, sizes: Sizes) -> dict[str, list[str]]:
    """The paragraphs used: the first ``cap`` of each part in the order of a hash of the text."""
    caps = {"public": sizes.public, "train": sizes.train, "validation": sizes.evaluation, "test": sizes.evaluation}
    chosen = {}
    for part, cap in caps.items():
        texts = sorted(parts[part], key=_hash)
        if len(texts) < cap:
            raise SystemExit(f"the corpus has {len(texts)} {part} paragraphs, fewer than {cap}")
        chosen[part] = texts[:cap]
    return chosen


def tokenized(texts: dict, sizes: Sizes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) per part: a byte-level BPE trained on the public text; truncated, right-padded
    with 0, labels -100 on the padding."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts["public"], vocab_size=sizes.vocab, min_frequency=2, special_tokens=["<pad>"],
                            show_progress=False)
    if bpe.get_vocab_size() > sizes.vocab:
        raise ValueError(f"the tokenizer has {bpe.get_vocab_size()} tokens, more than the model's {sizes.vocab}")
    out = {}
    for part, part_texts in texts.items():
        ids = torch.zeros((len(part_texts), sizes.tokens), dtype=torch.long)
        labels = torch.full((len(part_texts), sizes.tokens), -100, dtype=torch.long)
        for row, encoding in enumerate(bpe.encode_batch(part_texts)):
            tokens = torch.tensor(encoding.ids[: sizes.tokens], dtype=torch.long)
            ids[row, : len(tokens)] = tokens
            labels[row, : len(tokens)] = tokens
        out[part] = (ids.contiguous(), labels.contiguous())
    return out


# -- the model, shared with the Opacus peer (plain torch) ------------------------------------------

def build_model(sizes: Sizes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocabulary=sizes.vocab, width=sizes.width, layers=sizes.layers, heads=sizes.heads,
                       length=sizes.tokens)


def batch_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The batch's mean of each paragraph's own token-mean cross-entropy."""
    return per_paragraph_losses(model(ids), labels).mean()


def mean_loss(model, data: tuple) -> float:
    """Mean over paragraphs of each one's token-mean cross-entropy (nats); inf where it is not finite."""
    ids, labels = data
    model.eval()
    with torch.no_grad():
        losses = torch.cat([per_paragraph_losses(model(ids[i: i + 256]), labels[i: i + 256])
                            for i in range(0, len(ids), 256)])
    model.train()
    value = float(losses.mean())
    return value if math.isfinite(value) else math.inf


def make_optimizer(kind: str, parameters, rate: float):
    if kind == "adamw":
        return torch.optim.AdamW(parameters, lr=rate)
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=rate, momentum=0.9)
    raise ValueError(kind)


def pretrain(data: dict, sizes: Sizes) -> dict:
    """The public model's state: AdamW, no privacy, on the public paragraphs."""
    model = build_model(sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.pretrain_rate)
    ids, labels = data["public"]
    generator = torch.Generator().manual_seed(0)
    for _ in range(sizes.pretrain_epochs):
        for rows in torch.randperm(len(ids), generator=generator).split(sizes.batch):
            optimizer.zero_grad()
            batch_loss(model, ids[rows], labels[rows]).backward()
            optimizer.step()
    return {name: value.clone() for name, value in model.state_dict().items()}


def starting_model(setting: str, base: dict, sizes: Sizes):
    model = build_model(sizes)
    if setting == "finetune":
        model.load_state_dict(base)
    return model


# -- one opake run ------------------------------------------------------------------------------

def _options(method: str, sizes: Sizes, epsilon: float) -> tuple[dict, str]:
    from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy

    if method == "opake default":
        return {}, ""
    if method == "BLT":
        return {"strategy": blt_strategy(), "sampling": "balls_in_bins"}, ""
    if method == "DP-SGD (opake)":
        return {"strategy": identity_strategy(), "sampling": "poisson"}, ""
    if method == "BandMF":
        bands = _bands(sizes, epsilon)
        return {"strategy": band_mf_strategy(bands=bands), "sampling": "poisson"}, f"{bands} bands"
    raise ValueError(method)


def _planner(name: str, modules: tuple):
    """``name`` from the first of ``modules`` that has it (opake's planner moves between releases)."""
    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"opake has no {name} in {modules}")


def _bands(sizes: Sizes, epsilon: float) -> int:
    rule = _planner("cyclic_poisson_bands", ("opake.planner", "opake.dpftrl.accounting.band_choice", "opake.plan"))
    return rule(sizes.train, sizes.batch, sizes.epochs, epsilon, DELTA)


def opake_run(method: str, setting: str, optimizer_kind: str, epsilon: float, rate: float, seed: int,
              data: dict, base: dict, sizes: Sizes) -> dict:
    """Train one model (non-private or through make_private); its validation and test loss."""
    from opake.random import key
    from opake.torch import make_private

    started, cpu = time.perf_counter(), time.process_time()
    model = starting_model(setting, base, sizes)
    optimizer = make_optimizer(optimizer_kind, model.parameters(), rate)
    ids, labels = data["train"]
    torch.manual_seed(seed)
    result = {"sigma": 0.0, "chose": ""}
    if method == "non-private":
        generator = torch.Generator().manual_seed(seed)
        steps = len(ids) // sizes.batch
        for _ in range(sizes.epochs):
            order = torch.randperm(len(ids), generator=generator)
            for step in range(steps):
                rows = order[step * sizes.batch: (step + 1) * sizes.batch]
                optimizer.zero_grad()
                batch_loss(model, ids[rows], labels[rows]).backward()
                optimizer.step()
        result["steps"] = steps * sizes.epochs
    else:
        options, chose = _options(method, sizes, epsilon)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private = make_private(module=model, optimizer=optimizer,
                                   dataset=torch.utils.data.TensorDataset(ids, labels),
                                   batch_size=sizes.batch, epochs=sizes.epochs, target_epsilon=epsilon,
                                   target_delta=DELTA, max_grad_norm=1.0, key=key(1000 + seed), progress=False,
                                   **options)
        steps = 0
        for _ in range(sizes.epochs):
            for batch_ids, batch_labels in private.data_loader:
                private.optimizer.zero_grad()
                if len(batch_ids):
                    batch_loss(model, batch_ids, batch_labels).backward()
                private.optimizer.step()
                steps += 1
        choice = private.plan.choice
        result.update(sigma=float(private.noise_multiplier), steps=steps,
                      chose=choice.chosen.name if choice is not None else chose)
        private.detach()
    result.update(validation=mean_loss(model, data["validation"]), test=mean_loss(model, data["test"]),
                  seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu)
    return result


def predicted(method: str, optimizer_kind: str, epsilon: float, sizes: Sizes) -> dict:
    """The planner's noise error for ``method`` at the budget (``choose_mechanism``, restricted to
    the named mechanism; unrestricted for the default), with the name and noise multiplier."""
    # the torch-facing one, which reads the workload from the optimizer as make_private does
    choose_mechanism = _planner("choose_mechanism", ("opake.torch.planning", "opake.torch.choice", "opake.torch"))
    optimizer = make_optimizer(optimizer_kind, [torch.nn.Parameter(torch.zeros(1))], 1e-3)
    restriction = {}
    if method == "Opacus DP-SGD":
        method = "DP-SGD (opake)"
    if method != "opake default":
        restriction, _ = _options(method, sizes, epsilon)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice = choose_mechanism(num_examples=sizes.train, batch_size=sizes.batch, epochs=sizes.epochs,
                                  target_epsilon=epsilon, target_delta=DELTA, optimizer=optimizer, progress=False,
                                  **restriction)
    return {"error": choice.chosen.error, "sigma": choice.chosen.noise_multiplier, "name": choice.chosen.name,
            "candidates": {c.name: c.error for c in choice.candidates}}


# -- the Opacus peer ------------------------------------------------------------------------------

def peer_python() -> Path | None:
    configured = os.environ.get("OPAKE_PEER_OPACUS")
    path = Path(configured) if configured else HERE.parents[1] / "peer-opacus"
    if path.is_dir():
        path = path / "bin" / "python"
    return path if path.exists() else None


class PeerError(RuntimeError):
    pass


def peer_runs(python: Path, data_file: Path, setting: str, optimizer_kind: str, epsilon: float, jobs: list,
              on_run) -> None:
    """Run (rate, seed) jobs in Opacus' interpreter; ``on_run(rate, seed, result)`` for each line it prints."""
    command = [str(python), str(PEER), "--data", str(data_file), "--setting", setting, "--optimizer", optimizer_kind,
               "--epsilon", repr(epsilon), "--delta", repr(DELTA), "--jobs", *[f"{r!r}:{s}" for r, s in jobs]]
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    for line in process.stdout:
        if line.startswith("{"):
            record = json.loads(line)
            on_run(record.pop("rate"), record.pop("seed"), record)
    error = process.stderr.read()
    if process.wait() != 0:
        raise PeerError(f"Opacus peer exited {process.returncode}: " + " | ".join(error.strip().splitlines()[-3:]))


# -- the results file -----------------------------------------------------------------------------

def cell_key(setting, optimizer_kind, epsilon, method) -> str:
    return f"{setting}|{optimizer_kind}|{'inf' if method == 'non-private' else f'{epsilon:g}'}|{method}"


class Results:
    """The JSON file: ``meta`` (what was run), ``runs`` ({cell|rate|seed: result}), ``cells``
    ({cell: planner's prediction}), ``errors`` ({cell: message}); written after each change."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        if path.exists():
            self.data = json.loads(path.read_text())
            if self.data.get("meta", {}).get("config") != meta["config"]:
                raise SystemExit(f"{path} holds runs of another configuration; pass another --out or remove it")
        else:
            self.data = {"meta": meta, "runs": {}, "cells": {}, "errors": {}}
        self.data["meta"].update({k: v for k, v in meta.items() if k != "config"})

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        temporary.replace(self.path)

    def add(self, cell: str, rate: float, seed: int, result: dict) -> None:
        self.data["runs"][f"{cell}|{rate:g}|{seed}"] = result
        self.write()

    def runs_of(self, cell: str) -> dict:
        """{(rate, seed): result} of one cell."""
        found = {}
        for name, result in self.data["runs"].items():
            head, rate, seed = name.rsplit("|", 2)
            if head == cell:
                found[(float(rate), int(seed))] = result
        return found


def _index(rate: float) -> int:
    """Learning rate -> grid index (the inverse of ``rate_of``)."""
    return round(2 * math.log10(rate))


def next_jobs(runs: dict, center: int, seeds, max_rates: int) -> tuple[list, dict]:
    """What a cell needs next: [(rate, seed)], empty when done; and its state (best rate, edge)."""
    tuning = {_index(rate): r["validation"] for (rate, seed), r in runs.items() if seed == seeds[0]}
    wanted = {center - 1, center, center + 1} if len(tuning) < 3 else set()
    wanted |= set(range(min(set(tuning) | wanted), max(set(tuning) | wanted) + 1))  # no holes in the rates tried
    first = sorted(k for k in wanted - set(tuning) if GRID[0] <= k <= GRID[1])
    if first:
        return [(rate_of(k), seeds[0]) for k in first], {}
    best = min(sorted(tuning), key=lambda k: tuning[k])
    low, high = min(tuning), max(tuning)
    if len(tuning) < max_rates:
        if best == low and low - 1 >= GRID[0]:
            return [(rate_of(low - 1), seeds[0])], {}
        if best == high and high + 1 <= GRID[1]:
            return [(rate_of(high + 1), seeds[0])], {}
    edge = best in (low, high)
    missing = [(rate_of(best), seed) for seed in seeds[1:] if (rate_of(best), seed) not in runs]
    return missing, {"rate": rate_of(best), "edge": edge}


def _family(method: str) -> str:
    return {"non-private": "non-private", "DP-SGD (opake)": "dpsgd", "Opacus DP-SGD": "dpsgd"}.get(method, "correlated")


def center_for(results: Results, setting, optimizer_kind, epsilon, method, epsilons, seeds) -> int:
    """The best rate of the same method at the nearest other epsilon (Opacus: opake's DP-SGD at
    this epsilon first), else the prior."""
    candidates = []
    if method == "Opacus DP-SGD":
        candidates.append(cell_key(setting, optimizer_kind, epsilon, "DP-SGD (opake)"))
    candidates += [cell_key(setting, optimizer_kind, other, method)
                   for other in sorted(epsilons, key=lambda e: abs(math.log(e / epsilon))) if other != epsilon]
    for cell in candidates:
        runs = results.runs_of(cell)
        tuning = {rate: r["validation"] for (rate, seed), r in runs.items() if seed == seeds[0]}
        if len(tuning) >= 3:
            return _index(min(sorted(tuning), key=lambda r: tuning[r]))
    return PRIORS[(setting, optimizer_kind, _family(method))]


# -- the whole run ----------------------------------------------------------------------------------

def prepare(quick: bool, cache: Path | None):
    sizes = QUICK if quick else Sizes()
    started = time.perf_counter()
    texts = drawn(corpus(quick, cache), sizes)
    data = tokenized(texts, sizes)
    base = pretrain(data, sizes)
    spec = sources(quick)
    digest = hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()[:16]
    return sizes, data, base, spec, digest, time.perf_counter() - started


def run_all(args) -> int:
    torch.set_num_threads(args.threads)
    sizes, data, base, spec, digest, seconds = prepare(args.quick, None if args.quick and not args.cache else OUT)
    epsilons = tuple(args.epsilons or ((8.0,) if args.quick else EPSILONS))
    seeds = tuple(args.seeds or ((0, 1) if args.quick else SEEDS))
    stages = [tuple(s.split("-")) for s in args.stages] if args.stages else list(STAGES)
    methods = args.methods or list(METHODS)
    config = {"sizes": asdict(sizes), "corpus": digest, "delta": DELTA, "seeds": list(seeds)}
    opake_dir = Path(importlib.util.find_spec("opake").origin).parent
    commit = opake_dir.parents[1] / "COMMIT"  # a snapshot of a commit's src/opake (git archive) records it there
    meta = {"config": config, "sources": spec, "torch": torch.__version__, "threads": args.threads,
            "opake": str(opake_dir) + (f" (commit {commit.read_text().strip()})" if commit.exists() else ""),
            "paragraphs": {part: len(ids) for part, (ids, _) in data.items()}}
    results = Results(Path(args.out), meta)
    base_model = starting_model("finetune", base, sizes)
    results.data["meta"]["pretrained_test_loss"] = mean_loss(base_model, data["test"])
    results.data["meta"]["preparation_seconds"] = seconds
    results.write()
    print(f"corpus {digest}: {meta['paragraphs']} paragraphs; prepared in {seconds:.0f} s; pretrained test loss "
          f"{results.data['meta']['pretrained_test_loss']:.3f}; results in {args.out}", flush=True)
    python = None if args.no_opacus else peer_python()
    data_file = None
    failures = []
    for setting, optimizer_kind in stages:
        for epsilon in epsilons:
            for method in methods:
                if method == "non-private" and epsilon != epsilons[0]:
                    continue
                cell = cell_key(setting, optimizer_kind, epsilon, method)
                if method == "Opacus DP-SGD" and python is None:
                    results.data["errors"][cell] = "not installed (OPAKE_PEER_OPACUS or ../peer-opacus)"
                    continue
                if method != "non-private" and cell not in results.data["cells"]:
                    results.data["cells"][cell] = {"predicted": predicted(method, optimizer_kind, epsilon, sizes)}
                    results.write()
                center = center_for(results, setting, optimizer_kind, epsilon, method, epsilons, seeds)
                results.data["errors"].pop(cell, None)
                if method in SAME_AS_DEFAULT:
                    _same_as_default(results, cell, method, setting, optimizer_kind, epsilon, seeds, data, base,
                                     sizes)
                while True:
                    jobs, state = next_jobs(results.runs_of(cell), center, seeds, sizes.max_rates)
                    if not jobs:
                        results.data["cells"].setdefault(cell, {}).update(state)
                        results.write()
                        break
                    if method == "Opacus DP-SGD":
                        if data_file is None:
                            data_file = Path(args.out).with_name(Path(args.out).stem + "_peer.pt")
                            torch.save({"data": data, "base": base, "sizes": asdict(sizes)}, data_file)
                        try:
                            peer_runs(python, data_file, setting, optimizer_kind, epsilon, jobs,
                                      lambda rate, seed, r, c=cell: _record(results, c, rate, seed, r))
                        except PeerError as error:
                            results.data["errors"][cell] = str(error)
                            results.write()
                            failures.append(f"{cell}: {error}")
                            print(f"FAILED {cell}: {error}", flush=True)
                            break
                        continue
                    for rate, seed in jobs:
                        _record(results, cell, rate, seed,
                                opake_run(method, setting, optimizer_kind, epsilon, rate, seed, data, base, sizes))
    print()
    report(results.data, file=sys.stdout)
    if failures:
        print("\n".join(["", "failures:"] + failures), file=sys.stderr)
        return 1
    return 0


# A named mechanism that the default also chose is the same computation (same strategy, sampling,
# calibration and key): where one run at the default's tuned rate and seed 0 gives bit-identical losses,
# the default's runs stand for the named cell (marked in the report), which saves about a fifth of the
# compute. The BLT named is blt_strategy(); the default's BLT is the optimizer's recipe, which for SGD
# with momentum differs, so there it is always run.
SAME_AS_DEFAULT = {"BLT": lambda name, bands: name == "BLT",
                   "DP-SGD (opake)": lambda name, bands: name == "DP-SGD, Poisson",
                   "BandMF": lambda name, bands: name == f"BandMF, {bands} bands"}


def _same_as_default(results: Results, cell: str, method: str, setting, optimizer_kind, epsilon, seeds, data, base,
                     sizes) -> None:
    default_cell = cell_key(setting, optimizer_kind, epsilon, "opake default")
    state = results.data["cells"].get(default_cell, {})
    chosen = state.get("predicted", {}).get("name", "")
    if "rate" not in state:
        return
    bands = _bands(sizes, epsilon) if method == "BandMF" else None
    if not SAME_AS_DEFAULT[method](chosen, bands):
        return
    default_runs = results.runs_of(default_cell)
    rate = state["rate"]
    if (rate, seeds[0]) not in results.runs_of(cell):
        _record(results, cell, rate, seeds[0],
                opake_run(method, setting, optimizer_kind, epsilon, rate, seeds[0], data, base, sizes))
    mine, theirs = results.runs_of(cell)[(rate, seeds[0])], default_runs[(rate, seeds[0])]
    if (mine["validation"], mine["test"], mine["sigma"]) != (theirs["validation"], theirs["test"], theirs["sigma"]):
        return
    missing = [(key, result) for key, result in default_runs.items() if key not in results.runs_of(cell)]
    if not missing and results.data["cells"].get(cell, {}).get("same_as") == default_cell:
        return
    for (other_rate, seed), result in missing:
        results.data["runs"][f"{cell}|{other_rate:g}|{seed}"] = {**result, "chose": "", "same_as": default_cell}
    results.data["cells"].setdefault(cell, {})["same_as"] = default_cell
    results.write()
    print(f"{cell}: bit-identical to {default_cell} at lr {rate:g}, seed {seeds[0]}: its runs stand", flush=True)


def _record(results: Results, cell: str, rate: float, seed: int, result: dict) -> None:
    results.add(cell, rate, seed, result)
    print(f"{cell:<44} lr {rate:<7g} seed {seed}: validation {result['validation']:.4f} test {result['test']:.4f} "
          f"sigma {result['sigma']:.4g} {result.get('chose', '')} ({result['seconds']:.1f} s)", flush=True)


# -- the report -----------------------------------------------------------------------------------

def cell_summary(data: dict, cell: str) -> dict | None:
    """Tuned rate, tests over seeds at it, mean seconds a run; None without runs."""
    runs = {}
    for name, result in data["runs"].items():
        head, rate, seed = name.rsplit("|", 2)
        if head == cell:
            runs[(float(rate), int(seed))] = result
    if not runs:
        return None
    seeds = data["meta"]["config"]["seeds"]
    tuning = {rate: r["validation"] for (rate, seed), r in runs.items() if seed == seeds[0]}
    best = min(sorted(tuning), key=lambda r: tuning[r])
    at_best = [runs[(best, s)] for s in seeds if (best, s) in runs]
    state = data["cells"].get(cell, {})
    done = "rate" in state and len(at_best) == len(seeds)
    return {"rate": best, "tests": [r["test"] for r in at_best], "runs": at_best, "done": done,
            "edge": state.get("edge", best in (min(tuning), max(tuning))), "rates": sorted(tuning),
            "seconds": statistics.fmean(r["seconds"] for r in runs.values() if "same_as" not in r)
            if any("same_as" not in r for r in runs.values()) else 0.0,
            "cpu_seconds": sum(r.get("cpu_seconds", r["seconds"]) for r in runs.values() if "same_as" not in r),
            "chose": next((r.get("chose") for r in at_best if r.get("chose")), ""),
            "sigma": at_best[0]["sigma"] if at_best else None, "same_as": "same_as" in state}


def report(data: dict, file=sys.stdout) -> None:
    meta = data["meta"]
    sizes = meta["config"]["sizes"]
    steps = sizes["train"] // sizes["batch"]
    print(f"Private training: {meta['paragraphs']['train']} paragraphs, batch {sizes['batch']}, {sizes['epochs']} "
          f"epochs ({steps} steps an epoch, {steps * sizes['epochs']} steps), clip 1, "
          f"delta {meta['config']['delta']:g}; "
          f"model: width {sizes['width']}, {sizes['layers']} layer(s), {sizes['tokens']} tokens, BPE {sizes['vocab']}; "
          f"pretrained test loss {meta.get('pretrained_test_loss', float('nan')):.3f}; "
          f"seeds {meta['config']['seeds']}; "
          f"torch {meta.get('torch')}, {meta.get('threads')} thread(s); opake from {meta.get('opake')}", file=file)
    cells = set(name.rsplit("|", 2)[0] for name in data["runs"]) | set(data.get("errors", {}))
    stages = [s for s in STAGES if any(c.startswith(f"{s[0]}|{s[1]}|") for c in cells)]
    for setting, optimizer_kind in stages:
        print(f"\n{setting}, {optimizer_kind}", file=file)
        print(f"{'epsilon':>7}  {'method':<15} {'chose':<16} {'lr':>6} {'test loss mean +- std':>22} "
              f"{'pred. error':>11} {'sigma':>7} {'vs Opacus':>18} {'gap closed':>10} {'s/run':>6}", file=file)
        floor = cell_summary(data, cell_key(setting, optimizer_kind, 0, "non-private"))
        epsilons = sorted({float(c.split("|")[2]) for c in cells if c.startswith(f"{setting}|{optimizer_kind}|")
                           and c.split("|")[2] != "inf"})
        for epsilon in [math.inf] + epsilons:
            if epsilon == math.inf:
                rows = [("non-private", floor)]
            else:
                rows = [(m, cell_summary(data, cell_key(setting, optimizer_kind, epsilon, m))) for m in METHODS[1:]]
            reference = next((s for m, s in rows if m == "Opacus DP-SGD" and s and s["tests"]), None)
            for method, summary in rows:
                cell = cell_key(setting, optimizer_kind, epsilon, method)
                label = "-" if epsilon == math.inf else f"{epsilon:g}"
                if summary is None:
                    if cell in data.get("errors", {}):
                        print(f"{label:>7}  {method:<15} {data['errors'][cell]}", file=file)
                    continue
                mean, std = _summary(summary["tests"])
                spread = f"+- {std:.3f}" if len(summary["tests"]) > 1 else "(1 seed)"
                flags = (("" if summary["done"] else " *") + (" edge" if summary["edge"] and summary["done"] else "")
                         + (" =default" if summary["same_as"] else ""))
                pred = data["cells"].get(cell, {}).get("predicted")
                error = "" if pred is None else f"{pred['error']:.4g}"
                if method == "Opacus DP-SGD" and pred is not None and summary["sigma"]:
                    error = f"{pred['error'] * summary['sigma'] / pred['sigma']:.4g}"
                versus, gap = "", ""
                if reference is not None and method != "Opacus DP-SGD" and epsilon != math.inf:
                    ref_mean = _summary(reference["tests"])[0]
                    in_sd = _in_pooled_sd(mean - ref_mean, summary["tests"], reference["tests"])
                    versus = f"{mean - ref_mean:+.3f} {in_sd}"
                    if floor and floor["tests"] and ref_mean != _summary(floor["tests"])[0]:
                        gap = f"{(ref_mean - mean) / (ref_mean - _summary(floor['tests'])[0]):.0%}"
                sigma = "" if not summary["sigma"] else f"{summary['sigma']:.3f}"
                print(f"{label:>7}  {method:<15} {summary['chose'] or '':<16} {summary['rate']:>6g} {mean:>12.4f} "
                      f"{spread:<9} {error:>11} {sigma:>7} {versus:>18} {gap:>10} {summary['seconds']:>6.1f}{flags}",
                      file=file)
    own = [r for r in data["runs"].values() if "same_as" not in r]
    print(f"\n{len(own)} runs, {sum(r['seconds'] for r in own) / 3600:.2f} h wall, "
          f"{sum(r.get('cpu_seconds', r['seconds']) for r in own) / 3600:.2f} h CPU "
          f"(mean {statistics.fmean(r['seconds'] for r in own) if own else 0:.1f} s a run)", file=file)
    print("\n(test loss: nats, mean +- std over seeds at the rate tuned on validation with the first seed; pred. "
          "error: the planner's worst-step noise error for the optimizer's workload (choose_mechanism; Opacus: "
          "opake's DP-SGD error scaled by Opacus' noise multiplier); vs Opacus: difference to Opacus DP-SGD, in "
          "pooled sds over seeds; gap closed: the share of Opacus' gap to non-private closed; * not finished; edge: "
          "the best rate is at the end of the rates tried; =default: the same computation as the "
          "default's (bit-identical at its tuned rate), whose runs it shows)", file=file)


def merged(path: Path, others: list) -> dict:
    """The JSON of ``path`` with the runs, cells and errors of ``others`` added (each must hold the
    same configuration: corpus, sizes, seeds)."""
    data = json.loads(path.read_text())
    for other in others:
        more = json.loads(other.read_text())
        if more["meta"]["config"] != data["meta"]["config"]:
            raise SystemExit(f"{other} holds runs of another configuration than {path}")
        for part in ("runs", "cells", "errors"):
            data[part].update(more[part])
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one epsilon, seeds 0 1, 3 rates: seconds")
    parser.add_argument("--report", action="store_true", help="print the table from --out and exit")
    parser.add_argument("--with", dest="others", nargs="+", default=(), metavar="FILE",
                        help="--report: also the runs of these files (stages run by other processes, each with "
                             "its own --out; the same configuration)")
    parser.add_argument("--out", default=None, help="the JSON file (default benchmarks/out/quality_regime.json)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epsilons", type=float, nargs="+", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--stages", nargs="+", default=None, choices=[f"{s}-{o}" for s, o in STAGES])
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--cache", action="store_true", help="--quick: cache the corpus in benchmarks/out too")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(OUT / ("quality_regime_quick.json" if args.quick else "quality_regime.json"))
    if args.report:
        report(merged(Path(args.out), [Path(other) for other in args.others]))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
