"""FP8 training of the model's Linear layers: an FP8 linear (autograd Function + module) and `apply_fp8`.

    model = apply_fp8(GPT(cfg), "tensor")        # or "row" | "block" | "none"; lm_head stays bf16 by default
    ...  loss.backward(); engine.step(...); model.fp8.step()    # after every optimizer step: re-cast the weights

The three GEMMs of Y = X W^T + b, each on FP8 operands with fp32 accumulation (kernels/fp8_matmul.py):
    forward   Y  = X  W^T      X e4m3 (M, K),      W e4m3 (N, K)          -> Y in the autocast dtype (or x's)
    dgrad     dX = dY W        dY e5m2 (M, N),     W^T e4m3 (K, N)        -> dX in x's dtype
    wgrad     dW = dY^T X      dY^T e5m2 (N, M),   X^T e4m3 (K, M)        -> dW fp32 (the master weight's dtype)
Both operands of every GEMM are K-major, so each quantization also writes the transposed copy the other GEMM needs
(kernels/fp8_quant.py). Scaling per `mode`: tensor (one scale per tensor; `delayed=True` takes X's and dY's from
an amax history), row (per row of each operand and of its transpose), block (X, dY in 1x128 blocks along K, W in
128x128 blocks: DeepSeek-V3's recipe, arXiv 2412.19437 3.3). dY is e5m2 unless `grad_dtype="e4m3"`. Scales are
powers of two by default (`pow2`: the only rounding is fp8's own). The forward GEMM accumulates fast, the backward
ones promote to fp32 every 128 K (torchao's defaults); block scaling always promotes.

The weight is quantized once per optimizer step, reused by every micro-batch, keyed by (version, storage, the
model's fp8 generation): the fused AdamW bumps no version, so the trainer calls `model.fp8.step()` after each step.
Master weights, grads and optimizer state stay fp32; no FP8 state is a parameter or buffer; checkpoints add delayed
scaling's amax histories (amax_state: a resume is exact; another layout takes merge_amax's). Where a data-parallel
engine set `weight.grad_into` (engine.py), the wgrad GEMM writes dW straight into that view. CPU tensors run the
PyTorch references; `interpret=True` runs the Triton kernels under TRITON_INTERPRET=1 (tests). The MLP with both
Linears in tensor mode is one FP8MLPFunction, GELU folded into the casts (FP8Linear.fused_mlp). Callers: parallel.py
(apply_fp8; the auto filter: fp8_filter.py), tp.py (FP8 on the shards), model.TorchOps.mlp; notes/fp8.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import types

import torch
import torch.nn as nn

from kernels.fp8_matmul import fp8_matmul_ref, fp8_matmul_triton, triton_supported
from kernels.fp8_quant import E4M3, E5M2, FP8Tensors, fp8_quantize
from nanopara.model import Linear

MODES = ("none", "tensor", "row", "block")
DEFAULT_EXCLUDE = ("lm_head",)  # the tied output head stays in bf16 (its logits feed the loss directly)


@dataclasses.dataclass
class FP8Recipe:
    mode: str = "tensor"          # tensor | row | block
    grad_dtype: str = "e5m2"      # dY's format: e5m2 (range) | e4m3 (precision, own scale)
    pow2: bool = True             # scales rounded down to powers of two: exact scaling
    delayed: bool = False         # tensor mode: X and dY scales from an amax history instead of a pass over them
    history: int = 16             # amax history length (delayed scaling)
    fast_accum_fwd: bool = True   # forward GEMM: no fp32 promotion inside the tensor core's accumulation
    fast_accum_bwd: bool = False  # dgrad / wgrad: promote every 128 K
    ws: bool = False              # Hopper: promoted GEMMs through kernels/fp8_matmul_ws.py (parallelize: graphed steps)

    def __post_init__(self):
        if self.mode not in MODES[1:]:
            raise ValueError(f"fp8: mode must be one of {MODES[1:]}, got {self.mode!r}")
        if self.grad_dtype not in ("e5m2", "e4m3"):
            raise ValueError(f"fp8: grad_dtype must be e5m2 or e4m3, got {self.grad_dtype!r}")
        if self.delayed and self.mode != "tensor":
            raise ValueError("fp8: delayed scaling needs one scale per tensor (mode='tensor')")
        if self.history < 1:
            raise ValueError(f"fp8: history must be >= 1, got {self.history}")


class FP8State:
    """What the FP8 modules of one model share: the recipe, the weight-cache generation (`step()`), whether CPU
    tensors take the Triton kernels (interpreter tests) and counters (`casts`: weight quantizations so far)."""

    def __init__(self, recipe: FP8Recipe, interpret: bool = False):
        self.recipe, self.interpret = recipe, interpret
        self.generation = 0
        self.casts = 0

    def step(self) -> None:
        """The weights changed (call after every optimizer step): the next forward re-quantizes them."""
        self.generation += 1

    def triton_path(self, t: torch.Tensor) -> bool:
        return self.interpret or triton_supported(t.device)


class AmaxHistory:
    """The last `length` amaxes of one tensor, on its device (no host sync): scale from their max (delayed
    scaling, Micikevicius et al. 2022); the first call has no history and scales from the tensor itself."""

    def __init__(self, length: int):
        self.length, self.buf = length, None

    def amax(self):
        return None if self.buf is None else self.buf.amax().view(1, 1)

    def push(self, amax: torch.Tensor) -> None:
        """Newest first. After the first push the buffer is written in place: a CUDA graph replay (graph.py) re-runs
        these copies into the captured addresses, so the history advances with each replay."""
        a = amax.detach().float().reshape(1)
        if self.buf is None:
            self.buf = a.repeat(self.length)
        else:
            self.buf[1:] = self.buf[:-1].clone()
            self.buf[:1] = a


# ----------------------------------------------------------------------------------------------------------------
# quantization of each operand per mode: FP8Tensors(q, s, qt, st); q / qt None where not needed

def _quantize_act(x2, dtype, recipe, triton, want_q=True, want_qt=True, history=None, colsum=False, prologue=None,
                  h=None):
    """X or dY (M, C): q (M, C) scaled along C for the GEMM that contracts C, qt (C, M) scaled along the tokens
    for the weight-gradient GEMM. colsum: also x2's column sums from a cast's pass (dY: db; row mode: from qt's).
    prologue (tensor mode, the FP8 MLP): quantize gelu(x2) or x2 * gelu'(h) instead (kernels/fp8_prologue.py)."""
    if recipe.mode == "tensor":
        amax = history.amax() if history is not None else None
        out = fp8_quantize(x2, dtype, "tensor", recipe.pow2, transpose=want_qt, amax=amax, triton_path=triton,
                           colsum=colsum, prologue=prologue, h=h)
        if history is not None:
            history.push(out.amax)
        return out
    if prologue is not None:
        raise ValueError(f"fp8: a cast prologue is tensor mode only, not {recipe.mode!r}")
    if recipe.mode == "row":
        q = fp8_quantize(x2, dtype, "row", recipe.pow2, triton_path=triton) if want_q else FP8Tensors(None, None)
        t = fp8_quantize(x2, dtype, "col", recipe.pow2, triton_path=triton, colsum=colsum) if want_qt else \
            FP8Tensors(None, None)
        return FP8Tensors(q.q, q.s, t.qt, t.st, None, t.colsum)
    return fp8_quantize(x2, dtype, "1x128", recipe.pow2, transpose=want_qt, triton_path=triton, colsum=colsum)


def _quantize_weight(w, recipe, triton):
    """W (N, K) fp32 master -> q (N, K) for the forward, qt = W^T (K, N) for dgrad, both e4m3."""
    if recipe.mode == "tensor":
        return fp8_quantize(w, E4M3, "tensor", recipe.pow2, transpose=True, triton_path=triton)
    if recipe.mode == "row":
        q = fp8_quantize(w, E4M3, "row", recipe.pow2, triton_path=triton)
        t = fp8_quantize(w, E4M3, "col", recipe.pow2, triton_path=triton)
        return FP8Tensors(q.q, q.s, t.qt, t.st)
    return fp8_quantize(w, E4M3, "128x128", recipe.pow2, transpose=True, triton_path=triton)


def _gemm(a, b, sa, sb, bias, out_dtype, fast_accum, triton, out=None, ws=False):
    if triton:
        return fp8_matmul_triton(a, b, sa, sb, bias, out_dtype, fast_accum, out=out, ws=ws)
    y = fp8_matmul_ref(a, b, sa, sb, bias, out_dtype)
    return y if out is None else out.copy_(y)


# ----------------------------------------------------------------------------------------------------------------
# one Linear's forward and backward on FP8 operands, shared by FP8LinearFunction and FP8MLPFunction

def _out_dtype(x):
    """The dtype of a Linear's output: the autocast dtype where autocast is on (as F.linear's), else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _no_autocast(dev):
    """Autocast off for the FP8 ops, whose dtypes are explicit (the reference path matmuls in fp32). The backward
    runs outside autocast (engine.py, graph.py): then there is nothing to turn off, and the context's Python cost
    (~2.5 us) would be host time on every FP8 linear."""
    return torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()


def _grad_dest(weight):
    """weight where the engine gave it a gradient destination (model.matmul_weight's rule), asked for in backward;
    else None."""
    return weight if (getattr(weight, "grad_into", None) is not None and weight.grad is None
                      and not torch.compiler.is_compiling()) else None


def _linear_fwd(x2, weight, bias, layer, triton, out_dtype, want_qt, prologue=None):
    """Y = X' W^T + b (M, N) with X' = x2 (M, K), or gelu(x2) for prologue="gelu_tanh": X' quantized (its
    transpose too where wgrad will need it; from the layer's amax history under delayed scaling), W from the
    layer's cache. Returns (Y, X' quantized, W quantized)."""
    recipe = layer.fp8_state.recipe
    w8 = layer.weight_fp8(weight, triton)
    x8 = _quantize_act(x2, E4M3, recipe, triton, want_qt=want_qt, history=layer.hist_x if recipe.delayed else None,
                       prologue=prologue)
    return _gemm(x8.q, w8.q, x8.s, w8.s, bias, out_dtype, recipe.fast_accum_fwd, triton, ws=recipe.ws), x8, w8


def _linear_bwd(dy2, saved, layer, triton, need, dest, dtypes, prologue=None, h=None):
    """dY' = dy2 (M, N), or dy2 * gelu'(h) for prologue="gelu_tanh_bwd", quantized once (q for dgrad, q^T for
    wgrad, its column sums for db); then dX = dY' W (M, K), dW = dY'^T X' (N, K) written into dest's engine buffer
    where it gives one, db = sum of dY' over M. saved: (X'^T, its scale, W^T, its scale) from the forward;
    need: (dX, dW, db) wanted; dtypes: (dX's, dW's, db's). Returns (dX, dW, db), None where not wanted."""
    xqt, xst, wqt, wst = saved
    need_dx, need_dw, need_db = need
    recipe = layer.fp8_state.recipe
    gdt = E5M2 if recipe.grad_dtype == "e5m2" else E4M3
    g8 = _quantize_act(dy2, gdt, recipe, triton, want_q=need_dx, want_qt=need_dw,
                       history=layer.hist_dy if recipe.delayed else None, colsum=need_db, prologue=prologue, h=h)
    dx = dw = db = None
    if need_dx:  # (M, N) x (K, N)^T -> (M, K)
        dx = _gemm(g8.q, wqt, g8.s, wst, None, dtypes[0], recipe.fast_accum_bwd, triton, ws=recipe.ws)
    if need_dw:  # (N, M) x (K, M)^T -> (N, K), straight into the engine's buffer view where it gave one
        out = dest.grad_into(dest) if dest is not None else None
        direct = out is not None and out.dtype in (torch.float32, torch.bfloat16) and out.stride(-1) == 1
        dw = _gemm(g8.qt, xqt, g8.st, xst, None, dtypes[1], recipe.fast_accum_bwd, triton,
                   out=out if direct else None, ws=recipe.ws)
        if out is not None and not direct:
            dw = out.copy_(dw)
    if need_db:  # summed by a cast of dY as it reads dY (row mode without dW: one more pass)
        db = (g8.colsum if g8.colsum is not None else dy2.sum(0, dtype=torch.float32)).to(dtypes[2])
    return dx, dw, db


# ----------------------------------------------------------------------------------------------------------------
# autograd

class FP8LinearFunction(torch.autograd.Function):
    """fwd: Y = X W^T + b on e4m3 operands; bwd: dX = dY W and dW = dY^T X on e5m2 (or e4m3) dY. Saves X^T and
    W^T in FP8 (half the bytes of a bf16 X), nothing in high precision."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        triton = layer.fp8_state.triton_path(x)
        out_dtype = _out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            y, x8, w8 = _linear_fwd(x.reshape(-1, x.shape[-1]), weight, bias, layer, triton, out_dtype,
                                    want_qt=ctx.needs_input_grad[1])  # (M, N)
        ctx.save_for_backward(x8.qt, x8.st, w8.qt, w8.st)
        ctx.layer, ctx.triton, ctx.weight = layer, triton, _grad_dest(weight)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])  # 2-D: not a view (tp.py reduces it in place)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad[:2] + (ctx.dtypes[2] is not None and ctx.needs_input_grad[2],)
        with _no_autocast(dy.device.type):
            dx, dw, db = _linear_bwd(dy.reshape(-1, dy.shape[-1]), ctx.saved_tensors, ctx.layer, ctx.triton, need,
                                     ctx.weight, ctx.dtypes)
        return None if dx is None else dx.view(*dy.shape[:-1], dx.shape[-1]), dw, db, None


class FP8MLPFunction(torch.autograd.Function):
    """The GPT-2 MLP y = c_proj(gelu_tanh(c_fc(x))) with both Linears in FP8 tensor mode, GELU folded into the casts
    (kernels/fp8_prologue.py): the forward quantizes g = gelu(h) straight from c_fc's output h, the backward
    dh = dg * gelu'(h) straight from c_proj's dgrad output dg; neither g nor dh is ever written in high precision.
    Saves X^T, h (for gelu'), g^T and both W^T: h in its own dtype, the rest FP8 (what the two FP8LinearFunctions
    and F.gelu save between them). Each Linear keeps its own amax histories (delayed scaling)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, fc, proj):
        triton = True  # FP8Linear.fused_mlp: the Triton path only
        out_dtype = _out_dtype(x)
        need = ctx.needs_input_grad
        with torch.autocast(x.device.type, enabled=False):
            h, x8, w18 = _linear_fwd(x.reshape(-1, x.shape[-1]), w1, b1, fc, triton, out_dtype, want_qt=need[1])
            y, g8, w28 = _linear_fwd(h, w2, b2, proj, triton, out_dtype, want_qt=need[3], prologue="gelu_tanh")
        ctx.save_for_backward(x8.qt, x8.st, w18.qt, w18.st, h, g8.qt, g8.st, w28.qt, w28.st)
        ctx.fc, ctx.proj, ctx.dests = fc, proj, (_grad_dest(w1), _grad_dest(w2))
        ctx.dtypes1 = (x.dtype, w1.dtype, None if b1 is None else b1.dtype)
        ctx.dtypes2 = (h.dtype, w2.dtype, None if b2 is None else b2.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        n = ctx.needs_input_grad
        need1 = (n[0], n[1], ctx.dtypes1[2] is not None and n[2])
        need2 = (any(need1), n[3], ctx.dtypes2[2] is not None and n[4])  # dg only for what lies before it
        with _no_autocast(dy.device.type):
            dg, dw2, db2 = _linear_bwd(dy.reshape(-1, dy.shape[-1]), saved[5:], ctx.proj, True, need2, ctx.dests[1],
                                       ctx.dtypes2)
            dx = dw1 = db1 = None
            if dg is not None:  # (M, H): c_fc's dY' = dg * gelu'(h), made inside its cast
                dx, dw1, db1 = _linear_bwd(dg, saved[:4], ctx.fc, True, need1, ctx.dests[0], ctx.dtypes1,
                                           prologue="gelu_tanh_bwd", h=saved[4])
        return None if dx is None else dx.view(*dy.shape[:-1], dx.shape[-1]), dw1, db1, dw2, db2, None, None


# ----------------------------------------------------------------------------------------------------------------
# module and model surgery

class FP8Linear(Linear):
    """model.Linear whose three GEMMs run in FP8 (same parameters and state-dict keys as the Linear it replaces)."""

    @classmethod
    def from_linear(cls, lin: nn.Linear, state: FP8State) -> "FP8Linear":
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new.weight, new.bias = lin.weight, lin.bias  # the same Parameter objects (ties, optimizer, engine views)
        return attach_fp8(new, state)

    def weight_fp8(self, w: torch.Tensor, triton: bool) -> FP8Tensors:
        """The FP8 weight and its transpose, quantized at most once per (weight version, generation)."""
        key = (w._version, w.data_ptr(), w.device, self.fp8_state.generation, triton)
        if self._w8_key != key:
            self._w8 = _quantize_weight(w.detach(), self.fp8_state.recipe, triton)
            self._w8_key = key
            self.fp8_state.casts += 1
        return self._w8

    @torch.compiler.disable  # under torch.compile: one graph break per FP8 linear, run eagerly (Python-side cache)
    def forward(self, x):
        return FP8LinearFunction.apply(x, self.weight, self.bias, self)

    @torch.compiler.disable
    def fused_mlp(self, x, c_proj):
        """c_proj(gelu_tanh(self(x))) as one FP8MLPFunction where it applies, else None (the caller runs the three
        ops: model.TorchOps.mlp). It applies where c_proj is an FP8Linear of this one's state in tensor mode, on the
        Triton path (CUDA, or the interpreter), and neither module has forward hooks the fused call would skip;
        row / block modes, one Linear in FP8, tp.py's parallel linears (not FP8Linear) keep the three ops."""
        state = self.fp8_state
        if (not isinstance(c_proj, FP8Linear) or c_proj.fp8_state is not state or state.recipe.mode != "tensor"
                or not state.triton_path(x) or self._forward_hooks or self._forward_pre_hooks
                or c_proj._forward_hooks or c_proj._forward_pre_hooks):
            return None
        return FP8MLPFunction.apply(x, self.weight, self.bias, c_proj.weight, c_proj.bias, self, c_proj)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.fp8_state.recipe.mode}"


