"""The command line's options: one parser for every ``memfit`` subcommand, its defaults read from
:class:`~memfit.config.TrainConfig`. Built without importing torch, so ``memfit --help`` starts at once;
:mod:`memfit.cli` runs what it parses, and ``docs/options.md`` is generated from it.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from memfit.config import (
    CHECKPOINTING,
    DEVICES,
    DISTRIBUTED,
    OPTIMIZERS,
    PLANNED_LORA_RANK,
    PRECISIONS,
    QUANTIZE_BASE,
    TASKS,
    TrainConfig,
)
from memfit.errors import ConfigError
from memfit.names import BUILTIN_DATASETS as BUILTIN
from memfit.names import DATA_FORMATS, PRESETS, PROFILES


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"memfit: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def _bool_flag(group: argparse._ArgumentGroup | argparse.ArgumentParser, name: str, help_text: str) -> None:
    group.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=help_text)


def add_train_options(parser: argparse.ArgumentParser, *, for_estimate: bool = False) -> None:
    """Every ``train`` option, grouped by technique as in the README; defaults live in :class:`TrainConfig`."""
    defaults = TrainConfig()
    for add_group in (_model_and_data_options, _batch_options, _precision_options, _memory_options,
                      _adapter_options, _optimizer_options, _schedule_options):
        add_group(parser, defaults)
    if not for_estimate:
        _planning_and_reliability_options(parser, defaults)
    _rank_options(parser, defaults, for_estimate=for_estimate)
    _device_options(parser, defaults, for_estimate=for_estimate)


def _model_and_data_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The model, the data and how texts are cut."""
    data = parser.add_argument_group("model and data")
    data.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), local HF model directory, or Hub id "
                                      f"org/name[@revision] (local cache first) [{defaults.model}]")
    data.add_argument("--data", help=f"built-in ({', '.join(BUILTIN)}), a .csv/.jsonl/.json/.parquet file, a "
                                     "Parquet or save_to_disk folder, a Hub dataset id, or an image folder "
                                     f"[{defaults.data}]")
    data.add_argument("--data-split", help=f"split of a Hub dataset or saved DatasetDict [{defaults.data_split}]")
    data.add_argument("--data-config", help="configuration (subset) of a Hub dataset that has several")
    data.add_argument("--data-format", choices=DATA_FORMATS, help="how a table's rows become examples [auto: "
                                                                  "recognised from the columns]")
    data.add_argument("--task", choices=TASKS, help="classification, or fine-tuning on instruction data: causal-lm "
                                                    "(decoders), seq2seq (encoder-decoders: T5, BART) [auto: "
                                                    "instruction data: seq2seq on an encoder-decoder, else "
                                                    "causal-lm; causal-lm for decoder LLMs]")
    data.add_argument("--text-column", help=f"text column of a CSV/JSONL file [{defaults.text_column}]")
    data.add_argument("--label-column", help=f"label column of a CSV/JSONL file [{defaults.label_column}]")
    data.add_argument("--prompt-column", help=f"prompt column of instruction data [{defaults.prompt_column}]")
    data.add_argument("--completion-column", help="completion column of instruction data (the loss is on it) "
                                                  f"[{defaults.completion_column}]")
    data.add_argument("--messages-column", help="chat field of instruction data: a list of role/content turns "
                                                f"ending with the answer [{defaults.messages_column}]")
    data.add_argument("--max-length", type=int, help=f"tokens per text [{defaults.max_length}]")
    data.add_argument("--max-target-length", type=int, help="seq2seq: tokens per target, the decoder's side "
                                                            "[--max-length]")
    data.add_argument("--val-fraction", type=float, help=f"held-out share [{defaults.val_fraction}]")
    data.add_argument("--train-samples", type=int, help="use only N training examples")
    data.add_argument("--val-samples", type=int, help="use only N validation examples")


