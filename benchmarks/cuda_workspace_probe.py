"""How much a CUDA training step allocates beyond its tensors: cuBLAS and cuBLASLt workspaces.

PyTorch takes cuBLAS workspaces from its caching allocator, so ``torch.cuda.memory_allocated()`` counts them.
This prints what appears beyond the tensors after a matmul on the Python thread, a backward (the autograd
engine's own thread), a bf16 autocast matmul and a Linear with a bias (addmm through cuBLASLt). memfit's
estimator models the result (``memfit.memory.emulation.cublas_workspaces``). Needs a CUDA device.

    python benchmarks/cuda_workspace_probe.py
"""

from __future__ import annotations

import torch


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main() -> None:
    x = torch.randn(512, 512, device="cuda", requires_grad=True)
    tensor = x.numel() * 4
    base = allocated()
    y = x @ x
    print("after fp32 matmul (Python thread): extra", allocated() - base - tensor)
    y.sum().backward()
    print("after backward (autograd thread): extra", allocated() - base - 2 * tensor)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = x @ x
    print("after bf16 autocast matmul: extra", allocated() - base - 2 * tensor - z.numel() * 2)
    linear = torch.nn.Linear(512, 512, device="cuda")
    before = allocated()
    out = linear(x)
    print("after addmm (Linear with bias): extra over before it", allocated() - before - out.numel() * 4,
          "total extra", allocated() - base)


if __name__ == "__main__":
    main()
