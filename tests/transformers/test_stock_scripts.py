"""The stock Hugging Face and TRL scripts, switched to private training, run with their own command lines.

``stock_scripts/`` holds scripts in the shape of transformers' ``run_clm.py`` and TRL's ``sft.py`` and
``dpo.py`` (their argument dataclasses, parsers and calls), each switched only by the trainer class
and its arguments class (``DPTrainer``/``DPTrainingArguments``, ``DPSFTTrainer``/``DPSFTConfig``,
``DPDPOTrainer``/``DPDPOConfig``). Here they run in this process (``main(argv)``, argv as a shell
would split the command line) on tiny models and data saved to folders the command lines name, as
a user's scripts read theirs (nothing downloads): ``--max_steps`` (a partial last epoch),
``--resume_from_checkpoint``, ``--gradient_checkpointing``, evaluation, LoRA (``--use_peft``), and
the refusal of TRL's ``--packing``. The 2-process FSDP run of ``run_clm`` under ``torchrun`` is
compared with one process, and dropout is shown to be the difference between process layouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from opake.torch.short_run import ShortRunWarning  # noqa: E402
from opake.transformers import UnsupportedTrainingArgumentError  # noqa: E402
from trl_support import llama, preference_rows, sentence, sft_rows, tokenizer  # noqa: E402

SCRIPTS = pathlib.Path(__file__).resolve().parent / "stock_scripts"
# TRL's configs still set the deprecated gradient_checkpointing field, as the stock scripts do.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

# Opacus 1.6 (its own environment, PRVAccountant, as make_private prints) for DP-SGD with Poisson
# sampling at noise multiplier 1.0, sample rate 8/86, 13 steps, delta 1e-5 (RDPAccountant: 3.507).
OPACUS_PRV_EPSILON_13_STEPS = 2.931


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"stock_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is imported
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def quiet(monkeypatch, tmp_path):
    """TRL's telemetry off, no progress bars, the data sets' cache in the test's folder."""
    monkeypatch.setenv("CI", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


def _gpt2(vocabulary: int, dropout: float):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocabulary, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=0, bos_token_id=1, eos_token_id=1))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model folders (GPT-2 with transformers' default dropout 0.1 as run_clm fine-tunes it, the same
    without dropout, Llama for TRL; each with a word-level tokenizer) and data files: text lines for
    run_clm (120 lines: 86 blocks of 8 tokens, 10 steps an epoch at batch 8), prompt/completion
    and preference rows for TRL (40 rows each: 5 steps an epoch at batch 8)."""
    root = tmp_path_factory.mktemp("stock")
    words = tokenizer()
    for name, model in (("gpt2", _gpt2(len(words), 0.1)), ("gpt2_no_dropout", _gpt2(len(words), 0.0)),
                        ("llama", llama())):
        model.save_pretrained(root / name)
        words.save_pretrained(root / name)
    rng = random.Random(0)
    (root / "train.txt").write_text("\n".join(sentence(rng, 3, 8) for _ in range(120)) + "\n")
    (root / "valid.txt").write_text("\n".join(sentence(rng, 3, 8) for _ in range(20)) + "\n")
    for folder, rows in (("sft", sft_rows), ("dpo", preference_rows)):
        (root / folder).mkdir()
        for split, count, seed in (("train", 40, 0), ("test", 8, 1)):
            table = rows(count, seed)
            lines = [json.dumps({column: values[i] for column, values in table.items()}) for i in range(count)]
            (root / folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


COMMON = "--report_to none --use_cpu --disable_tqdm true --logging_steps 1 --save_strategy no"


def run_clm(files, out, extra: str = "", model: str = "gpt2"):
    argv = (f"--model_name_or_path {files / model} --train_file {files / 'train.txt'} "
            f"--validation_file {files / 'valid.txt'} --cache_dir {out / 'cache'} --block_size 8 --do_train "
            f"--do_eval --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-2 "
            f"--output_dir {out / 'out'} {COMMON} {extra}").split()
    return _script("run_clm_style").main(argv)


def run_clm_line(argv: list):
    return _script("run_clm_style").main(argv)


def run_trl(script: str, files, out, extra: str):
    data = "sft" if script == "sft_style" else "dpo"
    argv = (f"--model_name_or_path {files / 'llama'} --dataset_name {files / data} --output_dir {out / 'out'} "
            f"--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --bf16 false --max_length 32 "
            f"{COMMON} {extra}").split()
    return _script(script).main(argv)


def weights(folder: pathlib.Path, name: str = "model.safetensors") -> dict:
    return safetensors_torch.load_file(str(folder / name))


def relative(got: dict, expected: dict) -> float:
    return max(float((got[name] - expected[name]).norm() / expected[name].norm()) for name in expected)


def logged(trainer, key: str = "epsilon") -> list:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


EPSILON_8 = "--target_epsilon 8 --target_delta 1e-5 --privacy_seed 0"


@pytest.fixture(scope="module")
def baseline(files, tmp_path_factory):
    """run_clm for 2 epochs at epsilon 8: the run the other command lines are compared with."""
    out = tmp_path_factory.mktemp("baseline")
    trainer = run_clm(files, out, f"--num_train_epochs 2 {EPSILON_8}")
    return trainer, out


# -- run_clm ---------------------------------------------------------------------------------------------


def test_run_clm_trains_evaluates_and_reports_its_epsilon(baseline):
    trainer, out = baseline
    results = json.loads((out / "out" / "all_results.json").read_text())  # save_metrics: what log_metrics printed
    plan = trainer.private.plan
    assert trainer.private.steps_taken == plan.n_steps == 20 and plan.steps_per_epoch == 10
    assert results["epsilon"] == trainer.private.epsilon_spent() == plan.epsilon
    assert 7.99 < results["epsilon"] <= 8.0
    assert results["eval_samples"] == 14 and results["perplexity"] > 1 and "eval_accuracy" in results
    assert (out / "out" / "model.safetensors").is_file()


def test_run_clm_with_gradient_checkpointing_and_evaluation_every_steps_trains_the_same_model(files, baseline,
                                                                                             tmp_path):
    """The same model bit for bit, dropout (0.1) included: checkpointing recomputes with the saved random
    state, and evaluation runs on a fork of the generators (its DataLoader draws a seed)."""
    trainer = run_clm(files, tmp_path, f"--num_train_epochs 2 {EPSILON_8} --gradient_checkpointing "
                                       f"--eval_strategy steps --eval_steps 3")
    assert trainer.model.is_activation_checkpointing and len(logged(trainer, "eval_loss")) >= 6
    assert relative(weights(tmp_path / "out"), weights(baseline[1] / "out")) == 0.0


def test_run_clm_max_steps_plans_exactly_those_steps_and_spends_the_budget_there(files, baseline, tmp_path):
    """--max_steps 13 with 10 steps an epoch: a plan of 13 steps, the second epoch cut after 3. The
    noise is calibrated for those 13 steps: the printed epsilon is the target (not the smaller
    epsilon of 13 steps of the 20-step plan, whose noise is larger: the control), with less noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)  # stopping at max_steps is the plan, not a short run
        trainer = run_clm(files, tmp_path, f"--max_steps 13 {EPSILON_8}")
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    whole = baseline[0]
    plan = trainer.private.plan
    assert trainer.private.steps_taken == trainer.state.global_step == plan.n_steps == 13
    assert plan.request.steps == 13 and plan.request.epochs is None and plan.epochs == 2
    assert results["epsilon"] == trainer.private.epsilon_spent() == plan.epsilon
    assert 8.0 * (1 - 1e-3) <= plan.epsilon <= 8.0
    at_step_13 = next(entry["epsilon"] for entry in whole.state.log_history if entry.get("step") == 13)
    assert at_step_13 < plan.epsilon  # the 20-step plan's first 13 steps spend less, with more noise
    if plan.strategy == whole.private.plan.strategy and plan.sampling == whole.private.plan.sampling:
        assert plan.noise_multiplier < whole.private.plan.noise_multiplier