def attach_fp8(layer: nn.Module, state: FP8State) -> nn.Module:
    """Give a module with `weight` what FP8LinearFunction reads: the shared state, the weight-cast cache
    (`weight_fp8`) and, for delayed scaling, the amax histories of X and dY. Used by FP8Linear and by tp.py's
    column/row-parallel linears, which run FP8LinearFunction on their shard between their collectives."""
    layer.fp8_state = state
    layer._w8, layer._w8_key = None, None
    layer.hist_x = layer.hist_dy = None
    if state.recipe.delayed:
        layer.hist_x, layer.hist_dy = AmaxHistory(state.recipe.history), AmaxHistory(state.recipe.history)
    if not isinstance(layer, FP8Linear):
        layer.weight_fp8 = types.MethodType(FP8Linear.weight_fp8, layer)
    return layer


def _selector(filter):
    """filter -> predicate(name): None = every Linear but DEFAULT_EXCLUDE; a string = comma-separated fnmatch
    patterns of module names to convert (e.g. "*.mlp.*,*.attn.c_attn"); a callable(name, module) as is."""
    if filter is None:
        return lambda name, mod: name.rpartition(".")[2] not in DEFAULT_EXCLUDE
    if isinstance(filter, str):
        pats = [p.strip() for p in filter.split(",") if p.strip()]
        return lambda name, mod: any(fnmatch.fnmatchcase(name, p) for p in pats)
    return filter