def _batch_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The effective batch and its micro-batch / accumulation split."""
    batch = parser.add_argument_group("batch (accumulation: less activation memory, more micro-steps)")
    batch.add_argument("--effective-batch", type=int, help=f"samples per optimizer step [{defaults.effective_batch}]")
    batch.add_argument("--micro-batch-size", type=int, help="samples per forward/backward [effective batch]")
    batch.add_argument("--accumulation-steps", type=int, help="micro-steps per optimizer step (instead of "
                                                              "--micro-batch-size)")
    batch.add_argument("--eval-batch-size", type=int, help=f"[{defaults.eval_batch_size}]")
    _bool_flag(batch, "packing", "causal LM: pack the training examples into full --max-length rows, attention "
                                 "within each example; the batch sizes then count rows [off]")


def _precision_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Mixed precision and the GradScaler."""
    precision = parser.add_argument_group("precision (16-bit activations; fp16 adds a GradScaler; bf16-true: the "
                                          "weights, gradients and optimizer state themselves in bf16)")
    precision.add_argument("--precision", choices=PRECISIONS, help=f"[{defaults.precision}]")
    _bool_flag(precision, "kahan", "bf16-true: Kahan-summed updates keep what bf16 rounds away (torch-optimi) "
                                   "[on under bf16-true with adamw/sgd]")
    _bool_flag(precision, "force-cpu-fp16", "run fp16 on CPU although it is ~20x slower")
    _bool_flag(precision, "force-bf16", "run bf16 on a card without native bf16 (emulated, slow)")
    precision.add_argument("--init-scale", type=float, help=f"GradScaler initial scale [{defaults.init_scale:g}]")
    precision.add_argument("--growth-interval", type=int, help=f"GradScaler growth interval "
                                                               f"[{defaults.growth_interval}]")


def _memory_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Checkpointing and freezing."""
    memory = parser.add_argument_group("checkpointing and freezing (memory for compute, or for accuracy)")
    memory.add_argument("--checkpointing", choices=CHECKPOINTING, help=f"[{defaults.checkpointing}]")
    memory.add_argument("--checkpoint-every", type=int, help=f"N of every-n [{defaults.checkpoint_every}]")
    _bool_flag(memory, "offload-activations", "CUDA: saved activations in host memory until backward (PCIe "
                                              "traffic, same result) [off]")
    _bool_flag(memory, "freeze-embeddings", "freeze the embedding block")
    memory.add_argument("--train-top-layers", type=int, help="train only the top K layers plus the head")
    memory.add_argument("--loss-chunk", type=int, metavar="N", help="causal LM: the loss over chunks of N token "
                                                                   "positions, its fp32 logits recomputed in "
                                                                   "backward [off]")


def _adapter_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """LoRA adapters and quantised base weights (QLoRA)."""
    lora = parser.add_argument_group("LoRA and QLoRA (train adapters; the base frozen, 16-bit or quantised)")
    lora.add_argument("--lora-rank", type=int, metavar="R", help="LoRA adapters of rank R on the blocks' Linear "
                                                                "layers [0: off]")
    lora.add_argument("--lora-alpha", type=float, help="scaling numerator (update x alpha/rank) [2 x rank]")
    lora.add_argument("--lora-dropout", type=float, help=f"dropout on the adapters' input [{defaults.lora_dropout}]")
    lora.add_argument("--lora-targets", metavar="NAMES", help="comma-separated Linear names (q_proj,v_proj) "
                                                             "[every Linear of the blocks]")
    lora.add_argument("--quantize-base", choices=QUANTIZE_BASE, help="the blocks' frozen Linear weights in "
                                                                     "4-bit NF4 or 8 bits (bitsandbytes) "
                                                                     f"[{defaults.quantize_base}]")
    _bool_flag(lora, "merge", "also save the base model with the adapters merged in [off]")


def _optimizer_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The optimizer, clipping and the non-finite guard."""
    optim = parser.add_argument_group("optimizer and stability")
    optim.add_argument("--optimizer", choices=OPTIMIZERS, help=f"[{defaults.optimizer}]")
    _bool_flag(optim, "fused", "AdamW's fused kernel: fastest, no temporaries [on in one process]")
    _bool_flag(optim, "foreach", "multi-tensor optimizer kernels (faster than a loop, higher step peak)")
    _bool_flag(optim, "offload-optimizer", "CUDA: optimizer state and update on the host; the card keeps weights "
                                           "and gradients (slower steps, same result) [off]")
    _bool_flag(optim, "optimizer-in-backward", "update each parameter in backward and free its gradient: no full "
                                               "set of gradients (one micro-batch per step, no clipping) [off]")
    optim.add_argument("--lr", type=float, help=f"peak learning rate [{defaults.lr:g}]")
    optim.add_argument("--weight-decay", type=float, help=f"[{defaults.weight_decay}]")
    optim.add_argument("--warmup-ratio", type=float, help=f"[{defaults.warmup_ratio}]")
    optim.add_argument("--momentum", type=float, help=f"SGD momentum [{defaults.momentum}]")
    optim.add_argument("--max-grad-norm", type=_optional_float, help=f"clip norm, 'none' to disable "
                                                                     f"[{defaults.max_grad_norm}]")
    optim.add_argument("--max-nonfinite-steps", type=int, help=f"stop after N consecutive non-finite steps "
                                                               f"[{defaults.max_nonfinite_steps}]")


