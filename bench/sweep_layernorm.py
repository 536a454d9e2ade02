"""Tile and row-group sweeps of kernels/layernorm.py (GPU time, CUDA-graph replay): where its tuning numbers come from.

    python bench/sweep_layernorm.py

Prints, per shape, the tiles the autotuner picked, the forward time and the backward time at several row-group
counts per SM; then, at 16384x768, the backward's two kernels alone over explicit tiles.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import layernorm as ln  # noqa: E402


def _tuned(M, C, dtype):
    """Run fwd+bwd once at (M, C) and print the tiles the autotuner picked."""
    x = torch.randn(M, C, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(C, device="cuda", dtype=dtype, requires_grad=True)
    ln.layernorm(x, w, None).backward(torch.randn(M, C, device="cuda", dtype=dtype))
    for name, k in (("fwd", ln._layernorm_fwd_kernel), ("bwd", ln._layernorm_bwd_kernel)):
        print(f"  tuned {name} {M}x{C} {str(dtype).split('.')[-1]}: {k.best_config}")


def _groups_sweep(M, C, dtype):
    """GPU time (CUDA-graph replay) of the forward and of the backward at several row-group counts per SM."""
    x = torch.randn(M, C, device="cuda", dtype=dtype)
    w, b = torch.ones(C, device="cuda"), torch.zeros(C, device="cuda")
    dy = torch.randn_like(x)
    _, _, mean, rstd = ln.layernorm_fwd(x, w, b, 1e-5)
    t_f = triton.testing.do_bench_cudagraph(lambda: ln.layernorm_fwd(x, w, b, 1e-5), return_mode="median")
    cells = []
    for g in (2, 4, 8, 16, 32):
        n = g * ln._sm_count(x.device)
        t = triton.testing.do_bench_cudagraph(lambda: ln.layernorm_bwd(dy, x, w, True, mean, rstd, n_groups=n),
                                              return_mode="median")
        cells.append(f"{g}/SM {t * 1e3:.1f} us")
    print(f"  {M}x{C} GPU time: fwd {t_f * 1e3:.1f} us; bwd by row groups per SM: {', '.join(cells)}")


def _bwd_sweep(M, C, dtype):
    """GPU time of the two backward kernels alone over explicit tiles (graph replay): where the backward goes."""
    x = torch.randn(M, C, device="cuda", dtype=dtype)
    w = torch.ones(C, device="cuda")
    dy = torch.randn_like(x)
    _, _, mean, rstd = ln.layernorm_fwd(x, w, None, 1e-5)
    dx = torch.empty_like(x)
    res = []
    for g in (2, 4, 8):
        n = g * ln._sm_count(x.device)
        rows = triton.cdiv(triton.cdiv(M, n), ln.BWD_GROUP_ALIGN) * ln.BWD_GROUP_ALIGN
        n = triton.cdiv(M, rows)
        part = torch.empty((2, n, C), device="cuda")
        for m in (1, 2, 4, 8):
            for nw in (2, 4, 8, 16):
                def main_only():
                    ln._layernorm_bwd_kernel.fn[(n,)](x, dy, None, dx, w, mean, rstd, part[0], part[1], M, C, rows,
                                                      C, C, 0, C, HAS_DH=False, HAS_BIAS=True, BLOCK_M=m,
                                                      BLOCK_C=triton.next_power_of_2(C), num_warps=nw)
                try:
                    res.append((triton.testing.do_bench_cudagraph(main_only, return_mode="median") * 1e3, g, m, nw))
                except Exception:  # noqa: BLE001  (a tile that does not compile / spills out of resources)
                    pass
        dw, db = torch.empty(C, device="cuda"), torch.empty(C, device="cuda")
        for bc, bg, nw in ((32, 128, 4), (16, 128, 4), (16, 64, 2), (32, 64, 4), (64, 64, 4), (8, 256, 4)):
            t = triton.testing.do_bench_cudagraph(
                lambda: ln._layernorm_dwdb_kernel[(triton.cdiv(C, bc),)](part[0], part[1], dw, db, n, C,
                                                                         HAS_BIAS=True, BLOCK_G=bg, BLOCK_C=bc,
                                                                         num_warps=nw),
                return_mode="median")
            print(f"    dwdb {M}x{C} groups {g}/SM ({n}): BLOCK_C {bc} BLOCK_G {bg} w{nw}: {t * 1e3:.1f} us")
    for t, g, m, nw in sorted(res)[:8]:
        print(f"    bwd main {M}x{C}: {t:.1f} us  groups {g}/SM BLOCK_M {m} w{nw}")


def main():
    dtype = torch.bfloat16
    for M, C in ((16384, 768), (32768, 768), (4096, 8192)):
        _tuned(M, C, dtype)
        _groups_sweep(M, C, dtype)
    _bwd_sweep(16384, 768, dtype)


if __name__ == "__main__":
    main()
