#!/usr/bin/env bash
# Every GPU check of memfit in one run (under 10 minutes on one card), results under $OUT (default results/gpu):
#   1. the tests marked gpu;
#   2. the estimator validation grid (predicted vs measured peak allocated/reserved per setup);
#   3. memfit bench on BERT-base (seq 128 and 512) and ViT-base/16 (random init: memory and speed are real,
#      accuracy is not a pretrained model's), capped to a GTX 1080 Ti's 11 GiB with
#      torch.cuda.set_per_process_memory_fraction (memfit bench --device-profile 1080ti).
# A big card capped at 11 GiB has the 1080 Ti's memory, not its speed: compare the memory columns with a
# 1080 Ti, and the speed columns only with each other.
#
# Needs python3 with CUDA torch, transformers, rich, psutil, matplotlib, scikit-learn and pytest; memfit runs
# from src/ (no install). The text data is synthetic (a learnable keyword task at full length), so no
# packaged data or tokenizer is needed: the BERT directory carries a small WordPiece vocabulary.
#
#   OUT=results/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
PY=${PYTHON:-python3}
SAMPLES=${SAMPLES:-512}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
status=0
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/gpu_check.log"; }

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"

log "1. tests marked gpu"
$PY -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.txt" | tail -3 || status=1

log "2. estimator validation grid"
$PY benchmarks/validate_estimator.py --grid full --memory-gib 11 --json "$OUT/validate_estimator.json" \
    2>&1 | tee "$OUT/validate_estimator.txt" | tail -25 || status=1

log "3. bench data: BERT-base directory with its vocabulary, long synthetic texts"
$PY - "$WORK" <<'EOF' || status=1
import csv, json, random, sys
from pathlib import Path
from memfit.models import PRESET_CONFIGS
work = Path(sys.argv[1])
good = ["great", "wonderful", "moving", "sharp", "funny", "brilliant", "warm"]
bad = ["dull", "boring", "tedious", "flat", "messy", "weak", "lifeless"]
filler = ["the", "film", "is", "a", "story", "that", "with", "its", "cast", "and", "plot", "scene", "actor"]
bert = work / "bert-base"
bert.mkdir()
(bert / "config.json").write_text(json.dumps(PRESET_CONFIGS["bert-base"]().to_dict()))
(bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *filler, *good, *bad]))
rng = random.Random(0)
with (work / "long.csv").open("w", newline="") as file:
    writer = csv.writer(file)
    writer.writerow(["text", "label"])
    for index in range(4000):
        words = rng.choices(filler, k=600)  # truncated at --max-length
        words.insert(rng.randrange(100), rng.choice(good if index % 2 == 0 else bad))
        writer.writerow([" ".join(words), "pos" if index % 2 == 0 else "neg"])
EOF

for seq in 128 512; do
    log "3. bench bert-base seq $seq (1080 Ti memory)"
    $PY -m memfit bench --model "$WORK/bert-base" --data "$WORK/long.csv" --max-length $seq \
        --device-profile 1080ti --samples "$SAMPLES" --val-samples 256 --output-dir "$WORK/bench-bert-s$seq" \
        2>&1 | tee "$OUT/bench_bert_base_s$seq.log" | tail -12 || status=1
    for file in bench.md bench.json bench_memory_speed.png bench_timelines.png; do
        cp "$WORK/bench-bert-s$seq/$file" "$OUT/bert_base_s${seq}_$file" 2>/dev/null || true
    done
done

log "3. bench vit-base/16 224px on digits (1080 Ti memory)"
$PY -m memfit bench --model vit-base --data digits --device-profile 1080ti --samples "$SAMPLES" \
    --val-samples 256 --output-dir "$WORK/bench-vit" 2>&1 | tee "$OUT/bench_vit_base.log" | tail -12 || status=1
for file in bench.md bench.json bench_memory_speed.png bench_timelines.png; do
    cp "$WORK/bench-vit/$file" "$OUT/vit_base_$file" 2>/dev/null || true
done

log "done (status $status)"
exit $status