def _schedule_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Epochs, steps, seed, logging."""
    schedule = parser.add_argument_group("schedule")
    schedule.add_argument("--epochs", type=int, help=f"[{defaults.epochs}]")
    schedule.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    schedule.add_argument("--seed", type=int, help=f"[{defaults.seed}]")
    schedule.add_argument("--log-every", type=int, help=f"optimizer steps per metrics line [{defaults.log_every}]")
    _bool_flag(schedule, "eval-before", "also evaluate before the first step (zero-shot accuracy) [off]")


def _planning_and_reliability_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Planning to a budget; OOM recovery, checkpoints and resume (train only)."""
    planning = parser.add_argument_group("planning (memfit plan): the fastest setup within a memory budget")
    planning.add_argument("--budget", metavar="SIZE", help="plan the micro-batch, precision, checkpointing and "
                                                           "optimizer to fit SIZE (e.g. 11GiB), then train")
    planning.add_argument("--plan", metavar="PLAN_JSON", help="train with a plan saved by memfit plan --save")
    planning.add_argument("--device-profile", metavar="GPU", help="plan for that card (1080ti, t4, a profile file) "
                                                                  "and rehearse its plan here, the card's memory "
                                                                  "emulated as the limit")
    planning.add_argument("--dry-run", action="store_true", help="plan, check the model, the data and every option, "
                                                                 "print the resolved config, and stop: nothing is "
                                                                 "trained or written")
    _opt_in_options(planning)
    reliability = parser.add_argument_group("reliability (out-of-memory recovery keeps the effective batch)")
    reliability.add_argument("--emulate-budget", metavar="SIZE",
                             help="behave as if the device had SIZE of memory, e.g. 300MiB or 11GiB")
    reliability.add_argument("--save-every", type=int, metavar="N",
                             help="checkpoint every N optimizer steps and at the end")
    reliability.add_argument("--keep-last", type=int, metavar="K",
                             help=f"complete checkpoints to keep [{defaults.keep_last}]")
    reliability.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                             help="continue from the newest checkpoint in --output-dir, or from PATH")
    reliability.add_argument("--overwrite", action="store_true", default=None,
                             help="replace the run in an existing --output-dir")
    reliability.add_argument("--memory-timeline", action="store_true", default=None,
                             help="record memory at every allocation of step 2 into memory_timeline.json")
    reliability.add_argument("--quantize", action="store_true", help="int8-quantize the model at the end "
                                                                     "and report (memfit quantize)")


def _rank_options(parser: argparse.ArgumentParser, defaults: TrainConfig, *, for_estimate: bool) -> None:
    """More than one GPU."""
    ranks = parser.add_argument_group("more than one GPU (launch training with torchrun --nproc-per-node N -m "
                                      "memfit train ...); the effective batch is over all ranks")
    ranks.add_argument("--distributed", choices=DISTRIBUTED,
                       help="replicate (ddp), shard parameters, gradients and optimizer state (fsdp), or fsdp only "
                            f"when a replica does not fit (auto) [{defaults.distributed}]")
    if for_estimate:
        ranks.add_argument("--world-size", type=int, help="ranks to estimate one rank's peak for [1]")
    _bool_flag(ranks, "cpu-offload", "fsdp: keep parameter shards and the optimizer step on the host")
    _bool_flag(ranks, "reduce-every-micro-step", "fsdp: reduce-scatter the gradients in every micro-step, not only "
                                                 "the window's last: they stay sharded (less memory, more traffic)")
    ranks.add_argument("--shard-group", type=int, metavar="N",
                       help="fsdp: shard within groups of N ranks and replicate across them (HSDP; N = the GPUs of "
                            "one node) [every rank]")


