#!/usr/bin/env bash
# The noise engine on a GPU, in one call of the device tool (a few minutes once started):
# the device-parametrized engine tests (tests/dpftrl/noise/engine/test_devices.py runs each check on CPU and
# CUDA) plus the other engine tests under the device's torch, then the noise-engine benchmark
# with --device cuda. Results are also written to $OUT (or benchmarks/out).
#
# The device image has torch, numpy, scipy, pytest, hypothesis, mpmath and threadpoolctl, but not
# optree, dp-accounting or dm-tree: they travel as wheels in .whl/ (git-ignored through
# .git/info/exclude). Fetch them once, here, for the image's Python 3.12:
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl optree==0.20.0 dp-accounting==0.6.0 dm-tree==0.1.10
# The fine-tuning benchmark (benchmarks/finetune_step.py) also needs transformers and peft with
# their dependencies (accelerate, huggingface-hub, tokenizers, safetensors, regex, pyyaml, tqdm,
# ...) in .whl/; without them it prints "skipped" and the rest of the check runs as before.
# Then call the device tool with carry [".whl"] and the command: bash benchmarks/device_check.sh
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
ENGINE=tests/dpftrl/noise/engine
python3 -m pytest -q -p no:cacheprovider $ENGINE/test_devices.py $ENGINE/test_engine.py \
  $ENGINE/test_state.py $ENGINE/test_errors.py $ENGINE/test_streaming.py 2>&1 | tee "$OUT/tests.txt"
tests_status=${PIPESTATUS[0]}
python3 benchmarks/noise_engine.py --device cuda --peers none 2>&1 | grep -v USDT | tee "$OUT/bench.txt"
python3 benchmarks/finetune_step.py --device cuda --peers none 2>&1 | grep -v USDT | tee "$OUT/finetune.txt"
exit "$tests_status"
