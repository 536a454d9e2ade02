"""Batch-split streams (parallel.tp_streams=2): one half of a micro-batch computes while the other's tp collective runs.

Issue #42 (notes/tp.md): under a CUDA graph, tp2's all-reduces run with nothing beside them. Here a micro-step's B
rows are cut into two halves (DeepSpeed-Domino's idea), A on one CUDA stream and B on another, and the forward is
driven stage by stage (GPT.embed, each block, GPT.head): A's block, then B's. A process group runs its collectives
in the order they are issued, on its one NCCL stream, and each makes only the stream that issued it wait, so
while A's all-reduce runs the GPU can compute B's block, and the reverse. Stage by stage matters: run whole, A's forward
would queue all its collectives before B's first, and B would wait for A's forward to end.
The two mean losses are averaged (equal halves, no ignored targets: the full batch's mean) and one backward
runs: autograd runs each op's backward on its forward's stream and takes ready nodes newest first, so the
backward alternates between the halves block by block too. Under a CUDA graph (graph.py) the capture records two
branches that the GPU may overlap with no host involved; eager mode is not expected to gain (host-bound).
Streams: both fork from the caller's stream and it waits for both after the backward; the inputs are the
caller's, alive past that join; B's embedding waits for A's (SP's position table is made by the first call).
On CPU there are no streams: the same halves and math, one after the other (what the CPU tests exercise).
Limits (Config.check): tp > 1, pp = cp = 1, an even micro_batch; not with MoE, FP8, compile, ZeRO-2/3,
grad_dests=on, or SP with dropout. Loss masks and a loss_fn are refused (train.py, Trainer.forward_backward).
dp > 1: the backward runs under no_sync (mixed streams) and engine.step / the graph's end reduces, after the join.
Used by trainer.py and graph.py; tests: tests/test_tp_streams.py, tests/test_capture_safety.py; notes/tp.md.
"""
from __future__ import annotations

import contextlib

import torch


def make_streams(device: torch.device):
    """The two side streams of split_fwd_bwd on a CUDA device (made once: a graph capture reuses them); None on
    any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def _stages(model, x, y):
    """GPT.forward(x, y) as a generator: yields None after the embedding and after each block, then the loss."""
    h, m, ops = model.embed(x), None, model.ops_for(x.device)
    yield None
    for block in model.transformer.h:
        h, m = block(h, ops, None, m)
        yield None
    yield model.head(h, m, y)[1]


def split_fwd_bwd(model, amp, x, y, scale: float, streams, backward=None) -> torch.Tensor:
    """One micro-step's forward + backward as two halves of the batch: the mean loss (0-dim fp32, detached).

    model: a GPT (tp-sharded); amp: a callable returning the autocast context; scale: the factor of the loss in
    the backward; streams: make_streams' pair, or None (CPU: no streams); backward(loss): engine.backward, or
    None for loss.backward(). Under dp > 1 the caller runs it under engine.no_sync(): the gradient hooks would
    launch reductions on whichever stream finished a bucket, before the other stream's share of it."""
    if model._forward_pre_hooks or model._forward_hooks:
        raise ValueError("parallel.tp_streams=2 runs the model's stages, not its forward: its forward hooks "
                         "(SP's per-rank dropout RNG) would be skipped")
    n = x.shape[0] // 2
    if x.shape[0] != 2 * n:
        raise ValueError(f"parallel.tp_streams=2 needs an even micro-batch, got {x.shape[0]} rows")
    cur = torch.cuda.current_stream(x.device) if streams is not None else None
    on = [contextlib.nullcontext] * 2 if streams is None else [lambda s=s: torch.cuda.stream(s) for s in streams]
    if streams is not None:  # fork: both halves start after what the caller's stream has queued
        for s in streams:
            s.wait_stream(cur)
    runs = [_stages(model, x[:n], y[:n]), _stages(model, x[n:], y[n:])]
    outs, first = [None, None], True
    while outs[0] is None:  # the same stages in both halves: A's, then B's, to the losses
        for i, run in enumerate(runs):
            if first and i == 1 and streams is not None:  # B's embedding after A's (SP's cached positions)
                streams[1].wait_stream(streams[0])
            with on[i](), amp():  # autocast per stage: a cast it caches is never read on the other stream
                outs[i] = next(run)
        first = False
    if streams is not None:  # the losses meet on the caller's stream
        for s in streams:
            cur.wait_stream(s)
    loss = (outs[0].float() + outs[1].float()) / 2
    if backward is None:
        (loss * scale).backward()
    else:
        backward(loss * scale)
    if streams is not None:  # join: everything either half queued (gradients included) before what comes next
        for s in streams:
            cur.wait_stream(s)
    return loss.detach()
