"""Every Python block of README.md and docs/*.md runs, each as its own test case.

A block is read from its page and executed as written. What it takes as given (a model, a data
set, a process group) is set up first by a *prelude* that the page names in an HTML comment on
the line before the block, ``<!-- prelude: name -->`` (several: ``<!-- prelude: a, b -->``); the
preludes are defined here, in plain view, and only make stand-ins (tiny models, a few examples,
a local stand-in for a model download). A block that cannot run on a CPU-only machine is marked
``<!-- not run: reason -->`` and reported as skipped with that reason; there may be only a few
(``MOST_NOT_RUN``). A page edit that breaks a block breaks its test case, named by page and line
(``README.md:37``).

A few blocks also get checks after they run (``CHECKS``, by page and the heading above the block):
the README's quick starts run their whole plan, meet their budget and save a checkpoint that
loads with ``weights_only=True``.

Blocks on torch.distributed (preludes in ``_CHILD_PROCESS``) run in a child process of their own,
one gloo rank in the environment torchrun sets (world size 1), so that no process group is left
behind in this one. The last test checks that every relative link and every repository path named
in README.md, docs/*.md and benchmarks/README.md points at a file that exists.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"   # the preludes import the tests' helpers (transformers_support, trl_support)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MOST_NOT_RUN = 3

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(prelude|not run):\s*(.*?)\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str            # relative to the repository root
    line: int            # line of the opening fence (1-based)
    heading: str         # the nearest heading above the block
    code: str
    preludes: tuple[str, ...]
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, heading, index = [], "", 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            if lines[index].startswith("#"):
                heading = lines[index].lstrip("#").strip()
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if fence.group(2) == "python":
            before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            mark = _MARK.match(before)
            preludes = tuple(n.strip() for n in mark.group(2).split(",")) if mark and mark.group(1) == "prelude" else ()
            not_run = mark.group(2) if mark and mark.group(1) == "not run" else None
            code = textwrap.dedent("\n".join(lines[index + 1:end])) + "\n"
            blocks.append(Block(str(page.relative_to(root)), index + 1, heading, code, preludes, not_run))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]


# --- preludes: what a block takes as given ---------------------------------------------------------

PRELUDES = {
    # A small classifier without BatchNorm, its optimizer and 128 examples; `path` for a checkpoint.
    "classifier": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        features = torch.randn(128, 10)
        train_ds = torch.utils.data.TensorDataset(features, features[:, :3].argmax(dim=1))
        path = "private.pt"
    """,
    # The classifier made private at epsilon 3, the mechanism chosen for the budget.
    "private_run": """
        from opake.torch import make_private
        private = make_private(module=model, optimizer=optimizer, dataset=train_ds, batch_size=32, epochs=2,
                               target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0)
    """,
    # A model with a `body` and a `head`, the settings of a short run, and one training step.
    "two_stage_model": """
        import torch
        import torch.nn.functional as F
        from opake.torch import make_private

        class TwoStage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh())
                self.head = torch.nn.Linear(16, 3)

            def forward(self, x):
                return self.head(self.body(x))

        torch.manual_seed(0)
        model = TwoStage()
        features = torch.randn(128, 10)
        train_ds = torch.utils.data.TensorDataset(features, features[:, :3].argmax(dim=1))
        epochs = 3
        run_settings = dict(dataset=train_ds, batch_size=32, epochs=epochs, max_grad_norm=1.0,
                            target_epsilon=3.0, target_delta=1e-5)

        def train_step(x, y):
            private.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            private.optimizer.step()
    """,
    # Records with a user id (4 examples per user); loss_fn(model, batch) on a collated batch of them.
    "user_records": """
        import torch
        import torch.nn.functional as F
        from opake.torch import make_private
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        features = torch.randn(256, 10)
        train_ds = [{"x": features[i], "y": features[i, :3].argmax(), "user_id": i // 4} for i in range(256)]

        def loss_fn(model, batch):
            return F.cross_entropy(model(batch["x"]), batch["y"])
    """,
    # A layer of the user's own (a Linear with a learnable output scale).
    "scaled_linear": """
        import torch

        class ScaledLinear(torch.nn.Linear):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.scale = torch.nn.Parameter(torch.ones(()))

            def forward(self, x):
                return self.scale * super().forward(x)
    """,
    # A proven privacy process of a BLT run.
    "mf_gaussian_process": """
        import opake.dpftrl.accounting as dpftrl_acc
        from opake.dpftrl.noise import blt_strategy
        proc = dpftrl_acc.mf_gaussian(1.2, blt_strategy(max_buffers=10), n_steps=5000, min_sep=100,
                                      max_participations=5)
    """,
    # The functional layer's given: a least-squares problem (params, data, loss_fn of ONE example, lr).
    "least_squares": """
        import torch
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(1000, 20, generator=generator)
        targets = features @ torch.linspace(-1, 1, 20) + 0.1 * torch.randn(1000, generator=generator)
        data = torch.utils.data.TensorDataset(features, targets)   # data[indices] -> (x, y)
        params = torch.zeros(20)
        lr = 0.05

        def loss_fn(params, example):
            x, y = example
            return 0.5 * (x @ params - y) ** 2
    """,
    # One batch of 16 examples and its clipped gradient (opake's clipped_grad), computed once and
    # returned at every step: the specification's 10000-step loop then costs the noise, not 10000
    # per-example backward passes. The loop itself (grad_fn -> noise_fn -> params) is as written.
    "fixed_batch": """
        from opake.dpftrl.clipping import clipped_grad
        batch = data[torch.arange(16)]
        noise_multiplier = 4.0          # about what acc.calibrate gives for epsilon 2 over 10000 single steps
        _clipped_grad, clip_state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=16)
        _grads, _ = _clipped_grad(params, batch, state=clip_state)

        def grad_fn(params, batch, state):
            return _grads, state
    """,
    "a_noise_multiplier": """
        noise_multiplier = 1.2
    """,
    # For docs/audit.md: a fresh tiny model per run, and 40 examples (the canaries add 1000 more).
    "audit_task": """
        import torch
        torch.manual_seed(0)
        features = torch.randn(40, 8)
        train_ds = torch.utils.data.TensorDataset(features, features[:, :2].argmax(dim=1))

        def build_model():
            return torch.nn.Linear(8, 2)
    """,
    # Opacus' and opake's scripts: a Net without BatchNorm and 256 examples.
    "opacus_net": """
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

            def forward(self, x):
                return self.layers(x)

        torch.manual_seed(0)
        features = torch.randn(256, 10)
        train_dataset = torch.utils.data.TensorDataset(features, features[:, :3].argmax(dim=1))
    """,
    "opacus_installed": """
        import pytest
        pytest.importorskip("opacus")
    """,
    # Hugging Face: a tiny GPT-2 (no download), 256 short sentences and their collator.
    "hf_gpt2": """
        import pytest
        pytest.importorskip("transformers")
        monkeypatch.setenv("CI", "1")   # TRL's telemetry off
        from transformers_support import CharDataset, collate, gpt2, sentences
        model, train_ds, collator = gpt2(), CharDataset(sentences(256)), collate
    """,
    # A tiny Llama stands in for a model download: AutoModelForCausalLM.from_pretrained(name) builds
    # it from a config; 512 training and 32 evaluation sentences, their collator.
    "hub_stand_in": """
        import pytest
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("peft")
        monkeypatch.setenv("CI", "1")
        from transformers_support import VOCAB, CharDataset, collate, sentences

        def tiny_llama(name, *args, **kwargs):
            torch.manual_seed(0)
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0))

        import torch
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tiny_llama)   # undone after the test
        train_ds, eval_ds, collator = CharDataset(sentences(512)), CharDataset(sentences(32, seed=1)), collate
    """,
    # A DPTrainer run that saved checkpoints in "out": what a resumed script finds.
    "checkpointed_run": """
        import pytest
        transformers = pytest.importorskip("transformers")
        monkeypatch.setenv("CI", "1")
        from transformers import TrainingArguments
        from opake.transformers import DPTrainer
        from transformers_support import CharDataset, collate, gpt2, sentences
        model, train_ds, collator = gpt2(), CharDataset(sentences(64)), collate
        args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, num_train_epochs=2,
                                 learning_rate=0.05, save_steps=2, report_to="none", use_cpu=True)
        DPTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator, target_epsilon=8.0,
                  target_delta=1e-6).train()
        model = gpt2()   # the resumed script builds its model afresh
    """,
    # TRL: a tiny Llama policy and model, a word-level tokenizer, 32 completions and 32 preference pairs.
    "trl_data": """
        import pytest
        pytest.importorskip("trl")
        datasets = pytest.importorskip("datasets")
        monkeypatch.setenv("CI", "1")
        from trl_support import llama, preference_rows, sft_rows, tokenizer
        model, policy, tokenizer = llama(), llama(seed=1), tokenizer()
        completions = datasets.Dataset.from_dict(sft_rows(32))
        preferences = datasets.Dataset.from_dict(preference_rows(32))
    """,
    # torch.distributed, one gloo rank (the block runs in a child process): a model, 512 examples and
    # a loss. MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are set as torchrun sets them.
    "one_rank": """
        import torch
        import torch.nn.functional as F

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

            def forward(self, x):
                return self.layers(x)

        torch.manual_seed(0)
        features = torch.randn(512, 10)
        train_ds = torch.utils.data.TensorDataset(features, features[:, :3].argmax(dim=1))
        loss_fn = F.cross_entropy
    """,
    # The process group started, a tiny Llama (model.model.layers) and 512 sentences, padded to one length.
    "one_rank_llama": """
        import torch
        import torch.distributed as dist
        import transformers
        import opake.random
        from opake.torch import make_private
        from transformers_support import VOCAB, CharDataset, collate, sentences
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0))
        padded = collate(list(CharDataset(sentences(512))))   # every row padded to the longest
        train_ds = [{name: padded[name][i] for name in ("input_ids", "attention_mask", "labels")} for i in range(512)]
    """,
    # The noise engine's given: a model's parameters, a horizon, a noise multiplier, and clipped
    # gradients (already summed over the ranks).
    "noise_engine_inputs": """
        import torch
        import torch.distributed as dist
        from opake.types import clipped
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        N, sigma = 20, 1.0
        clipped_grads = clipped({name: torch.zeros_like(p) for name, p in model.named_parameters()}, l2_bound=1.0)
    """,
    # One rank's flat shards of a full template (world size 1: the whole of each leaf).
    "shard_inputs": """
        import torch
        from opake.dpftrl.noise import blt_strategy
        from opake.dpftrl.noise.distributed import even_shards
        full_template = {"weight": torch.zeros(16, 10), "bias": torch.zeros(16)}
        rank, world_size = 0, 1
        strategy, N, sigma, l2_bound = blt_strategy(), 20, 1.0, 1.0
        shard_grads = {name: torch.zeros(part.stop - part.start)
                       for name, part in even_shards(full_template, rank, world_size).items()}
    """,
}

