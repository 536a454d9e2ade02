"""MoE on one GPU: grouped GEMM, permute / unpermute, the MoE layer fwd + bwd against PyTorch, the training step.

    python bench/bench_moe.py [--quick] [--out F.jsonl]     (~4 minutes on an H100, autotuning included)
    python bench/bench_moe.py --sections=step [--step-profile] [--out F.jsonl]   (5. only: gpt2_moe's step)
    python bench/bench_moe.py --smoke                       (CPU, Triton interpreter, tiny shapes: the script runs)

GPT-2 124M width (C = 768, experts C -> 4C -> C), E = 8 experts, top-2, bf16; every ratio is against a baseline
timed in the same run on the same GPU. Sections:
1. parity  the Triton MoE layer (bf16 autocast) against the fp32 per-expert loop: max error / max |ref| of y, dx
           and each parameter grad, beside the PyTorch sorted path's bf16 error (tests/test_moe.py's gpu test)
2. gemm    grouped GEMM fwd / dgrad / wgrad TFLOP/s at R = 16384 (gpt2_moe's step: 8 x 1024 tokens, top-2) and
           65536 rows (--gemm-rows), c_fc (N=3072, K=768) and c_proj (N=768, K=3072), balanced and skewed groups
           (expert e's share ~ 1/(e+1)^1.5: 48% to one expert), against one dense cuBLAS GEMM of the same FLOPs and
           torch._grouped_mm; goal (issue #44): >= 1.05x _grouped_mm. Where TMA runs (sm_90+, the interpreter under
           --smoke; --no-tma skips it) the TMA kernels too (`triton_tma`; `triton` = pointer kernels)
3. moves   route / permute / unpermute fwd and bwd: ms, GB/s and % of the measured copy bandwidth, against
           PyTorch's index ops on the same order. Goal: >= 80% of copy
4. layer   the MoE layer fwd + bwd (router, aux losses, dispatch, experts, combine) at B*T = 16384 and 32768
           tokens: triton vs the per-expert loop, the sorted-index PyTorch path, and sorted + torch._grouped_mm
           (and triton_tma); speedup over the loop (goal >= 3x), TFLOP/s of its expert GEMMs, its time over those
           GEMMs' alone (`grouped_mlp` on the sorted rows: the dispatch)
5. step    (--sections=step) train.py's step of gpt2_moe, micro-batch 8 x 1024, eager vs train.cuda_graph=true,
           capacity 1.0 and dropless: ms, tok/s, MFU on active parameters, peak GB, last loss (equal in both modes)
JSON lines (one per row, stamped by bench/harness.py) go to --out; tables to stdout.
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

import harness as H
from kernels import grouped_gemm as gg
from kernels import moe_route as mr
from nanopara.moe import MoEConfig, MoEMLP


def copy_bandwidth(device):
    if device != "cuda":
        return float("nan")
    return mr._copy_bandwidth()


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


# ----------------------------------------------------------------------------------------------------------------
# 1. parity


def layer_fwd_bwd(m, x, impl, dtype):
    """One forward + backward of an MoE layer through `impl`: returns [y, dx, grads of the parameters]."""
    m.impl = impl
    m.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_()
    with H.amp(x.device, "bf16" if dtype == torch.bfloat16 else "fp32")():
        y = m(xl)
    y.backward(torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y).to(y.dtype))
    return [y.detach()] + [xl.grad] + [p.grad.clone() for p in m.parameters()]


def parity(args):
    torch.manual_seed(0)
    m = MoEMLP(MoEConfig(n_embd=args.C, moe_experts=args.E, moe_top_k=args.k)).to(args.device)
    x = torch.randn(2, args.tokens_small // 2, args.C, device=args.device)
    ref = layer_fwd_bwd(m, x, "loop", torch.float32)
    rows = []
    names = ["y", "dx"] + [n for n, _ in m.named_parameters()]
    for impl in ("sorted", "triton") + (("triton_tma",) if args.tma else ()):
        flag = gg.TMA
        gg.TMA = impl == "triton_tma"  # the triton layer with its fwd / dgrad / wgrad GEMMs through the TMA kernels
        try:
            got = layer_fwd_bwd(m, x, "triton" if impl == "triton_tma" else impl, args.dtype)
        finally:
            gg.TMA = flag
        rows.append(dict(section="parity", impl=impl, **{n: max_rel(a, b) for n, a, b in zip(names, got, ref)}))
    print(f"\n1. parity: max error / max |fp32 loop ref| at {x.shape[0] * x.shape[1]} tokens, {args.dtype_name}")
    print(f"{'impl':>10} " + " ".join(f"{n.split('.')[-2][:6] + '.' + n.split('.')[-1][:1] if '.' in n else n:>9}"
                                      for n in names))
    for r in rows:
        print(f"{r['impl']:>10} " + " ".join(f"{r[n]:9.1e}" for n in names))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 2. grouped GEMM, 3. permute / unpermute


def tma_rows(args):
    """Whether the TMA kernel gets rows (gemm, layer), printing why not where it does not."""
    if args.no_tma:
        print("TMA rows skipped: --no-tma")
        return False
    ok, why = gg.tma_supported(torch.device(args.device))
    if not ok:
        print(f"TMA rows skipped: {why}")
    return ok


def _wgrad_db(dy, x, offs, mma):
    """grouped_wgrad with the bias gradient, through the TMA kernel, db summed on the tensor cores or not."""
    keep, gg.WGRAD_DB_MMA = gg.WGRAD_DB_MMA, mma
    try:
        return gg.grouped_wgrad(dy, x, offs, bias=True, tma=True)
    finally:
        gg.WGRAD_DB_MMA = keep


def bench_gemm(R, E, N, K, skew, dtype, device, timer, tma=False):
    """TFLOP/s rows of fwd / dgrad / wgrad (ours), torch._grouped_mm (where it exists) and one dense cuBLAS GEMM of
    the same FLOPs, at R rows over E groups, w (E, N, K). `timer(fn)` -> ms. tma: also fwd / dgrad / wgrad through
    the TMA kernels (impl "triton_tma"; the caller checks tma_supported), and its wgrad with the bias gradient
    (triton_tma_db, triton_tma_db_mma: db on the CUDA / tensor cores); "triton" is the pointer kernels. Rows
    get vs_dense and vs_grouped_mm (time of that baseline / this time: > 1 is faster)."""
    torch.manual_seed(0)
    offs = gg.offsets_of(gg.group_sizes(R, E, skew), device)
    x = torch.randn(R, K, device=device, dtype=dtype)
    w = torch.randn(E, N, K, device=device, dtype=dtype) / K ** 0.5
    dy = torch.randn(R, N, device=device, dtype=dtype)
    wd = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
    flops = 2 * R * N * K
    cases = {
        ("fwd", "triton"): lambda: gg.grouped_fwd(x, w, None, offs, tma=False),
        ("fwd", "dense_cublas"): lambda: x @ wd.t(),
        ("dgrad", "triton"): lambda: gg.grouped_dgrad(dy, w, offs, tma=False),
        ("dgrad", "dense_cublas"): lambda: dy @ wd,
        ("wgrad", "triton"): lambda: gg.grouped_wgrad(dy, x, offs, bias=False, tma=False),
        ("wgrad", "dense_cublas"): lambda: dy.t() @ x,
    }
    if tma:
        cases[("fwd", "triton_tma")] = lambda: gg.grouped_fwd(x, w, None, offs, tma=True)
        cases[("dgrad", "triton_tma")] = lambda: gg.grouped_dgrad(dy, w, offs, tma=True)
        cases[("wgrad", "triton_tma")] = lambda: gg.grouped_wgrad(dy, x, offs, bias=False, tma=True)
        cases[("wgrad", "triton_tma_db")] = lambda: _wgrad_db(dy, x, offs, False)  # + the bias gradient
        cases[("wgrad", "triton_tma_db_mma")] = lambda: _wgrad_db(dy, x, offs, True)
    gmm = getattr(torch, "_grouped_mm", None)
    if gmm is not None:
        ends = offs[1:]
        wt = w.transpose(-2, -1)  # (E, K, N) column-major view, the layout _grouped_mm wants for its B
        cases[("fwd", "torch_grouped_mm")] = lambda: gmm(x, wt, offs=ends)
        cases[("dgrad", "torch_grouped_mm")] = lambda: gmm(dy, w, offs=ends)
        cases[("wgrad", "torch_grouped_mm")] = lambda: gmm(dy.t(), x, offs=ends)  # (E, N, K): groups along R
    rows = []
    for (op, impl), fn in cases.items():
        row = dict(op=op, impl=impl, R=R, E=E, N=N, K=K, skew=skew)
        try:
            ms = timer(fn)
        except Exception as exc:  # noqa: BLE001  (a baseline this torch lacks: report it, keep the table)
            rows.append(dict(row, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        rows.append(dict(row, ms=ms, tflops=flops / ms / 1e9))
    for base, field in (("dense_cublas", "vs_dense"), ("torch_grouped_mm", "vs_grouped_mm")):
        ms = {r["op"]: r["ms"] for r in rows if r["impl"] == base and "ms" in r}
        for r in rows:
            if "ms" in r and r["op"] in ms:
                r[field] = ms[r["op"]] / r["ms"]  # > 1: faster than that baseline
    return rows


def gemm(args, timer):
    rows = []
    tma = args.tma
    print(f"\n2. grouped GEMM, R = {args.gemm_rows} rows over E = {args.E} groups ({args.dtype_name}); TFLOP/s, x "
          "dense = time of the dense cuBLAS GEMM of equal FLOPs / this time, x gmm = time of torch._grouped_mm / "
          "this time")
    impls = ["triton"] + (["triton_tma", "triton_tma_db", "triton_tma_db_mma"] if tma else [])
    print(f"{'R':>6} {'shape':>10} {'skew':>9} {'op':>6} " + " ".join(f"{n:>20}" for n in impls) +
          f" {'_grouped_mm':>14} {'dense cuBLAS':>12}")
    for R, (N, K, shape), skew in itertools.product(args.gemm_rows, ((4 * args.C, args.C, "c_fc"),
                                                                      (args.C, 4 * args.C, "c_proj")), args.skews):
        res = bench_gemm(R, args.E, N, K, skew, args.dtype, args.device, timer, tma=tma)
        rows += [dict(r, section="gemm", shape=shape) for r in res]
        by = {(r["op"], r["impl"]): r for r in res}
        for op in ("fwd", "dgrad", "wgrad"):
            def cell(impl, width=14):
                r = by.get((op, impl))
                if r is None or "ms" not in r:
                    return f"{'n/a' if r is None else 'error':>{width}}"
                if impl == "dense_cublas":
                    return f"{r['tflops']:{width}.0f}"
                text = f"{r['tflops']:5.0f} {r['vs_dense']:5.2f}x"
                if impl.startswith("triton"):  # x _grouped_mm too ('-' where torch lacks it)
                    gm = r.get("vs_grouped_mm")
                    text += f" {gm:5.2f}x" if gm is not None else f" {'-':>6}"
                return f"{text:>{width}}"
            print(f"{R:>6} {shape:>10} {skew:>9} {op:>6} " + " ".join(cell(n, 20) for n in impls) +
                  f" {cell('torch_grouped_mm')} {cell('dense_cublas', 12)}")
    errors = [r for r in rows if "error" in r]
    for r in errors[:3]:
        print(f"  {r['impl']} {r['op']}: {r['error']}")
    return rows


def moves(args, timer, copy_gbs):
    rows = []
    print(f"\n3. routing and row moves ({args.dtype_name}, E = {args.E}, k = {args.k}); copy bandwidth "
          f"{copy_gbs:.0f} GB/s")
    print(f"{'tokens':>7} {'op':>14} {'triton ms':>10} {'GB/s':>6} {'%copy':>6} {'torch ms':>9} {'GB/s':>6} "
          f"{'speedup':>8}")
    for N in args.tokens:
        res = mr.bench_moves(N, args.C, args.E, args.k, args.dtype, copy_gbs, args.device, timer)
        rows += [dict(r, section="moves") for r in res]
        by = {(r["op"], r["impl"]): r for r in res}
        for op in ("route", "permute", "unpermute", "permute_bwd", "unpermute_bwd"):
            t, p = by[(op, "triton")], by[(op, "torch")]
            print(f"{N:>7} {op:>14} {t['ms']:10.4f} {t['gbs']:6.0f} {t['pct_copy']:5.0f}% {p['ms']:9.4f} "
                  f"{p['gbs']:6.0f} {p['ms'] / t['ms']:7.2f}x")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 4. the layer


def layer(args, timer):
    rows = []
    gmm_ok = hasattr(torch, "_grouped_mm")
    impls = ["loop", "sorted"] + (["grouped_mm"] if gmm_ok else []) + ["triton"] + \
        (["triton_tma"] if args.tma else [])
    C, E, k = args.C, args.E, args.k
    print(f"\n4. MoE layer fwd + bwd (C = {C}, E = {E}, top-{k}, dropless, {args.dtype_name} autocast; router, aux "
          "losses and dispatch included)")
    print(f"{'tokens':>7} {'impl':>11} {'ms':>9} {'vs loop':>8} {'TFLOP/s':>8} {'/GEMMs':>7}")
    for N in args.tokens:
        torch.manual_seed(0)
        m = MoEMLP(MoEConfig(n_embd=C, moe_experts=E, moe_top_k=k)).to(args.device)
        x = torch.randn(N, C, device=args.device, dtype=args.dtype).requires_grad_()
        dy = torch.randn(N, C, device=args.device, dtype=args.dtype)
        flops = 3 * 2 * (2 * N * k * C * 4 * C)  # the expert GEMMs: fwd + dgrad + wgrad of c_fc and c_proj

        # the expert GEMMs alone, on this routing's sorted rows (what the layer would cost with free dispatch)
        r = mr.route_triton(m.router_logits(x.detach()), k)
        xs = mr.permute_fwd(x.detach(), r.dest, r.rows).requires_grad_()
        dys = torch.randn(r.rows, C, device=args.device, dtype=args.dtype)
        w = m.experts.params()

        def gemms_only():
            gg.grouped_mlp_triton(xs, *w, r.offsets).backward(dys)
        t_gemm = timer(gemms_only)
        res = {}
        for impl in impls:
            m.impl = "triton" if impl == "triton_tma" else impl

            def step():
                with H.amp(args.device, "bf16" if args.dtype == torch.bfloat16 else "fp32")():
                    y = m(x)
                y.backward(dy)
            flag = gg.TMA
            gg.TMA = impl == "triton_tma"  # the module flag: the layer's fwd / dgrad / wgrad GEMMs take TMA kernels
            try:
                res[impl] = timer(step)
            except Exception as exc:  # noqa: BLE001  (e.g. _grouped_mm unsupported here: report, keep the table)
                rows.append(dict(section="layer", impl=impl, tokens=N, error=f"{type(exc).__name__}: {exc}"[:200]))
                print(f"{N:>7} {impl:>11} error: {rows[-1]['error']}")
            finally:
                gg.TMA = flag
        for impl, ms in res.items():
            row = dict(section="layer", impl=impl, tokens=N, C=C, E=E, k=k, ms=ms, speedup_vs_loop=res["loop"] / ms,
                       tflops=flops / ms / 1e9, over_gemms=ms / t_gemm)
            rows.append(row)
            print(f"{N:>7} {impl:>11} {ms:9.3f} {row['speedup_vs_loop']:7.2f}x {row['tflops']:8.1f} "
                  f"{row['over_gemms']:6.2f}x")
        rows.append(dict(section="layer", impl="grouped_mlp_only", tokens=N, ms=t_gemm, tflops=flops / t_gemm / 1e9))
        print(f"{N:>7} {'GEMMs only':>11} {t_gemm:9.3f} {'':>8} {flops / t_gemm / 1e9:8.1f}")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 5. the training step


def train_step(args):
    """train.py's step (parallelize -> Trainer) eager and graphed, per capacity: one row each, then the ratios."""
    from nanopara.mesh import Mesh
    from nanopara.report import flops_per_token
    mesh = Mesh.build(device=args.device)
    preset = "tiny_moe" if args.smoke else args.step_preset
    B, T = args.step_batch, args.step_seq
    print(f"\n5. training step, {preset}, one device, micro-batch {B} x {T} ({args.dtype_name} autocast), "
          f"{args.step_warmup} warm-up + {args.step_steps} timed steps; MFU on the active parameters")
    print(f"{'capacity':>9} {'mode':>11} {'ms':>8} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GB':>8} "
          f"{'loss':>9}")
    rows = []
    for cap, opt, graph in [(c, o, g) for c in args.step_capacities for o in args.step_optimizers
                            for g in ((False, True) if args.device == "cuda" else (False,))]:  # a graph needs CUDA
        cfg = H.make_cfg(preset, {"train.micro_batch": B, "train.seq_len": T, "model.moe_capacity": cap,
                                  "train.cuda_graph": "true" if graph else "false", "train.optimizer": opt})
        trainer, n_params = H.build_trainer(cfg, mesh)
        batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)
        t = H.timed(lambda: H.train_step(trainer, batches), args.step_steps, args.step_warmup, mesh=mesh,
                    each=True, peak_from_start=graph)
        tps = B * T * trainer.accum / t["median_s"]
        row = dict(section="step", preset=preset, capacity=cap, mode="graph" if graph else "eager", optimizer=opt,
                   micro_batch=B, seq_len=T, step_ms=t["median_s"] * 1e3, tokens_per_s=tps,
                   tflops=flops_per_token(cfg.model, n_params, T) * tps / 1e12, active_params=n_params,
                   mfu=H.mfu(cfg, n_params, tps, 1, mesh.device), peak_gb=t["peak_gb"],
                   loss_last=t["last"].item())
        rows.append(row)
        mode = row["mode"] + ("" if opt == "torch" else "+" + opt)
        print(f"{cap:>9} {mode:>11} {row['step_ms']:8.2f} {tps:10,.0f} {row['tflops']:8.1f} "
              f"{row['mfu']:6.1%} {row['peak_gb']:8.1f} {row['loss_last']:9.5f}")
        if args.step_profile:  # one more step under the profiler: where the step's GPU time goes, by kind
            # the row keeps 80 kernels (the many small ones of "other" too), the printout the top 25
            row.update(H.kernel_summary(H.profile(lambda: H.train_step(trainer, batches), mesh.device), top=80))
            print(H.summary_lines({**row, "top_kernels_ms": row["top_kernels_ms"][:25]},
                                  f"capacity {cap} {mode}"))
        trainer.close()
        del trainer, batches
        H.free()
    by = {(r["capacity"], r["mode"], r["optimizer"]): r for r in rows}
    for cap, opt in [(c, o) for c in args.step_capacities for o in args.step_optimizers]:
        if (cap, "graph", opt) in by:
            e, g = by[(cap, "eager", opt)], by[(cap, "graph", opt)]
            ratio = dict(section="step", capacity=cap, optimizer=opt, graph_over_eager=e["step_ms"] / g["step_ms"],
                         loss_rel_diff=abs(g["loss_last"] - e["loss_last"]) / abs(e["loss_last"]))
            rows.append(ratio)
            print(f"capacity {cap} {opt}: graph {ratio['graph_over_eager']:.3f}x eager, last loss rel. diff "
                  f"{ratio['loss_rel_diff']:.1e}")
        if opt != "torch" and (cap, "graph", "torch") in by and (cap, "graph", opt) in by:
            a, b = by[(cap, "graph", "torch")], by[(cap, "graph", opt)]
            rows.append(dict(section="step", capacity=cap, optimizer=opt, over_torch_graph=a["step_ms"] / b["step_ms"]))
            print(f"capacity {cap}: graphed {opt} {a['step_ms'] / b['step_ms']:.3f}x graphed torch AdamW")
    return rows


