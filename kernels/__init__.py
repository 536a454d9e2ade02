"""Fused Triton kernels, one op per file (the kernel-file layout: README.md's file map).

Each module holds `<op>_ref` (pure PyTorch, the spec and the CPU path), the `@triton.jit` kernels, their
launchers, an autograd Function and the public `<op>()`, which takes the Triton path on CUDA tensors. CPU tests run
the kernels in Triton's interpreter (TRITON_INTERPRET=1; what it gets right and wrong: notes/triton_cpu.md).
"""
