"""A layout's step time, itemised, and `predict`: the planner's whole answer for one run (memory + time).

Per pp stage and micro-batch: the forward and backward GPU time of its blocks (planner.block_gpu), the head or
embedding, the weights' bf16 casts and gradient accumulation, and the exposed TP / SP (all collectives on the
critical path: tp_overlap is off by default), CP (ring: its K/V messages and dK/dV parts exposed, as measured;
Ulysses: four all-to-alls each way), EP (dispatch and combine all-to-alls) communication. The host issues each
action at planner._host_layer per block (HOST_FWD_SHARE of it in the forward), so an action takes max(GPU, host) (+
the table's host_wait_share of the smaller where an eager collective makes the host wait). Pipeline (p stages, m
micro-batches, S_i = F_i + B_i): T = m max S + (p-1) x mean unit, unit = S (1F1B, GPipe), S/v (interleaved), F
(ZB-H1: B's input half hides W), plus a p2p message a stage crossing. After the last micro-batch: data-parallel
reduction (DDP all-reduce, ZeRO-1/2 reduce-scatter + all-gather, ZeRO-3 gathers per micro-step), overlapped with the
last backward but its last bucket (the tied embedding's gradient completes last), with 30 % of the overlapped time
added to compute (notes/dp.md: the backward slows ~1 ms under ~2 ms of all-reduce against a no-communication
control), then torch's fused AdamW (29 bytes a parameter at its measured share of copy bandwidth) plus the norm's
read, and FP8's weight casts (once a step; every replay under a graph). Under a CUDA graph every micro-step adds its
weight gradients into the kept .grad (18 bytes a parameter, zeroed once a step), where eager writes the first.
"""
from __future__ import annotations

from nanopara import gpus as G
from nanopara.planner import (Run, _host_layer, _is_moe, _linear_s, block_gpu, check, fp8_linears, linear_shapes,
                              memory, stage_blocks, stage_params, wait_share)

CONTENTION = 0.3   # compute slowdown per second of overlapped collective (notes/dp.md's no-communication control)
CE_BYTES_TORCH = 68.0  # F.cross_entropy over fp32 logits, fwd+bwd, per token and vocab entry at copy bandwidth
                       # (results/bench_cross_entropy_full.txt: 13.2 ms at 16384 x 50304, H200); ours 7.3 -> 8
# share of a block's fwd + bwd host time spent issuing its forward (autograd's backward runs in C++ and issues about
# 2x the forward's kernels for less than 2x its host time): CPU proxies of the dense block, 1F1B's F 2.4 ms against
# its backward 3.5-4.1 (bench/host_zb.py) and a forward alone ~250 us of ~650-750 (notes/pp.md's recompute proxy)
HOST_FWD_SHARE = 0.37
MICRO_SHARE = 0.6  # share of the table's per-step host time that recurs every micro-step (embedding, head, loss)
# the GPU's own gap between back-to-back kernels of one stream, none of which the kernel rates hold: a graph replay
# (no host in play) of gpt2_moe, span 32.34 ms against 30.91 busy over 1,345 kernels (moe_step_profile_h100.jsonl):
# 1.07 us a kernel. Kernels a block and micro-batch (eager step profiles, less ~100 a step for AdamW, clipping, the
# embedding and loss): gpt_1b 5,401 in 4 micro-steps of 18 blocks (ckpt_async_profile_h100.jsonl) 74, gpt2_1558m
# 3,010 in 48 (recompute_h100_4.jsonl, ac none) 61: dense 67; gpt2_moe 1,176 in 6 dense + 6 MoE blocks
# (moe_step_profile_h100.jsonl, eager) leaves 112 an MoE block. Ours only: other trainers' (kernels=cudnn) counts
# are not known
KERNEL_GAP_US = 1.07
KERNELS_PER_BLOCK = {False: 67, True: 112}


def graph_adds(run: Run) -> bool:
    """Whether a CUDA-graphed step keeps .grad and adds into it: all but trainer.py's GraphedMicroStep with
    overwrite (one GPU's worth of dp x cp, no pipeline, one micro-step a step, tp_streams off: the planner's layouts
    have no tp_streams), whose backward writes each gradient whole (gpt_1b bf16 graph 0.961x -> 0.999x eager,
    results/fp8_e2e_compile_h100.txt and fp8_e2e_fused_h100.txt; gpt2_moe 32.0 -> 30.2 ms, moe_step_*_h100.txt)."""
    L = run.layout
    return L.graph and not (L.pp == 1 and L.dp * L.cp == 1 and run.accum == 1)


def _combine(gpu_s: float, host_s: float, wait: float) -> float:
    return max(gpu_s, host_s) + wait * min(gpu_s, host_s)