def test_run_clm_resumes_from_a_checkpoint_with_its_command_line(files, tmp_path):
    """The run is cut after checkpoint-5 (the later checkpoints removed, as a crash leaves it); the
    same command line with --resume_from_checkpoint (and no seed: the checkpoint's key is adopted)
    ends on the uninterrupted run's model, bit for bit, with the same epsilon."""
    line = "--max_steps 13 --target_epsilon 8 --target_delta 1e-5 --save_strategy steps --save_steps 5"
    first = run_clm(files, tmp_path, f"{line} --privacy_seed 0")
    uninterrupted = weights(tmp_path / "out")
    for later in ("checkpoint-10", "checkpoint-13"):
        shutil.rmtree(tmp_path / "out" / later, ignore_errors=True)
    resumed = run_clm(files, tmp_path, f"{line} --resume_from_checkpoint {tmp_path / 'out' / 'checkpoint-5'}")
    assert resumed.private.steps_taken == 13
    assert resumed.private.epsilon_spent() == first.private.epsilon_spent()
    assert relative(weights(tmp_path / "out"), uninterrupted) == 0.0


@pytest.mark.slow
def test_run_clm_dp_sgd_with_poisson_sampling_prints_opacus_epsilon(files, tmp_path):
    """The Opacus setting on the same command line (DP-SGD, Poisson sampling, a given noise multiplier,
    13 steps): the printed epsilon is within 1% of Opacus' own accountant's for those steps."""
    trainer = run_clm(files, tmp_path, "--max_steps 13 --noise_multiplier 1.0 --target_delta 1e-5 --privacy_seed 0 "
                                       "--strategy dp_sgd --sampling poisson --logging_steps 13")  # PLD per log
    plan = trainer.private.plan
    assert plan.sampling == "poisson" and plan.sample_rate == pytest.approx(8 / 86)
    epsilon = json.loads((tmp_path / "out" / "all_results.json").read_text())["epsilon"]
    assert abs(epsilon - OPACUS_PRV_EPSILON_13_STEPS) / OPACUS_PRV_EPSILON_13_STEPS < 0.01


