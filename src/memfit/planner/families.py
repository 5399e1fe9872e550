"""What the planner varies: a family of setups (precision, checkpointing, optimizer, freezing, strategy, LoRA)
and a candidate (a family at one micro-batch, with its predicted peak and speed)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memfit.config import TrainConfig, runs_sharded
from memfit.devices import DeviceProfile

CHECKPOINTING = ("none", "every-2", "full")
"""The checkpointing a plan chooses from, least recompute first."""
LOSS_CHUNK = 256
"""Token positions per chunk of a causal LM's loss when the planner chooses chunking
(:mod:`memfit.techniques.chunked_loss`): the fp32 logits of 256 positions are live at a time, not the
sequence's (2,048 x 128,256 fp32 are 1.0 GiB, and the loss keeps more of that size)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Everything of a setup except the micro-batch split."""

    precision: str
    checkpointing: str
    """``none | every-2 | full``."""
    kernels: str
    """How the optimizer step runs: ``fused`` (AdamW in one process), ``foreach`` or ``loop``."""
    freeze: str = "none"
    """``none | embeddings | top-K`` (train only the top K layers)."""
    optimizer: str = "adamw"
    strategy: str = "none"
    """More than one GPU: ``ddp``, ``fsdp`` or ``fsdp-offload``; ``none`` for one."""
    lora_rank: int = 0
    """LoRA adapters of this rank instead of training the weights (0: full fine-tuning)."""
    quantize_base: str = "none"
    """``nf4`` under LoRA: QLoRA's 4-bit base weights."""
    offload_optimizer: bool = False
    """The optimizer's state and update on the host (one CUDA card): the same update, slower steps."""
    loss_chunk: int | None = None
    """A causal LM's loss over chunks of this many positions, their logits recomputed in backward (the same
    loss; one more pass of the output layer); ``None``: the run's own setting."""
    kahan: bool = False
    """``bf16-true``: Kahan-summed updates (torch-optimi)."""
    optimizer_in_backward: bool = False
    """Each parameter updated in backward, its gradient freed: one micro-batch per window, no clipping."""
    drops_clipping: bool = False
    """The step in backward where the run clips by the global norm: the clipping is dropped (an opt-in)."""
    offload_activations: bool = False
    """Saved activations on the host (one CUDA card): the same step, PCIe traffic in forward and backward."""
    packing: bool = False
    """The run's causal-LM examples packed into full rows (the run's setting, not the plan's choice)."""
    shard_group: int | None = None
    """FSDP within groups of this many ranks, replicated across the groups (HSDP: one machine's GPUs each);
    ``None``: the run's own ``shard_group``."""
    reduce_every: bool = False
    """FSDP: gradients reduce-scattered in every micro-step of a window, so they stay sharded (more traffic);
    the same setup as without where a window is one micro-batch."""

    @property
    def ranks(self) -> bool:
        return self.strategy != "none"

    @property
    def strategy_label(self) -> str:
        """``hsdp (groups of N)`` for FSDP in groups of the plan's choosing, else the strategy."""
        return f"hsdp (groups of {self.shard_group})" if self.shard_group is not None else self.strategy

    @property
    def technique(self) -> str:
        """``full``, ``lora`` or ``qlora``: the families' order of fidelity."""
        return "full" if not self.lora_rank else ("lora" if self.quantize_base == "none" else "qlora")

    @property
    def technique_label(self) -> str:
        if self.technique == "full":
            return "full fine-tuning"
        return f"LoRA r={self.lora_rank}" + (f" on a {self.quantize_base} base" if self.technique == "qlora" else "")

    @property
    def accuracy_neutral(self) -> bool:
        return self.freeze == "none" and "8bit" not in self.optimizer and not self.lora_rank and \
            self.precision != "bf16-true" and not self.drops_clipping

    @property
    def paged(self) -> bool:
        """8-bit states in CUDA unified memory, paged to the host when the card runs short."""
        return self.optimizer == "paged-adamw8bit"

    @property
    def opt_ins(self) -> tuple[str, ...]:
        """The planner flags this family needs (none when it is always allowed)."""
        flags = [f"--allow-{self.technique}"] if self.lora_rank else []
        flags += ["--allow-freeze"] if self.freeze != "none" else []
        flags += ["--allow-8bit-optimizer"] if "8bit" in self.optimizer and not self.lora_rank else []
        flags += ["--allow-bf16-true"] if self.precision == "bf16-true" else []
        flags += ["--allow-optimizer-in-backward"] if self.optimizer_in_backward else []
        flags += ["--allow-offload"] if self.offload_optimizer or self.offload_activations or self.paged else []
        return tuple(flags)

    @property
    def opt_in(self) -> str | None:
        """The planner flags this family needs, in words, or ``None`` when it is always allowed."""
        return " and ".join(self.opt_ins) or None

    @property
    def optimizer_label(self) -> str:
        name = self.optimizer if "8bit" in self.optimizer else f"{self.optimizer}-{self.kernels}"
        return name + ("-kahan" if self.kahan else "") + (" in backward" if self.optimizer_in_backward else "")

    def configure(self, base: TrainConfig, *, micro_batch_size: int, effective_batch: int) -> TrainConfig:
        """``base`` with this family's techniques and the given split (``effective_batch``: the global one,
        over ``base.world_size`` ranks when the family is distributed)."""
        top = int(self.freeze.removeprefix("top-")) if self.freeze.startswith("top-") else None
        return dataclasses.replace(
            base, micro_batch_size=micro_batch_size, accumulation_steps=None, effective_batch=effective_batch,
            distributed=self.strategy.removesuffix("-offload"), cpu_offload=self.strategy == "fsdp-offload",
            world_size=base.world_size if self.ranks else 1,
            shard_group=(self.shard_group or base.shard_group) if self.strategy.startswith("fsdp") else None,
            precision=self.precision, checkpointing="every-n" if self.checkpointing == "every-2" else
            self.checkpointing, checkpoint_every=2, foreach={"foreach": True, "loop": False}.get(self.kernels),
            fused=self.kernels == "fused" and self.optimizer == "adamw", optimizer=self.optimizer,
            freeze_embeddings=self.freeze == "embeddings" or base.freeze_embeddings,
            train_top_layers=top if top is not None else base.train_top_layers,
            lora_rank=self.lora_rank, quantize_base=self.quantize_base, offload_optimizer=self.offload_optimizer,
            loss_chunk=self.loss_chunk if self.loss_chunk is not None else base.loss_chunk,
            kahan=self.kahan if self.precision == "bf16-true" else None,
            optimizer_in_backward=self.optimizer_in_backward, offload_activations=self.offload_activations,
            max_grad_norm=None if self.optimizer_in_backward else base.max_grad_norm,
            reduce_every_micro_step=self.reduces_every(micro_batch_size, effective_batch, base.world_size))

    def reduces_every(self, micro_batch_size: int, effective_batch: int, world_size: int) -> bool:
        """Whether this family's split reduces gradients in more than one micro-step per window."""
        return self.reduce_every and self.strategy.startswith("fsdp") and \
            effective_batch > micro_batch_size * world_size


