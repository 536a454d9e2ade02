"""Activation checkpointing of the transformer blocks: train.activation_checkpointing = none | full | selective.

    apply_activation_checkpointing(blocks, mode)  # parallel.py: after the PP split, before the DP/ZeRO wrap

Bytes a layer keeps for backward, in units of s*b*h (sequence, micro-batch, n_embd; bf16 autocast, fp32 residual
stream, flash attention; Korthikanti et al. 2022 count 34 + 5*a*s/h at 2 bytes a value):
  none       36 (38 with dropout): LayerNorm inputs and outputs, qkv, attention output, GELU input and output
  selective  24: keeps every matmul output and the LayerNorm inputs; recomputes in backward the LayerNorm outputs
             and the 4h-wide GELU output with the same kernels (bit-identical), and the dropout masks from the RNG
             state taken before each dropout. No matmul and no collective runs again.
  full       6: keeps the block's inputs (the fp32 residual and the previous block's MLP output) and reruns the
             whole block in backward (~+1/3 of the step's FLOPs; under TP its collectives too), restoring the RNG
             state for the rerun (tp.py's per-rank dropout stream is the rank's own).
Both recompute with the weights the forward read (ZeRO-3 rebinds module weights to empty placeholders in between).

Host time is the cost to watch (issue #24): every saved tensor packed or unpacked through a Python hook costs
microseconds, and a block saves ~24. So full is a minimal non-reentrant checkpoint (_Frame, not
torch.utils.checkpoint): one small holder per saved tensor, filled by the rerun, the block's module and parameter
slots found once (_Info). Selective opens its saved-tensor hooks only in windows, from the moment a LayerNorm (or
GELU) output is made until the next op of the op table (the Linear that consumes it saves its input inside it);
every other saved tensor of the block never meets Python. With dropout > 0 selective also runs the block under a
TorchFunctionMode that catches F.dropout.
Called by parallel.py; tests/test_recompute.py (bit-exact against none); bench/bench_recompute.py; notes/pp.md.
"""
from __future__ import annotations

import types
import weakref
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from nanopara.model import TorchOps

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Make each Block of `blocks` (GPT.transformer.h, a pp Chunk's transformer.h.values(), TP-applied or not)
    run its forward under `mode`, in place; "none" restores the plain forward. Parameters and names are untouched.
    What a block's modules hold is looked up at its first training forward (FP8 and ZeRO-3 change it after this
    call, before that); module surgery after that needs this call again."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}: expected one of {', '.join(MODES)}")
    wrap = {"full": _full_forward, "selective": _selective_forward}.get(mode)
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"apply_activation_checkpointing expects transformer Block modules, got {type(block)}")
        block.__dict__.pop("forward", None)  # a second call replaces the first
        block.__dict__.pop("_ac_info", None)
        if wrap is not None:
            block.forward = wrap.__get__(block)
        block.activation_checkpointing = mode


class _Info:
    """What one block's forward needs to know of its modules, found once (walking block.modules() per forward
    cost ~200 us of host time a block): the (module, name) of every tensor the modules hold (parameters, or the
    plain attributes ZeRO-3 binds in their place) and the modules with a dropout probability."""

    def __init__(self, block):
        mods = list(block.modules())
        self.slots = [(m, k) for m in mods for d in (m._parameters, m.__dict__) for k, v in d.items()
                      if isinstance(v, torch.Tensor)]
        self.dropouts = [m for m in mods if isinstance(getattr(m, "dropout", None), float)]

    def tensors(self) -> list:
        """(attribute dict, name, tensor) of every slot as bound now."""
        out = []
        for m, k in self.slots:
            d = m._parameters if k in m._parameters else m.__dict__
            out.append((d, k, d.get(k)))
        return out


def _info(block) -> _Info:
    info = block.__dict__.get("_ac_info")
    if info is None:
        info = block.__dict__["_ac_info"] = _Info(block)
    return info


def _has_dropout(block, info: _Info) -> bool:  # model.py's modules hold their dropout probability as a float
    return block.training and any(m.dropout > 0 for m in info.dropouts)


