"""Train a small ViT from scratch on Fashion-MNIST to a fixed checkpoint: the vision model ``memfit bench``
fine-tunes (no pretrained ViT ships offline; this one stands in for a pretrained ViT-Base).

The ViT reads 28x28 grey images in 4x4 patches (49 patches + CLS = 50 tokens), 4 layers of width 128,
4 heads. It trains with ``memfit train`` itself on the first ``--samples`` examples of memfit's seeded
training split (seed 0); the validation split (7,000 images) is never trained on, here or in the bench.
The checkpoint is ``<output-dir>/model``, and a summary goes to ``--json``.

    .venv/bin/python benchmarks/pretrain_vit_fashion_mnist.py --output-dir runs/vit-fashion-mnist \
        --json benchmarks/results/vit_pretrain_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memfit import TrainConfig, train

VIT = {
    "architectures": ["ViTModel"], "model_type": "vit", "image_size": 28, "patch_size": 4, "num_channels": 1,
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 256,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/vit-fashion-mnist")
    parser.add_argument("--samples", type=int, default=30000, help="training samples [30000]")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--json", help="write the run's summary here")
    args = parser.parse_args()
    output = Path(args.output_dir)
    architecture = output / "architecture"
    architecture.mkdir(parents=True, exist_ok=True)
    (architecture / "config.json").write_text(json.dumps(VIT, indent=2) + "\n")
    summary = train(TrainConfig(model=str(architecture), data="fashion-mnist", train_samples=args.samples,
                                val_samples=2000, epochs=args.epochs, effective_batch=64, lr=1e-3,
                                weight_decay=0.05, precision="fp32", seed=0, output_dir=str(output / "run"),
                                overwrite=True, log_every=50))
    checkpoint = output / "run" / "model"
    print(f"checkpoint: {checkpoint} (val accuracy {summary.val_accuracy:.4f} on 2000 held-out images)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/pretrain_vit_fashion_mnist.py " + " ".join(
                f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items() if value is not None),
            "architecture": VIT, "train_samples": summary.train_samples, "epochs": args.epochs,
            "val_accuracy": summary.val_accuracy, "val_samples": summary.val_samples,
            "samples_per_second": summary.samples_per_second, "train_seconds": summary.train_seconds,
            "checkpoint": str(checkpoint)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