def _device_options(parser: argparse.ArgumentParser, defaults: TrainConfig, *, for_estimate: bool) -> None:
    """Where it runs (or, for estimate, what it is estimated for) and where it writes."""
    where = parser.add_argument_group("device and output")
    if for_estimate:
        where.add_argument("--device", dest="profile", default="cpu",
                           help=f"target device profile ({', '.join(PROFILES)}) or a .toml/.json profile [cpu]")
        where.add_argument("--batch-size", type=int, help="micro-batch size to estimate (alias of "
                                                          "--micro-batch-size; also the effective batch, times "
                                                          "--world-size, if that is not given)")
        where.add_argument("--seq-len", type=int, help="sequence length to estimate [--max-length]")
        where.add_argument("--image-size", type=int, help="image size to estimate [the model's]")
        where.add_argument("--steps", type=int, default=2, help="optimizer steps to trace [2]")
        where.add_argument("--full-length", action="store_true",
                           help="every text fills --seq-len (long texts truncated, packed sequences): no micro-batch "
                                "is padded, and an unpadded step keeps less (no attention mask; grouped-query K/V "
                                "not repeated) [off: the worst case, a padded batch]")
        where.add_argument("--exact-trace", action="store_true",
                           help="trace every block and micro-step instead of a few replayed to full length (the "
                                "same numbers, slower) [off]")
    else:
        where.add_argument("--device", help=f"{', '.join(DEVICES)}, or a GPU profile (1080ti, t4, ...): train on "
                                            f"CUDA, planned for that card [{defaults.device}]")
    where.add_argument("--output-dir", help="[runs/<timestamp>]")
    where.add_argument("--config", help="TOML/YAML/JSON file with the same option names (flags override it)")
    where.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")


OPT_IN_HELP = {
    "--allow-freeze": "opt-in, changes what is learned: freeze the embeddings or lower layers if needed",
    "--allow-8bit-optimizer": "opt-in: 8-bit AdamW states if needed (bitsandbytes)",
    "--allow-offload": "opt-in: the optimizer's state, the saved activations or (with 8-bit states) the paged "
                       "states on the host (one CUDA card), if needed",
    "--allow-optimizer-in-backward": "opt-in: each parameter updated in backward, its gradient freed (no "
                                     "clipping, one micro-batch per step), if needed",
    "--allow-bf16-true": "opt-in: weights, gradients and optimizer state in bf16 with Kahan-summed updates, if "
                         "needed",
    "--allow-lora": f"opt-in: LoRA adapters (r={PLANNED_LORA_RANK} with train), the base frozen in 16 bits, when "
                    "no full fine-tuning fits",
    "--allow-qlora": "opt-in: LoRA on a 4-bit NF4 base (bitsandbytes), when LoRA does not fit",
}
"""The planner's opt-ins, the same for ``plan`` and ``train --budget`` (and ``serve``'s page): consent to
techniques that change what is learned or where memory lives, tried only when nothing accuracy-neutral fits."""


