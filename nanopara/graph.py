"""One micro-step's forward + backward replayed as a CUDA graph (`--train.cuda_graph=true`).

Why: in eager mode the host launches every kernel of the step (~1,000 for GPT-2 124M) from Python; at B=32, T=1024
on an H200 the GPU then idles ~6 ms of a ~67 ms step waiting for the CPU. A CUDA graph records the launches once
and replays them with one call. Our Triton kernels launch their compiled binaries directly (kernels/launch.py),
which a graph can record once the first eager calls have tuned and compiled them.

What is captured: `model(x, y)` under autocast and `(loss * scale).backward()`, with x, y copied into static input
buffers before each replay. Gradients accumulate in place into the parameters' existing .grad tensors, so gradient
accumulation works unchanged: the engine zeroes them in place after each step instead of freeing them
(`engine.keep_grad_buffers`). The optimizer step, clipping and logging stay eager. Before capturing, `warmup`
eager micro-steps run on a side stream (tuning, compiling, cuBLAS and allocator warm-up), and their gradients are
zeroed: the first replay starts from the state an eager run would.

Pipeline parallel (`GraphedPipelineStep`): the whole step of this rank's schedule (every micro-batch's F/B/W, the
send/recv batches between them, the loss broadcast and the tied-weight gradient sum) is one graph per rank, captured
by all pp ranks together; a replay launches the step's thousands of kernels and its p2p with one call, so small
micro-batches stop being host-bound (notes/pp.md). The schedule is static, so every replay repeats the same messages.

Limits, checked by parallel.check_layout before any work: a CUDA device; dp = cp = 1 (tensor and pipeline parallel:
their collectives and send/recv run inside the captured region, so the graph records them; DDP/ZeRO launch
communication from Python hooks, which a replay would not run); fixed shapes; no fp16 dynamic loss scaling; no
dropout under sequence parallel (tp._PerRankDropoutRng swaps RNG states from Python hooks). FP8 (train.fp8): the
weight casts are captured and run on every replay (the same values); activation scales and delayed scaling's amax
histories live on the device, so nothing syncs.

Tested by tests/test_graph.py (GPU: graphed and eager training give the same losses and weights, pp2 included;
CPU: the layout errors) and tests/test_capture_safety.py (CPU, tp2 +- sp and pp2: the captured region makes no host
sync, no host-to-device copy and the same collectives on every rank); measured by bench/bench_layout.py.
"""
from __future__ import annotations

import torch


class GraphedMicroStep:
    """`step(x, y) -> loss`: one forward + backward, replayed from a CUDA graph captured on the first call.

    model: the module to run (the engine's model); amp: a callable returning the autocast context (or a null
    context); scale: the constant the loss is multiplied by before backward (1 / accumulation steps); engine: its
    gradients are kept allocated and zeroed in place. The returned loss is a static buffer overwritten by the next
    replay: read or accumulate it before calling again.
    """

    def __init__(self, model, amp, scale: float, engine, warmup: int = 3):
        self.model, self.amp, self.scale, self.engine, self.warmup = model, amp, scale, engine, warmup
        self.graph = None
        engine.keep_grad_buffers = True

    def _fwd_bwd(self, x, y):
        with self.amp():
            _, loss = self.model(x, y)
        (loss.float() * self.scale).backward()
        return loss.detach()

    def _before_capture(self):
        """Between the eager warm-up and the capture (tests/test_capture_safety.py runs the same sequence on CPU:
        warm-up `_fwd_bwd` calls, this, then the `_fwd_bwd` a capture would record)."""
        self.engine.zero_grad_buffers()
        tp = getattr(self.model, "tp_state", None)
        if tp is not None and tp.sp and self.model.cfg.dropout > 0:  # as parallel.check_layout, for direct callers
            raise ValueError("cuda_graph with sequence parallel and dropout: tp.py swaps each rank's RNG state from "
                             "Python hooks, which a capture cannot record")
        fp8 = getattr(self.model, "fp8", None)
        if fp8 is not None:  # FP8 (fp8.py): a stale weight cache now makes the capture record each layer's weight
            fp8.step()  # cast, so every replay casts the weights it reads (no Python check on replay); delayed
            # scaling's amax histories were made by the warm-up and are updated in place, so replays advance them

    def _capture(self, x, y):
        self.x, self.y = x.clone(), y.clone()  # static inputs: each replay reads these addresses
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up: tunes and compiles every kernel, creates every .grad
            for _ in range(self.warmup):
                self._fwd_bwd(self.x, self.y)
        torch.cuda.current_stream().wait_stream(side)
        self._before_capture()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._fwd_bwd(self.x, self.y)

    def __call__(self, x, y):
        if self.graph is None:
            self._capture(x, y)
        elif x.shape != self.x.shape or y.shape != self.y.shape:
            raise ValueError(f"cuda_graph: batch shape changed from {tuple(self.x.shape)} to {tuple(x.shape)}")
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.loss

    def close(self):
        """Free the graph. Before destroy_process_group: NCCL kernels captured in a live graph make ncclCommDestroy
        hang (pytorch/pytorch#115388; measured: tp2 runs that finished training hung at exit)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None


class GraphedPipelineStep:
    """`step(xs, ys, scale) -> loss`: pp.Pipeline.step over the step's m micro-batches plus the tied-weight gradient
    sum, replayed from one CUDA graph per rank (captured on the first call, by every pp rank at the same call).

    xs / ys: this stage's token ids / targets per micro-batch (None where the stage reads none), copied into static
    buffers before each replay; scale: the loss factor (constant: fp16's dynamic scale is refused). The returned
    loss is a static buffer overwritten by the next replay."""

    def __init__(self, pipe, engine, fp8=None, warmup: int = 2):
        self.pipe, self.engine, self.fp8, self.warmup = pipe, engine, fp8, warmup
        self.graph, self.scale = None, None
        engine.keep_grad_buffers = True

    def _step(self):
        from nanopara.pp import sync_tied_grads
        with self.engine.no_sync():
            loss = self.pipe.step(self.xs, self.ys, self.scale)
        sync_tied_grads(self.pipe.chunks.values(), self.pipe.tied_group)
        return loss.detach()

    def _capture(self, xs, ys):
        self.xs = None if xs is None else [x.clone() for x in xs]
        self.ys = None if ys is None else [y.clone() for y in ys]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up: compiles kernels, creates .grad and every p2p communicator
            for _ in range(self.warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.engine.zero_grad_buffers()
        if self.fp8 is not None:  # as GraphedMicroStep: the capture records each layer's weight cast
            self.fp8.step()
        torch.cuda.empty_cache()  # the warm-up's cached activations: the graph's pool holds the step's own
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step()

    def __call__(self, xs, ys, scale: float):
        if self.graph is None:
            self.scale = scale
            self._capture(xs, ys)
        elif scale != self.scale:
            raise ValueError(f"cuda_graph: the pipeline's loss scale changed from {self.scale} to {scale}")
        for static, new in ((self.xs, xs), (self.ys, ys)):
            for s, t in zip(static or (), new or ()):
                if s.shape != t.shape:
                    raise ValueError(f"cuda_graph: batch shape changed from {tuple(s.shape)} to {tuple(t.shape)}")
                s.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.loss

    def close(self):
        """Free the graph before destroy_process_group (GraphedMicroStep.close)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None
