"""GPT-2, single device: learned positions, pre-LN blocks, GELU(tanh), tied wte/lm_head, padded vocab.

This file never imports torch.distributed. Parallelism is applied from outside by parallel.parallelize (tp.py
replaces Linear layers and `loss_fn`; an engine of engine.py owns the optimizer and the gradient sync). Hot ops go
through `kernels/` when `model.kernels` resolves to "triton" (CUDA tensors); "torch" uses the strongest PyTorch
ops (SDPA, F.layer_norm, F.cross_entropy) — the baseline.

Names follow GPT-2's own (`wte`, `wpe`, `h.N.ln_1`, `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`,
`ln_f`) so OpenAI/Hugging Face checkpoints map one to one (`from_hf_state_dict` / `to_hf_state_dict`).

Shapes: B batch, T sequence, C = n_embd, nh heads, hs = C // nh, V vocab, Vp padded vocab.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanopara.config import ModelConfig
from nanopara.moe import MoEMLP, active_params  # moe.py imports nothing of nanopara: no cycle


def split_qkv(qkv, n_head):
    """Packed projection (B, T, 3*nh*hs), columns [q heads | k heads | v heads] -> q, k, v: (B, nh, T, hs) views."""
    B, T, _ = qkv.shape
    return qkv.view(B, T, 3, n_head, -1).permute(2, 0, 3, 1, 4).unbind(0)


# ----------------------------------------------------------------------------------------------------------------
# op tables: one place decides which implementation of each hot op the model uses

class TorchOps:
    """PyTorch's best eager ops; with torch.compile this is the baseline our kernels must beat."""

    @staticmethod
    def attention_qkv(qkv, n_head):  # packed (B, T, 3*nh*hs) -> (B, nh, T, hs)
        q, k, v = split_qkv(qkv, n_head)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def layernorm(x, ln):
        return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps)

    @staticmethod
    def add_layernorm(x, residual, ln):  # h = x + residual; returns (LN(h), h)
        h = x + residual
        return F.layer_norm(h, (h.shape[-1],), ln.weight, ln.bias, ln.eps), h

    @staticmethod
    def cross_entropy(logits, targets, n_vocab):  # logits (N, Vp), targets (N,), -1 = ignore
        return F.cross_entropy(logits[:, :n_vocab].float(), targets, ignore_index=-1)

    @staticmethod
    def mlp(x, c_fc, c_proj):  # c_proj(gelu_tanh(c_fc(x)))
        fused = getattr(c_fc, "fused_mlp", None)  # FP8 tensor mode: GELU folded into the casts (nanopara/fp8.py)
        y = fused(x, c_proj) if fused is not None else None
        return c_proj(F.gelu(c_fc(x), approximate="tanh")) if y is None else y


class TritonOps:
    """nanopara's fused Triton kernels (CUDA). Imported lazily so CPU-only use never touches Triton.

    Under torch.compile the kernels are called through the `nanopara::` custom ops of kernels/ops.py, so the
    compiler treats each as one opaque node and compiles the rest of the model around them; in eager mode through
    their autograd Functions directly (the custom-op dispatch cost ~300 us of host time per LayerNorm fwd+bwd on
    an H200, bench/bench_launch.py: the CPU must stay ahead of the GPU). `interpret=True` runs the Triton paths even on
    CPU tensors (tests, under TRITON_INTERPRET=1); otherwise CPU tensors get the PyTorch references.
    `ce` picks the loss: "inplace" (eager fused kernel, dlogits written into the logits buffer; under
    torch.compile a graph break at the loss) or "op" (custom ops: no graph break, one more pass over the logits).
    """

    def __init__(self, interpret: bool = False, ce: str = "inplace"):
        from kernels import attention, cross_entropy, layernorm
        if ce not in ("inplace", "op"):
            raise ValueError(f"TritonOps: ce must be 'inplace' or 'op', got {ce!r}")
        self._interpret, self._ce_mode = interpret, ce
        self._ref = attention.attention_qkv, layernorm.layernorm, layernorm.add_layernorm, cross_entropy.cross_entropy
        self._eager = attention.attention_qkv_triton, layernorm.layernorm_triton, layernorm.add_layernorm_triton
        self._ce_eager = cross_entropy.cross_entropy_triton

    @property
    def _k(self):
        """kernels/ops.py, imported on first use under torch.compile (or ce="op"): registering the custom ops pulls
        in torch._dynamo, seconds of start-up that an eager run never needs."""
        from kernels import ops
        return ops

    def _triton(self, t):
        return self._interpret or t.is_cuda

    def attention_qkv(self, qkv, n_head):  # the backward returns d(qkv) in one buffer: no stack of dq, dk, dv
        if not self._triton(qkv):
            return self._ref[0](qkv, n_head, causal=True)
        return (self._k.attention_qkv if torch.compiler.is_compiling() else self._eager[0])(qkv, n_head, causal=True)

    # every LayerNorm output feeds a Linear: under autocast it is written in the matmul's dtype directly
    def layernorm(self, x, ln):
        if not self._triton(x):
            return self._ref[1](x, ln.weight, ln.bias, ln.eps)
        fn = self._k.layernorm if torch.compiler.is_compiling() else self._eager[1]
        return fn(x, ln.weight, ln.bias, ln.eps, out_dtype=matmul_dtype(x))

    def add_layernorm(self, x, residual, ln):
        if not self._triton(x):
            return self._ref[2](x, residual, ln.weight, ln.bias, ln.eps)
        fn = self._k.add_layernorm if torch.compiler.is_compiling() else self._eager[2]
        return fn(x, residual, ln.weight, ln.bias, ln.eps, out_dtype=matmul_dtype(x))

    def cross_entropy(self, logits, targets, n_vocab):
        if not self._triton(logits):
            return self._ref[3](logits, targets, n_vocab=n_vocab, ignore_index=-1)
        if self._ce_mode == "op":
            return self._k.cross_entropy(logits, targets, n_vocab=n_vocab, ignore_index=-1)
        if torch.compiler.is_compiling():  # a graph break: runs eagerly on the compiled graph's logits
            return self._k.cross_entropy_inplace(logits, targets, n_vocab=n_vocab, ignore_index=-1)
        return self._ce_eager(logits, targets, n_vocab, -1, "mean", 1.0)

    # cuBLAS GEMMs + GELU: GELU fused into Triton GEMM epilogues measured no faster (notes/e2e.md)
    mlp = staticmethod(TorchOps.mlp)