# -- TRL's sft.py and dpo.py -----------------------------------------------------------------------------


def test_trl_sft_with_lora_and_evaluation(files, tmp_path):
    """sft.py's LoRA command line (without --packing, refused below): only the adapters train."""
    trainer = run_trl("sft_style", files, tmp_path, f"--num_train_epochs 1 --learning_rate 2e-3 --use_peft "
                                                    f"--lora_r 4 --lora_alpha 8 --lora_target_modules q_proj v_proj "
                                                    f"--eval_strategy steps --eval_steps 2 {EPSILON_8}")
    assert trainer.private.steps_taken == trainer.private.plan.n_steps == 5
    assert 7.99 < logged(trainer)[-1] == trainer.private.epsilon_spent() <= 8.0
    assert logged(trainer, "eval_loss")
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_trl_sft_packing_is_refused_with_its_reason(files, tmp_path):
    with pytest.raises(UnsupportedTrainingArgumentError, match=r"packing=True.*re-packs others.*per segment"):
        run_trl("sft_style", files, tmp_path, f"--num_train_epochs 1 --packing {EPSILON_8}")


def test_trl_dpo_docstring_command_line_with_max_steps_and_lora(files, tmp_path):
    """dpo.py's LoRA command line (--max_steps, --eval_strategy steps, --no_remove_unused_columns): a
    plan of exactly 7 steps (epochs of 5, the second cut after 2), the noise calibrated for them."""
    trainer = run_trl("dpo_style", files, tmp_path, f"--learning_rate 5e-3 --num_train_epochs 1 --max_steps 7 "
                                                    f"--eval_strategy steps --eval_steps 3 --no_remove_unused_columns "
                                                    f"--use_peft --lora_r 4 --lora_alpha 8 "
                                                    f"--lora_target_modules q_proj v_proj {EPSILON_8}")
    plan = trainer.private.plan
    assert trainer.private.steps_taken == trainer.state.global_step == plan.n_steps == 7 and plan.epochs == 2
    assert logged(trainer)[-1] == trainer.private.epsilon_spent() == plan.epsilon
    assert 8.0 * (1 - 1e-3) <= plan.epsilon <= 8.0
    assert logged(trainer, "eval_loss")


# -- several processes: run_clm under torchrun with FSDP -----------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _clm_line(files, out, model: str, per_device: int, accumulation: int = 2) -> list:
    return (f"--model_name_or_path {files / model} --train_file {files / 'train.txt'} --cache_dir {out / 'cache'} "
            f"--block_size 8 --do_train --per_device_train_batch_size {per_device} "
            f"--gradient_accumulation_steps {accumulation} "
            f"--learning_rate 1e-2 --num_train_epochs 1 --noise_multiplier 0.8 --target_delta 1e-5 --privacy_seed 3 "
            f"--optim adamw_torch --output_dir {out / 'out'} {COMMON}").split()


@pytest.mark.slow
def test_run_clm_under_torchrun_with_fsdp_is_the_one_process_run_without_dropout(files, tmp_path):
    """``torchrun --nproc_per_node 2 run_clm_style.py ... --fsdp full_shard`` (2 gloo ranks, batch 2 per
    rank) against one process (batch 4), GPT-2 without dropout: the same steps and epsilon, weights
    within 1e-5 (measured: 1.4e-7, the order of the float sums). With dropout the two are different
    draws of the dropout masks (next test)."""
    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    one = run_clm_line(_clm_line(files, tmp_path / "one", "gpt2_no_dropout", 4))
    sharded = tmp_path / "two"
    done = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()),
                           str(SCRIPTS / "run_clm_style.py"), *_clm_line(files, sharded, "gpt2_no_dropout", 2),
                           "--fsdp", "full_shard"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # a rank aborting in gloo's teardown after the results are written is not this test's subject
    results = sharded / "out" / "all_results.json"
    assert done.returncode == 0 or (results.exists() and "terminate called" in done.stderr), done.stderr[-3000:]
    printed = json.loads(results.read_text())
    assert printed["epsilon"] == one.private.epsilon_spent() and printed["epoch"] == 1.0
    assert relative(weights(sharded / "out"), weights(tmp_path / "one" / "out")) < 1e-5


@pytest.mark.slow
def test_dropout_masks_are_what_differs_between_process_layouts(files, tmp_path):
    """Each forward pass draws dropout masks for the rows it holds: cutting the same planned batches
    into micro-batches of 2 instead of 4 rows, in one process, changes the trained model as much as
    a second process does (GPT-2's default dropout 0.1, 10 AdamW steps at lr 1e-2: about 0.25
    relative), and not at all without dropout. No tolerance between layouts holds with dropout on."""
    def trained(model: str, per_device: int) -> dict:
        out = tmp_path / f"{model}-{per_device}"
        run_clm_line(_clm_line(files, out, model, per_device, accumulation=8 // per_device))
        return weights(out / "out")

    assert relative(trained("gpt2", 2), trained("gpt2", 4)) > 0.05
    assert relative(trained("gpt2_no_dropout", 2), trained("gpt2_no_dropout", 4)) < 1e-5
