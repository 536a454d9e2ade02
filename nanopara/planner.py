"""Peak memory and step time of one layout, itemised: the arithmetic of plan.py and `train.py --plan`.

Model: GPT-2 as nanopara builds it (LayerNorm, GELU MLP of 4C, tied wte, learned positions, fp32 residual stream)
or a modern dense shape (grouped-query KV heads, SwiGLU width, untied head, rotary: `Model(kv_heads=, ffn=,
swiglu=True, tied=False, positions=0)`), optionally MoE (E experts, top-k, every `moe_every`-th block).
Memory per GPU (the fullest pipeline stage), bytes: parameters / gradients / AdamW states by ZeRO stage (Rajbhandari
et al.: 16Psi, 8Psi + 8Psi/N, 4Psi + 12Psi/N, 16Psi/N over the dp x cp ranks), autocast's bf16 weight copies,
activations per block and micro-batch in units of tokens x C bytes (recompute.py's accounting: 36 none, 24
selective, 6 full for GPT-2; tp shards the matmul parts, sp everything; Korthikanti et al. 2022) times the
micro-batches in flight (1F1B: p - i on stage i, GPipe m, interleaved Megatron's warm-up count, ZB-H1 p), the
loss's logits, one block's backward workspace, communication buffers, and the caching allocator's slack.
Step time: GEMMs at the GPU table's TFLOP/s for their shape class (FP8: each scaling mode's measured GEMM rate and
quantization time an element), MoE's expert MLP at the grouped MLP's measured rate for its rows an expert,
attention at its kernel's rate, memory-bound bytes at elementwise GB/s, the optimizer, each axis's
communication (TP/SP and ring/Ulysses CP and EP exposed,
DP overlapped with the last backward but its last bucket), the pipeline bubble from the stages' action times, and
a host floor: every micro-batch takes max(GPU, host) where the host issues each block's kernels at the table's
us per block for this layout's variant (eager; a CUDA graph replays for ~nothing). Tokens/s and MFU as train.py
counts them (report.flops_per_token). Tables: nanopara/gpus.py; checks against results/: nanopara/plan_check.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from nanopara import gpus as G

GB = 1e9


class PlanError(ValueError):
    """A layout or model the planner cannot take: one line, the way out in it."""


@dataclass
class Model:
    name: str = "custom"
    n_layer: int = 12
    d: int = 768                 # residual width C
    n_head: int = 12
    kv_heads: int = 0            # 0: = n_head (multi-head attention)
    ffn: int = 0                 # MLP width; 0: 4C
    vocab: int = 50304           # padded vocabulary
    swiglu: bool = False
    tied: bool = True            # GPT-2 ties wte and lm_head
    positions: int = 1024        # learned position rows (0: rotary)
    norm_params: int = 2         # LayerNorm weight + bias (RMSNorm: 1)
    bias: bool = True
    experts: int = 0
    top_k: int = 2
    moe_every: int = 2
    expert_ffn: int = 0          # each routed expert's MLP width (model.moe_hidden); 0: = ffn
    shared: int = 0              # shared experts of width expert_ffn per MoE layer (model.moe_shared): replicated

    def __post_init__(self):
        self.kv_heads = self.kv_heads or self.n_head
        self.ffn = self.ffn or 4 * self.d
        self.expert_ffn = self.expert_ffn or self.ffn

    @property
    def hd(self) -> int:
        return self.d // self.n_head

    @property
    def qkv_out(self) -> int:
        return self.d + 2 * self.kv_heads * self.hd

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.n_layer) if i % self.moe_every == self.moe_every - 1) if self.experts else 0

    def mlp_params(self, ffn: int = 0) -> int:
        ffn = ffn or self.ffn
        return (3 if self.swiglu else 2) * self.d * ffn + (ffn + self.d if self.bias else 0)

    def moe_dense_params(self) -> int:
        """An MoE layer's parameters outside its routed experts: the router and the shared experts' MLP."""
        return self.d * self.experts + (self.mlp_params(self.shared * self.expert_ffn) if self.shared else 0)

    def attn_params(self) -> int:
        return self.d * self.qkv_out + self.d * self.d + (self.qkv_out + self.d if self.bias else 0)

    def params(self, active: bool = False) -> int:
        dense_mlp = self.mlp_params()
        expert = (self.top_k if active else self.experts) * self.mlp_params(self.expert_ffn) + self.moe_dense_params()
        mlps = (self.n_layer - self.moe_layers) * dense_mlp + self.moe_layers * expert
        blocks = self.n_layer * (self.attn_params() + 2 * self.norm_params * self.d) + mlps
        embed = self.vocab * self.d * (1 if self.tied else 2) + self.positions * self.d
        return blocks + embed + self.norm_params * self.d

    def flops_per_token(self, seq: int) -> float:
        """report.flops_per_token: 6N (active, positions excluded) + 12 L C T."""
        return 6 * (self.params(active=True) - self.positions * self.d) + 12 * self.n_layer * self.d * seq

    @staticmethod
    def from_config(m, name: str = "") -> "Model":
        return Model(name=name or "custom", n_layer=m.n_layer, d=m.n_embd, n_head=m.n_head, vocab=m.padded_vocab,
                     positions=m.block_size, bias=m.bias, experts=m.moe_experts, top_k=m.moe_top_k,
                     moe_every=m.moe_every, expert_ffn=m.moe_hidden, shared=m.moe_shared)


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"       # gpipe | 1f1b | interleaved | zb
    virtual: int = 1
    pp_layers: tuple = ()        # blocks per chunk in model order; () = even
    micro_batch: int = 1
    ac: str = "none"             # none | selective | full
    fp8: str = "none"
    fp8_filter: str = "auto"     # auto: the Linears fp8_filter.auto_gains picks (train.py's default) | all | globs
    graph: bool = False          # CUDA graph replay (no host floor)
    kernels: str = "triton"      # triton (ours) | torch | cudnn (other trainers: cuDNN attention, no host floor)
    cp_impl: str = "ring"
    sp_keep: bool = False
    reduce_bytes: int = 4        # DDP gradient all-reduce dtype
    optimizer: str = "torch"     # torch (fused AdamW) | flat (flat.py: one launch, the bf16 weights written by it)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("dp", self.dp),
                                        ("ep", self.ep)) if v > 1] or ["1 GPU"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.virtual})" if self.virtual > 1 else ""))
        parts += [f"zero{self.zero}"] * (self.zero > 0) + ["sp"] * self.sp + [f"ac={self.ac}"] * (self.ac != "none")
        parts += [f"fp8={self.fp8}"] * (self.fp8 != "none") + ["graph"] * self.graph
        parts += ["flat"] * (self.optimizer == "flat")
        return " ".join(parts) + f" b{self.micro_batch}"


@dataclass
class Run:
    model: Model
    layout: Layout
    seq: int = 1024
    tokens_per_step: int = 0     # 0: one micro-batch on every dp rank
    gpu: str = "H100"
    fabric: dict = field(default_factory=lambda: dict(G.FABRIC))

    @property
    def accum(self) -> int:
        L = self.layout
        return max(1, self.tokens_per_step // (L.micro_batch * self.seq * L.dp)) if self.tokens_per_step else 1


def check(run: Run, world: int | None = None) -> None:
    """One clear line for a layout that does not divide the model, the GPUs or the batch."""
    m, L, s = run.model, run.layout, run.seq
    if world is not None and L.world != world:
        raise PlanError(f"dp*tp*pp*cp = {L.dp}*{L.tp}*{L.pp}*{L.cp} = {L.world} does not match {world} GPUs")
    for what, n in (("heads", m.n_head), ("MLP width", m.ffn), ("padded vocabulary", m.vocab)):
        if n % L.tp:
            raise PlanError(f"tp={L.tp} does not divide the model's {what} ({n})")
    if m.kv_heads % L.tp and L.tp % m.kv_heads:
        raise PlanError(f"tp={L.tp} and the {m.kv_heads} KV heads: one must divide the other")
    if m.n_layer < L.pp * L.virtual:
        raise PlanError(f"pp*virtual = {L.pp * L.virtual} chunks for {m.n_layer} blocks: each chunk needs one")
    if L.pp_layers and (len(L.pp_layers) != L.pp * L.virtual or sum(L.pp_layers) != m.n_layer):
        raise PlanError(f"pp_layers {L.pp_layers} must give {L.pp * L.virtual} chunks summing to {m.n_layer}")
    if L.cp > 1 and s % (2 * L.cp):
        raise PlanError(f"cp={L.cp} cuts each sequence into 2*cp chunks: seq {s} is not divisible by {2 * L.cp}")
    if L.sp and (s // L.cp) % L.tp:
        raise PlanError(f"sp: the {s // L.cp} tokens a cp rank holds are not divisible by tp={L.tp}")
    tokens = L.micro_batch * s * L.dp
    if run.tokens_per_step % tokens:
        raise PlanError(f"the batch of {run.tokens_per_step} tokens is not a multiple of micro_batch*seq*dp = "
                        f"{L.micro_batch}*{s}*{L.dp} = {tokens}")
    if L.pp > 1 and L.zero >= 2:
        raise PlanError(f"zero={L.zero} with pp={L.pp}: nanopara pipelines take ZeRO-0/1 (parallel.zero<=1)")
    if m.experts and (m.experts % L.ep or (L.dp * L.cp) % L.ep):
        raise PlanError(f"ep={L.ep} must divide the {m.experts} experts and dp*cp = {L.dp * L.cp}")
    if L.ep > 1 and not m.experts:
        raise PlanError(f"ep={L.ep} needs an MoE model (experts > 0)")


# ----------------------------------------------------------------------------------------------------------------
# what each pipeline rank holds

def stage_blocks(run: Run) -> list[list[int]]:
    """Per pp rank, the block indices of its chunks (rank i holds chunks i, i+p, ...: interleaved order)."""
    m, L = run.model, run.layout
    n = L.pp * L.virtual
    sizes = list(L.pp_layers) or [m.n_layer // n + (i < m.n_layer % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [[b for c in range(i, n, L.pp) for b in range(starts[c], starts[c] + sizes[c])] for i in range(L.pp)]


def _is_moe(m: Model, b: int) -> bool:
    return bool(m.experts) and b % m.moe_every == m.moe_every - 1


def stage_params(run: Run, i: int, blocks: list[int]) -> tuple[float, float]:
    """(dense params, expert params) on one rank of pp stage i: matmuls / tp, experts / ep (whole per tp rank)."""
    m, L = run.model, run.layout
    moe = sum(_is_moe(m, b) for b in blocks)
    dense = len(blocks) * (m.attn_params() / L.tp + 2 * m.norm_params * m.d) + (len(blocks) - moe) * \
        m.mlp_params() / L.tp + moe * m.moe_dense_params()
    experts = moe * m.experts // L.ep * m.mlp_params(m.expert_ffn)
    if i == 0:
        dense += m.vocab * m.d / L.tp + m.positions * m.d
    if i == L.pp - 1:
        dense += m.norm_params * m.d + (m.vocab * m.d / L.tp if (not m.tied or L.pp > 1) else 0)
    return dense, experts


def in_flight(run: Run, i: int) -> float:
    """Micro-batches whose activations stage i holds at its peak (per chunk-layer: interleaved counts chunks)."""
    L, m = run.layout, run.accum
    if L.pp == 1:
        return 1
    if L.schedule == "gpipe":
        return m
    if L.schedule == "zb":
        return min(L.pp, m)
    if L.schedule == "interleaved":
        chunks = min(m * L.virtual, (L.pp - i - 1) * 2 + (L.virtual - 1) * L.pp + 1)
        return chunks / L.virtual
    return min(L.pp - i, m)


def act_coef(run: Run, moe: bool) -> float:
    """Bytes a block keeps for backward per token of the rank's micro-batch, over C (recompute.py's accounting)."""
    m, L = run.model, run.layout
    tp, f = L.tp, m.ffn / m.d
    if L.ac == "full":
        return 6 / (tp if L.sp else 1)
    ln_in = 8.0
    on = fp8_linears(run)  # FP8 Linears keep their inputs quantized (1 byte), the others bf16
    size = {name: 1.0 if f else 2.0 for name, f in on.items()}
    lin_in = size["attn.c_proj"]
    ln_out = size["c_attn"] + size["c_fc"]
    mlp_out_b = size["mlp.c_proj"]
    mlp_in, mlp_out = (4 * f, mlp_out_b * f) if m.swiglu else (2 * f, mlp_out_b * f)  # GELU in / out; SwiGLU
    if moe:  # k permuted rows and their hidden; the shared experts' MLP (width shared x expert_ffn, whole on each
        fe, fs = m.expert_ffn / m.d, m.shared * m.expert_ffn / m.d  # tp rank) its GELU's input and output as dense's
        mlp_in, mlp_out = m.top_k * (2 + 2 * fe) + 2 * fs, m.top_k * 2 * fe + mlp_out_b * fs
    if L.ac == "selective":
        ln_out, mlp_out = 0.0, 0.0
    sharded = 2 * m.qkv_out / m.d + lin_in + (mlp_in + mlp_out if not moe else 0)
    replicated = ln_in + ln_out + (mlp_in + mlp_out if moe else 0)
    lse = 4 * m.n_head / m.d
    return (replicated + sharded) / tp + lse / tp if L.sp else replicated + (sharded + lse) / tp


# ----------------------------------------------------------------------------------------------------------------
# memory

# Ring attention's glue (K/V stacks, the packed-qkv gradient's cat, mixed-dtype adds of the dK/dV parts, casts:
# strided, non-vectorised kernels), bytes-equivalent at the elementwise rate per ring step, token of the rank and C:
# the "other" kernels of a cp step beyond 1/cp of the one-GPU step's, gpt_1b at 16k on H100: cp2 176.1 - 114.6 / 2
# ms for 4 micro-steps (results/cp2_16k_h100_2.jsonl, notes/cp.md) = 118 bytes, cp4 30.0 - 28.7 / 4 ms for one
# (cp4_16k_h100_2.jsonl) = 91 bytes; their mean
RING_GLUE = 104.0
SLACK = 0.07     # caching allocator: reserved over allocated (2 MB block rounding, cached free blocks); assumed
CONTEXT_GB = 1.0  # CUDA context + NCCL buffers, outside torch's counters; assumed


def memory(run: Run) -> dict:
    """Peak bytes on the fullest GPU, itemised; `peak_alloc` (torch's max allocated), `reserved`, `fits`."""
    m, L, gpu = run.model, run.layout, G.lookup(run.gpu)
    tok = L.micro_batch * run.seq // L.cp
    nd, nde = L.dp * L.cp, max(1, L.dp * L.cp // L.ep)
    best = None
    for i, blocks in enumerate(stage_blocks(run)):
        dense, expert = stage_params(run, i, blocks)
        # one device, one micro-step: gradients are handed over as autograd makes them, after the activations'
        # peak (recompute.py's rows: peak = states less 4 Psi + activations); flat buffers otherwise (engine.py)
        held = L.world > 1 or run.accum > 1
        states = {"params": 4 * (dense / nd if L.zero == 3 else dense) + 4 * (expert / nde if L.zero == 3 else expert),
                  "grads": held * sum(4 * (p if L.zero <= 1 else p / n) for p, n in ((dense, nd), (expert, nde))),
                  "optimizer": 8 * (dense + expert) if L.zero == 0 else 8 * (dense / nd + expert / nde)}
        unit = 2 * 4 * (m.attn_params() + m.mlp_params()) / L.tp
        weights16 = 2 * (dense + expert) if L.zero < 3 else unit  # FP8: the e4m3 weight and its transpose, as many
        n_moe = sum(_is_moe(m, b) for b in blocks)
        acts = in_flight(run, i) * tok * m.d * ((len(blocks) - n_moe) * act_coef(run, False) +
                                                  (n_moe and n_moe * act_coef(run, True)))
        # one block's backward workspace: the MLP hidden's gradient (an MoE block: the k routed rows' at the experts'
        # width, or the shared experts' MLP if wider) and a few C-wide buffers
        hidden = max(m.top_k * m.expert_ffn, m.shared * m.expert_ffn) if m.experts else m.ffn / L.tp
        work = tok * (4 * hidden + 8 * m.d)
        if L.ac == "full":
            work += tok * m.d * act_coef(replace(run, layout=replace(L, ac="none")), False)
        logits = 0.0
        if i == L.pp - 1:
            # ours: bf16 logits, the gradient written in place; F.cross_entropy(logits.float()): + the fp32 copy,
            # its log-softmax and that one's gradient (4 + 4 + 4 bytes)
            logits = tok * m.vocab / L.tp * (2 if L.kernels != "torch" else 14)
        comm = 0.0
        if L.zero == 2:
            comm += 2 * 2 * 25e6
        if L.sp:
            comm += 2 * tok * m.d * 2
        if L.cp > 1:
            comm += 4 * tok * m.kv_heads * m.hd * 2 / L.tp
        items = {**states, "weights_bf16": weights16, "activations": acts, "logits": logits,
                 "workspace": work, "comm_buffers": comm}
        alloc = sum(items.values())
        if best is None or alloc > best["peak_alloc"]:
            best = {"stage": i, "items": items, "peak_alloc": alloc}
    best["items"]["allocator_slack"] = SLACK * best["peak_alloc"]
    best["reserved"] = best["peak_alloc"] * (1 + SLACK)
    best["capacity"] = gpu.mem_gb * GB
    best["fits"] = best["reserved"] + CONTEXT_GB * GB <= best["capacity"]
    return best


# ----------------------------------------------------------------------------------------------------------------
# time

def _gemm_s(gpu, M, N, K, dtype="bf16", scale=1.0) -> float:
    if M <= 0 or N <= 0 or K <= 0:
        return 0.0
    tf = gpu.gemm_tflops[dtype if dtype in gpu.gemm_tflops and gpu.gemm_tflops[dtype] else "bf16"]
    return 2 * M * N * K / (tf[G.gemm_class(M, N, K)] * 1e12 * scale)


def _linear_s(gpu, t, n, k, fp8: bool, scale=1.0) -> tuple[float, float]:
    """(forward, backward) seconds of a Linear over t rows, k -> n: the forward GEMM, then dgrad and wgrad."""
    dt = "fp8" if fp8 else "bf16"
    return _gemm_s(gpu, t, n, k, dt, scale), _gemm_s(gpu, t, k, n, dt, scale) + _gemm_s(gpu, n, k, t, dt, scale)


def linear_shapes(m: Model, tp: int) -> dict:
    """A dense block's four Linears as (K in, N out) on one tp rank (its shard)."""
    return {"c_attn": (m.d, m.qkv_out / tp), "attn.c_proj": (m.d / tp, m.d),
            "c_fc": (m.d, (2 if m.swiglu else 1) * m.ffn / tp), "mlp.c_proj": (m.ffn / tp, m.d)}


def fp8_linears(run: Run) -> dict:
    """Which of a dense block's four Linears run FP8: all (fp8_filter=all), those its globs match (as module names:
    transformer.h.0.attn.c_attn, ...), or those auto_gains picks at their tp shard's shape and the rank's tokens."""
    from fnmatch import fnmatch
    from nanopara.fp8_filter import auto_gains
    L, tokens = run.layout, run.layout.micro_batch * run.seq // run.layout.cp
    globs = [g.strip() for g in L.fp8_filter.split(",") if g.strip()]

    def pick(name, k, n):
        if L.fp8_filter == "auto":
            return auto_gains(L.fp8, int(k), int(n), tokens)
        module = {"c_attn": "attn.c_attn", "c_fc": "mlp.c_fc"}.get(name, name)
        return L.fp8_filter == "all" or any(fnmatch(f"transformer.h.0.{module}", g) for g in globs)
    return {name: L.fp8 != "none" and pick(name, k, n) for name, (k, n) in linear_shapes(run.model, L.tp).items()}


def block_gpu(run: Run, gpu, moe: bool) -> dict:
    """GPU seconds of one block's forward and backward for one micro-batch on one rank, by kind."""
    m, L = run.model, run.layout
    s = run.seq // L.cp
    t, tp = L.micro_batch * s, L.tp
    on = fp8_linears(run)
    fp8 = any(on.values())
    sh = {name: (n, k) for name, (k, n) in linear_shapes(m, tp).items()}
    lin, mlp = [sh["c_attn"], sh["attn.c_proj"]], [sh["c_fc"], sh["mlp.c_proj"]]
    lin_on, mlp_on = [on["c_attn"], on["attn.c_proj"]], [on["c_fc"], on["mlp.c_proj"]]
    mode = gpu.fp8_modes.get(L.fp8, (1.0, None)) if fp8 else (1.0, None)  # GEMM rate / tensorwise, ps an element
    measured = fp8 and gpu.fp8_linear.get(L.fp8)  # the whole FP8Linear's measured speed-up over bf16, casts in
    def linear(n, k, f):  # noqa: E306
        if f and measured:
            x = G.fp8_linear_speedup(gpu, L.fp8, k, n)[0]
            return tuple(s / x for s in _linear_s(gpu, t, n, k, False))
        return _linear_s(gpu, t, n, k, f, mode[0] if f else 1.0)
    gemm = [linear(n, k, f) for (n, k), f in zip(lin, lin_on)]
    if moe:  # experts whole on each tp rank (sp: its own tokens; ep: the rows routed to its E/ep experts): the
        rows = t * m.top_k / (tp if L.sp else 1)  # grouped MLP, epilogues and bias gradients in, at its measured
        fw = 2 * rows * (3 if m.swiglu else 2) * m.expert_ffn * m.d  # rate for this many rows an expert
        tf = G.grouped_tflops(gpu, rows * L.ep / m.experts) * 1e12
        gemm += [(fw / tf, 2 * fw / tf), _linear_s(gpu, t, m.experts, m.d, False)]
        ts, hs = t // (tp if L.sp else 1), m.shared * m.expert_ffn  # shared experts: dense GEMMs, whole per rank
        gemm += [_linear_s(gpu, ts, n, k, False) for n, k in ((hs, m.d), (m.d, hs))] if m.shared else []
    else:
        gemm += [linear(n, k, f) for (n, k), f in zip(mlp, mlp_on)]
    fwd = sum(g[0] for g in gemm)
    bwd = sum(g[1] for g in gemm)
    attn_flops = 2 * L.micro_batch * (m.n_head / tp) * s * (s * L.cp) * m.hd * 3.5  # causal: 1/cp of 2bHS^2D
    if L.kernels in ("torch", "cudnn"):  # SDPA's flash backend; other trainers' cuDNN attention
        key = {"torch": "sdpa_", "cudnn": "cudnn_"}[L.kernels] + ("64" if m.hd < 128 else "128")
        attn = attn_flops / (gpu.attention_tflops.get(key, gpu.attention_tflops["128"]) * 1e12)
    else:  # ours at the sequence length (ring attention: the whole sequence's), as the model calls it
        attn = attn_flops / (G.attention_tflops(gpu, m.hd, s * L.cp) * 1e12)
    f = m.ffn / m.d
    rep, shd = 58.0, 36.0 + 34.0 * f / 4  # bytes/token/C, fwd+bwd: LayerNorms and residual; MLP act, bias grads
    if L.kernels == "torch":  # eager LayerNorm ~1.9x our bytes (results/bench_layernorm.txt), unfused residual
        rep += 96.0           # adds and the LayerNorm outputs' casts (notes/e2e.md)
    if moe:  # the MLP's activation and bias passes are inside the grouped MLP's measured time
        shd -= 34.0 * f / 4
    mem_bytes = t * m.d * ((rep + shd) / tp if L.sp else rep + shd / tp)
    if moe:  # permute, unpermute, fwd and bwd (results/moe_h100.txt section 3: 75-88 % of copy bandwidth)
        mem_bytes += t * m.top_k * m.d * 2 * 8
    if L.cp > 1 and L.cp_impl == "ring" and L.kernels != "cudnn":  # our ring's glue (RING_GLUE)
        mem_bytes += L.cp * t * m.d * RING_GLUE / (tp if L.sp else 1)
    memb = mem_bytes / (gpu.membw_gbs["elementwise"] * 1e9)
    fp8_lin = [nk for nk, f in zip(lin + ([] if moe else mlp), lin_on + ([] if moe else mlp_on)) if f]
    if fp8 and not measured:  # each FP8 Linear quantizes its X and dY (and transposes) once a micro-batch: at the
        memb += (t * sum(n + k for n, k in fp8_lin) * mode[1] * 1e-12 if mode[1] is not None else  # mode's time an
                 t * m.d * 96 / tp * len(fp8_lin) / 4 / (gpu.membw_gbs["elementwise"] * 1e9))  # element, or 96 B a C
    out = {"gemm": fwd + bwd, "attention": attn, "memory_bound": memb, "fwd_share": (fwd + attn / 3.5) /
           max(fwd + bwd + attn, 1e-12)}
    if L.ac == "full":
        out["recompute"] = fwd + attn / 3.5 + memb / 3
    elif L.ac == "selective":
        out["recompute"] = memb / 6
    return out


def _variants(run: Run, moe: bool) -> list[str]:
    """The host table's variants this block runs (each calibrated alone against "dense")."""
    L = run.layout
    v = ["torch_kernels" if L.kernels == "torch" else "dense"]
    v += ["ac_full"] * (L.ac == "full") + ["ac_selective"] * (L.ac == "selective")
    v += ["fp8_tensor"] * any(fp8_linears(run).values())
    v += ["moe"] * moe + [("tp2_sp" if L.sp else "tp2")] * (L.tp > 1) + ["ep2"] * (moe and L.ep > 1)
    v += ["zero3"] * (L.zero == 3) + ["dp2"] * (L.zero < 3 and L.dp * L.cp > 1) + ["pp2"] * (L.pp > 1)
    return v + ["zb"] * (L.schedule == "zb" and L.pp > 1) + ["cp2"] * (L.cp > 1)


def wait_share(run: Run, gpu, moe: bool) -> float:
    """How much of a block's GPU time the host waits for instead of running ahead (0: max(GPU, host); 1: their
    sum): a host sync in the block (bench_calibrate counts them per variant), or an eager collective or send/recv
    that blocks the host (its probe in the comm section)."""
    if run.layout.graph or run.layout.kernels == "cudnn":
        return 0.0
    L, syncs = run.layout, gpu.host.get("syncs_per_layer", {})
    w = max([min(1.0, syncs.get(v, 0.0)) for v in _variants(run, moe)])
    if L.tp > 1 or (moe and L.ep > 1) or L.cp_impl == "ulysses" and L.cp > 1:
        w = max(w, gpu.host_wait_share)
    if L.pp > 1 or L.cp > 1:
        w = max(w, gpu.p2p_host_wait_share)
    return w


def _host_layer(run: Run, gpu, moe: bool) -> float:
    """Host seconds to issue one block's forward + backward for one micro-batch: the table's us for the base
    variant plus each active variant's difference to it (calibrated one at a time by bench_calibrate.py)."""
    L, h = run.layout, gpu.host["layer_us"]
    v = [f"fp8_{L.fp8}" if k == "fp8_tensor" and f"fp8_{L.fp8}" in h else k for k in _variants(run, moe)]
    share = sum(fp8_linears(run).values()) / 4  # the FP8 variant was calibrated with all four Linears in FP8
    us = h[v[0]] + sum((h.get(k, h["dense"]) - h["dense"]) * (share if k.startswith("fp8_") else 1) for k in v[1:])
    if L.cp > 2:
        us += (L.cp - 2) * (h.get("cp2", h["dense"]) - h["dense"])  # ring steps grow with cp
    return 0.0 if L.graph or L.kernels == "cudnn" else us * 1e-6