def micro_comm(run: Run, gpu, blocks: list[int], attn_s: float) -> dict:
    """Exposed seconds of one micro-batch's TP, CP and EP collectives on one rank (forward + backward)."""
    m, L, fab = run.model, run.layout, run.fabric
    t = L.micro_batch * run.seq // L.cp
    act = t * m.d * 2
    out = {"tp_comm": 0.0, "cp_comm": 0.0, "ep_comm": 0.0}
    if L.tp > 1:
        c = lambda kind: G.coll_time(gpu, kind, act, L.tp, 1, fab)  # noqa: E731
        per = 4 * (c("all_gather") + c("reduce_scatter")) + (0 if L.sp_keep else 2 * c("all_gather")) if L.sp \
            else 4 * c("all_reduce")
        if L.ac == "full":
            per *= 1.5  # the recomputed forward's collectives again
        out["tp_comm"] = len(blocks) * per + 2 * c("all_reduce")  # + vocab-parallel embedding and loss
    if L.cp > 1:
        n = len(blocks)
        if L.cp_impl == "ulysses":
            a2a = G.coll_time(gpu, "all_to_all", t * m.qkv_out * 2 / L.tp, L.cp, L.tp, fab)
            out["cp_comm"] = n * 2 * 2 * a2a
        else:  # (cp-1) K/V messages forward, (cp-1) K/V + (cp-1) dK/dV parts backward, all on the critical
            # path: bench_cp's step against the same step with the messages as no-ops says 1.12 / 1.16 ms a layer at
            # cp2 16k (two hosts) and 3.25 at cp4 32k, more than the messages' own 0.81 / 2.42 ms at the pair's rate
            # (results/cp_gpt_1b_16k_h100.json, cp2_16k_h100_2.txt, cp4_32k_gpt_1b_h100.json): none hides
            # (other trainers' runs, kernels=cudnn: each step's message against that step's attention, as assumed)
            kv = t * 2 * m.kv_heads * m.hd * 2 / L.tp
            msg = G.coll_time(gpu, "send_recv", kv, 2, L.tp, fab)
            if L.kernels == "cudnn":
                step = attn_s / L.cp  # one ring step's attention (fwd and bwd share attn_s as 1 : 2.5)
                msgs = max(0.0, msg - step / 3.5) + max(0.0, 2 * msg - step * 2.5 / 3.5)
            else:
                msgs = 3 * msg
            out["cp_comm"] = n * (L.cp - 1) * (msgs + 2 * gpu.latency_us * 1e-6)
    moe = sum(_is_moe(m, b) for b in blocks)
    if moe and L.ep > 1:
        a2a = G.coll_time(gpu, "all_to_all", t * m.top_k * m.d * 2 / (L.tp if L.sp else 1), L.ep, L.tp, fab)
        out["ep_comm"] = moe * 4 * a2a
    return out


