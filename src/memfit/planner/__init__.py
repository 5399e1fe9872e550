"""The planner: the fastest setup that fits a memory budget, at the effective batch the user chose.

The effective batch is never changed: the planner only chooses how to compute it. What it varies:

- accuracy-neutral, always allowed: the micro-batch / accumulation split, the precision (fp32 and the
  device's low precision: bf16 where native, else fp16 on CUDA), checkpointing (none, every 2nd layer, every
  layer), and the optimizer step's implementation (fused AdamW in one process; foreach kernels or a
  per-parameter loop otherwise, and a loop or fused step when nothing else fits);
- opt-ins (one typed value, :class:`~memfit.planner.allowed.Allowed`), tried when nothing accuracy-neutral
  fits, in their order of fidelity and each on top of the ones before (:mod:`memfit.planner.opt_ins`): the
  optimizer step inside backward (``optimizer_in_backward``: one micro-batch per step, no clipping), the
  optimizer's state or the saved activations on the host (``offload``, one CUDA card; the same update),
  16-bit weights with Kahan-summed updates (``bf16_true``, a card with bf16), 8-bit optimizer states
  (``eight_bit_optimizer``; paged to the host with ``offload`` too) and freezing (``freeze``: the embeddings,
  or all but the top half or quarter of the layers), least change first. Where only a smaller effective batch
  would fit the step in backward, the verdict says which.
- opt-in adapters, in order of fidelity after full fine-tuning: LoRA (``lora``: adapters of
  ``lora_rank``, the base frozen in 16 bits) and then QLoRA (``qlora``: the same on a 4-bit NF4 base).
  Each says what it needs at least; the first allowed one that fits is searched like the neutral families
  (precision x checkpointing x optimizer, 8-bit states too with ``eight_bit_optimizer``). A run that already
  asks for LoRA (``config.lora_rank``) is planned within it.

Cost model (all of it):

    memory   peak(m) = the estimator's exact trace of the setup (memory.estimate), or a line through two
             traces of the same family at micro-batches m1, m2: per phase (forward, backward,
             optimizer) allocated(m) = a + b·m, the peak is the largest phase, plus the allocator's reserve
             (also a line) and the non-PyTorch bytes of the device. A trace of two micro-steps stands for
             any accumulation >= 2: every micro-step after the first sees the same live set, except the
             window's input batches, which all live until the window ends (added per sample). Every trace
             of a model whose blocks repeat is a shortened one (a few blocks, a few micro-steps) replayed at
             full length, equal to the full trace to the byte (memory.repeats; --exact-trace: in full).
    time     t(step) = E·F / (R_dtype·EFFICIENCY)            compute: F = traced FLOPs per sample (forward,
                                                               backward, checkpointing's recompute), R_dtype
                                                               = the profile's dense FLOP/s for the dtype
             + (k·ops_micro + ops_optimizer)·τ                per-op host overhead: k micro-steps of a window
             + trainable·BYTES_PER_TRAINED_PARAMETER / BW     the optimizer's memory traffic
               (offloaded: trainable·(8/host + BYTES_PER_TRAINED_PARAMETER/HOST_MEMORY_BANDWIDTH), fp32
               gradients and weights over the host link, the update at host memory speed)
             + k·D / BW                                       QLoRA: D = bytes read and written per
                                                               micro-step to dequantise the 4-bit weights
                                                               (forward, backward, recompute), traced
             + E·2·a / host                                   offloaded activations: a bytes a sample
                                                               saves, out and back over the host link
               (bf16-true: half the optimizer traffic, + 10 bytes per parameter with Kahan; paged 8-bit
               states: + 4 bytes per parameter over the host link)
             + communication (``--gpus N``, per optimizer step, W = N ranks, r = (W-1)/W, link = the
               profile's rank-to-rank bandwidth; taken as not hidden behind compute, an upper bound):
               ddp   2r·trainable·4 / link                   the gradient all-reduce
               fsdp  k·2r·params·b / link + r·trainable·4 / link   all-gathers in forward and backward of
                                                               each micro-step (b: bytes of the compute
                                                               dtype), one reduce-scatter of fp32 gradients
               offload: fsdp's, plus k·2·params·b/W + trainable·4/W over the host link, and the optimizer
               step on the host (its traffic at host memory speed)
               machines (``--gpus-per-node G`` < W): a collective over ranks of several machines runs at
               min(link, node), node = the profile's bandwidth between machines; hsdp (FSDP in groups of G,
               replicated across the W/G machines, q = (W/G-1)/(W/G)): fsdp's terms over the group at the
               link, plus 2q·trainable·4/G / (node/G) (each rank's gradient shard all-reduced across the
               machines, whose network the machine's G ranks share)
    speed    E / t(step) samples/s (E the global batch; with N ranks each computes E/N); fits = peak <=
             budget·(1 - margin), the peak being one rank's, and (``--host-memory``) each rank's host peak
             times the ranks of one machine <= its host memory.

On a card whose fp16 rate equals its fp32 rate (Pascal), fp16 only adds cast ops: it is chosen for memory,
never for speed. Search: families (precision x checkpointing x optimizer implementation) are traced in the
order of their best possible speed (a bound from what was traced so far); a family that cannot beat the
best fitting setup at any micro-batch is not traced. The chosen setup and the runner-up are confirmed with
exact traces, as is any faster setup whose line comes within ``BAND`` of the budget. Where every parameter's fp32
weight, gradient and optimizer state alone exceed the budget (an 8B model on an 11 GiB card), the least that full
fine-tuning needs (full checkpointing, micro-batch 1, each precision, with and without the loss in chunks) is
traced first, and when it does not fit no family is searched: every other setup keeps at least as much. Where a
LoRA base's weights alone (2 bytes a parameter at least) exceed the budget of one GPU, LoRA's least need is not
traced. A family whose least need was traced already (a stage's) and does not fit gets no line: a larger
micro-batch keeps more.

What only a GPU can confirm: EFFICIENCY and τ are typical eager-mode figures, not measured per card; the
ranking depends on their ratio, the memory side does not. QLoRA's dequantisation is priced as memory traffic
at the card's bandwidth, as bitsandbytes' dequantise-then-matmul path does it; its fused kernels for small
batches are not modelled, and none of it has been measured on a GPU; nor has the offloaded optimizer's
step (transfers and the host's update), priced at the profile's host-link and a typical host bandwidth; nor
communication across machines, whose bandwidths are assumptions (:data:`memfit.devices.NODE_BANDWIDTH`); nor
the low-memory full fine-tuning terms: offloaded activations priced as two unoverlapped PCIe crossings per
micro-step, paged 8-bit states as paged in and out once per step, Kahan summation as 10 more bytes of
traffic per parameter, and the step in backward's per-parameter host read of each gradient's norm (not
priced).
"""

from memfit.planner.choose import plan, plan_for_run
from memfit.planner.families import Candidate, Family
from memfit.planner.report import Plan, load_plan
from memfit.planner.search import micro_batch_sizes

__all__ = ["Candidate", "Family", "Plan", "load_plan", "micro_batch_sizes", "plan", "plan_for_run"]