def apply_fp8(model: nn.Module, mode: str = "tensor", filter=None, recipe: FP8Recipe | None = None,
              interpret: bool = False) -> nn.Module:
    """Swap the model's nn.Linear modules (model.Linear included) that `filter` selects for FP8Linear, in place (and
    switch tp.py's column/row-parallel linears to FP8 on their shards);
    returns the model with `model.fp8` (the FP8State: call `.step()` after each optimizer step). mode "none":
    unchanged. recipe: overrides beyond the mode (grad_dtype, pow2, delayed, ...)."""
    if mode not in MODES:
        raise ValueError(f"apply_fp8: mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model
    recipe = dataclasses.replace(recipe, mode=mode) if recipe is not None else FP8Recipe(mode=mode)
    state = FP8State(recipe, interpret)
    keep = _selector(filter)
    for name, mod in list(model.named_modules()):
        if not keep(name, mod):
            continue
        if type(mod) in (nn.Linear, Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FP8Linear.from_linear(mod, state))
        elif getattr(mod, "takes_fp8", False):  # tp.py's column/row-parallel linears: FP8 on their shard
            attach_fp8(mod, state)
    model.fp8 = state
    return model


# ----------------------------------------------------------------------------------------------------------------
# delayed scaling's state in checkpoints (Trainer.state_dict / load_state_dict, reshard.py)

def _delayed(model: nn.Module):
    """(global module name, module) of every linear that keeps amax histories (torch.compile's prefix dropped)."""
    for name, mod in model.named_modules():
        if getattr(mod, "hist_x", None) is not None:
            yield name.replace("_orig_mod.", ""), mod


def amax_state(model: nn.Module) -> dict:
    """{module name: {"x": history, "dy": history}}: copies, newest first; None before the module's first forward
    (or backward). Per rank: a tp shard's or a dp rank's amaxes are its own."""
    return {name: {k: None if h.buf is None else h.buf.detach().clone() for k, h in (("x", mod.hist_x),
                                                                                      ("dy", mod.hist_dy))}
            for name, mod in _delayed(model)}


def _fit(t: torch.Tensor, length: int) -> torch.Tensor:
    """A history of `length`: the newest entries kept, the oldest repeated (a longer or shorter saved history)."""
    t = t.detach().float().reshape(-1)[:length]
    return torch.cat([t, t[-1:].expand(length - t.numel())]) if t.numel() < length else t


def load_amax_state(model: nn.Module, sd: dict, device) -> None:
    """Inverse of amax_state, written into an existing buffer in place (a captured CUDA graph pushes into its
    addresses). A linear without a saved history (None, or absent: another train.fp8_filter) starts afresh; a
    saved one this model does not run in FP8 is left out."""
    for name, mod in _delayed(model):
        hists = sd.get(name) or {}
        for key, h in (("x", mod.hist_x), ("dy", mod.hist_dy)):
            t = hists.get(key)
            if t is None:
                h.buf = None
            elif h.buf is not None and h.buf.numel() == h.length:
                h.buf.copy_(_fit(t, h.length))
            else:
                h.buf = _fit(t, h.length).to(device)


def merge_amax(saved: list, names) -> dict:
    """Histories for the linears `names` of another layout, from every saved rank's amax_state (None where a rank
    had none): the elementwise max over the ranks that hold the linear. A whole tensor's amax is the max of its
    shards' amaxes, so a tp-sharded X or dY joins exactly and a dp rank's max covers the global batch; a rank that
    now holds a smaller shard scales from the larger amax: no overflow, at most a coarser scale until the history
    rolls over (16 steps)."""
    out = {}
    for name in names:
        hists = [s[name] for s in saved if s and s.get(name) is not None]
        out[name] = {}
        for key in ("x", "dy"):
            ts = [h[key].detach().float().reshape(-1) for h in hists if h.get(key) is not None]
            n = min((t.numel() for t in ts), default=0)
            out[name][key] = torch.stack([t[:n] for t in ts]).amax(0) if ts else None
    return out