def matmul_dtype(x):
    """The dtype a matmul consuming x will cast it to: the autocast dtype when autocast is on for x's device,
    else None. LayerNorm outputs that only feed a Linear are written in it directly (no separate cast pass)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def make_ops(kind: str, device: torch.device | str):
    device = torch.device(device)
    if kind == "triton" or (kind == "auto" and device.type == "cuda"):
        return TritonOps()
    return TorchOps()


# ----------------------------------------------------------------------------------------------------------------
# modules

class _WeightCast(torch.autograd.Function):
    """w -> w in the matmul's dtype (the cast autocast would make inside F.linear, or `shadow`, that cast made
    already); backward writes dW, in w's dtype, into the tensor `w.grad_into(w)` returns instead of a new one (None
    or no grad_into: a new one)."""

    @staticmethod
    def forward(ctx, w, dtype, shadow=None):
        ctx.w = w
        if shadow is not None:
            return shadow.view_as(shadow)
        return w.to(dtype) if w.dtype != dtype else w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        into = getattr(ctx.w, "grad_into", None)
        dest = into(ctx.w) if into is not None else None
        return (grad.to(ctx.w.dtype) if dest is None else dest.copy_(grad)), None, None


def matmul_weight(w: torch.Tensor) -> torch.Tensor:
    """A Linear's weight as its matmul reads it. Where something set `w.grad_into` (a data-parallel engine,
    engine.Engine._set_grad_dests: a function of w returning a w-shaped view of its gradient bucket, or None), the
    fp32 gradient is written straight into that view, so autograd keeps it as w.grad and the engine's bucket needs
    no copy of it. Where w has a current `shadow` in the autocast dtype (flat.py: the optimizer wrote it with the
    weights, and w._version has not moved since), the matmul reads it instead of casting w. Otherwise w itself, and
    F.linear casts it under autocast as usual: no destination set, a gradient already there (the next micro-steps
    accumulate into it in place), no_grad, or torch.compile."""
    shadow, into = getattr(w, "shadow", None), getattr(w, "grad_into", None)
    if (shadow is None and into is None) or torch.compiler.is_compiling():  # (the common case: no Python work)
        return w
    on = torch.is_autocast_enabled(w.device.type)
    dtype = torch.get_autocast_dtype(w.device.type) if on else w.dtype
    if shadow is not None and (shadow.dtype != dtype or getattr(w, "shadow_version", None) != w._version):
        shadow = None
    if not torch.is_grad_enabled():
        return w if shadow is None else shadow
    if shadow is None and (into is None or w.grad is not None):
        return w
    return _WeightCast.apply(w, dtype, shadow)


class Linear(nn.Linear):
    """nn.Linear whose weight goes through matmul_weight (same parameters, names and numerics)."""

    def forward(self, x):
        return F.linear(x, matmul_weight(self.weight), self.bias)


class LayerNorm(nn.Module):
    """Parameters only; the op comes from the model's op table (so blocks can fuse the residual add into it)."""

    def __init__(self, n: int, bias: bool, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None
        self.eps = eps


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # columns: [q heads | k heads | v heads]
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head  # heads held by this module: tp.py lowers it to n_head // tp
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout

    def forward(self, x, ops, kv_cache=None):
        qkv = self.c_attn(x)  # (B, T, 3*nh*hs); under sequence parallel c_attn gathers T, so read T from here
        B, T, _ = qkv.shape
        if kv_cache is None:
            y = ops.attention_qkv(qkv, self.n_head)  # (B, nh, T, hs)
        else:  # incremental decoding: append this step's keys/values, attend over everything cached
            q, k, v = split_qkv(qkv, self.n_head)  # (B, nh, T, hs) views
            k, v = kv_cache.update(k, v)
            mask = kv_cache.mask(T)  # the cache decides: None = causal over what it returned (T > 1), or all of it
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hs)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x, ops):
        return F.dropout(ops.mlp(x, self.c_fc, self.c_proj), self.dropout, self.training)


