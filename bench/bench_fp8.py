"""FP8 on one GPU: GEMMs, quantization kernels and the FP8 linear against cuBLAS and bf16, in one run.

    python bench/bench_fp8.py [--quick] [--only gemm,quant,linear,mlp] [--accum fast|precise|both] [--out F.jsonl]
        [--linear_models gpt_1b,gpt_3b,gpt2_124m,gpt_1b_m4096] [--linear_graph]   # the linear section's models
        [--profile attn.c_proj] [--gemm_modes tensor] [--gemm_shapes c_fc,mlp.c_proj]
    python bench/bench_fp8.py --ptxas [--quick] [--json]   # no GPU: every GEMM tile and quantization kernel,
                                                           # compiled for sm_90a: registers, spills, wgmma, TMA

Sections (each prints a table; every row also goes to --out as one JSON line, stamped by bench/harness.py):
  parity  each GEMM mode against fp8_matmul_ref, every quantization kernel bit-exact against fp8_quantize_ref (GPU)
  gemm    TFLOP/s at 8192^3 and at the training GEMMs of gpt_1b (8 x 1024 tokens, C = 2048) and gpt2_124m
          (32 x 1024 tokens, C = 768): each Linear's forward (M, N, K), dgrad (M, K, N) and wgrad (N, K, M).
          Ours: tensor, row, block (1x128 x 128x128; wgrad 1x128 x 1x128). cuBLAS: bf16 torch.mm, and
          torch._scaled_mm tensorwise, rowwise and (if this torch has it) blockwise 1x128 x 128x128. Ratios: tensor
          vs cuBLAS tensorwise, row vs rowwise (goal >= 0.9x), block vs rowwise (goal >= 0.8x) and vs blockwise.
          Accumulation: fast (the forward's) by default; --accum precise compares promote-every-128 on both sides.
  quant   GB/s of each quantization kernel (bytes in + out) at the models' activation and weight shapes, and as
          % of the measured device-to-device copy bandwidth; the tiles the tuner picked (per-tensor, per-column)
  linear  FP8Linear forward + backward against the model's bf16 Linear under autocast (fp32 master weight), per
          mode, at each Linear; the weight's cast reused (micro-batches 2..) and paid every call ("+cast"); what the
          auto rule picks. --linear_graph: each replayed from a CUDA graph (FP8 with the Gluon promoted GEMMs)
  mlp     a GPT-2 MLP fwd+bwd at gpt_1b's shape (8192 x 2048 -> 8192 -> 2048, bf16 autocast): bf16, FP8 tensor as
          three ops, FP8 fused (GELU in the casts: fp8.FP8MLPFunction), fused delayed; ms, x bf16 (weight casts reused)
Timing: do_bench medians; the first use of each (shape, mode) tunes the GEMM, kept per GPU by kernels/tuning.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import harness as H

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (model, tokens per micro-step, C); its Linears (out, in): c_attn (3C, C), attn.c_proj (C, C), c_fc (4C, C),
# mlp.c_proj (C, 4C)
MODELS = [("gpt_1b", 8 * 1024, 2048), ("gpt2_124m", 32 * 1024, 768)]
# more for the linear section (--linear_models): fp8.py's auto rule was measured at gpt_1b's shapes only
MORE_LINEARS = [("gpt_3b", 8 * 1024, 3072), ("gpt_1b_m4096", 4 * 1024, 2048)]


def linears(C):
    return [("c_attn", 3 * C, C), ("attn.c_proj", C, C), ("c_fc", 4 * C, C), ("mlp.c_proj", C, 4 * C)]


def gemm_shapes(quick):
    """(label, M, N, K) of out (M, N) = A (M, K) B (N, K)^T."""
    shapes = [("square", 8192, 8192, 8192)]
    for model, M, C in MODELS[:1] if quick else MODELS:
        for name, N, K in linears(C):
            shapes.append((f"{model} {name} fwd", M, N, K))
            if not quick:
                shapes += [(f"{model} {name} dgrad", M, K, N), (f"{model} {name} wgrad", N, K, M)]
    return shapes


def _bench(fn, grad_to_none=None):
    return H.bench_ms(fn, grad_to_none=grad_to_none)


# ---------------------------------------------------------------------------------------------------------------
# operands


def _operands(M, N, K, mode, wgrad=False, a_dtype=E4M3):
    """Quantized A (M, K), B (N, K) and scales for a mode, made by our kernels from bf16 data."""
    from kernels.fp8_quant import fp8_quantize
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    if mode == "tensor":
        A, B = fp8_quantize(a, a_dtype, "tensor"), fp8_quantize(b, E4M3, "tensor")
    elif mode == "row":
        A, B = fp8_quantize(a, a_dtype, "row"), fp8_quantize(b, E4M3, "row")
    else:
        A, B = fp8_quantize(a, a_dtype, "1x128"), fp8_quantize(b, E4M3, "1x128" if wgrad else "128x128")
    return A.q, B.q, A.s, B.s


def _scaled_mm_fn(a, b, sa, sb, kind, fast):
    """A callable running torch._scaled_mm on our operands in its layout (B column-major), or a reason string."""
    M, N = a.shape[0], b.shape[0]
    bt = b.t()  # (K, N), column-major: the layout cuBLAS wants for the second operand
    if kind == "tensor":
        args = (sa.reshape(()), sb.reshape(()))
    elif kind == "row":
        args = (sa.reshape(M, 1).contiguous(), sb.reshape(1, N).contiguous())
    else:  # blockwise: A 1x128 scales (M, K/128) with stride (1, M) (ours); B's 128x128 grid given transposed
        args = (sa, sb.t())
    try:
        fn = lambda: torch._scaled_mm(a, bt, *args, out_dtype=torch.bfloat16, use_fast_accum=fast)  # noqa: E731
        fn()
        return fn
    except Exception as e:  # noqa: BLE001
        if kind == "block":  # cuBLAS wants the 128x128 grid's rows padded to a multiple of 4 K-blocks (some versions)
            kb = sa.shape[1]
            pad = torch.zeros(sb.shape[0], (kb + 3) // 4 * 4, device="cuda")
            pad[:, :kb] = sb
            try:
                fn = lambda: torch._scaled_mm(a, bt, sa, pad[:, :kb].t(), out_dtype=torch.bfloat16,  # noqa: E731
                                              use_fast_accum=fast)
                fn()
                return fn
            except Exception as e2:  # noqa: BLE001
                e = e2
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


# ---------------------------------------------------------------------------------------------------------------
# sections


def parity(out):
    from kernels.fp8_matmul import fp8_matmul_ref, fp8_matmul_triton
    from kernels.fp8_quant import GRANULARITIES, fp8_quantize
    torch.manual_seed(0)
    print("parity (GPU): quantization kernels bit-exact vs reference; GEMM max |err| / max |ref|")
    bad = 0
    for M, K in ((1031, 770), (4096, 2048)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * torch.logspace(-4, 4, K, device="cuda")
        for dt in (E4M3, E5M2):
            for pow2 in (False, True):
                for g in GRANULARITIES:
                    tr = g in ("tensor", "1x128", "128x128")
                    got = fp8_quantize(x, dt, g, pow2, transpose=tr)
                    ref = fp8_quantize(x.cpu(), dt, g, pow2, transpose=tr)
                    for name, u, v in zip(got._fields, got, ref):
                        if u is None or name == "amax":
                            continue
                        same = (torch.equal(u.cpu().view(torch.uint8), v.view(torch.uint8)) if u.element_size() == 1
                                else torch.equal(u.cpu(), v))
                        if not same:
                            bad += 1
                            print(f"  MISMATCH {M}x{K} {dt} pow2={pow2} {g} {name}")
    print(f"  quantization: {'all bit-exact' if not bad else f'{bad} mismatches'}")
    for mode, wgrad in (("tensor", False), ("row", False), ("block", False), ("block", True)):
        for M, N, K in ((1000, 1030, 1100), (8192, 2048, 2048)):
            a, b, sa, sb = _operands(M, N, K, mode, wgrad)
            bias = torch.randn(N, device="cuda")
            for fast in (True, False):
                y = fp8_matmul_triton(a, b, sa, sb, bias, torch.float32, fast_accum=fast)
                r = fp8_matmul_ref(a, b, sa, sb, bias, torch.float32)
                err = ((y - r).abs().max() / r.abs().max()).item()
                print(f"  gemm {mode}{' 1x128 B' if wgrad else ''} {M}x{N}x{K} fast_accum={fast}: {err:.2e}")
                H.append_jsonl(out, dict(section="parity", mode=mode, M=M, N=N, K=K, fast_accum=fast, rel_err=err))
    H.append_jsonl(out, dict(section="parity", quant_mismatches=bad))


def gemm(out, quick, accum, modes=("tensor", "row", "block"), only="", ws=False):
    from kernels.fp8_matmul import _scaling, fp8_matmul_ref, fp8_matmul_triton
    print(f"\n{'GEMM (M, N, K)':>34} {'bf16':>6} | {'tensor':>6} {'cuBLAS':>6} {'x':>5} | {'row':>6} {'cuBLAS':>6} "
          f"{'x':>5} | {'block':>6} {'x row':>5} {'cuBLAS':>6} {'x':>5}   (TFLOP/s)")
    fasts = {"fast": [True], "precise": [False], "both": [True, False]}[accum]
    shapes = gemm_shapes(quick and not only)
    for label, M, N, K in [s for s in shapes if not only or any(w in s[0] for w in only.split(","))]:
        wgrad = label.endswith("wgrad")
        flop = 2 * M * N * K
        tf = lambda ms: flop / ms / 1e9  # noqa: E731
        a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        t_bf16 = tf(_bench(lambda: torch.mm(a16, b16.t())))
        del a16, b16
        for fast in fasts:
            row = dict(section="gemm", shape=label, M=M, N=N, K=K, fast_accum=fast, bf16_tflops=t_bf16)
            for mode in modes:
                a, b, sa, sb = _operands(M, N, K, mode, wgrad)
                row[f"{mode}_tflops"] = tf(_bench(lambda: fp8_matmul_triton(a, b, sa, sb, None, torch.bfloat16,
                                                                              fast_accum=fast)))
                if ws and (not fast or mode == "block"):  # the Gluon kernel: each config, its error, the best
                    from kernels import fp8_matmul_ws
                    scaling = _scaling(a, b, sa, sb)
                    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                    cfgs = fp8_matmul_ws.CONFIGS["block" if scaling[0] else "precise"]
                    ts = [tf(_bench(lambda c=c: fp8_matmul_ws.launch(a, b, y, None, sa, sb, *scaling, config=c)))
                          for c in cfgs]
                    y32 = fp8_matmul_ws.launch(a, b, torch.empty(M, N, device="cuda"), None, sa, sb, *scaling)
                    r = fp8_matmul_ref(a, b, sa, sb, None, torch.float32)
                    row.update({f"{mode}_ws_tflops": max(ts), f"{mode}_ws_config": list(cfgs[ts.index(max(ts))]),
                                f"{mode}_ws_all": {str(c): t for c, t in zip(cfgs, ts)},
                                f"{mode}_ws_rel_err": ((y32 - r).abs().max() / r.abs().max()).item()})
                    del y, y32, r
                cu = _scaled_mm_fn(a, b, sa, sb, mode, fast) if not (mode == "block" and wgrad) else "1x128 B"
                if callable(cu):
                    row[f"cublas_{mode}_tflops"] = tf(_bench(cu))
                else:
                    row[f"cublas_{mode}_error"] = cu
                del a, b, sa, sb
            for mode, base in (("tensor", "tensor"), ("row", "row"), ("block", "row"), ("block", "block")):
                if f"cublas_{base}_tflops" in row:
                    row[f"{mode}_vs_cublas_{base}"] = row[f"{mode}_tflops"] / row[f"cublas_{base}_tflops"]
                if f"{mode}_ws_tflops" in row and f"cublas_{base}_tflops" in row:
                    row[f"{mode}_ws_vs_cublas_{base}"] = row[f"{mode}_ws_tflops"] / row[f"cublas_{base}_tflops"]
            for m in (m for m in modes if f"{m}_ws_tflops" in row):
                vs = row.get(f"{m}_ws_vs_cublas_{'row' if m == 'block' else m}", float("nan"))
                print(f"{'Gluon WS ' + m:>34} {row[m + '_ws_tflops']:6.0f} TFLOP/s = {vs:4.2f}x cuBLAS, "
                      f"{row[m + '_ws_tflops'] / row[m + '_tflops']:4.2f}x Triton, max err {row[m + '_ws_rel_err']:.1e}"
                      f" {row[m + '_ws_config']}")
            g = lambda k: row.get(k, float("nan"))  # noqa: E731
            print(f"{label + (' precise' if not fast else ''):>34} {t_bf16:6.0f} | {g('tensor_tflops'):6.0f} "
                  f"{g('cublas_tensor_tflops'):6.0f} {g('tensor_vs_cublas_tensor'):4.2f}x | {g('row_tflops'):6.0f} "
                  f"{g('cublas_row_tflops'):6.0f} {g('row_vs_cublas_row'):4.2f}x | {g('block_tflops'):6.0f} "
                  f"{g('block_vs_cublas_row'):4.2f}x {g('cublas_block_tflops'):6.0f} "
                  f"{g('block_vs_cublas_block'):4.2f}x")
            H.append_jsonl(out, row)
    print("goals: tensor and row >= 0.90x cuBLAS (same scaling); block >= 0.80x cuBLAS rowwise. cuBLAS blockwise: "
          "NaN = unavailable in this torch (reason in the JSON line); wgrad's 1x128 x 1x128 has no cuBLAS column")


def _copy_gbs():
    src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _bench(lambda: dst.copy_(src)) / 1e6


def _tiles_picked(fn):
    """The tiles fn's launches of the autotuned quantization kernels run: fn once, with their picks forgotten in this
    process first (kernels/tuning.py's store gives them back without timing them again; the first time, this call
    tunes). 'amax 64x256 w8, cast 128x64 w16' or 'fixed' (the rows and block kernels have fixed tiles)."""
    from kernels import fp8_quant as fq
    tuned = (("amax", fq._amax_k), ("cast", fq._cast_k))
    for _, k in tuned:
        k.cache.clear()  # FastKernel's binaries by launch key: the next launch goes through the autotuner
        k.kernel.cache.clear()  # the autotuner's picks by tuning key
    fn()
    return ", ".join(f"{name} {fq.tile_name(c)}" for name, k in tuned for c in k.kernel.cache.values()) or "fixed"


def quant(out, quick):
    from kernels import fp8_quant as fq
    copy = _copy_gbs()
    print(f"\nquantization ({torch.cuda.get_device_name()}: copy {copy:.0f} GB/s)")
    print(f"{'kernel':>34} {'shape':>14} {'us':>8} {'GB/s':>6} {'%copy':>6}  tuned tiles")
    cases = []
    for model, M, C in MODELS[:1] if quick else MODELS:
        x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4 * C, C, device="cuda") * 0.02  # fp32 master weight (c_fc)
        R, K = x.shape
        cases += [
            (f"{model} X tensor (+X^T)", (R, K), lambda x=x: fq.quantize_tensor(x, transpose=True),
             R * K * (2 + 2 + 2)),
            (f"{model} X tensor delayed (+X^T)", (R, K),
             lambda x=x: fq.quantize_tensor(x, amax=torch.ones(1, device="cuda"), transpose=True), R * K * (2 + 2)),
            (f"{model} X rows", (R, K), lambda x=x: fq.quantize_rows(x), R * K * 3),
            (f"{model} X cols (X^T)", (R, K), lambda x=x: fq.quantize_cols_t(x), R * K * (2 + 2 + 1)),
            (f"{model} X 1x128 (+X^T)", (R, K), lambda x=x: fq.quantize_1x128(x, transpose=True), R * K * 4),
            (f"{model} dY e5m2 1x128 (+dY^T)", (R, K), lambda x=x: fq.quantize_1x128(x, E5M2, transpose=True),
             R * K * 4),
            (f"{model} W fp32 128x128 (+W^T)", tuple(w.shape),
             lambda w=w: fq.quantize_128x128(w, transpose=True), w.numel() * 6),
            (f"{model} W fp32 tensor (+W^T)", tuple(w.shape),
             lambda w=w: fq.quantize_tensor(w, transpose=True), w.numel() * (4 + 4 + 2)),
        ]
    for name, shape, fn, nbytes in cases:
        tiles = _tiles_picked(fn)
        us = _bench(fn) * 1e3
        gbs = nbytes / us / 1e3
        print(f"{name:>34} {f'{shape[0]}x{shape[1]}':>14} {us:8.1f} {gbs:6.0f} {100 * gbs / copy:5.0f}%  {tiles}")
        H.append_jsonl(out, dict(section="quant", kernel=name, shape=list(shape), us=us, gbs=gbs,
                                 pct_copy=100 * gbs / copy, copy_gbs=copy, tiles=tiles))
    print("bytes = what must move: input reads (2 for the two-pass kernels), fp8 outputs (2 with the transpose); "
          "scales not counted; tuned tiles: BLOCK_M x BLOCK_K, warps (kernels/fp8_quant.py)")


def _graph_replay(fn, params, fresh=None):
    """fn (a fwd+bwd) captured in a CUDA graph after three eager runs on a side stream; returns the replay. The
    .grads then live in the graph and each replay adds into them (the same add for bf16 and FP8). fresh: called just
    before the capture (FP8State.step: the capture records the weight's cast, so every replay pays it)."""
    for p in params:
        p.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if fresh is not None:
        fresh()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def linear(out, quick, names="", profile="", graph=False):
    """names: comma-separated models of MODELS + MORE_LINEARS (default: gpt_1b with --quick, else MODELS).
    profile: comma-separated Linear names (e.g. attn.c_proj): one tensor-mode fwd+bwd of each, profiled.
    graph: every fwd+bwd replayed from a CUDA graph, FP8 with recipe.ws (as train.py's graphed FP8 steps run):
    the GPU's time without the host's launches, what the auto rule must be measured by for graphed steps."""
    from nanopara.fp8 import FP8Linear, FP8Recipe, FP8State
    from nanopara.fp8_filter import auto_gains
    from nanopara.model import Linear
    print(f"\n{'FP8Linear fwd+bwd (M, N, K)':>34} {'bf16 ms':>8} | " + " | ".join(
        f"{m:>6} ms {'x':>5} {'+cast x':>7}" for m in ("tensor", "row", "block")) + " | auto rule")
    known = {m[0]: m for m in MODELS + MORE_LINEARS}
    for model, M, C in [known[n] for n in names.split(",")] if names else MODELS[:1] if quick else MODELS:
        for name, N, K in linears(C):
            torch.manual_seed(0)
            base = Linear(K, N).to("cuda")
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

            def step(lin, state=None):
                if state is not None:
                    state.step()
                with H.amp("cuda")():
                    y = lin(x)
                y.backward(dy)
            params = [x, base.weight, base.bias]  # grads set to None before each call: no accumulation adds
            t16 = _bench(_graph_replay(lambda: step(base), params)) if graph else _bench(lambda: step(base), params)
            row = dict(section="linear", model=model, linear=name, M=M, N=N, K=K, bf16_ms=t16, graph=graph)
            cells = []
            for mode in ("tensor", "row", "block"):
                state = FP8State(FP8Recipe(mode=mode, ws=graph))
                lin = FP8Linear.from_linear(base, state)
                step(lin)  # tune
                if graph:
                    t = _bench(_graph_replay(lambda: step(lin), params))
                    tc = _bench(_graph_replay(lambda: step(lin), params, fresh=state.step))
                    state.step()  # the cast that capture cached lived in that graph's pool: cast again when next used
                else:
                    t = _bench(lambda: step(lin), params)
                    tc = _bench(lambda: step(lin, state), params)
                row.update({f"{mode}_ms": t, f"{mode}_speedup": t16 / t, f"{mode}_cast_speedup": t16 / tc})
                if name in profile.split(",") and mode == "tensor":  # where the time of a slow row goes
                    for label, fn in (("bf16", lambda: step(base)), ("tensor", lambda: step(lin))):
                        s = H.kernel_summary(H.profile(fn, "cuda"), top=12)
                        print(H.summary_lines(s, f"{model} {name} {label} fwd+bwd"), flush=True)
                        row[f"profile_{label}"] = s
                cells.append(f"{t:9.3f} {t16 / t:4.2f}x {t16 / tc:6.2f}x")
            # what fp8.py's train.fp8_filter=auto picks here, and '!' where this row's measurement disagrees
            auto = [m for m in ("tensor", "row", "block") if auto_gains(m, K, N, M)]
            row["auto_fp8"] = auto
            flags = "".join("!" if (row[f"{m}_speedup"] > 1) != (m in auto) else "" for m in ("tensor", "row", "block"))
            print(f"{f'{model} {name} ({M}, {N}, {K})':>34} {t16:8.3f} | " + " | ".join(cells) +
                  f" | {','.join(auto) or 'bf16'} {flags}")
            H.append_jsonl(out, row)
    print("x = bf16 ms / fp8 ms with the weight cast reused (micro-batches 2.. of a step); +cast x: cast every call;"
          " auto rule: the modes fp8.py's fp8_filter=auto puts in FP8 here, '!' where the x column disagrees")


def mlp(out, device="cuda", M=8 * 1024, C=2048):
    """The mlp section (gpt_1b's MLP by default; tests/test_fp8_mlp.py runs it on CPU at a tiny shape, the kernels
    in the interpreter: its times mean nothing there)."""
    import torch.nn.functional as F

    from nanopara.fp8 import FP8Linear, FP8Recipe, FP8State
    from nanopara.model import Linear, TorchOps
    torch.manual_seed(0)
    fc, proj = Linear(C, 4 * C).to(device), Linear(4 * C, C).to(device)
    x = torch.randn(M, C, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, C, device=device, dtype=torch.bfloat16)
    interpret = torch.device(device).type != "cuda"
    variants = [("bf16", False, fc, proj)]
    for name, recipe, fused in (("FP8 tensor, three ops", FP8Recipe(), False), ("FP8 tensor fused", FP8Recipe(), True),
                                ("FP8 tensor fused delayed", FP8Recipe(delayed=True), True)):
        state = FP8State(recipe, interpret)
        variants.append((name, fused, FP8Linear.from_linear(fc, state), FP8Linear.from_linear(proj, state)))

    def step(fused, a, b):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):  # the trainer's on a GPU, and here
            y = TorchOps.mlp(x, a, b) if fused else b(F.gelu(a(x), approximate="tanh"))
        y.backward(dy)
        return y.grad_fn.name()
    params = [x, fc.weight, fc.bias, proj.weight, proj.bias]  # grads set to None before each call
    print(f"\nMLP fwd+bwd ({M} tokens, {C} -> {4 * C} -> {C}, fp32 master weights)")
    t16 = None
    for name, fused, a, b in variants:
        last = step(fused, a, b)  # tunes; delayed: the histories' first (current-scaled) call
        assert fused == last.startswith("FP8MLPFunction"), f"{name}: y came from {last}"
        t = H.bench_ms(lambda: step(fused, a, b), device, reps=1, grad_to_none=params)  # reps: CPU only
        t16 = t16 or t
        print(f"{name:>28} {t:8.3f} ms {t16 / t:5.2f}x bf16")
        H.append_jsonl(out, dict(section="mlp", variant=name, M=M, C=C, hidden=4 * C, ms=t, x_bf16=t16 / t))
    print("weights' FP8 casts reused (micro-batches 2.. of a step); fused: g = gelu(h) and dh = dg gelu'(h) are made "
          "inside the casts, never written (notes/fp8.md)")