def _bind(entries) -> None:
    for d, k, v in entries:
        d[k] = v


# ----------------------------------------------------------------------------------------------------------------
# full

def _full_forward(self, x, ops, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():  # generation, evaluation: nothing is kept
        return forward(self, x, ops, *args, **kwargs)
    info = _info(self)
    frame = _Frame(self, info, (x, ops, *args), kwargs)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return forward(self, x, ops, *args, **kwargs)


class _Holder:
    """Stands in for one saved tensor of a checkpointed forward; the rerun puts the recomputed tensor here. It lives
    exactly as long as the autograd node that saved it (released after its backward unless the graph is retained),
    and the recomputed tensor with it."""
    __slots__ = ("t", "__weakref__")

    def __init__(self):
        self.t = None


class _Frame:
    """One checkpointed block forward: its inputs, the weights it read, its autocast and (with dropout) RNG state,
    and weak references to the holders of what it saved, in order. The first unpack reruns the forward once under
    the same state and fills every holder still alive (the rerun saves the same tensors in the same order)."""

    def __init__(self, block, info: _Info, args, kwargs):
        self.block, self.info, self.args, self.kwargs = block, info, args, kwargs
        self.weights = info.tensors()  # the rerun reads these (ZeRO-3 rebinds them to placeholders in between)
        dev = x.device if isinstance(x := args[0], torch.Tensor) else torch.device("cpu")
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                         for t in dict.fromkeys((dev.type, "cpu"))]
        self.cache = torch.is_autocast_cache_enabled()
        self.rng = None
        if _has_dropout(block, info):  # a host copy of the RNG state, only where a dropout draws from it
            self.rng = (torch.get_rng_state(), dev, torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        self.holders = []

    def pack(self, t):
        h = _Holder()
        self.holders.append(weakref.ref(h))
        return h

    def unpack(self, h):
        if h.t is None:
            self.rerun()
        return h.t

    def rerun(self):
        live = [r() for r in self.holders]
        n = 0

        def pack(t):  # the k-th tensor the rerun saves is the k-th the forward saved
            nonlocal n
            if n < len(live) and live[n] is not None:
                live[n].t = t.detach()
            n += 1
            return ()

        now = self.info.tensors()
        _bind(self.weights)
        rng = self.rng
        if rng is not None:
            keep = torch.get_rng_state(), (torch.cuda.get_rng_state(rng[1]) if rng[2] is not None else None)
            _set_rng(rng[0], rng[1], rng[2])
        try:
            with torch.enable_grad(), _autocast(self.autocast, self.cache), saved_tensors_hooks(pack, _no_unpack):
                type(self.block).forward(self.block, *self.args, **self.kwargs)
        finally:
            _bind(now)
            if rng is not None:
                _set_rng(keep[0], rng[1], keep[1])
        if n != len(live):
            raise RuntimeError(f"activation checkpointing (full): the recomputed forward saved {n} tensors for "
                               f"backward, the forward {len(live)}: the block must run the same ops both times")


def _no_unpack(_):
    raise RuntimeError("activation checkpointing (full): backward through a recomputed graph")


def _set_rng(cpu_state, dev, cuda_state):
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, dev)


class _autocast:
    """The autocast state a forward ran under (per device type), re-entered for its recomputation."""

    def __init__(self, states, cache):
        self.states, self.cache, self.ctx = states, cache, []

    def __enter__(self):
        for dev, enabled, dtype in self.states:
            if torch.is_autocast_enabled(dev) != enabled or (enabled and torch.get_autocast_dtype(dev) != dtype):
                c = torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=self.cache)
                c.__enter__()
                self.ctx.append(c)

    def __exit__(self, *exc):
        while self.ctx:
            self.ctx.pop().__exit__(*exc)


# ----------------------------------------------------------------------------------------------------------------
# selective