@dataclass(kw_only=True, slots=True)
class Candidate:
    family: Family
    micro_batch_size: int
    accumulation_steps: int
    predicted_peak_bytes: int | None
    """What is compared with the budget: peak reserved by the allocator plus the non-PyTorch bytes."""
    predicted_allocated_bytes: int | None
    peak_phase: str | None
    predicted_samples_per_second: float
    exact: bool
    """From an exact trace of this setup (else from the family's line)."""
    fits: bool | None
    """``None``: not traced, because it cannot beat the chosen setup (``False`` without a peak: not traced,
    because the same family checkpointing more does not fit)."""
    reason: str = ""
    relative_speed: float | None = None
    """Predicted samples/s relative to the chosen setup."""
    world_size: int = 1
    """Ranks whose windows make one optimizer step (1 unless the family is distributed)."""
    trainable_parameters: int = 0
    """Parameters the setup trains (adapters only, with LoRA), from its trace; 0 when not traced."""
    parameters: int = 0
    """All parameters of the model (frozen and quantized ones too), from its trace."""
    predicted_host_bytes: int = 0
    """Host memory one rank holds at its peak: offloaded optimizer state, shards or activations."""

    @property
    def reduces_every(self) -> bool:
        """Whether this split reduces its gradients in every micro-step (FSDP, accumulating)."""
        return self.family.reduces_every(self.micro_batch_size, self.global_batch, self.world_size)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: ``predicted_samples_per_second`` counts them all."""
        return self.micro_batch_size * self.accumulation_steps * self.world_size

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "accumulation_steps": self.accumulation_steps,
                "precision": self.family.precision, "checkpointing": self.family.checkpointing,
                "optimizer": self.family.optimizer_label, "kernels": self.family.kernels,
                "freeze": self.family.freeze, "accuracy_neutral": self.family.accuracy_neutral,
                "distributed": self.family.strategy, "shard_group": self.family.shard_group,
                "world_size": self.world_size,
                "lora_rank": self.family.lora_rank, "quantize_base": self.family.quantize_base,
                "offload_optimizer": self.family.offload_optimizer, "loss_chunk": self.family.loss_chunk,
                "weights_precision": "bf16" if self.family.precision == "bf16-true" else "fp32",
                "kahan": self.family.kahan, "optimizer_in_backward": self.family.optimizer_in_backward,
                "drops_clipping": self.family.drops_clipping, "offload_activations": self.family.offload_activations,
                "packing": self.family.packing,
                "reduce_every_micro_step": self.reduces_every,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_allocated_bytes": self.predicted_allocated_bytes, "peak_phase": self.peak_phase,
                "predicted_samples_per_second": self.predicted_samples_per_second,
                "predicted_optimizer_steps_per_second": self.predicted_samples_per_second / self.global_batch,
                "relative_speed": self.relative_speed, "exact": self.exact, "fits": self.fits,
                "reason": self.reason, "technique": self.family.technique, "opt_ins": list(self.family.opt_ins),
                "trainable_parameters": self.trainable_parameters, "parameters": self.parameters,
                "predicted_host_bytes": self.predicted_host_bytes}

    def describe(self) -> str:
        freeze = "" if self.family.freeze == "none" else f", freeze {self.family.freeze}"
        ranks = f"{self.family.strategy_label}, " if self.family.ranks else ""
        per_rank = " per rank" if self.family.ranks else ""
        adapters = f", {self.family.technique_label}" if self.family.lora_rank else ""
        host = " on the host" if self.family.offload_optimizer else ""
        host += ", activations on the host" if self.family.offload_activations else ""
        host += " (clipping dropped)" if self.family.drops_clipping else ""
        chunks = f", loss in chunks of {self.family.loss_chunk}" if self.family.loss_chunk else ""
        if self.reduces_every:
            chunks += ", gradients reduced every micro-step"
        return (f"{ranks}micro-batch {self.micro_batch_size} x {self.accumulation_steps}{per_rank}, "
                f"{self.family.precision}, checkpointing {self.family.checkpointing}{chunks}, "
                f"{self.family.optimizer_label}{host}{freeze}{adapters}")


def runs_on(precision: str, strategy: str) -> bool:
    """Whether a setup in ``precision`` runs with ``strategy``: bf16-true weights train in one process or sharded
    (on the cards or on the host), not replicated by DDP."""
    return precision != "bf16-true" or strategy != "ddp"


def least_first(candidate: Candidate) -> tuple[bool, int]:
    """The order of least needs: those that fit first (the host's memory too), then the least on the card."""
    return not candidate.fits, candidate.predicted_peak_bytes or 0


def with_chunked_loss(families: list[Family], base: TrainConfig, task: str) -> list[Family]:
    """``families`` and, for a causal LM whose run does not set ``--loss-chunk``, each fully checkpointed one
    again with its loss in chunks of :data:`LOSS_CHUNK`: where even full checkpointing leaves too much, the
    logits of the whole sequence are often what is left."""
    if task != "causal-lm" or base.loss_chunk is not None:
        return families
    chunked = [dataclasses.replace(f, loss_chunk=LOSS_CHUNK) for f in families
               if f.checkpointing == "full" and f.loss_chunk is None]
    return [*families, *chunked]


def with_sharded_gradients(families: list[Family], base: TrainConfig) -> list[Family]:
    """``families`` and each FSDP one again with its gradients reduced in every micro-step: a window of several
    micro-batches otherwise keeps every trained parameter's unsharded gradient until its last backward. A run
    that asks for it (``--reduce-every-micro-step``) gets only those."""
    sharded = [dataclasses.replace(f, reduce_every=True) if f.strategy.startswith("fsdp") else f for f in families]
    return list(dict.fromkeys(sharded if base.reduce_every_micro_step else [*families, *sharded]))


def default_kernels(optimizer: str, strategy: str, profile: DeviceProfile, *, kahan: bool = False) -> str:
    """The step memfit runs by default: fused AdamW in one process, else torch's default (foreach kernels on
    CUDA, a loop on CPU); torch-optimi's Kahan-summed step in a loop."""
    if kahan:
        return "loop"
    if optimizer == "adamw" and strategy == "none":
        return "fused"
    return "foreach" if profile.kind == "cuda" else "loop"


def leaner_kernels(family: Family) -> list[str]:
    """The other implementations of the family's step, to try when nothing fits (fused and loop keep no
    gradient-sized temporaries; foreach does)."""
    options = ["fused", "loop"] if family.optimizer == "adamw" and not family.ranks and not family.kahan \
        else ["loop"]
    return [kernels for kernels in options if kernels != family.kernels]


def strategies(base: TrainConfig, profile: DeviceProfile,
               per_node: int | None = None) -> tuple[tuple[str, int | None], ...]:
    """What a plan for ``base.world_size`` ranks may choose from, as (strategy, shard group): replicate first,
    then shard, then shard within each machine's GPUs and replicate across machines (HSDP, where ``per_node``
    GPUs fill several machines and the run names no shard group: only gradients cross the network), then
    offload (CUDA only; on CPU the shards already live in host memory; within the run's own shard groups where
    it names them, of two ranks or more, not the machines' HSDP, which keeps every all-reduced output on the card
    until the backward ends).
    An 8-bit optimizer replicates: its step does not run on FSDP's sharded parameters."""
    if base.world_size == 1:
        return (("none", None),)
    if not runs_sharded(base.optimizer) or base.distributed == "ddp":
        return (("ddp", None),)
    offload = (("fsdp-offload", None),) if profile.kind == "cuda" and base.shard_group != 1 else ()
    machines = (("fsdp", per_node),) if per_node is not None and per_node < base.world_size and \
        base.shard_group is None else ()
    if base.distributed == "fsdp" and base.cpu_offload and profile.kind == "cuda":
        return (("fsdp-offload", None),)
    sharded = (("fsdp", None), *machines, *offload)
    return sharded if base.distributed == "fsdp" else (("ddp", None), *sharded)