# ----------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the layer at 32768 tokens only")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (checks the script)")
    p.add_argument("--sections", default="parity,gemm,moves,layer", help="any of parity,gemm,moves,layer,step")
    p.add_argument("--step-capacities", default="1.0,0", help="step: model.moe_capacity values (0: dropless)")
    p.add_argument("--step-optimizers", default="torch", type=lambda s: s.split(","),
                   help="step: train.optimizer values, each a row (torch,flat: flat.py against torch's fused AdamW)")
    p.add_argument("--step-preset", default="gpt2_moe", help="step: the MoE preset (gpt2_moe, gpt2_moe_fine)")
    p.add_argument("--step-steps", type=int, default=20, help="step: timed steps per row")
    p.add_argument("--step-warmup", type=int, default=10, help="step: untimed steps (autotuning, the capture)")
    p.add_argument("--step-profile", action="store_true",
                   help="step: a profiled step per row (kernel kinds, top 25; 80 in --out)")
    p.add_argument("--gemm-rows", default="16384,65536",
                   help="gemm: rows R (tokens x top-k; 16384 is gpt2_moe's step at 8 x 1024)")
    p.add_argument("--no-tma", action="store_true", help="no rows for the grouped GEMM's TMA kernel")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args(argv)
    args.E, args.k = 8, 2
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        args.device, args.dtype, args.C, args.tokens, args.tokens_small = "cpu", torch.float32, 16, [40], 40
        args.skews = ["skewed"]
        args.step_batch, args.step_seq = 2, 32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs a CUDA GPU (or --smoke on CPU)")
        args.device, args.dtype, args.C = "cuda", torch.bfloat16, 768
        args.tokens = [32768] if args.quick else [16384, 32768]
        args.tokens_small = 4096
        args.skews = ["balanced", "skewed"]
        args.step_batch, args.step_seq = 8, 1024
    args.step_capacities = [float(c) for c in args.step_capacities.split(",")]
    args.gemm_rows = ([max(args.tokens) * args.k] if args.smoke else
                      [int(r) for r in args.gemm_rows.split(",")])
    args.dtype_name = str(args.dtype).split(".")[-1]
    return args


def main(argv=None):
    args = parse(argv)
    timer = lambda fn: H.bench_ms(fn, args.device, reps=1)  # noqa: E731
    print(H.banner(f"bench_moe C={args.C} E={args.E} top-{args.k} {args.dtype_name}"
                   + (" (Triton interpreter)" if args.smoke else "")), flush=True)
    sections = args.sections.split(",")
    args.tma = tma_rows(args)
    rows = []
    if "parity" in sections:
        rows += parity(args)
    if "gemm" in sections:
        rows += gemm(args, timer)
    if "moves" in sections:
        rows += moves(args, timer, copy_bandwidth(args.device))
    if "layer" in sections:
        rows += layer(args, timer)
    if "step" in sections:
        rows += train_step(args)
    H.append_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
