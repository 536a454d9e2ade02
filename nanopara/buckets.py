"""Gradient buckets (DDP, ZeRO-1/2) and flat parameter buffers (ZeRO): how the engines group parameters.

grad_buckets: parameters in reverse registration order (about the order backward produces gradients), cut into
runs of at most parallel.bucket_mb; expert parameters (ep.py) never share a bucket with the others (they reduce
over the edp group, `reduce_group`), and the pipeline's tied weight (`pp_tied`) sits alone in the last bucket,
reduced after pp.sync_tied_grads (Megatron-LM#844). BucketHooks counts gradients into buckets from
post-accumulate-grad hooks and launches each full bucket in index order, so every rank issues the same
collectives in the same order (the engine defines `_launch(i)`).
Flat: a bucket's parameters end to end in one fp32 buffer, zero-padded to a multiple of N = dp*cp ranks; rank r
owns [r*padded/N, (r+1)*padded/N). Within it, decayed (2-D) parameters come first, then by tp kind, so a rank's
slice meets each (decay, kind) class in at most one piece. views: the 1-D slices of such a buffer.

Used by dp.py (DDP), zero.py (ZeRO-1/2) and zero3.py (ZeRO-3); tested through them by tests/test_dp.py.
"""
from __future__ import annotations

import torch

from nanopara.engine import param_kind, weak_method
from nanopara.optim import decays


def views(buf: torch.Tensor, sizes) -> list[torch.Tensor]:
    """Consecutive 1-D slices of buf. Not buf.split(): these views are updated in place (gradient accumulation,
    the optimizer), which autograd forbids on the outputs of a multi-output view op."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [buf[o:o + s] for o, s in zip(offsets, sizes)]


# ----------------------------------------------------------------------------------------------------------------
# gradient buckets (DDP, ZeRO-1/2)

def grad_buckets(params, cap_elems: int) -> list[list]:
    """Buckets of `params` in reverse registration order (about the order backward produces gradients), except the
    pipeline's tied weight (`pp_tied`), alone in the last bucket: its two halves are summed between the first and
    the last stage (pp.sync_tied_grads) before a reduction may touch it, and every other bucket may go first."""
    tied = [p for p in params if getattr(p, "pp_tied", False)]
    rest = [p for p in params[::-1] if not getattr(p, "pp_tied", False)]
    return split_buckets(rest, cap_elems) + ([tied] if tied else [])


def split_buckets(params, cap_elems: int) -> list[list]:
    """Consecutive runs of `params` of at most cap_elems elements each (a larger parameter gets its own); expert
    parameters (ep.py) and the others never share one, as they reduce over different groups."""
    out, cur, size = [], [], 0
    for p in params:
        if cur and (size + p.numel() > cap_elems or hasattr(p, "ep_dim") != hasattr(cur[0], "ep_dim")):
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    return out + ([cur] if cur else [])


def reduce_group(engine, params):
    """(group, size, index of this rank) that reduces `params`' gradients: the edp group for expert parameters
    (ep.py; group None when one rank holds each expert), else dp x cp."""
    if params and hasattr(params[0], "ep_dim"):
        mesh = engine.mesh
        return engine.edp_group, mesh.sizes["edp"], mesh.coords["edp"]
    return engine.group, engine.n, engine.r


class BucketHooks:
    """Count gradients into buckets (post-accumulate-grad hooks) and launch each full bucket, in index order, so
    every rank issues the same collectives in the same order. The engine defines `_launch(i) -> work`."""

    def _install_hooks(self, buckets):
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self._sizes = [len(b) for b in buckets]
        self._ready, self._next, self._works = [0] * len(buckets), 0, []
        for b in buckets:
            for p in b:
                self._handles.append(p.register_post_accumulate_grad_hook(weak_method(self, "_on_grad")))

    def _counts_now(self, p) -> bool:
        return self._sync or id(p) in self._live

    def _on_grad(self, p):
        if self._counts_now(p):
            self._ready[self._bucket_of[id(p)]] += 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False):
        # force: after backward, buckets whose parameters got no gradient (unused) still reduce, in order
        while self._next < len(self._sizes) and (force or self._ready[self._next] == self._sizes[self._next]):
            self._works.append(self._launch(self._next))
            self._next += 1

    def _check_single_sync(self):
        if self._sync and self._next:
            raise RuntimeError("a second gradient-synchronising backward before step(): run the non-final "
                               "micro-steps under engine.no_sync()")

    def _reset_buckets(self):
        self._ready, self._next = [0] * len(self._sizes), 0


# ----------------------------------------------------------------------------------------------------------------
# flat buffers (ZeRO)

class Flat:
    """Parameters laid end to end in one flat fp32 buffer, zero-padded to a multiple of N; rank r holds
    [lo, hi) = [r*padded/N, (r+1)*padded/N).

    Within the buffer, parameters are ordered decayed (2-D) first, then by tp kind, so each (decay, kind) class is
    one contiguous range and a rank's slice meets every class in at most one piece (few optimizer tensors, one
    norm term per class).
    """

    def __init__(self, name: str, params: list, names: list, n: int, r: int):
        order = sorted(range(len(params)), key=lambda i: (not decays(names[i], params[i]), param_kind(params[i])))
        self.name, self.params, self.names = name, [params[i] for i in order], [names[i] for i in order]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.padded = -(-self.numel // n) * n
        self.shard = self.padded // n
        self.lo, self.hi = r * self.shard, (r + 1) * self.shard
        self.expert = any(hasattr(p, "ep_dim") for p in self.params)  # ep.py: sharded over the edp group
        self.classes = []  # [start, end, decay, kind]
        for p, nm, off, size in zip(self.params, self.names, self.offsets, self.sizes):
            key = [decays(nm, p), param_kind(p)]
            if self.classes and self.classes[-1][2:] == key:
                self.classes[-1][1] = off + size
            else:
                self.classes.append([off, off + size, *key])

    def owned(self):
        """(start, end, decay, kind) of the pieces of [lo, hi) in each class, relative to lo."""
        for a, b, decay, kind in self.classes:
            x, y = max(a, self.lo), min(b, self.hi)
            if x < y:
                yield x - self.lo, y - self.lo, decay, kind

    def meta(self) -> dict:
        m = {"params": [[n, list(s), o] for n, s, o in zip(self.names, self.shapes, self.offsets)],
             "numel": self.numel, "padded": self.padded, "lo": self.lo, "hi": self.hi}
        return {**m, "expert": True} if self.expert else m  # (unchanged for checkpoints without experts)

    def slice_of(self, full: dict, device) -> torch.Tensor:
        """This rank's [lo, hi) of the flat buffer built from {name: full tensor} (padding and missing names: 0)."""
        out = torch.zeros(self.shard, device=device)
        for name, off, size in zip(self.names, self.offsets, self.sizes):
            a, b = max(off, self.lo), min(off + size, self.hi)
            if a < b and name in full:
                out[a - self.lo:b - self.lo] = full[name].reshape(-1)[a - off:b - off].to(device, torch.float32)
        return out