def _selective_forward(self, x, ops, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():  # generation, evaluation: nothing is kept
        return forward(self, x, ops, *args, **kwargs)
    sel = _SelectiveOps(ops)
    try:
        if _has_dropout(self, _info(self)):
            with _RegenerateDropout():
                return forward(self, x, sel, *args, **kwargs)
        return forward(self, x, sel, *args, **kwargs)
    finally:
        sel.close()  # the marked tensors live on only where something saved them


class _Recipe:
    """Stands in for a saved tensor: rebuilds it in backward. A saved view of a marked tensor keeps its view."""
    __slots__ = ("fn", "inputs", "view", "autocast")

    def __init__(self, fn, inputs, view_of, autocast):
        self.fn, self.autocast = fn, autocast
        self.inputs = [(t, t._version) for t in inputs]
        self.view = view_of

    def rebuild(self):
        for t, version in self.inputs:
            if t._version != version:
                raise RuntimeError("activation checkpointing (selective): an input of a recomputed activation was "
                                   "modified in place after the forward")
        with torch.no_grad(), _autocast(self.autocast, torch.is_autocast_cache_enabled()):
            t = self.fn()
        size, stride, offset = self.view
        return t.as_strided(size, stride, offset)


def _unpack(packed):
    return packed.rebuild() if type(packed) is _Recipe else packed


def _autocast_state(dev: str):
    return [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))]


def _frozen(ln):
    """The LayerNorm's tensors as this forward reads them: ZeRO-3 rebinds module attributes to empty placeholders
    after a unit's forward and refills only the storage of the tensors the forward used before its backward."""
    return types.SimpleNamespace(weight=ln.weight, bias=ln.bias, eps=ln.eps)


def _matmul_dtype(y):
    """y as the Linear that reads it will cast it under autocast (TritonOps writes LayerNorm outputs in that dtype
    already; casting here for the torch path makes the cast, not the fp32 output, the tensor the Linear saves)."""
    dev = y.device.type
    if torch.is_autocast_enabled(dev) and y.dtype != torch.get_autocast_dtype(dev):
        return y.to(torch.get_autocast_dtype(dev))
    return y


class _SelectiveOps:
    """A block's op table with the LayerNorm and GELU outputs marked recomputable; everything else is `ops`.

    A mark opens a window of saved-tensor hooks that stays open until the next op of the table is asked for (or the
    block returns): the Linear reading the marked tensor saves it (or a view: e.g. its (B*T, C) rows) inside the
    window, and the pack hook swaps it for a recipe. Tensors saved outside the windows never reach Python."""

    def __init__(self, ops):
        self._ops, self._marks, self._hooks = ops, {}, None

    def __getattr__(self, name):  # attention_qkv, cross_entropy, ...: the model's own; the window closes
        self.close()
        return getattr(self._ops, name)

    def close(self):
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        self._marks.clear()

    def _mark(self, t, fn, *inputs):
        if t.layout == torch.strided and t.numel() and t.storage_offset() == 0 and t.is_contiguous():
            self._marks[t.data_ptr()] = (t, t._version, fn, inputs, _autocast_state(t.device.type))
            if self._hooks is None:
                self._hooks = saved_tensors_hooks(self._pack, _unpack)
                self._hooks.__enter__()
        return t

    def _pack(self, t):
        try:
            hit = self._marks.get(t.data_ptr())
        except RuntimeError:  # no data pointer (sparse, ...): never marked
            return t
        # a tensor starting where a marked one starts is a view of it (the marked one is alive: no reuse)
        if hit is None or hit[0].dtype != t.dtype or hit[1] != t._version or t.layout != torch.strided:
            return t
        return _Recipe(hit[2], hit[3], (t.size(), t.stride(), t.storage_offset()), hit[4])

    def layernorm(self, x, ln):
        self.close()
        ln, ops = _frozen(ln), self._ops

        def fn():
            return _matmul_dtype(ops.layernorm(x, ln))
        return self._mark(fn(), fn, x)

    def add_layernorm(self, x, residual, ln):  # y = ln(h), h = x + residual: h is kept (LayerNorm's input)
        self.close()
        ln, ops = _frozen(ln), self._ops
        y, h = ops.add_layernorm(x, residual, ln)
        if type(ops).add_layernorm is TorchOps.add_layernorm and type(ops).layernorm is TorchOps.layernorm:
            def fn():  # F.layer_norm(x + residual) is F.layer_norm(h): no add to redo
                return _matmul_dtype(ops.layernorm(h, ln))
        else:
            C, dtype = x.shape[-1], x.dtype

            def fn():  # the same fused kernel (same tiles, same row sums) on 0 + h == h; the zeros are one row
                return _matmul_dtype(ops.add_layernorm(h.new_zeros(C, dtype=dtype).expand(h.shape), h, ln)[0])
        return self._mark(_matmul_dtype(y), fn, h), h

    def mlp(self, x, c_fc, c_proj):  # the window of the LayerNorm before it is still open for c_fc
        if type(self._ops).mlp is not TorchOps.mlp:  # another MLP op (e.g. GELU fused into a GEMM): run it as is
            ops = self._ops
            self.close()
            return ops.mlp(x, c_fc, c_proj)
        fused = getattr(c_fc, "fused_mlp", None)
        if fused is not None:  # an FP8 c_fc keeps x in FP8 only: nothing here for the window to recompute
            self.close()
            y = fused(x, c_proj)  # FP8 tensor mode: keeps h and FP8 copies, as the three ops would (c_proj: g^T)
            if y is not None:
                return y
        a = c_fc(x)  # (B, T, 4C): kept by GELU's backward
        self.close()
        g = F.gelu(a, approximate="tanh")  # TorchOps.mlp's math
        y = c_proj(self._mark(g, lambda: F.gelu(a, approximate="tanh"), a))
        self.close()
        return y


