"""The typed configuration of a training run.

:class:`TrainConfig` holds every option of ``memfit train`` under the same name as its CLI flag
(``--micro-batch-size`` is ``micro_batch_size``). :meth:`TrainConfig.validate` checks every field and every
cross-field rule at once and raises one :class:`~memfit.errors.ConfigError` listing all problems. Checks that
need the model or the data (depth, labels, vocabulary) happen in :func:`memfit.build.prepare`, before any
training starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.devices import gpu_profile_problems
from memfit.errors import ConfigError, Problems
from memfit.files import load_option_file
from memfit.names import DATA_FORMATS
from memfit.units import parse_bytes

if TYPE_CHECKING:
    from memfit.data import Columns

PRECISIONS = ("auto", "fp32", "fp16", "bf16", "bf16-true")
CHECKPOINTING = ("none", "full", "every-n")
OPTIMIZERS = ("adamw", "sgd", "adamw8bit", "paged-adamw8bit")
QUANTIZE_BASE = ("none", "nf4", "int8")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED = ("none", "ddp", "fsdp", "auto")
TASKS = ("auto", "classification", "causal-lm", "seq2seq")
OPT_INS = ("allow_freeze", "allow_8bit_optimizer", "allow_offload", "allow_optimizer_in_backward", "allow_bf16_true",
           "allow_lora", "allow_qlora")
"""The planning opt-ins (``--allow-*``): what ``budget`` may plan beyond the accuracy-neutral setups."""
PLANNED_LORA_RANK = 16
"""The rank of the adapters a plan chooses under ``allow_lora``/``allow_qlora``."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # --- model and data ---
    model: str = "minilm"
    """A preset name (``memfit models``), a local Hugging Face model directory, or a Hub id
    (``org/name[@revision]``, read from the local cache first)."""
    data: str = "rotten-tomatoes"
    """A built-in dataset name, a table (CSV, JSON Lines, JSON array or Parquet file; a folder of Parquet files; a
    ``datasets`` directory saved with ``save_to_disk``; a Hub dataset id ``org/name``), or an image folder with one
    subfolder per class."""
    data_split: str = "train"
    """The split of a Hub dataset or a saved ``DatasetDict`` to train on (memfit holds out its own validation)."""
    data_config: str | None = None
    """The configuration (subset) of a Hub dataset that has several."""
    data_format: str = "auto"
    """``auto | alpaca | sharegpt | messages | prompt-completion | text-label``: how a table's rows become
    examples; auto recognises it from the columns (:mod:`memfit.data.formats`)."""
    task: str = "auto"
    """``classification | causal-lm | seq2seq | auto``. auto: for instruction data (prompt/completion or
    messages), seq2seq on an encoder-decoder model (T5, BART) and causal-LM fine-tuning on any other; causal-LM
    fine-tuning for decoder LLMs (the LLM presets, ``*ForCausalLM`` directories); otherwise classification.
    seq2seq: the prompt is the encoder's source, the completion the decoder's target (the loss is on it)."""
    text_column: str = "text"
    """Column holding the text in a CSV/JSONL file."""
    label_column: str = "label"
    """Column holding the label in a CSV/JSONL file."""
    prompt_column: str = "prompt"
    """Column holding the prompt of an instruction pair (causal-lm; the source of seq2seq)."""
    completion_column: str = "completion"
    """Column holding the completion of an instruction pair: what the model learns to write (causal-lm; the
    target of seq2seq)."""
    messages_column: str = "messages"
    """Field holding a chat conversation, a list of {"role", "content"} turns ending with the answer."""
    max_length: int = 64
    """Tokens per text after truncation. Activation memory grows linearly (quadratically for the math attention
    kernel) with it."""
    max_target_length: int | None = None
    """seq2seq: tokens per target (the decoder's side) after truncation, the end-of-sequence token kept.
    ``None``: ``max_length``. The decoder's activations and the logits (target tokens x vocabulary) grow with
    it; a summary's target is often far shorter than its source."""
    val_fraction: float = 0.1
    """Share of the examples held out for validation, by a split seeded with ``seed``."""
    train_samples: int | None = None
    """Use only the first N examples of the (shuffled) training split."""
    val_samples: int | None = None
    """Use only the first N examples of the validation split."""

    # --- batch ---
    effective_batch: int = 32
    """Samples per optimizer step. It is what is learned; memfit never changes it behind your back."""
    micro_batch_size: int | None = None
    """Samples per forward/backward pass. Smaller uses less activation memory, costs speed. Default: the
    effective batch (no accumulation)."""
    accumulation_steps: int | None = None
    """Alternative to ``micro_batch_size``: micro-steps per optimizer step (micro batch = effective / steps)."""
    eval_batch_size: int = 64
    """Samples per evaluation forward pass (no activations are kept for backward)."""
    packing: bool = False
    """Causal LM: concatenate the training examples into rows of exactly ``max_length`` tokens, attention kept
    within each example (:mod:`memfit.data.packing`). A sample is then a packed row: ``effective_batch`` and
    ``micro_batch_size`` count rows, samples/s is rows/s. Validation stays per example, unpacked."""

    # --- planning ---
    budget: str | None = None
    """Plan the run to this much memory (e.g. ``11GiB``): the planner picks the micro-batch, precision,
    checkpointing and optimizer implementation that train fastest within it (:mod:`memfit.planner`)."""
    plan: str | None = None
    """Train with a plan saved by ``memfit plan --save`` instead of planning now."""
    device_profile: str | None = None
    """Plan for this GPU (``1080ti``, a profile file) and run that plan on this machine, the card's memory (or
    ``budget``) emulated as the limit: a rehearsal of the card's run before renting it."""
    allow_freeze: bool = False
    """Planning opt-in (changes what is learned): freeze the embeddings or the lower layers if nothing else fits."""
    allow_8bit_optimizer: bool = False
    """Planning opt-in: bitsandbytes' 8-bit AdamW states if nothing else fits."""
    allow_offload: bool = False
    """Planning opt-in: the optimizer's state, the saved activations or (with 8-bit states) the paged states on
    the host, one CUDA card."""
    allow_optimizer_in_backward: bool = False
    """Planning opt-in: the optimizer step inside backward (no clipping, one micro-batch per step)."""
    allow_bf16_true: bool = False
    """Planning opt-in: weights, gradients and optimizer state in bf16, updates Kahan-summed."""
    allow_lora: bool = False
    """Planning opt-in: LoRA adapters of rank :data:`PLANNED_LORA_RANK`, the base frozen in 16 bits, when no full
    fine-tuning fits."""
    allow_qlora: bool = False
    """Planning opt-in: LoRA on a 4-bit NF4 base when LoRA does not fit either."""

    # --- techniques ---
    precision: str = "auto"
    """``fp32 | fp16 | bf16 | bf16-true | auto``. fp16 = autocast + GradScaler; bf16 = autocast, no scaler;
    bf16-true = the weights, gradients and optimizer state themselves in bf16, no autocast
    (:mod:`memfit.techniques.bf16_true`); auto = bf16 on CUDA with compute capability >= 8.0, fp16 on older CUDA
    cards; on CPU bf16 where the processor computes it natively (AVX512-BF16, AMX), else fp32."""
    force_cpu_fp16: bool = False
    """Allow fp16 on CPU, which works but is about 20x slower than fp32 there."""
    force_bf16: bool = False
    """Allow bf16 (mixed or true) on a card without native bf16 (compute capability < 8.0), emulated there."""
    kahan: bool | None = None
    """Kahan-summed updates of bf16 weights (torch-optimi): small updates are kept instead of rounded away.
    ``None``: on under ``bf16-true`` with AdamW or SGD."""
    optimizer_in_backward: bool = False
    """Update each parameter inside backward as soon as its gradient is complete, and free the gradient: no full
    set of gradients ever exists. One micro-batch per window, no clipping
    (:mod:`memfit.techniques.optimizer_in_backward`)."""
    init_scale: float = 65536.0
    """GradScaler's initial loss scale (fp16 only)."""
    growth_interval: int = 2000
    """Optimizer steps without overflow before GradScaler doubles the scale (fp16 only)."""
    checkpointing: str = "none"
    """``none | full | every-n``: recompute layer activations in backward instead of storing them."""
    checkpoint_every: int = 2
    """With ``checkpointing = "every-n"``: checkpoint one layer in every N."""
    offload_activations: bool = False
    """CUDA: what autograd saves in forward goes to host memory until backward needs it (parameters and small
    tensors stay); with checkpointing, the blocks' inputs (:mod:`memfit.techniques.offload_activations`)."""
    freeze_embeddings: bool = False
    """Freeze the embedding block: no gradients or optimizer state for it."""
    train_top_layers: int | None = None
    """Train only the top K transformer layers plus the head; everything below is frozen."""
    loss_chunk: int | None = None
    """Causal LM and seq2seq: the loss over chunks of N token positions, each chunk's fp32 logits and log-softmax
    recomputed in backward instead of kept (:mod:`memfit.techniques.chunked_loss`)."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the blocks' Linear layers, the base frozen (:mod:`memfit.techniques.lora`);
    0 trains the weights themselves."""
    lora_alpha: float | None = None
    """LoRA's scaling numerator (the update is scaled by alpha / rank). ``None``: twice the rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (costs one mask and one copy of each adapted layer's input)."""
    lora_targets: str | None = None
    """Comma-separated last names of the Linear layers that get adapters (``q_proj,v_proj``); ``None``: every
    Linear of the transformer blocks."""
    quantize_base: str = "none"
    """``none | nf4 | int8``: the blocks' frozen Linear weights in bitsandbytes' 4-bit NF4 or 8 bits, LoRA on top
    (QLoRA; :mod:`memfit.techniques.quantized_base`)."""
    merge: bool = False
    """LoRA: also save the base model with the adapters merged in (``model/merged``)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (after unscaling under fp16). ``None`` disables clipping."""
    max_nonfinite_steps: int = 5
    """Stop the run after this many consecutive optimizer steps with a non-finite loss or gradient."""
    optimizer: str = "adamw"
    """``adamw | sgd | adamw8bit | paged-adamw8bit`` (the last two need bitsandbytes; paged needs CUDA)."""
    foreach: bool | None = None
    """Multi-tensor (foreach) optimizer kernels: faster than a loop, but hold a temporary copy of the gradients
    during the step. ``None`` keeps torch's default (when the step is not fused)."""
    offload_optimizer: bool = False
    """Keep the optimizer's state and run its update on the host, one process on a CUDA card: the card holds
    weights and gradients only (:mod:`memfit.techniques.offload`)."""
    fused: bool | None = None
    """AdamW's fused kernel: the whole update in one kernel per parameter group, with no gradient-sized
    temporaries: the fastest and leanest step where torch has it (CPU and CUDA). ``None``: fused for AdamW in
    one process unless ``foreach`` is set (either way); distributed runs keep torch's default."""
    lr: float = 5e-5
    """Peak learning rate of the linear warmup/decay schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""
    warmup_ratio: float = 0.1
    """Share of the optimizer steps spent warming the learning rate up from 0."""
    momentum: float = 0.9
    """SGD momentum."""

    # --- schedule ---
    epochs: int = 1
    """Passes over the training split (one pass of MiniLM over Rotten Tomatoes already reaches ~0.78)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (even mid-epoch)."""
    eval_before: bool = False
    """Also evaluate before the first step (zero-shot, for a pretrained LLM): ``val_accuracy_before``."""
    seed: int = 0
    """Seeds the split, the shuffling and the head's initialisation: the same seed gives the same losses."""
    log_every: int = 10
    """Optimizer steps between two lines of ``metrics.jsonl`` (the progress bar updates every step)."""

    # --- reliability ---
    emulate_budget: str | None = None
    """Behave as if the device had this much memory (e.g. ``300MiB``): on CPU the storage tracker raises
    ``torch.OutOfMemoryError`` when live tensor bytes would exceed it; on CUDA the allocator is capped."""
    save_every: int | None = None
    """Write a checkpoint every N optimizer steps, and one at the end (:mod:`memfit.checkpoints`)."""
    keep_last: int = 2
    """Complete checkpoints kept in ``<output-dir>/checkpoints``; older ones are deleted after each save."""
    resume: str | None = None
    """``latest`` (the newest complete checkpoint of the output dir; a fresh start when there is none) or a
    checkpoint directory."""
    memory_timeline: bool = False
    """Record the live memory after every allocation and free during optimizer step 2 (step 1 for a one-step
    run), each labelled forward/backward/optimizer, into ``memory_timeline.json``."""
    overwrite: bool = False
    """Allow a fresh run into an output dir that already holds a run (its run files are replaced)."""

    # --- where ---
    device: str = "auto"
    """``auto | cpu | cuda``, or a GPU profile name (``1080ti``): train on this machine's CUDA device, planned
    for that card (its memory is the budget unless ``budget`` says otherwise)."""
    output_dir: str | None = None
    """Where metrics, summary and the fine-tuned model go. Default: ``runs/<timestamp>``."""

    # --- more than one GPU (torchrun) ---
    distributed: str = "none"
    """``none | ddp | fsdp | auto`` under ``torchrun``: replicate (DDP), shard parameters, gradients and optimizer
    state (FSDP2), or FSDP only when a replica would not fit (:mod:`memfit.distributed`)."""
    world_size: int = 1
    """Processes (GPUs) the run is for: set by torchrun when training; give it to ``memfit estimate``/``plan``."""
    cpu_offload: bool = False
    """FSDP only: keep the parameter shards and the optimizer step on the host (``CPUOffloadPolicy``)."""
    shard_group: int | None = None
    """FSDP only: shard within groups of this many ranks and replicate across the groups (HSDP: the GPUs of one
    node, so only gradients cross nodes); ``None``: shard across every rank."""
    reduce_every_micro_step: bool = False
    """FSDP only: reduce-scatter the gradients in every micro-step's backward, not only in the window's last, so
    they stay sharded between micro-steps (:func:`memfit.distributed.micro_step_sync`)."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Reserved for forward-compatible keys; must stay empty."""

    def validate(self) -> None:
        """Raise one :class:`ConfigError` listing every problem of this config."""
        problems = Problems()
        _check_types(problems, self)  # a config file can hold any type; the range checks below need the right one
        problems.raise_if_any(ConfigError)
        _check_choice(problems, "precision", self.precision, PRECISIONS)
        _check_choice(problems, "checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice(problems, "optimizer", self.optimizer, OPTIMIZERS)
        _check_choice(problems, "task", self.task, TASKS)
        _check_choice(problems, "data_format", self.data_format, DATA_FORMATS)
        _check_distributed(problems, self)
        _check_step_kernels(problems, self)
        _check_low_memory_full(problems, self)
        _check_adapters(problems, self)
        if self.device not in DEVICES:
            problems.lines.extend(gpu_profile_problems(self.device, "--device", DEVICES))
        _check_numbers(problems, self)
        _check_batch_split(problems, self)
        _check_run_dir_and_budget(problems, self)
        if self.extra:
            problems.add(f"unknown option(s): {', '.join(sorted(self.extra))}; the names are those of "
                         "'memfit train --help', as snake_case or dash-case")
        problems.raise_if_any(ConfigError)

    @property
    def plans(self) -> bool:
        """Whether the planner chooses this run's split and techniques (``budget``, ``plan`` or a GPU profile
        as ``device``)."""
        return self.budget is not None or self.plan is not None or self.device not in DEVICES \
            or self.device_profile is not None

    def without_opt_ins(self) -> TrainConfig:
        """This config without ``--allow-*`` (once a plan has chosen, they have done their part)."""
        cleared: dict[str, Any] = dict.fromkeys(OPT_INS, False)
        return dataclasses.replace(self, **cleared)

    @property
    def opt_ins(self) -> tuple[str, ...]:
        """The ``--allow-*`` flags given."""
        return tuple(f"--{name.replace('_', '-')}" for name in OPT_INS if getattr(self, name))

    @property
    def emulate_budget_bytes(self) -> int | None:
        if self.emulate_budget is None:
            return None
        return parse_bytes(str(self.emulate_budget), option="--emulate-budget")

    @property
    def target_length(self) -> int:
        """seq2seq: the target's tokens (``max_target_length``, else ``max_length``)."""
        return self.max_target_length or self.max_length

    @property
    def per_rank_batch(self) -> int:
        """Samples of each window one rank takes: the effective (global) batch over the ranks, rounded up."""
        return math.ceil(self.effective_batch / self.world_size)

    @property
    def resolved_micro_batch_size(self) -> int:
        """Per-rank micro-batch size implied by ``micro_batch_size`` or ``accumulation_steps``."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        if self.accumulation_steps is not None:
            return math.ceil(self.per_rank_batch / self.accumulation_steps)
        return self.per_rank_batch

    @property
    def resolved_accumulation_steps(self) -> int:
        """Micro-steps per full window on each rank; the last one is smaller when the micro batch does not
        divide it. ``effective_batch = micro x accumulation x world_size`` (when they divide)."""
        return math.ceil(self.per_rank_batch / self.resolved_micro_batch_size)

    @property
    def columns(self) -> Columns:
        """The file's field names."""
        from memfit.data import Columns

        return Columns(text=self.text_column, label=self.label_column, prompt=self.prompt_column,
                       completion=self.completion_column, messages=self.messages_column,
                       data_format=self.data_format, split=self.data_split, subset=self.data_config)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values.pop("extra")
        return values


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                                       "None": (type(None),)}
_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "None": "unset"}