def is_moe_block(cfg: ModelConfig, i: int) -> bool:
    """Block i's MLP is a MoEMLP (nanopara/moe.py): every moe_every-th block, the last of each group."""
    return cfg.moe_experts > 0 and i % cfg.moe_every == cfg.moe_every - 1


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int = 0):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias)
        self.mlp = MoEMLP(cfg, linear=Linear) if is_moe_block(cfg, i) else MLP(cfg)  # same forward(x, ops)

    def forward(self, x, ops, kv_cache=None, m=None):
        """x: the residual stream; m: the previous block's MLP output, not yet added to it (None for block 0).
        Returns (x, m) the same way: every residual add is fused into the LayerNorm that reads its sum."""
        if m is None:
            h = ops.layernorm(x, self.ln_1)
        else:
            h, x = ops.add_layernorm(m, x, self.ln_1)  # x <- x + m; h = ln_1(x), one pass over the residual stream
        a = self.attn(h, ops, kv_cache)
        y, x = ops.add_layernorm(a, x, self.ln_2)  # x <- x + a; y = ln_2(x)
        return x, self.mlp(y, ops)


class KVCache:
    """Keys/values of one layer for generation: (B, nh, T_max, hs) buffers filled left to right.

    The attention's cache protocol: `update(k, v)` stores this step's (B, nh, T, hs) keys/values and returns the
    keys/values to attend over; `mask(T)` returns the boolean mask of those (query i sees key j where True), or
    None for no mask: causal when T > 1 (the returned keys start at this update's first query), every key when
    T == 1. decode.StaticKVCache is the other implementation (fixed shapes for CUDA graphs)."""

    def __init__(self, B, nh, T_max, hs, device, dtype):
        self.k = torch.zeros(B, nh, T_max, hs, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.start = 0  # tokens already cached before the current update
        self.end = 0

    def update(self, k, v):
        T = k.shape[2]
        self.start, self.end = self.end, self.end + T
        self.k[:, :, self.start:self.end] = k
        self.v[:, :, self.start:self.end] = v
        return self.k[:, :, :self.end], self.v[:, :, :self.end]

    def mask(self, T):  # new query i (absolute start+i) sees keys 0..start+i; None where SDPA needs no mask
        if T == 1 or self.start == 0:
            return None
        q_pos = torch.arange(self.start, self.end, device=self.k.device)[:, None]
        return torch.arange(self.end, device=self.k.device)[None, :] <= q_pos  # (T, end) bool


def kv_caches(model, B: int, T_max: int, dtype) -> list[KVCache]:
    """One KVCache per block of `model` (a GPT, or one after apply_tp: its heads per rank) for B rows."""
    dev = model.transformer.wpe.weight.device
    return [KVCache(B, blk.attn.n_head, T_max, blk.attn.head_dim, dev, dtype) for blk in model.transformer.h]


def keep_rows(caches: list[KVCache], rows: torch.Tensor) -> None:
    """Keep batch rows `rows` of every cache: finished rows leave a batched generation (evals.py, rl.py)."""
    for c in caches:
        c.k, c.v = c.k[rows], c.v[rows]


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias),
        ))
        self.lm_head = Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied (GPT-2)
        self._ops = {}  # device type -> op table, chosen on first use
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, 0.02) everywhere, residual projections N(0, 0.02/sqrt(2*n_layer)), zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        with torch.no_grad():  # padding rows of the tied embedding: never looked up, never scored
            self.transformer.wte.weight[self.cfg.vocab_size:].zero_()

    def ops_for(self, device: torch.device):
        if device.type not in self._ops:
            self._ops[device.type] = make_ops(self.cfg.kernels, device)
        return self._ops[device.type]

    def num_params(self, non_embedding: bool = True) -> int:
        """Active parameters: with MoE layers, a token passes through k of E experts, so only k/E of the expert
        weights count (moe.active_params); train.py's 6N FLOPs per token and MFU use this, so MoE MFU is honest."""
        n = active_params(self)  # = all parameters for a dense model
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    # ------------------------------------------------------------------------------------------------------------
    def forward(self, idx, targets=None, kv_caches=None, pos0: int = 0, pos=None):
        """idx (B, T) int64 -> (logits (B, T, Vp), loss or None). targets == -1 are ignored (SFT masking).
        pos: (T,) positions of idx's tokens when they are not pos0, pos0+1, ... (context parallel's chunks,
        cp.py; decode.py's device-side position, which a CUDA graph replays at any step); the caller checked them
        against block_size."""
        x, ops, m = self.embed(idx, pos0, pos), self.ops_for(idx.device), None
        for i, block in enumerate(self.transformer.h):
            x, m = block(x, ops, None if kv_caches is None else kv_caches[i], m)
        return self.head(x, m, targets)

    def embed(self, idx, pos0: int = 0, pos=None):
        """forward's first stage: token + position embeddings (then dropout), the residual stream (B, T, C).
        forward runs embed, the blocks, head; tp_streams.py runs the same stages for two halves of a batch."""
        T = idx.shape[1]
        if pos is None:
            if pos0 + T > self.cfg.block_size:
                raise ValueError(f"sequence of {pos0 + T} tokens exceeds the model's context of {self.cfg.block_size}")
            pos = torch.arange(pos0, pos0 + T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        return F.dropout(x, self.cfg.dropout, self.training)

    def head(self, x, m, targets=None):
        """forward's last stage: the last block's (x, m) -> final LayerNorm, lm_head -> (logits, loss or None)."""
        ops = self.ops_for(x.device)
        x = ops.layernorm(x, self.transformer.ln_f) if m is None else ops.add_layernorm(m, x, self.transformer.ln_f)[0]
        logits = self.lm_head(x)  # (B, T, Vp)
        loss = None if targets is None else self.loss_fn(logits, targets)
        return logits, loss

    def loss_fn(self, logits, targets):
        """Mean cross-entropy over non-ignored targets; padding columns (>= vocab_size) never count."""
        ops = self.ops_for(logits.device)
        return ops.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), self.cfg.vocab_size)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        """Sample continuations of idx (B, T) with a KV cache; temperature 0 means greedy."""
        B, T = idx.shape
        total = min(T + max_new_tokens, self.cfg.block_size)
        caches = kv_caches(self, B, total, self.transformer.wpe.weight.dtype)
        logits, _ = self(idx, kv_caches=caches)
        out = [idx]
        for step in range(total - T):
            nxt = logits[:, -1, :self.cfg.vocab_size].float()  # never sample a padding id
            if temperature == 0:
                tok = nxt.argmax(-1, keepdim=True)
            else:
                nxt = nxt / temperature
                if top_k is not None:
                    kth = torch.topk(nxt, min(top_k, nxt.shape[-1])).values[:, -1:]
                    nxt = nxt.masked_fill(nxt < kth, float("-inf"))
                tok = torch.multinomial(F.softmax(nxt, dim=-1), 1, generator=generator)
            out.append(tok)
            if step < total - T - 1:
                logits, _ = self(tok, kv_caches=caches, pos0=T + step)
        return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# OpenAI GPT-2 weights as Hugging Face stores them (GPT2LMHeadModel): Conv1D keeps weights as (in, out)

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def from_hf_state_dict(model: GPT, sd: dict) -> None:
    """Load a GPT2LMHeadModel state dict (transposing Conv1D weights, padding the vocab) into `model`."""
    own = model.state_dict()
    sd = {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers
    missing = [k for k in own if k != "lm_head.weight" and k not in sd]
    if missing:
        raise ValueError(f"Hugging Face state dict is missing {len(missing)} keys, e.g. {missing[:3]}")
    with torch.no_grad():
        for k, p in own.items():
            if k == "lm_head.weight":
                continue  # tied to wte
            w = sd[k].t() if k.endswith(_CONV1D) else sd[k]
            if k == "transformer.wte.weight":
                p.zero_()
                p[: w.shape[0]].copy_(w)
                continue
            if w.shape != p.shape:
                raise ValueError(f"{k}: Hugging Face shape {tuple(w.shape)} does not fit model shape {tuple(p.shape)}")
            p.copy_(w)


def to_hf_state_dict(model: GPT) -> dict:
    """Export in GPT2LMHeadModel's layout (Conv1D weights (in, out), vocab unpadded, lm_head tied copy)."""
    V = model.cfg.vocab_size
    out = {}
    for k, p in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        w = p.detach().cpu()
        if k == "transformer.wte.weight":
            w = w[:V]
        out[k] = w.t().contiguous() if k.endswith(_CONV1D) else w.clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
