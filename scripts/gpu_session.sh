#!/usr/bin/env bash
# One lent-GPU session, prepared to run once inside a short lease (see docs/gpu_session.md for what it measured):
#   1. the gpu test tier (Triton kernels vs the torch reference; runtime and EAGLE-3 recipe end to end on CUDA),
#   2. scripts/gpu_check.py (kernels on large inputs, kernel vs torch timings),
#   3. the reference EAGLE-3 recipe on CUDA (bf16 autocast training, report with CUDA timings),
#   4. data-scaling variants of the recipe (more self-distilled samples than ~20 CPU minutes allow), trained on
#      CUDA; their checkpoints come back so the report can be run on the CPU against the shipped recipe.
# Every stage has its own time limit under one deadline, so a failing or slow stage never costs the ones after it;
# everything lands in $RES and is packed into $OUT/results.tgz at the end.
#
# Inputs that are not tracked (prepare here, then name them in the device call's `carry`):
#   .whl/       wheels missing from the device image (transformers==5.24.0, datasets, dill, multiprocess)
#   .gpu/stdlib-corpus/stdlib_{train,heldout}_text.jsonl   this machine's corpus (the device's Python has another
#               stdlib); the train file may be a subset to fit the transfer limit.
# Usage on the device: bash scripts/gpu_session.sh [deadline_seconds]
# Smoke test of this script on a CPU machine: DEVICE=cpu EXTRA="train.max_steps=2 ..." bash scripts/gpu_session.sh
# On the 2026-11-29 H200 VM the recipe-cuda stage's report (16 prompts, T = 0 and 1) did not finish inside its 240 s:
# a target token cost ~11 ms of host overhead there. EXTRA="report.prompts=8 report.temperatures=[0.0]" fits it.
set -u
START=$(date +%s)
DEADLINE=$((START + ${1:-540}))
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec > >(tee -a "$OUT/session.log") 2>&1

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

CORPUS=.gpu/stdlib-corpus
COMMON=(
    target.device=${DEVICE:-cuda}
    stdlib_corpus_dir=$CORPUS
    data.path=$CORPUS/stdlib_train_text.jsonl
    eval_data.path=$CORPUS/stdlib_heldout_text.jsonl
    data.cache_dir=/tmp/hf-cache
    eval_data.cache_dir=/tmp/hf-cache
    self_distill.batch_size=512
)

stage gpu-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py
stage gpu-check 150 python3 scripts/gpu_check.py --out "$RES/gpu_check.md"

stage recipe-cuda 240 python3 train/eagle3.py --config recipes/reference/eagle3.yaml "${COMMON[@]}" \
    train.output_dir=/tmp/e3-ref ${EXTRA:-}
mkdir -p "$RES/recipe-cuda"
cp /tmp/e3-ref/report.md /tmp/e3-ref/report.json /tmp/e3-ref/train_log.jsonl "$RES/recipe-cuda/" 2>/dev/null

# data scaling: 4x and 10x the shipped recipe's self-distilled samples (and raw chunks), same lr, trained on CUDA;
# the report runs afterwards on the CPU, against the same baselines as the shipped recipe
for spec in "x4 14000 1600 8" "x10 35000 4000 32"; do
    read -r name samples raw batch <<<"$spec"
    stage "variant-$name" 180 python3 train/eagle3.py --config recipes/reference/eagle3.yaml "${COMMON[@]}" \
        train.output_dir=/tmp/e3-$name self_distill.samples=$samples train.max_train_samples=$raw \
        train.batch_size=$batch report.enabled=false train.save_every=0 ${EXTRA:-}
    mkdir -p "$RES/$name"
    cp /tmp/e3-$name/config.json /tmp/e3-$name/model.safetensors /tmp/e3-$name/draft_vocab.safetensors \
        /tmp/e3-$name/recipe.yaml /tmp/e3-$name/train_log.jsonl "$RES/$name/" 2>/dev/null
done

tar czf "$OUT/results.tgz" -C "$RES" .
echo "=== done after $(($(date +%s) - START)) s"
