#!/usr/bin/env bash
# Every GPU check of the training and generation issues, as one command for a machine with a
# CUDA GPU and the packages of pyproject's dev extras already there (nothing is installed or
# fetched; the package runs from src/):
#
#   bash scripts/gpu_checks.sh OUTDIR [bench/gpu.py's options, e.g. --only decode --new-tokens 512]
#
# OUTDIR gets gpu_info.txt (nvidia-smi), gpu_tests.log (the GPU-only tests), gpu_bench.log
# and gpu.json (bench/gpu.py: training MFU, decode bandwidth, each beside transformers), and
# train_shards.log and train_shards.json (bench/train_shards.py: synthetic text prepared into
# llm.c-format shards on this machine, then gpt2-124m trained on them for 300 steps: tokens/s,
# MFU and the loader's share of a step; its CPU check: python bench/train_shards.py --smoke).
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUTDIR [bench/gpu.py options]}
shift
mkdir -p "$out"
py=$(command -v python3 || command -v python)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv >"$out/gpu_info.txt" 2>&1
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  >>"$out/gpu_info.txt" 2>&1
"$py" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
"$py" bench/gpu.py --out "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}
"$py" bench/train_shards.py --out "$out/train_shards.json" 2>&1 | tee "$out/train_shards.log"
shards=${PIPESTATUS[0]}
echo "GPU tests: exit $tests; bench/gpu.py: exit $bench; bench/train_shards.py: exit $shards"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$shards" -eq 0 ]