# ----------------------------------------------------------------------------------------------------------------
# dropout masks from the RNG state

def _dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def _rng_state(dev: torch.device):
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


class _RegenerateDropout(TorchFunctionMode):
    """Inside a selective block's forward: whatever F.dropout saves for backward (CUDA: the bool mask; CPU: the
    scaled noise) is packed as the RNG state before the call, and rebuilt in backward by the same F.dropout call on
    a zero tensor of the same shape from that state. The mask depends only on the RNG state, numel and (CUDA) the
    vector width, which is the widest for the fresh, aligned tensors used here; other inputs keep their masks."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.dropout:
            return func(*args, **kwargs)
        x, p, training, inplace = _dropout_args(*args, **kwargs)
        if not (training and 0 < p < 1 and not inplace and x.requires_grad and x.is_contiguous()
                and x.data_ptr() % 16 == 0):
            return func(*args, **kwargs)
        with saved_tensors_hooks(_MaskPack(x, p), _unpack):
            return func(*args, **kwargs)


class _MaskPack:
    """The pack hook of one F.dropout call. Saved-tensor hooks live as long as what they packed, so this holds
    no tensor, only what rebuilding needs."""

    def __init__(self, x, p):
        self.state, self.p, self.count = _rng_state(x.device), p, 0
        self.x_ptr, self.shape, self.dtype, self.device = x.untyped_storage().data_ptr(), x.shape, x.dtype, x.device

    def __call__(self, t):
        if t.untyped_storage().data_ptr() == self.x_ptr:
            return t  # the input itself: never rebuilt from the RNG
        self.count += 1
        autocast = [(self.device.type, False, torch.get_autocast_dtype(self.device.type))]
        return _Recipe(_Mask(self, self.count - 1), (), (t.size(), t.stride(), t.storage_offset()), autocast)


class _Mask:
    """Rebuilds the k-th tensor that F.dropout saved: the same call on zeros, from the RNG state before it ran."""

    def __init__(self, call: _MaskPack, k: int):
        self.call, self.k = call, k

    def __call__(self):
        c, dev = self.call, self.call.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
            if dev.type == "cuda":
                torch.cuda.set_rng_state(c.state, dev)
            else:
                torch.set_rng_state(c.state)
            got = []
            with torch.enable_grad(), saved_tensors_hooks(lambda t: got.append(t) or t, lambda t: t):
                F.dropout(torch.zeros(c.shape, dtype=c.dtype, device=dev, requires_grad=True), c.p, True)
        return got[self.k]