def _opt_in_options(group: argparse._ArgumentGroup) -> None:
    for flag, text in OPT_IN_HELP.items():  # default None: "not given" (a config file may set it)
        group.add_argument(flag, action="store_true", default=None, help=text)


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    target = parser.add_argument_group("what to plan")
    target.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or local HF model directory "
                                        f"[{defaults.model}]")
    target.add_argument("--seq-len", type=int, help=f"tokens per text [{defaults.max_length}]")
    target.add_argument("--image-size", type=int, help="image size [the model's]")
    target.add_argument("--effective-batch", type=int, help="samples per optimizer step; never changed by the "
                                                            f"plan [{defaults.effective_batch}]")
    target.add_argument("--num-labels", type=int, default=2, help="classes of the task head [2]")
    target.add_argument("--task", choices=TASKS, help="[auto: causal-lm for decoder LLMs]")
    target.add_argument("--max-target-length", type=int, help="seq2seq: tokens per target [--seq-len]")
    budget = parser.add_argument_group("the budget")
    budget.add_argument("--device", default="1080ti", help=f"device profile ({', '.join(PROFILES)}) or a "
                                                           ".toml/.json profile file [1080ti]")
    budget.add_argument("--budget", metavar="SIZE", help="memory to fit, e.g. 11GiB or 8GB [the device's]")
    budget.add_argument("--margin", type=_fraction, default=0.05, help="headroom kept free, e.g. 5%% or 0.05 [5%%]")
    budget.add_argument("--distributed", choices=("auto", "ddp", "fsdp"), help="with --gpus: the strategy to keep "
                                                                          "[auto: the planner chooses]")
    budget.add_argument("--gpus", type=int, help="plan one rank of N GPUs (the budget is each one's): also choose "
                                                 "DDP, FSDP or FSDP with CPU offload; the effective batch is global "
                                                 "[1]")
    budget.add_argument("--gpus-per-node", type=int, metavar="N",
                        help="GPUs of one machine, where --gpus/--max-gpus fill several: traffic across machines "
                             "at the profile's node_bandwidth, and FSDP within each machine replicated across "
                             "them (HSDP) planned too; the command launches on every machine [one machine]")
    budget.add_argument("--host-memory", metavar="SIZE",
                        help="host memory of one machine, e.g. 256GiB: setups that offload more than this (over "
                             "all its GPUs) do not fit [not checked]")
    budget.add_argument("--max-gpus", type=int, metavar="N",
                        help="plan every number of GPUs from 1 to N: the fewest each technique needs (full "
                             "fine-tuning, and LoRA/QLoRA with --allow-lora/--allow-qlora) and the fastest setup "
                             "at each count")
    allowed = parser.add_argument_group("what the plan may change (the effective batch never)")
    allowed.add_argument("--precision", choices=PRECISIONS, default="auto",
                         help="plan only this precision [auto: fp32 and the device's low precision]")
    allowed.add_argument("--optimizer", choices=("adamw", "sgd"), help=f"[{defaults.optimizer}]")
    _opt_in_options(allowed)
    allowed.add_argument("--lora-rank", type=int, default=PLANNED_LORA_RANK, metavar="R",
                         help=f"rank of planned adapters [{PLANNED_LORA_RANK}]")
    out = parser.add_argument_group("output")
    out.add_argument("--config", help="TOML/YAML/JSON file with train options to plan for")
    out.add_argument("--top", type=int, default=12, help="candidate rows to print [12]")
    out.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    out.add_argument("--emit", choices=("table", "trainer"), default="table",
                     help="trainer: print the plan as Python for a transformers Trainer script [table]")
    out.add_argument("--save", metavar="PLAN_JSON", help="write the plan for memfit train --plan")
    out.add_argument("--exact-trace", action="store_true",
                     help="trace every block and micro-step of each setup instead of a few replayed to full length "
                          "(the same plan, slower) [off]")


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    from memfit.bench_config import QUICK, SETUPS, BenchConfig

    defaults = BenchConfig()
    what = parser.add_argument_group("what to train (the same for every setup)")
    what.add_argument("--model", default=defaults.model, help=f"preset or local HF model directory "
                                                              f"[{defaults.model}]")
    what.add_argument("--data", default=defaults.data, help=f"built-in dataset, .csv/.jsonl, or image folder "
                                                            f"[{defaults.data}]")
    _column_options(parser)
    what.add_argument("--max-length", type=int, default=defaults.max_length, help=f"[{defaults.max_length}]")
    what.add_argument("--effective-batch", type=int, default=defaults.effective_batch,
                      help=f"samples per optimizer step, every setup [{defaults.effective_batch}]")
    what.add_argument("--samples", type=int, help="training samples per setup [the whole training split]")
    what.add_argument("--val-samples", type=int, help="validation samples [the whole validation split]")
    what.add_argument("--epochs", type=int, default=defaults.epochs, help=f"[{defaults.epochs}]")
    what.add_argument("--lr", type=float, default=defaults.lr, help=f"[{defaults.lr:g}]")
    what.add_argument("--seed", type=int, default=defaults.seed, help=f"[{defaults.seed}]")
    budget = parser.add_argument_group("the memory budget [the device's memory]")
    budget.add_argument("--device-profile", metavar="GPU", help="run here with that card's memory as the budget "
                                                                "(e.g. 1080ti: 11 GiB)")
    budget.add_argument("--emulate-budget", metavar="SIZE", help="run here with SIZE of memory, e.g. 400MiB")
    budget.add_argument("--margin", type=_fraction, default=defaults.margin, help="headroom kept free [5%%]")
    out = parser.add_argument_group("matrix and output")
    out.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="[all]")
    out.add_argument("--quick", action="store_true", help=f"small matrix: {QUICK['samples']} training and "
                                                          f"{QUICK['val_samples']} validation samples unless "
                                                          "given (minutes on a CPU)")
    out.add_argument("--speed-rounds", type=int, help="interleaved timing rounds after the runs, so machine "
                                                      "drift hits every setup alike [2; 0 with --quick]")
    out.add_argument("--speed-steps", type=int, default=defaults.speed_steps,
                     help=f"timed steps per setup and round [{defaults.speed_steps}]")
    out.add_argument("--output-dir", default=defaults.output_dir, help=f"[{defaults.output_dir}]")
    out.add_argument("--json", action="store_true", help="print bench.json's content on stdout")


