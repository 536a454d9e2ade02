"""Fused Triton kernels, one op per file (see DESIGN.md section 5).

Each module holds `<op>_ref` (pure PyTorch, the spec and the CPU path), the `@triton.jit` kernels, their
launchers, an autograd Function and the public `<op>()`, which takes the Triton path on CUDA tensors.
"""