# Preludes after which the block runs in a child process with one gloo rank.
_CHILD_PROCESS = {"one_rank", "one_rank_llama", "noise_engine_inputs"}


# --- checks after a block: (page, heading above the block) -> code run in the block's namespace ------

CHECKS = {
    ("README.md", "Train a PyTorch model privately"): """
        import torch
        assert private.steps_taken == private.plan.n_steps == 5 * (len(train_ds) // 64)   # the whole plan ran
        assert private.epsilon <= 3.0 + 1e-9
        assert torch.load("private.pt", weights_only=True)["format"]
    """,
    ("README.md", "Fine-tune a Hugging Face model privately"): """
        import torch
        assert trainer.private.steps_taken == trainer.private.plan.n_steps == 3 * (256 // 128)
        assert trainer.private.epsilon <= 8.0 + 1e-9
        assert not trainer.args.bf16 or torch.cuda.is_available()
    """,
    ("docs/transformers.md", "Which losses keep the guarantee"): """
        from transformers import TrainingArguments
        from transformers_support import CharDataset, collate, gpt2, sentences
        args = TrainingArguments(output_dir="custom", per_device_train_batch_size=16, num_train_epochs=1,
                                 learning_rate=0.05, save_strategy="no", report_to="none", use_cpu=True)
        custom = MyTrainer(model=gpt2(), args=args, train_dataset=CharDataset(sentences(64)), data_collator=collate,
                           target_epsilon=8.0, target_delta=1e-6)
        custom.train()
        assert custom.private.steps_taken == custom.private.plan.n_steps
    """,
    ("docs/transformers.md", "TRL: supervised fine-tuning and preference tuning"): """
        for run in (sft, dpo):
            assert run.private.steps_taken == run.private.plan.n_steps
            assert run.private.epsilon <= 8.0 + 1e-9
    """,
}