def _check_types(problems: Problems, config: TrainConfig) -> None:
    for spec in dataclasses.fields(config):
        if spec.name == "extra":
            continue
        parts = [part.strip() for part in str(spec.type).split("|")]
        allowed = tuple(kind for part in parts for kind in _TYPES[part])
        value = getattr(config, spec.name)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            expected = " or ".join(_NAMES[part] for part in parts)
            problems.add(f"--{spec.name.replace('_', '-')} must be {expected} (got {value!r})")


def _check_step_kernels(problems: Problems, config: TrainConfig) -> None:
    if config.fused and config.optimizer != "adamw":
        problems.add(f"--fused is AdamW's kernel, not --optimizer {config.optimizer}'s; drop --fused")
    if config.fused and config.foreach:
        problems.add("--fused and --foreach are two implementations of the same step; give one of them")
    if config.offload_optimizer and "8bit" in config.optimizer:
        problems.add(f"--offload-optimizer runs torch's optimizers on the host; --optimizer {config.optimizer} keeps "
                     "bitsandbytes' 8-bit states on the card: use one or the other")
    if config.offload_optimizer and several_processes(config):
        problems.add("--offload-optimizer is for one process; with several GPUs use --distributed fsdp --cpu-offload")


def _check_low_memory_full(problems: Problems, config: TrainConfig) -> None:
    """16-bit weights, Kahan summation and the optimizer step in backward against what they cannot do."""
    from memfit.techniques.bf16_true import kahan_problems, uses_kahan

    problems.lines.extend(kahan_problems(config.kahan, precision=config.precision, optimizer=config.optimizer))
    several = several_processes(config)
    if config.precision == "bf16-true" and several and config.distributed != "fsdp":
        problems.add("--precision bf16-true trains on several GPUs with --distributed fsdp (its bf16 weights, "
                     "gradients and state sharded); use it, or --precision bf16")
    if config.precision == "bf16-true" and config.offload_optimizer:
        problems.add("--precision bf16-true with --offload-optimizer is not supported; use one or the other")
    if config.fused and uses_kahan(config.kahan, precision=config.precision, optimizer=config.optimizer):
        problems.add("--fused is torch's AdamW kernel and Kahan summation (on by default under bf16-true) runs "
                     "torch-optimi's; drop --fused or add --no-kahan")
    if not config.optimizer_in_backward:
        return
    flag = "--optimizer-in-backward"
    if config.max_grad_norm is not None:
        problems.add(f"{flag} updates each parameter before the global gradient norm is known, so it cannot clip "
                     "by it; add --max-grad-norm none")
    split_known = config.effective_batch >= 1 and config.world_size >= 1 and \
        (config.micro_batch_size or 1) >= 1 and (config.accumulation_steps or 1) >= 1
    if split_known and config.resolved_accumulation_steps > 1 and config.budget is None and config.plan is None:
        problems.add(f"{flag} updates each parameter during the first micro-batch's backward, so gradients cannot "
                     f"accumulate over {config.resolved_accumulation_steps} micro-batches; use --micro-batch-size "
                     f"{config.per_rank_batch} (the effective batch) or a smaller --effective-batch")
    if config.precision == "fp16":
        problems.add(f"{flag}: fp16's loss scaler checks and unscales all gradients together; use --precision "
                     "bf16-true, bf16 or fp32")
    if several and config.distributed != "fsdp":
        problems.add(f"{flag} on several GPUs updates each rank's shard as FSDP reduces it; use --distributed fsdp "
                     "(DDP reduces its gradient buckets after the update would have used this rank's own gradient)")
    if config.offload_optimizer:
        problems.add(f"{flag} with --offload-optimizer is not supported; use one or the other")


