"""Activation checkpointing of the transformer blocks: train.activation_checkpointing = none | full | selective.

    apply_activation_checkpointing(blocks, mode)  # parallel.py: after the PP split, before the DP/ZeRO wrap

Bytes a layer keeps for backward (s sequence, b micro-batch, h n_embd, a heads): Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", count s*b*h*(34 + 5*a*s/h) at 2 bytes a value. Here (bf16
autocast, fp32 residual stream, flash attention: no s^2 scores, an fp32 lse of 4*a*s*b bytes), in units of s*b*h:
  none       LayerNorm inputs (the fp32 residual sums) 4+4, LayerNorm outputs 2+2, qkv 6, attention output 2, GELU
             input 8, GELU output 8, dropout masks 1+1 (dropout > 0): 36; with dropout 38 = the paper's 34 (its
             5*a*s/h is what flash attention recomputes anyway) + 4 (the LayerNorm inputs are fp32)
  selective  keeps every matmul output and the LayerNorm inputs; recomputes in backward the LayerNorm outputs and
             the 4h-wide GELU output from kept inputs with the same kernels (bit-identical), and the dropout masks
             from the RNG state taken before each dropout: 24. No matmul and no collective runs again (checkpointing
             the LN -> c_attn and LN -> c_fc -> GELU paths instead would rerun c_attn and c_fc: +14 h^2 FLOPs a
             token on the block's 72 h^2, +19%).
  full       keeps the block's inputs, the fp32 residual 4 + the previous block's MLP output 2: 6.
             torch.utils.checkpoint (use_reentrant=False) reruns the whole block in backward, ~+1/3 of the step's
             FLOPs, and under TP its collectives (2 all-reduces; SP: 2 all-gathers + 2 reduce-scatters). With dropout
             it restores the RNG state for the rerun; tp.py's per-rank dropout stream wraps the whole model, so that
             state is the rank's own.
Not per token: under autocast each matmul keeps a bf16 copy of its weight (2 bytes a parameter; full recasts).
Both recompute with the weights the forward read (ZeRO-3 rebinds module weights to empty placeholders in between).
Selective: saved-tensor hooks around the block's forward pack each tensor its op table marked (or a view of it, e.g.
a Linear's (B*T, C) input) as a recipe; with dropout > 0 a TorchFunctionMode over the forward catches F.dropout
(host time per op). Called by parallel.py; tests/test_recompute.py; bench/bench_recompute.py (time, memory).
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from nanopara.model import TorchOps

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Make each Block of `blocks` (GPT.transformer.h, a pp Chunk's transformer.h.values(), TP-applied or not)
    run its forward under `mode`, in place; "none" restores the plain forward. Parameters and names are untouched."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}: expected one of {', '.join(MODES)}")
    wrap = {"full": _full_forward, "selective": _selective_forward}.get(mode)
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"apply_activation_checkpointing expects transformer Block modules, got {type(block)}")
        block.__dict__.pop("forward", None)  # a second call replaces the first
        if wrap is not None:
            block.forward = wrap.__get__(block)
        block.activation_checkpointing = mode


# ----------------------------------------------------------------------------------------------------------------
# full

def _full_forward(self, x, ops, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():  # generation, evaluation: nothing is kept
        return forward(self, x, ops, *args, **kwargs)
    seen = _module_tensors(self)

    def run(*a, **k):  # the rerun reads the weights the forward read (ZeRO-3 rebinds them in between: _frozen)
        now = _module_tensors(self)
        _bind(seen)
        try:
            return forward(self, *a, **k)
        finally:
            _bind(now)
    # the RNG state is saved (and restored for the rerun) only where a dropout draws from it: a host copy per block
    return checkpoint(run, x, ops, *args, use_reentrant=False, preserve_rng_state=_has_dropout(self), **kwargs)


def _module_tensors(block) -> list:
    """(attribute dict, name, tensor) of every parameter or plain tensor attribute of the block's modules."""
    return [(d, k, v) for m in block.modules() for d in (m._parameters, m.__dict__) for k, v in d.items()
            if isinstance(v, torch.Tensor)]


def _bind(entries) -> None:
    for d, k, v in entries:
        d[k] = v


