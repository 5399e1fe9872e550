"""16-bit weights (``--precision bf16-true``) and Kahan-summed updates (``--kahan``).

Under ``bf16-true`` every floating-point parameter is stored and trained in bf16: its gradient is bf16, and so
is AdamW's state (torch's and torch-optimi's optimizers make their state in the parameter's dtype). With AdamW
that is 2 + 2 + 4 = 8 bytes per trained parameter instead of mixed precision's 4 + 4 + 8 (plus autocast's
16-bit copies of the weights). Buffers (rotary frequencies, position ids) keep their dtype.

Trade-off of the weights: bf16 has 8 bits of mantissa, so ``w + u`` rounds back to ``w`` whenever ``|u|`` is
below about ``|w| / 256``: late in a run, with a small learning rate, most updates of large weights are lost.
Kahan summation (torch-optimi's ``kahan_sum``) keeps, per parameter, a bf16 buffer of what the last addition
rounded away and adds it back at the next one, so small updates accumulate as they would in fp32. It costs one
more bf16 buffer per trained parameter (2 bytes: 10 bytes per parameter with AdamW) and one more pass over it
in each step. On by default under ``bf16-true`` with AdamW and SGD; bitsandbytes' 8-bit AdamW has no Kahan
buffer (``--optimizer adamw8bit`` runs without it).

Several GPUs: under ``--distributed fsdp`` FSDP2 shards the bf16 weights, gradients, states and Kahan buffers
as they are; weights are gathered in bf16, gradients reduce-scattered in fp32 (mixed precision's reduce dtype)
and kept in bf16, one rounding more than one process's sum. With ``--cpu-offload`` the shards, their gradients
and the optimizer live on the host in bf16 (10 bytes per parameter with AdamW and Kahan, against 16 in fp32) and
the optimizer steps there; each reduced gradient is cast to bf16 on the card before it crosses to the host.

Incompatible: ``--kahan`` without ``bf16-true`` (fp32 weights lose nothing to round); ``--kahan`` with an 8-bit
optimizer; ``bf16-true`` with fp16's GradScaler, with DDP (FSDP shards what DDP would replicate) and with
``--offload-optimizer`` (one process's host step is torch's fused AdamW, without Kahan's buffer).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

KAHAN_STATE = "kahan_comp"
"""The name torch-optimi gives a parameter's Kahan compensation buffer in its optimizer state."""


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every fp32 parameter of ``model`` in ``dtype``, in place (a tied weight is one parameter, cast
    once; quantised weights, which are not floats, stay as they are)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dtype == torch.float32:
                parameter.data = parameter.data.to(dtype)


def uses_kahan(config_kahan: bool | None, *, precision: str, optimizer: str) -> bool:
    """Whether the run's updates are Kahan-summed: as asked, else by default under ``bf16-true`` with an
    optimizer that has a Kahan buffer (AdamW, SGD)."""
    if config_kahan is not None:
        return config_kahan
    return precision == "bf16-true" and "8bit" not in optimizer


def kahan_problems(config_kahan: bool | None, *, precision: str, optimizer: str) -> list[str]:
    """What ``--kahan`` needs: 16-bit weights, an optimizer with a compensation buffer, torch-optimi."""
    if not uses_kahan(config_kahan, precision=precision, optimizer=optimizer):
        return []
    if precision != "bf16-true":
        return [f"--kahan compensates the rounding of bf16 weights; --precision {precision} keeps fp32 weights: "
                "use --precision bf16-true or drop --kahan"]
    if "8bit" in optimizer:
        return [f"--kahan: --optimizer {optimizer} has no Kahan buffer; use --optimizer adamw or --no-kahan"]
    if importlib.util.find_spec("optimi") is None:
        return ["--kahan needs torch-optimi: pip install 'memfit[lowmem]' (or --no-kahan)"]
    return []


def kahan_optimizer(groups: list[dict[str, Any]], *, name: str, lr: float, momentum: float,
                    foreach: bool | None) -> torch.optim.Optimizer:
    """torch-optimi's AdamW or SGD with Kahan summation, with torch's AdamW defaults (betas 0.9/0.999, eps
    1e-8; torch-optimi's own are 0.9/0.99 and 1e-6). Its Triton kernel is off: it needs an Ampere card, and the
    estimator traces the for-loop (``foreach=False``, one parameter's temporaries at a time: memfit's default
    here) or the foreach path the run will take."""
    import optimi

    loop = not foreach
    if name == "adamw":
        optimizer: torch.optim.Optimizer = optimi.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                                        kahan_sum=True, foreach=not loop, triton=False)
        return optimizer
    if name == "sgd":
        # torch_init: the momentum buffer starts as the first gradient, as torch's SGD (dampening off)
        sgd: torch.optim.Optimizer = optimi.SGD(groups, lr=lr, momentum=momentum, torch_init=True, kahan_sum=True,
                                                foreach=not loop, triton=False)
        return sgd
    raise AssertionError(f"no Kahan optimizer for {name!r}: refused by kahan_problems")
