"""Zero-bubble pipelines' split backward: the Linears' weight gradients deferred from B to W (Qi et al. 2023).

ZB-H1 (pp.py) runs a micro-batch's backward in two actions: B, the input gradient the upstream stage waits for,
and W, the weight gradient nobody waits for, scheduled into what would be bubbles. Without help W must walk the
chunk's autograd graph a second time (B + W > one backward). Here the chunk's Linears record what their weight
gradient needs instead:

    deferred = DeferredWeightGrads(chunk)   # the chunk's model.Linear modules run through _Linear from now on
    with deferred.recording(mb):            # B: dx (and biases) now; each Linear stores (input, output grad)
        torch.autograd.backward(y, dy, inputs=[x, *deferred.eager_params])
    deferred.run(mb)                        # W: dW = dy^T x per stored Linear, into .grad as autograd would

B accumulates every parameter that is not a deferred weight (LayerNorms, biases, embeddings, experts, TP and FP8
layers) through `inputs=`, so the graph is walked once. W replays nothing: one GEMM per Linear, through small
autograd nodes (_WeightGrads, one per W_GROUP = 4 Linears) so the gradients land as autograd's would: AccumulateGrad,
the engines' hooks and gradient destinations (model.matmul_weight) all apply. Outside `recording`, _Linear
computes dW at once, like F.linear. The arithmetic mirrors F.linear's own backward (addmm on the rows folded to
2-D), so the gradients equal the unsplit backward's bit for bit on the same device (tests/test_pp.py).

Memory: each deferred Linear holds its input and output gradient from B until W; ZB-H1 keeps at most p micro-
batches in flight, as 1F1B does, and W frees them, holding at most W_GROUP new weight gradients at a time. Under
autocast the bf16 weight cast is made once per step (`new_step`), as autocast's own cache does for F.linear.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanopara.model import Linear, matmul_weight


class _Linear(torch.autograd.Function):
    """y = x w^T + b; backward: dx and db always, dw now or (while its recorder is on) stored for W."""

    @staticmethod
    def forward(ctx, x, w, b, lin, rec):
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        xc, wc = x.to(dt), rec.cast(w, dt)
        bc = None if b is None else b.to(dt)
        ctx.save_for_backward(xc, wc)
        ctx.lin, ctx.rec = lin, rec
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.to(w.dtype).reshape(-1, dy.shape[-1])  # (N, out)
        dx = dy2.mm(w).view(*dy.shape[:-1], w.shape[1]).to(ctx.dtypes[0])
        db = None if ctx.dtypes[2] is None else dy2.sum(0).to(ctx.dtypes[2])
        if ctx.rec.key is not None:  # B of a split backward: the weight gradient waits for W
            ctx.rec.stored.setdefault(ctx.rec.key, []).append((ctx.lin, x.detach(), dy2.detach()))
            return dx, None, db, None, None
        return dx, weight_grad(x, dy2).to(ctx.dtypes[1]), db, None, None


def weight_grad(x: torch.Tensor, dy2: torch.Tensor) -> torch.Tensor:
    """dW (out, in) from the input x (..., in) and the output gradient (N, out), as addmm's backward makes it."""
    return x.reshape(-1, x.shape[-1]).t().mm(dy2).t()


W_GROUP = 4  # Linears per W node: a block's; its backward makes their dW at once (the transient memory of W)


class _WeightGrads(torch.autograd.Function):
    """One node whose backward hands each of a few weights its stored dW: W's way into AccumulateGrad and the
    engines' hooks, with a node per W_GROUP Linears rather than one per Linear (each node is host time). The
    engine adds a node's gradients before it runs the next, so W holds at most W_GROUP weight gradients unadded."""

    @staticmethod
    def forward(ctx, pairs, *weights):
        ctx.pairs, ctx.dtypes = pairs, [w.dtype for w in weights]  # pairs: [(x, dy2)] in the weights' order
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        pairs, ctx.pairs = ctx.pairs, None  # freed as soon as their products exist
        return (None, *[weight_grad(x, dy2).to(dt) for (x, dy2), dt in zip(pairs, ctx.dtypes)])


class DeferredWeightGrads:
    """The deferred weight gradients of one chunk's Linears (exactly model.Linear, whose weight no other module
    holds: TP, FP8 and MoE layers and a tied weight keep their own backward and count as eager parameters)."""

    def __init__(self, chunk: nn.Module):
        self.key, self.stored, self._casts = None, {}, {}
        owners = {}  # parameter -> how many modules hold it: a tied weight (wte = lm_head in one chunk) stays eager
        for m in chunk.modules():
            for p in m._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        self.linears = [m for m in chunk.modules() if type(m) is Linear and owners[id(m.weight)] == 1]
        deferred = {id(m.weight) for m in self.linears}
        self.weights = [m.weight for m in self.linears]
        self.eager_params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in deferred]
        for m in self.linears:
            m.forward = self._forward_of(m)  # this instance only: the class (and other models) unchanged

    def _forward_of(self, lin):
        def forward(x):
            return _Linear.apply(x, matmul_weight(lin.weight), lin.bias, lin, self)
        return forward

    def cast(self, w: torch.Tensor, dtype) -> torch.Tensor:
        """w in dtype, made once per step (new_step) and shared by the step's micro-batches."""
        if w.dtype == dtype:
            return w
        hit = self._casts.get(id(w))
        if hit is None or hit[0] is not w:
            hit = self._casts[id(w)] = (w, w.detach().to(dtype))
        return hit[1]

    def new_step(self) -> None:
        """The weights changed: forget the casts."""
        self._casts.clear()

    @contextlib.contextmanager
    def recording(self, key):
        """Backwards run inside store the Linears' weight-gradient inputs under `key` (a micro-batch)."""
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def run(self, key) -> None:
        """W: the weight gradients stored under `key`, accumulated into the weights as autograd would."""
        work = self.stored.pop(key, [])
        if work:  # a node per W_GROUP Linears: fewer nodes, while at most W_GROUP weight gradients exist unadded
            outs = [_WeightGrads.apply([(x, dy2) for _, x, dy2 in group], *[matmul_weight(lin.weight)
                                                                              for lin, _, _ in group])
                    for group in (work[i:i + W_GROUP] for i in range(0, len(work), W_GROUP))]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
