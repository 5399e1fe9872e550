"""The bench's inputs for benchmarks/gpu_check.sh, made without packaged data: a BERT directory (``bert-base``,
or ``bert-tiny`` for the dry run) with a small WordPiece vocabulary, and ``long.csv``, synthetic reviews of 600
words (truncated at the bench's --max-length) whose label is one keyword among filler.

    python benchmarks/gpu_bench_data.py WORK_DIR bert-base
"""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

from memfit.presets import PRESET_CONFIGS

GOOD = ["great", "wonderful", "moving", "sharp", "funny", "brilliant", "warm"]
BAD = ["dull", "boring", "tedious", "flat", "messy", "weak", "lifeless"]
FILLER = ["the", "film", "is", "a", "story", "that", "with", "its", "cast", "and", "plot", "scene", "actor"]
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 128}


def main() -> int:
    work, name = Path(sys.argv[1]), sys.argv[2]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLER, *GOOD, *BAD]
    config = PRESET_CONFIGS["bert-base"]().to_dict()
    if name == "bert-tiny":
        config.update(TINY, vocab_size=len(vocab))
    model = work / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    (model / "vocab.txt").write_text("\n".join(vocab) + "\n")
    rng = random.Random(0)
    with (work / "long.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        for index in range(2000):
            words = rng.choices(FILLER, k=600)
            words.insert(rng.randrange(100), rng.choice(GOOD if index % 2 == 0 else BAD))
            writer.writerow([" ".join(words), "pos" if index % 2 == 0 else "neg"])
    print(f"{model} and {work / 'long.csv'} (2000 rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
