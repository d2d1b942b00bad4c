"""Opacus peer for benchmarks/quality_regime.py; runs in ../peer-opacus's interpreter, never imported.

    ../peer-opacus/bin/python benchmarks/peers/opacus_quality_regime.py --data F --setting finetune \\
        --optimizer adamw --epsilon 8 --delta 1e-5 --jobs 0.001:0 0.003:0

Reads the tokenized split, the pretrained state and the sizes that quality_regime.py saved (``--data``,
torch.save), builds the same plain-torch model (benchmarks/lib/step_models.py through quality_regime's
torch-only helpers: nothing of opake's is imported here; ``sys.modules`` is checked), and trains it
with Opacus' ``make_private_with_epsilon`` (DP-SGD, Poisson sampling, its PRV accountant, clip norm
1), the same optimizer (AdamW, or SGD with momentum 0.9), batch size, epochs and per-paragraph loss
as the opake runs. For each ``rate:seed`` job it prints one JSON line {"rate", "seed", "validation",
"test", "sigma", "epsilon", "steps", "seconds"} as soon as it finishes. Any failure exits non-zero
with its error on stderr.
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quality_regime import Sizes, batch_loss, make_optimizer, mean_loss, starting_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--setting", choices=("finetune", "scratch"), required=True)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), required=True)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--jobs", nargs="+", required=True, help="rate:seed")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from opacus import PrivacyEngine

    if any(name == "opake" or name.startswith("opake.") for name in sys.modules):
        raise SystemExit("the Opacus peer imported opake")
    saved = torch.load(args.data, weights_only=False)
    sizes, data, base = Sizes(**saved["sizes"]), saved["data"], saved["base"]
    ids, labels = data["train"]

    for job in args.jobs:
        rate, seed = float(job.split(":")[0]), int(job.split(":")[1])
        started, cpu = time.perf_counter(), time.process_time()
        model = starting_model(args.setting, base, sizes)  # seeds torch with 0 to build: the run's seed after
        torch.manual_seed(seed)
        optimizer = make_optimizer(args.optimizer, model.parameters(), rate)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=sizes.batch)
        engine = PrivacyEngine()
        private_model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, epochs=sizes.epochs,
            target_epsilon=args.epsilon, target_delta=args.delta, max_grad_norm=1.0)
        steps = 0
        for _ in range(sizes.epochs):
            for batch_ids, batch_labels in loader:
                optimizer.zero_grad()
                if len(batch_ids):
                    batch_loss(private_model, batch_ids, batch_labels).backward()
                optimizer.step()
                steps += 1
        print(json.dumps({"rate": rate, "seed": seed, "validation": mean_loss(model, data["validation"]),
                          "test": mean_loss(model, data["test"]), "sigma": optimizer.noise_multiplier,
                          "epsilon": engine.get_epsilon(args.delta), "steps": steps, "chose": "",
                          "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