def _check_adapters(problems: Problems, config: TrainConfig) -> None:
    """LoRA and quantised base weights: their ranges, and the libraries they need."""
    _check_choice(problems, "quantize_base", config.quantize_base, QUANTIZE_BASE)
    rank, quantized = config.lora_rank, config.quantize_base != "none"
    if rank < 0:
        problems.add(f"--lora-rank must be >= 0 (got {rank}); 0 turns LoRA off")
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        problems.add(f"--lora-alpha must be > 0 (got {config.lora_alpha})")
    if not 0.0 <= config.lora_dropout < 1.0:
        problems.add(f"--lora-dropout must be in [0, 1) (got {config.lora_dropout})")
    if quantized and rank == 0:
        problems.add(f"--quantize-base {config.quantize_base} freezes the base weights: nothing would train; add "
                     "--lora-rank (e.g. 16) for QLoRA")
    if rank > 0 and importlib.util.find_spec("peft") is None:
        problems.add("--lora-rank needs PEFT: pip install 'memfit[lora]'")
    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        problems.add(f"--quantize-base {config.quantize_base} needs bitsandbytes: pip install 'memfit[lora]'")
    if config.merge and rank == 0:
        problems.add("--merge merges LoRA adapters into the base model; add --lora-rank or drop --merge")
    if config.quantize_base == "int8" and several_processes(config):
        problems.add("--quantize-base int8 keeps its row scales on bitsandbytes' weight object, which DDP and FSDP "
                     "replace with their own parameters; use --quantize-base nf4 with --distributed")