def _source(names, block: Block) -> str:
    unknown = [name for name in names if name not in PRELUDES]
    assert not unknown, f"{block.name} names preludes this test does not define: {unknown}"
    return "\n".join(textwrap.dedent(PRELUDES[name]) for name in names)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_in_child(block: Block, prelude: str, check: str, folder: pathlib.Path) -> None:
    """One gloo rank in a child process. The script writes a marker when the block and its checks are
    done, then closes the process group; an abort while gloo tears the group down (see
    tests/spawn_support.py) is accepted only after the marker."""
    done = folder / "done"
    script = folder / "block.py"
    script.write_text("\n".join([
        "import warnings", "warnings.simplefilter('ignore')", "import torch", "torch.set_num_threads(1)",
        prelude, f"exec(compile({block.code!r}, {block.name!r}, 'exec'))", check,
        f"open({str(done)!r}, 'w').close()",
        "import torch.distributed as dist",
        "if dist.is_initialized():", "    dist.destroy_process_group()"]))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", CI="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    finished = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=300)
    if finished.returncode != 0 and not (finished.returncode == -6 and done.exists()):
        pytest.fail(f"{block.name} failed in its child process (exit {finished.returncode}):\n"
                    f"{finished.stderr[-4000:]}")


# A block on torch.distributed starts its own interpreter (2-7 s): slow.
@pytest.mark.parametrize("block", [pytest.param(block, marks=pytest.mark.slow) if _CHILD_PROCESS & set(block.preludes)
                                   else block for block in BLOCKS], ids=[block.name for block in BLOCKS])