def _fraction(text: str) -> float:
    from memfit.units import fraction

    try:
        return fraction(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(error.problems[0]) from None


NO_CLIP = "none"
def _optional_float(text: str) -> float | str:
    return NO_CLIP if text.lower() in ("none", "off") else float(text)


def _column_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-column", help="text column of a CSV/JSONL --data [the run's, or text]")
    parser.add_argument("--label-column", help="label column of a CSV/JSONL --data [the run's, or label]")


def build_parser() -> Parser:
    parser = Parser(prog="memfit", description="Fine-tune transformers on the GPU memory you have.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = commands.add_parser("train", help="fine-tune a model (default: MiniLM on Rotten Tomatoes)")
    add_train_options(train)
    estimate = commands.add_parser("estimate", help="predict the peak memory of a training step, no GPU needed")
    add_train_options(estimate, for_estimate=True)
    quantize = commands.add_parser("quantize", help="int8-quantize a fine-tuned model; compare it with fp32")
    quantize.add_argument("source", metavar="RUN_DIR_OR_MODEL_DIR")
    quantize.add_argument("--method", choices=("int8-dynamic", "int8-weight-only"), default="int8-dynamic",
                          help="int8 weights with dynamic int8 activations, or int8 weights only [int8-dynamic]")
    quantize.add_argument("--backend", choices=("auto", "onnxruntime", "torchao"), default="auto",
                          help="onnxruntime (whole model int8, embeddings too, its CPU kernels) or torchao (Linear "
                               "layers int8, in PyTorch) [auto: onnxruntime when installed, for int8-dynamic]")
    quantize.add_argument("--data", help="validation data [the run's own]")
    _column_options(quantize)
    quantize.add_argument("--output-dir", help="[<model dir>-<method>]")
    quantize.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    evaluate = commands.add_parser("eval", help="validation accuracy of a saved (or quantized) model")
    evaluate.add_argument("--model", required=True, help="a run dir, a model dir, or a quantized dir")
    evaluate.add_argument("--data", help="validation data [the run's own]")
    _column_options(evaluate)
    planner = commands.add_parser("plan", help="the fastest setup that fits a memory budget at a fixed "
                                               "effective batch")
    add_plan_options(planner)
    bench = commands.add_parser("bench", help="measure memory, speed and accuracy of the memory-saving setups "
                                              "(and memfit's plan) on this machine")
    add_bench_options(bench)
    generate = commands.add_parser("generate", help="a greedy completion from a fine-tuned causal LM")
    generate.add_argument("model", metavar="RUN_DIR_OR_MODEL_DIR", help="a causal-LM run dir, a model dir or an "
                                                                       "LLM preset with weights (smollm2-135m)")
    generate.add_argument("--prompt", required=True, help="the prompt (as one user turn when the tokenizer has a "
                                                          "chat template)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="[64]")
    _bool_flag(generate, "raw", "feed the prompt as it is, without the chat template [off]")
    serve = commands.add_parser("serve", help="the planner as a local web page (pip install 'memfit[serve]')")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on; another than this machine's "
                                                           "loopback serves anyone who can reach it [127.0.0.1]")
    serve.add_argument("--port", type=int, default=8000, help="[8000; 0: any free port]")
    serve.add_argument("--queue", type=int, default=4, help="plans that may wait for the one running; more are "
                                                            "refused until one finishes [4]")
    commands.add_parser("models", help="list the model presets and the models in the local Hugging Face "
                                         "cache")
    commands.add_parser("devices", help="list the device profiles")
    return parser