def _check_numbers(problems: Problems, config: TrainConfig) -> None:
    """Counts, fractions and rates in their ranges."""
    for name in ("max_length", "effective_batch", "eval_batch_size", "epochs", "log_every",
                 "max_nonfinite_steps", "growth_interval"):
        _check_positive(problems, name, getattr(config, name))
    if config.checkpoint_every < 2:
        problems.add(f"--checkpoint-every must be >= 2 (got {config.checkpoint_every}); "
                     "use --checkpointing full to checkpoint every layer")
    _check_positive(problems, "keep_last", config.keep_last)
    if config.train_top_layers is not None and config.train_top_layers < 1:
        problems.add(f"--train-top-layers must be >= 1 (got {config.train_top_layers})")
    if not 0.0 < config.val_fraction < 1.0:
        problems.add(f"--val-fraction must be between 0 and 1 exclusive (got {config.val_fraction})")
    if not 0.0 <= config.warmup_ratio < 1.0:
        problems.add(f"--warmup-ratio must be in [0, 1) (got {config.warmup_ratio})")
    if not (math.isfinite(config.lr) and config.lr > 0):
        problems.add(f"--lr must be a positive number (got {config.lr})")
    if config.max_grad_norm is not None and not config.max_grad_norm > 0:
        problems.add(f"--max-grad-norm must be > 0 (got {config.max_grad_norm}); omit it to disable clipping")
    if config.init_scale <= 0:
        problems.add(f"--init-scale must be > 0 (got {config.init_scale})")
    for name in ("train_samples", "val_samples", "max_steps", "micro_batch_size", "save_every", "loss_chunk",
                 "max_target_length"):
        value = getattr(config, name)
        if value is not None:
            _check_positive(problems, name, value)