def test_the_block_runs(block, tmp_path, monkeypatch):
    if block.not_run is not None:
        assert block.not_run, f"{block.name}: <!-- not run: --> needs its reason"
        pytest.skip(f"not run: {block.not_run}")
    prelude = _source(block.preludes, block)
    check = textwrap.dedent(CHECKS.get((block.page, block.heading), ""))
    monkeypatch.chdir(tmp_path)
    if _CHILD_PROCESS & set(block.preludes):
        _run_in_child(block, prelude, check, tmp_path)
        return
    monkeypatch.syspath_prepend(str(TESTS))
    namespace = {"__name__": "docs_block", "monkeypatch": monkeypatch}   # a prelude's patches end with the test
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # the blocks' own warnings are not what is tested here
        exec(compile(prelude, f"prelude of {block.name}", "exec"), namespace)
        exec(compile(block.code, block.name, "exec"), namespace)
        exec(compile(check, f"checks of {block.name}", "exec"), namespace)


def test_every_page_block_is_found_and_few_are_not_run():
    assert len(BLOCKS) >= 20
    not_run = [block.name for block in BLOCKS if block.not_run is not None]
    assert len(not_run) <= MOST_NOT_RUN, f"too many blocks marked not run: {not_run}"


def test_every_check_belongs_to_a_block():
    headings = {(block.page, block.heading) for block in BLOCKS}
    assert set(CHECKS) <= headings, f"checks whose block moved: {set(CHECKS) - headings}"


def test_a_broken_block_fails_under_its_own_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n<!-- prelude: classifier -->\n```python\nmodel(undefined_name)\n```\n")
    (broken,) = read_blocks(page, root=tmp_path)
    assert (broken.name, broken.heading, broken.preludes) == ("page.md:4", "Title", ("classifier",))
    namespace = {}
    exec(compile(_source(broken.preludes, broken), "prelude", "exec"), namespace)
    with pytest.raises(NameError, match="undefined_name") as raised:
        exec(compile(broken.code, broken.name, "exec"), namespace)
    assert str(raised.traceback[-1].path) == "page.md:4"


# --- links ------------------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|examples|tests|src)/[\w./-]+\.(?:md|py|sh)"
                   r"|SECURITY\.md|README\.md)")


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    text = page.read_text()
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    for target in _PATH.findall(text):           # paths named in the text: from the repository root
        if not (ROOT / target).exists() and not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} points at files that do not exist: {sorted(set(missing))}"