def _dp(run: Run, gpu, dense: float, expert: float, window: float, first: bool) -> dict:
    """Data-parallel reduction of one step: (exposed, overlapped) seconds, and what runs after the update."""
    L, m, fab = run.layout, run.model, run.fabric
    n, ne = L.dp * L.cp, max(1, L.dp * L.cp // L.ep)
    if n == 1 and ne == 1:
        return {"exposed": 0.0, "overlapped": 0.0}
    c = lambda kind, b, k=n, st=L.tp: G.coll_time(gpu, kind, b, k, st, fab)  # noqa: E731
    g, ge = 4 * dense, 4 * expert
    if L.zero == 0:
        main = c("all_reduce", g * L.reduce_bytes / 4) + c("all_reduce", ge, ne, L.tp * L.ep)
        after = 0.0
    elif L.zero in (1, 2):
        main = c("reduce_scatter", g) * (run.accum if L.zero == 2 else 1) + c("reduce_scatter", ge, ne)
        after = c("all_gather", g) + c("all_gather", ge, ne)
    else:
        per = 2 * c("all_gather", g) + c("reduce_scatter", g) + 2 * c("all_gather", ge, ne)
        main, after = per * run.accum, 0.0
        window *= 3 * run.accum  # the gathers run under every micro-step's forward and backward
    last = c("all_reduce", min(g, 4 * m.vocab * m.d / L.tp)) if first and L.zero == 0 else 0.0
    hidden = min(main, window)
    return {"exposed": max(0.0, main - window) + last + after, "overlapped": hidden}


def _stage(run: Run, gpu, i: int, blocks: list[int]) -> dict:
    """One pp rank's micro-batch: GPU seconds by kind (forward / backward), host seconds, exposed comm."""
    m, L = run.model, run.layout
    t = L.micro_batch * run.seq // L.cp
    kinds = {"gemm": 0.0, "attention": 0.0, "memory_bound": 0.0, "recompute": 0.0, "kernel_gaps": 0.0}
    fwd = host = wait = 0.0
    for moe in (False, True):  # blocks of one kind cost the same: one evaluation each
        n = sum(_is_moe(m, b) == moe for b in blocks)
        if not n:
            continue
        blk = block_gpu(run, gpu, moe)
        fwd += n * blk["fwd_share"] * (blk["gemm"] + blk["attention"] + blk["memory_bound"])
        for k in kinds:
            kinds[k] += n * blk.get(k, 0.0)
        host += n * _host_layer(run, gpu, moe)
        if L.kernels != "cudnn":
            kinds["kernel_gaps"] += n * KERNELS_PER_BLOCK[moe] * KERNEL_GAP_US * 1e-6
        wait = max(wait, wait_share(run, gpu, moe))
    head = 0.0
    if i == L.pp - 1:  # lm_head over the (vocab / tp) shard and the loss's passes over the logits
        f, b_ = _linear_s(gpu, t, m.vocab / L.tp, m.d, False)
        ce = CE_BYTES_TORCH if L.kernels == "torch" else 8.0
        head = f + b_ + t * m.vocab / L.tp * ce / (gpu.membw_gbs["copy"] * 1e9)
    dense, expert = stage_params(run, i, blocks)
    # passes over the stage's parameters each micro-step (model.matmul_weight): autocast's bf16 weight cast, 4 + 2
    # bytes (pp: once a step, in step_time); the bf16 weight gradient cast to fp32, 2 + 4, and from the second
    # micro-step on added into .grad, 4 + 4 + 4 (the first is written in place): elementwise kernels. Under a CUDA
    # graph .grad stays allocated and every micro-step adds into it (graph.py; notes/tp.md: `add<float>` 2.4 ms of
    # a graphed tp2 step that the eager one-GPU step does not run), zeroed once a step in step_time; not where
    # the graph writes its gradients whole (graph_adds: one replay a step)
    grad_bytes = 18.0 if graph_adds(run) else 18 - 12 / run.accum
    cast = 6 if L.pp == 1 and L.optimizer != "flat" else 0  # flat.py: the matmuls read the optimizer's bf16 copy
    per_micro = (cast + grad_bytes) * (dense + expert) / (gpu.membw_gbs["elementwise"] * 1e9)
    kinds["head"], kinds["params_pass"] = head, per_micro
    fp8_w = 0.0  # each FP8 Linear quantizes its weight (and the transpose) once a step, at the mode's rate an
    if L.fp8 != "none" and gpu.fp8_linear.get(L.fp8):  # element (fp8.py weight_fp8's cache); measured: what the
        on = fp8_linears(run)  # cast adds to the FP8Linear at the table's M (1/x cast each call - 1/x reused)
        per_block = 0.0
        for name, (k, n) in linear_shapes(m, L.tp).items():
            if on[name]:
                x, xc = G.fp8_linear_speedup(gpu, L.fp8, k, n)
                per_block += sum(_linear_s(gpu, 8192, n, k, False)) * (1 / xc - 1 / x)
        fp8_w = sum(not _is_moe(m, b) for b in blocks) * per_block
    elif L.fp8 != "none" and gpu.fp8_modes.get(L.fp8, (1.0, None))[1]:
        on = fp8_linears(run)  # the Linears in FP8 (fp8_filter): their weights' elements
        lin = (on["c_attn"] * m.d * m.qkv_out + on["attn.c_proj"] * m.d * m.d +
               (on["c_fc"] * (2 if m.swiglu else 1) + on["mlp.c_proj"]) * m.d * m.ffn)
        dense_blocks = sum(not _is_moe(m, b) for b in blocks)
        fp8_w = dense_blocks * lin / L.tp * gpu.fp8_modes[L.fp8][1] * 1e-12
    comm = micro_comm(run, gpu, blocks, kinds["attention"] / max(len(blocks), 1))
    steps_host = 0.0 if (L.graph or L.kernels == "cudnn") else gpu.host["step_us"].get("dense", 0) * 1e-6
    host += MICRO_SHARE * steps_host
    gpu_s = sum(kinds.values()) + sum(comm.values())
    return {"kinds": kinds, "comm": comm, "gpu": gpu_s, "gpu_fwd": fwd + head / 3, "host": host, "wait": wait,
            "fp8_weights": fp8_w,
            "dense": dense, "expert": expert, "bwd_gpu": gpu_s - fwd - head / 3, "step_host": steps_host}


def step_time(run: Run) -> dict:
    """Seconds of one optimizer step on the slowest rank, itemised (items sum to step_s)."""
    L, gpu = run.layout, G.lookup(run.gpu)
    m, p = run.accum, L.pp
    stages = [_stage(run, gpu, i, b) for i, b in enumerate(stage_blocks(run))]
    p2p = 0.0
    if p > 1:
        act = L.micro_batch * run.seq // L.cp * run.model.d * 2 / (L.tp if L.sp else 1)
        p2p = L.virtual * G.coll_time(gpu, "send_recv", act, 2, L.tp * L.cp * L.dp, run.fabric)
    S = []
    for s in stages:
        hf = s["host"] * HOST_FWD_SHARE
        F = _combine(s["gpu_fwd"], hf, s["wait"]) + p2p
        B = _combine(s["bwd_gpu"], s["host"] - hf, s["wait"]) + p2p
        S.append((F, B))
    tot = [f + b for f, b in S]
    k = max(range(p), key=lambda i: tot[i])
    if p == 1:
        pipe, bubble = m * tot[0], 0.0
    else:
        unit = {"interleaved": [x / L.virtual for x in tot], "zb": [f for f, _ in S]}.get(L.schedule, tot)
        bubble = (p - 1) * sum(unit) / p
        pipe = m * tot[k] + bubble
    s = stages[k]
    dp = _dp(run, gpu, s["dense"], s["expert"], s["bwd_gpu"], k == 0)
    opt_params = (s["dense"] + s["expert"]) / (L.dp * L.cp if L.zero >= 1 else 1)
    # torch's fused AdamW (optim.build_adamw) at its measured share of copy; the norm's read (foreach_norm). flat.py:
    # one launch, 28 bytes a parameter + 2 for the bf16 copy, and the gradients made outside their slots copied in
    # (the tied embedding's, whose two uses leave it no slot: 8 bytes an element; the biases' are small)
    if L.optimizer == "flat":
        copied = run.model.vocab * run.model.d / L.tp if run.model.tied else 0
        opt = (30 * opt_params / gpu.adamw_flat_share + 4 * (s["dense"] + s["expert"]) + 8 * copied) / (
            gpu.membw_gbs["copy"] * 1e9)
    else:
        opt = (29 * opt_params / gpu.adamw_share + 4 * (s["dense"] + s["expert"])) / (gpu.membw_gbs["copy"] * 1e9)
    if graph_adds(run):  # the kept gradients zeroed in place (engine.zero_grad_buffers): 4 bytes written a parameter
        opt += 4 * (s["dense"] + s["expert"]) / (gpu.membw_gbs["copy"] * 1e9)
    if p > 1:
        opt += 6 * (s["dense"] + s["expert"]) / (gpu.membw_gbs["copy"] * 1e9)  # one weight cast a step
        if run.model.tied:  # the tied embedding's two halves summed between the first and last stage
            opt += G.coll_time(gpu, "all_reduce", 4 * run.model.vocab * run.model.d / L.tp, 2, L.tp * L.cp * L.dp,
                               run.fabric)
    # FP8 weights: cast once a step eagerly; a graph's replay casts them again every micro-step (graph.py bumps
    # the FP8 generation before capturing, so the capture records the casts)
    fp8_w = s["fp8_weights"] * (m if L.graph else 1)
    tail = max(opt, (1 - MICRO_SHARE) * s["step_host"])
    items = {k2: m * v for k2, v in s["kinds"].items()}
    items.update({k2: m * v for k2, v in s["comm"].items()})
    items["pp_p2p"] = 2 * m * p2p
    items["bubble"] = bubble
    gpu_sum = sum(items.values()) - bubble
    items["host_excess"] = max(0.0, pipe - bubble - gpu_sum)
    items["dp_exposed"] = dp["exposed"]
    items["dp_contention"] = CONTENTION * dp["overlapped"]
    items["optimizer"] = tail
    items["fp8_weights"] = fp8_w
    step = sum(items.values())
    return {"items": items, "step_s": step, "stage": k, "host_bound": items["host_excess"] > 0.05 * step}


def predict(run: Run, world: int | None = None) -> dict:
    """Memory and time of `run`, with tokens/s and MFU as train.py reports them."""
    check(run, world)
    gpu = G.lookup(run.gpu)
    t, mem = step_time(run), memory(run)
    tokens = run.accum * run.layout.micro_batch * run.seq * run.layout.dp
    tok_s = tokens / t["step_s"]
    mfu = run.model.flops_per_token(run.seq) * tok_s / (run.layout.world * gpu.peak_bf16)
    return {"time": t, "memory": mem, "tokens_per_step": tokens, "tokens_per_s": tok_s, "mfu": mfu,
            "step_s": t["step_s"], "peak_gb": mem["peak_alloc"] / 1e9, "reserved_gb": mem["reserved"] / 1e9,
            "fits": mem["fits"], "gpu": gpu.name}