def _check_batch_split(problems: Problems, config: TrainConfig) -> None:
    """Micro-batch and accumulation against the effective batch and the ranks."""
    if config.accumulation_steps is not None and config.accumulation_steps < 1:
        problems.add(f"--accumulation-steps must be >= 1 (got {config.accumulation_steps})")
    if config.micro_batch_size is not None and config.accumulation_steps is not None:
        problems.add("give either --micro-batch-size or --accumulation-steps, not both "
                     "(the other is derived from --effective-batch)")
    per_rank = -(-config.effective_batch // max(config.world_size, 1))
    ranks = f" over {config.world_size} ranks ({per_rank} per rank)" if config.world_size > 1 else ""
    if config.world_size > config.effective_batch > 0:
        problems.add(f"--effective-batch {config.effective_batch} is smaller than the {config.world_size} ranks; "
                     "give every rank at least one sample")
    elif config.micro_batch_size is not None and config.micro_batch_size > per_rank > 0:
        problems.add(f"--micro-batch-size {config.micro_batch_size} is larger than --effective-batch "
                     f"{config.effective_batch}{ranks}; use at most {per_rank}")
    if (config.accumulation_steps is not None and config.accumulation_steps > per_rank > 0):
        problems.add(f"--accumulation-steps {config.accumulation_steps} is larger than --effective-batch "
                     f"{config.effective_batch}{ranks}: a micro-batch needs at least one sample")


def _check_run_dir_and_budget(problems: Problems, config: TrainConfig) -> None:
    """Resume/overwrite of the output directory; budgets and saved plans against a fixed split."""
    if config.resume is not None and config.overwrite:
        problems.add("give either --resume or --overwrite, not both: one continues the run in the output dir, "
                     "the other replaces it")
    if config.resume == "latest" and config.output_dir is None:
        problems.add("--resume needs --output-dir: the directory of the run to continue")
    if config.emulate_budget is not None:
        problems.collect(lambda: parse_bytes(str(config.emulate_budget), option="--emulate-budget"))
    if config.budget is not None:
        problems.collect(lambda: parse_bytes(str(config.budget), option="--budget"))
    if config.budget is not None and config.plan is not None:
        problems.add("give either --budget (plan now) or --plan (use a saved plan), not both")
    if (config.budget is not None or config.plan is not None or config.device_profile is not None) and (
            config.micro_batch_size is not None or config.accumulation_steps is not None):
        problems.add("--budget/--plan choose the micro-batch; drop --micro-batch-size/--accumulation-steps "
                     "(or drop --budget/--plan)")
    _check_planning(problems, config)


def _check_planning(problems: Problems, config: TrainConfig) -> None:
    """The opt-ins, the rehearsal on another card and the dry run: only where this run plans."""
    given = " ".join(config.opt_ins)
    if given and config.plan is not None:
        problems.add(f"{given}: a saved --plan has chosen its setup already; give the opt-ins to memfit plan "
                     "... --save, or plan now with --budget instead of --plan")
    elif given and not config.plans:
        problems.add(f"{given}: opt-ins are for the planner, and this run does not plan; add --budget SIZE (e.g. "
                     "11GiB) or --device-profile GPU")
    if config.device_profile is None:
        return
    if config.device not in ("auto", "cpu", "cuda"):
        problems.add(f"--device-profile {config.device_profile} plans for that card and runs here; drop --device "
                     f"{config.device} (or --device-profile)")
    if config.emulate_budget is not None:
        problems.add("--device-profile runs with the card's memory (or --budget) as the limit; drop --emulate-budget")
    if config.plan is not None:
        problems.add("--device-profile plans for that card; a saved --plan has chosen already: drop one of them")
    problems.lines.extend(gpu_profile_problems(config.device_profile, "--device-profile"))


def runs_sharded(optimizer: str) -> bool:
    """Whether ``optimizer``'s step runs on FSDP's shards (bitsandbytes' 8-bit step needs whole tensors)."""
    return "8bit" not in optimizer


def _check_distributed(problems: Problems, config: TrainConfig) -> None:
    _check_choice(problems, "distributed", config.distributed, DISTRIBUTED)
    _check_positive(problems, "world_size", config.world_size)
    if config.world_size > 1 and config.distributed == "none":
        problems.add(f"--world-size {config.world_size} needs --distributed ddp, fsdp or auto")
    if config.cpu_offload and config.distributed not in ("fsdp", "auto"):
        problems.add("--cpu-offload offloads FSDP shards; use it with --distributed fsdp")
    if config.reduce_every_micro_step and config.distributed not in ("fsdp", "auto"):
        problems.add("--reduce-every-micro-step keeps FSDP's gradients sharded between micro-steps; use it with "
                     "--distributed fsdp (DDP keeps every gradient in its buckets anyway)")
    if (group := config.shard_group) is not None:
        if config.distributed != "fsdp":
            problems.add("--shard-group shards FSDP's parameters within groups of ranks; use it with --distributed "
                         "fsdp")
        if group < 1 or (config.world_size > 1 and config.world_size % group):
            problems.add(f"--shard-group {group} must divide the {config.world_size} ranks into equal groups (e.g. "
                         "the GPUs of one node)")
    if not runs_sharded(config.optimizer) and config.distributed == "fsdp":
        problems.add(f"--optimizer {config.optimizer}: bitsandbytes' 8-bit step runs on whole tensors, not on FSDP's "
                     "sharded parameters; use --distributed ddp (every rank keeps the 8-bit states) or --optimizer "
                     "adamw")


def several_processes(config: TrainConfig) -> bool:
    """Whether the run trains (or is estimated) as more than one process: a distributed strategy or ranks."""
    return config.distributed != "none" or config.world_size > 1


def _check_choice(problems: Problems, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        flag = "--" + name.replace("_", "-")
        problems.add(f"{flag} {value!r} is not one of: {', '.join(allowed)}")


def _check_positive(problems: Problems, name: str, value: int) -> None:
    if value < 1:
        problems.add(f"--{name.replace('_', '-')} must be >= 1 (got {value})")


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig) if f.name != "extra"]


def from_mapping(values: dict[str, Any], *, base: TrainConfig | None = None) -> TrainConfig:
    """Build a config from a mapping whose keys use either ``snake_case`` or ``dash-case``.

    Unknown keys are kept in ``extra`` so :meth:`TrainConfig.validate` reports them with the rest.
    """
    known = set(field_names())
    updates: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        (updates if name in known else extra)[name] = value
    config = dataclasses.replace(base or TrainConfig(), **updates)
    config.extra = {**config.extra, **extra}
    return config


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML, YAML or JSON run config (its ``[train]`` table, if it has one) into option names and values."""
    return load_option_file(path, flag="--config")