# ---------------------------------------------------------------------------------------------------------------
# --ptxas: what every candidate compiles to on sm_90a, no GPU needed


def ptxas_report(quick=False, log=sys.stdout):
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import fp8_matmul as fm
    from kernels import fp8_quant as fq
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def build(fn, sig, consts, warps, stages, divisible):
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        src = ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = c.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                                 text=True, check=True).stderr
        # ptxas C7514 / C7515: every wgmma serialised; C7517: a wait it injected before a read of a wgmma's result
        waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx)
        return dict(regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                    waits={n: waits.count(n) for n in sorted(set(waits))}, serialised="C7514" in log or "C7515" in log,
                    injected_wait="C7517" in log,
                    spill_bytes=int(re.search(r"(\d+) bytes spill stores", log).group(1)), smem=c.metadata.shared,
                    wgmma=ptx.count("wgmma.mma_async"), tma_ops=ptx.count("cp.async.bulk.tensor"),
                    nan_minmax=ptx.count("max.NaN") + ptx.count("min.NaN"), trans=c.asm["ttgir"].count("tt.trans"),
                    vector_stores=ptx.count("st.global.v4.b32") + ptx.count("st.global.v2.b32"))

    rows = []
    mm = fm._fp8_matmul_kernel.fn
    sig = dict(A="*fp8e4nv", B="*fp8e4nv", C="*bf16", BIAS="*fp32", SA="*fp32", SB="*fp32", M="i32", N="i32",
               K="i32", M_BUCKET="i32", stride_am="i32", stride_bn="i32", stride_cm="i32", stride_sam="i32",
               stride_sak="i32", stride_sbn="i32", stride_sbk="i32")
    div = [n for n, t in sig.items() if t.startswith("*")] + ["N", "K", "stride_am", "stride_bn", "stride_cm"]
    modes = [("tensor", False, 1, True, "*fp8e4nv", "*bf16"), ("tensor precise", False, 1, False, "*fp8e5", "*fp32"),
             ("block 128x128", True, 128, True, "*fp8e4nv", "*bf16"), ("block 1x128", True, 1, True, "*fp8e5", "*fp32")]
    for name, block_scaled, b_rows, fast, a_ty, c_ty in modes:
        tiles = [t for t in fm._TILES if (not block_scaled or t[2] == fq.BLOCK) and fm.tile_fits(
            *t, block_scaled or not fast, block_scaled and b_rows == 1, 4 if c_ty == "*fp32" else 2)]
        for m, n, k, stages, warps in tiles[:1] if quick else tiles:  # quick: the first candidate of each mode
            for tma in (True,) if quick else (True, False):
                consts = dict(BLOCK_SCALED=block_scaled, B_SCALE_ROWS=b_rows, HAS_BIAS=True, TMA=tma,
                              FAST_ACCUM=fast, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, PERSISTENT=True)
                r = build(mm, dict(sig, A=a_ty, C=c_ty), consts, warps, stages, div)
                rows.append(dict(kernel=f"gemm {name} {m}x{n}x{k} s{stages} w{warps}{' tma' if tma else ''}", **r))
                waits = " ".join(f"{w}:{c}" for w, c in r["waits"].items())  # N: count of wait_group N
                print(f"{rows[-1]['kernel']:>52}: {r['regs']:3d} regs, spills {r['spill_bytes']:4d} B, "
                      f"smem {r['smem']:6d} B, wgmma {r['wgmma']}, TMA ops {r['tma_ops']}, wait_group {waits}"
                      f"{', SERIALISED by ptxas' if r['serialised'] else ''}"
                      f"{', ptxas injected a wait' if r['injected_wait'] else ''}", file=log, flush=True)
    fmt = dict(FP8_MAX=448.0, MANT=3, BIAS=7, POW2=True, SOFT=False)
    qsig = dict(X="*bf16", H="*bf16", Q="*fp8e4nv", QT="*fp8e4nv", S="*fp32", ST="*fp32", AMAX="*fp32", AMAX_OUT="*i32",
                CSUM="*fp32", M="i32", K="i32", M_BUCKET="i32", stride_xm="i32", stride_qm="i32", stride_qtk="i32",
                stride_sm="i32", stride_sk="i32", stride_stk="i32", stride_stm="i32")
    # the autotuned per-tensor / per-column kernels: every candidate tile with each flag set the launchers use
    # (quick: the cast with q, q^T and RECORD, whose persistent walk spilled first)
    def cast(**f):
        return {**dict(WRITE_Q=True, WRITE_QT=True, RECORD=False, COLSUM=False, PROLOGUE=0), **f, **fmt}
    flag_sets = [("cast tensor +T +record", fq._cast_kernel, cast(PER_COL=False, RECORD=True), {}),
                 ("cast tensor +T +record +colsum", fq._cast_kernel, cast(PER_COL=False, RECORD=True, COLSUM=True),
                  {}),
                 ("cast tensor +T", fq._cast_kernel, cast(PER_COL=False), {}),
                 ("cast tensor q only", fq._cast_kernel, cast(PER_COL=False, WRITE_QT=False), {}),
                 ("cast tensor +T fp32 in", fq._cast_kernel, cast(PER_COL=False), {"X": "*fp32"}),
                 ("cast per column (T)", fq._cast_kernel, cast(PER_COL=True, WRITE_Q=False), {}),
                 ("cast per column (T) +colsum", fq._cast_kernel, cast(PER_COL=True, WRITE_Q=False, COLSUM=True), {}),
                 ("amax per tensor", fq._amax_kernel, dict(PER_COL=False, PROLOGUE=0, SOFT=False), {"AMAX": "*i32"}),
                 ("amax per column", fq._amax_kernel, dict(PER_COL=True, PROLOGUE=0, SOFT=False), {"AMAX": "*i32"}),
                 # the FP8 MLP's casts with the GELU folded in (kernels/fp8_prologue.py): forward g, backward dh
                 ("amax gelu", fq._amax_kernel, dict(PER_COL=False, PROLOGUE=1, SOFT=False), {"AMAX": "*i32"}),
                 ("cast gelu +T", fq._cast_kernel, cast(PER_COL=False, PROLOGUE=1), {}),
                 ("cast gelu +T +record", fq._cast_kernel, cast(PER_COL=False, PROLOGUE=1, RECORD=True), {}),
                 ("amax gelu bwd", fq._amax_kernel, dict(PER_COL=False, PROLOGUE=2, SOFT=False), {"AMAX": "*i32"}),
                 ("cast gelu bwd +T +colsum", fq._cast_kernel, cast(PER_COL=False, PROLOGUE=2, COLSUM=True), {}),
                 ("cast gelu bwd +T +record +colsum", fq._cast_kernel,
                  cast(PER_COL=False, PROLOGUE=2, RECORD=True, COLSUM=True), {})]
    quants = [(f"{name} {fq.tile_name(cfg)}", tuned.fn, {**flags, **cfg.kwargs}, over, cfg.num_warps,
               cfg.num_stages) for name, tuned, flags, over in (flag_sets[:1] if quick else flag_sets)
              for cfg in tuned.configs]
    quants += [("rows 8192", fq._rows_kernel, dict(**fmt, BLOCK_M=1, BLOCK_K=8192), {}, 8, 3),
               ("1x128", fq._blocks_kernel, dict(TILE_SCALE=False, WRITE_QT=False, COLSUM=False, **fmt, BLOCK_M=64,
                                                  BLOCK_K=128), {}, fq.WARPS, 3),
               ("1x128 +T", fq._blocks_kernel, dict(TILE_SCALE=False, WRITE_QT=True, COLSUM=False, **fmt, BLOCK_M=128,
                                                     BLOCK_K=128), {}, fq.BLOCK_WARPS, 3),
               ("1x128 +T +colsum", fq._blocks_kernel, dict(TILE_SCALE=False, WRITE_QT=True, COLSUM=True, **fmt,
                                                             BLOCK_M=128, BLOCK_K=128), {}, fq.BLOCK_WARPS, 3),
               ("128x128 +T fp32 in", fq._blocks_kernel, dict(TILE_SCALE=True, WRITE_QT=True, COLSUM=False, **fmt,
                                                               BLOCK_M=128, BLOCK_K=128), {"X": "*fp32"},
                fq.BLOCK_WARPS, 3)]
    for name, fn, consts, over, warps, stages in quants:
        s = {n: {**qsig, **over}[n] for n in fn.arg_names if n not in consts}
        r = build(fn, s, consts, warps, stages, list(s))  # model shapes: every size and stride a multiple of 16
        rows.append(dict(kernel=f"quant {name}", **r))
        print(f"{rows[-1]['kernel']:>66}: {r['regs']:3d} regs, spills {r['spill_bytes']:4d} B, smem {r['smem']:6d} B",
              file=log, flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8192^3 and gpt_1b's forward GEMMs only")
    p.add_argument("--only", default="parity,gemm,quant,linear,mlp", help="comma-separated sections")
    p.add_argument("--accum", default="fast", choices=("fast", "precise", "both"), help="GEMM accumulation")
    p.add_argument("--gemm_modes", default="tensor,row,block", help="gemm section: scalings to time")
    p.add_argument("--gemm_shapes", default="", help="gemm section: shape labels containing any of these "
                   "(e.g. 'c_fc,mlp.c_proj': fwd, dgrad and wgrad of both; overrides --quick's forward-only list)")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--linear_models", default="", help="linear section: e.g. gpt_1b,gpt_3b,gpt2_124m,gpt_1b_m4096")
    p.add_argument("--profile", default="", help="linear section: Linear names to profile, e.g. attn.c_proj")
    p.add_argument("--linear_graph", action="store_true", help="linear section: fwd+bwd replayed from CUDA graphs, "
                   "FP8 through the Gluon promoted GEMMs (graphed training steps' path)")
    p.add_argument("--ws", action="store_true", help="gemm section: also kernels/fp8_matmul_ws.py (Gluon, "
                   "warp-specialised) on the precise and block rows, each config")
    p.add_argument("--ptxas", action="store_true", help="compile the kernels for sm_90a (no GPU) and report")
    p.add_argument("--json", action="store_true", help="--ptxas: one JSON list on stdout (the table on stderr)")
    args = p.parse_args()
    if args.ptxas:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise SystemExit("--ptxas compiles real kernels: run it without TRITON_INTERPRET=1")
        rows = ptxas_report(args.quick, sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(rows))
        H.append_jsonl(args.out, rows)
        return
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (CPU: pytest tests/test_fp8.py; --ptxas compiles without one)")
    print(H.banner("bench_fp8 " + args.only), flush=True)
    out = args.out
    sections = args.only.split(",")
    t0 = time.time()
    if "parity" in sections:
        parity(out)
    if "gemm" in sections:
        gemm(out, args.quick, args.accum, tuple(args.gemm_modes.split(",")), args.gemm_shapes, args.ws)
    if "quant" in sections:
        quant(out, args.quick)
    if "linear" in sections:
        linear(out, args.quick, args.linear_models, args.profile, args.linear_graph)
    if "mlp" in sections:
        mlp(out)
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
