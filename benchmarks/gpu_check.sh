#!/usr/bin/env bash
# Every GPU check of memfit in one run of about 10 minutes, its results as three files in $OUT:
#   summary.md       what a person reads: device, each step's status and time, the estimator's worst errors,
#                    the bench table;
#   summary.json     the same as data;
#   results.tar.gz   everything else (logs, validate_estimator.json, bench.json/md/png).
# The steps, each under its own time limit so the whole run ends in time:
#   1. the tests marked gpu (tests/gpu), then (on a GPU) the cuBLAS workspace probe and the NCCL probe (what a
#      one-rank NCCL communicator and its first collectives take outside PyTorch's allocator);
#   2. the estimator validation grid (predicted vs measured peak allocated/reserved per setup), BERT, ViT and
#      two causal LMs (SmolLM2-360M, Llama-3.2-1B with its top 4 layers trained); then (on a GPU) the rows with
#      activations offloaded to the host (--offload-activations; predicted vs measured host bytes too), and
#      the rows with bf16-true weights and the optimizer step in backward (--grid lowmem);
#   3. memfit bench on BERT-base at seq 128 (random init: memory and speed are real, accuracy is not a
#      pretrained model's), capped to a GTX 1080 Ti's 11 GiB (memfit bench --device-profile 1080ti).
# A big card capped at 11 GiB has the 1080 Ti's memory, not its speed: compare the memory columns with a
# 1080 Ti, and the speed columns only with each other.
#
# Needs python3 with CUDA torch, transformers, rich, psutil, matplotlib, scikit-learn and pytest; memfit runs
# from src/ (no install, no packaged data: the text is synthetic and the BERT directory carries a small
# WordPiece vocabulary).
#
#   OUT=results/gpu bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run    # the same steps on this machine's CPU at tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
OUT=${OUT:-results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/results"
STEPS="$WORK/steps.tsv"
: >"$STEPS"

if [ $DRY_RUN = 1 ]; then
    # tiny sizes: the CPU grid of the estimator check, three kinds of bench row (training, int8, plan)
    MODEL=bert-tiny SEQ=32 SAMPLES=64 VAL=32 GRID=(--dry-run --grid tiny)
    BENCH=(--emulate-budget 400MiB --setups fp32 int8 plan)
else
    MODEL=bert-base SEQ=128 SAMPLES=${SAMPLES:-256} VAL=128 GRID=(--grid small --memory-gib 11)
    BENCH=(--device-profile 1080ti)
fi

# step NAME SECONDS COMMAND...: run under a time limit, output to results/NAME.log, one line in steps.tsv
step() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $(date -u +%H:%M:%S) $name (at most ${limit} s)"
    timeout -k 10 "$limit" "$@" >"$WORK/results/$name.log" 2>&1
    local code=$?
    printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - started))" >>"$STEPS"
    tail -4 "$WORK/results/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device', torch.cuda.get_arch_list())"
} >"$WORK/results/device.txt" 2>&1
cat "$WORK/results/device.txt"

step tests_gpu 75 $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/gpu
[ $DRY_RUN = 1 ] || step workspace_probe 20 $PY benchmarks/cuda_workspace_probe.py
[ $DRY_RUN = 1 ] || step nccl_probe 30 $PY benchmarks/nccl_probe.py --json "$WORK/results/nccl_probe.json"
step validate_estimator 170 $PY benchmarks/validate_estimator.py "${GRID[@]}" \
    --json "$WORK/results/validate_estimator.json"
[ $DRY_RUN = 1 ] || step validate_offload 60 $PY benchmarks/validate_estimator.py --grid activations \
    --memory-gib 11 --json "$WORK/results/validate_offload.json"
[ $DRY_RUN = 1 ] || step validate_lowmem 60 $PY benchmarks/validate_estimator.py --grid lowmem \
    --json "$WORK/results/validate_lowmem.json"
step bench_data 15 $PY benchmarks/gpu_bench_data.py "$WORK" "$MODEL"
step bench 220 $PY -m memfit bench --model "$WORK/$MODEL" --data "$WORK/long.csv" --max-length $SEQ \
    "${BENCH[@]}" --samples $SAMPLES --val-samples $VAL --speed-rounds 1 --speed-steps 4 \
    --output-dir "$WORK/results/bench"
$PY benchmarks/gpu_summary.py "$WORK" "$OUT" $([ $DRY_RUN = 1 ] && echo --dry-run)
status=$?
# logs, tables, JSON and plots only: the bench's saved models would take minutes to pack and exceed 16 MiB
(cd "$WORK" && find results steps.tsv -type f \( -name '*.log' -o -name '*.json' -o -name '*.md' -o -name '*.png' \
    -o -name '*.txt' -o -name '*.tsv' \) -size -4M -print0 | tar czf "$OUT/results.tar.gz" --null -T -)
ls "$OUT"
exit $status