# ----------------------------------------------------------------------------------------------------------------
# selective

def _selective_forward(self, x, ops, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():  # generation, evaluation: nothing is kept
        return forward(self, x, ops, *args, **kwargs)
    marks = _Marks()
    try:
        with saved_tensors_hooks(marks.pack, _unpack), (_RegenerateDropout() if _has_dropout(self)
                                                         else contextlib.nullcontext()):
            return forward(self, x, _SelectiveOps(ops, marks), *args, **kwargs)
    finally:
        marks.table.clear()  # the marked tensors live on only where something saved them


def _has_dropout(block) -> bool:  # model.py's modules hold their dropout probability as a float
    return block.training and any(isinstance(getattr(m, "dropout", None), float) and m.dropout > 0
                                  for m in block.modules())


class _Recipe:
    """Stands in for a saved tensor: rebuilds it in backward. A saved view of a marked tensor keeps its view."""

    def __init__(self, fn, inputs, view_of, autocast):
        self.fn, self.autocast = fn, autocast
        self.inputs = [(t, t._version) for t in inputs]
        self.view = view_of

    def rebuild(self):
        for t, version in self.inputs:
            if t._version != version:
                raise RuntimeError("activation checkpointing (selective): an input of a recomputed activation was "
                                   "modified in place after the forward")
        dev, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
            t = self.fn()
        size, stride, offset = self.view
        return t.as_strided(size, stride, offset)


def _unpack(packed):
    return packed.rebuild() if isinstance(packed, _Recipe) else packed


class _Marks:
    """One block forward's recomputable tensors, by storage: the pack hook swaps any saved tensor on one of those
    storages (e.g. the (B*T, C) view a Linear saves of its (B, T, C) input) for a recipe."""

    def __init__(self):
        self.table = {}  # storage data_ptr -> (tensor, its version, rebuild fn, inputs the fn reads, autocast state)

    def mark(self, t, fn, *inputs):
        if t.layout == torch.strided and t.numel() and t.storage_offset() == 0 and t.is_contiguous():
            dev = t.device.type
            state = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            self.table[t.untyped_storage().data_ptr()] = (t, t._version, fn, inputs, state)
        return t

    def pack(self, t):
        if t.layout != torch.strided or not t.numel():
            return t
        hit = self.table.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].dtype != t.dtype or hit[1] != t._version:
            return t
        return _Recipe(hit[2], hit[3], (t.size(), t.stride(), t.storage_offset()), hit[4])


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
    """A block's op table with the LayerNorm and GELU outputs marked recomputable; everything else is `ops`."""

    def __init__(self, ops, marks: _Marks):
        self._ops, self._marks = ops, marks

    def __getattr__(self, name):  # attention_qkv, cross_entropy, ...: the model's own
        return getattr(self._ops, name)

    def layernorm(self, x, ln):
        ln = _frozen(ln)

        def fn():
            return _matmul_dtype(self._ops.layernorm(x, ln))
        return self._marks.mark(fn(), fn, x)

    def add_layernorm(self, x, residual, ln):  # y = ln(h), h = x + residual: h is kept (LayerNorm's input)
        ln = _frozen(ln)
        y, h = self._ops.add_layernorm(x, residual, ln)
        C, dtype = x.shape[-1], x.dtype

        def fn():  # the same fused kernel (same tiles, same row sums) on 0 + h == h; the zeros are one row
            return _matmul_dtype(self._ops.add_layernorm(h.new_zeros(C, dtype=dtype).expand(h.shape), h, ln)[0])
        return self._marks.mark(_matmul_dtype(y), fn, h), h

    def mlp(self, x, c_fc, c_proj):
        if type(self._ops).mlp is not TorchOps.mlp:  # another MLP op (e.g. GELU fused into a GEMM): run it as is
            return self._ops.mlp(x, c_fc, c_proj)
        a = c_fc(x)  # (B, T, 4C): kept by GELU's backward
        g = F.gelu(a, approximate="tanh")  # TorchOps.mlp's math
        return c_proj(self._marks.mark(g, lambda: F.gelu(a, approximate="tanh"), a))


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
        autocast = (self.device.type, False, torch.get_autocast_dtype(self.device.type))
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
