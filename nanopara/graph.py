"""A training step replayed as a CUDA graph (`--train.cuda_graph`, auto-on for tp / pp: parallel.use_cuda_graph).

Why: in eager mode the host launches every kernel of the step from Python; where that is slower than the GPU (small
micro-batches, tp, pipeline stages) the GPU idles. A graph records the launches once and replays them with one
call. Our Triton kernels launch their compiled binaries directly (kernels/launch.py), so a graph can record them.

GraphedMicroStep (one GPU, tp): `model(x, y)` under autocast and `(loss * scale).backward()`, x, y copied into static
buffers before each replay. Gradients accumulate in place into the existing .grad tensors (the engine zeroes them
in place: `engine.keep_grad_buffers`); optimizer, clipping and logging stay eager. `warmup` eager calls first run
on a side stream (tuning, compiling, allocator), and their gradients are zeroed.
GraphedPipelineStep (pp, with or without tp): the whole step of this rank's schedule (every micro-batch's F/B/W, the
send/recv batches, the loss broadcast, the tied-weight gradient sum), one graph per rank captured by all pp ranks at
the same call; the schedule is static, so every replay repeats the same messages (notes/pp.md).

Limits, checked by parallel.check_layout: CUDA; dp = cp = 1 (DDP/ZeRO launch communication from Python hooks, which
a replay would skip); fixed shapes; no fp16 dynamic loss scaling; no dropout under sequence parallel (RNG swaps from
Python hooks). FP8: the weight casts are captured and run on every replay; activation scales and delayed amax
histories live on the device, so nothing syncs.
Tested by tests/test_graph.py, tests/test_pp.py (GPU: graphed == eager) and tests/test_capture_safety.py (CPU, tp2
+- sp and pp2: no host sync or host copy in the captured region, the same collectives each step).
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
    loss is a static buffer overwritten by the next replay. With dp > 1 (DDP or ZeRO-1) the gradient reduction is
    part of the graph: the hooks' bucket launches are recorded where the capture's backward made them, the rest and
    every wait at the end of the step (engine.reduced_in_graph), so the optimizer step stays eager."""

    def __init__(self, pipe, engine, fp8=None, warmup: int = 2):
        self.pipe, self.engine, self.fp8, self.warmup = pipe, engine, fp8, warmup
        self.graph, self.scale = None, None
        engine.keep_grad_buffers = True
        engine.zero_grad_buffers()  # DDP: every .grad becomes its bucket slot now, before anything is captured
        engine.reduced_in_graph = engine.n > 1  # pp x dp: the step's reduction is captured too (_step)

    def _step(self):
        from nanopara.pp import sync_tied_grads
        self.engine._live = set()  # as step() leaves it: the warm-up steps run back to back, with no step() between
        with self.engine.no_sync():
            loss = self.pipe.step(self.xs, self.ys, self.scale)
        sync_tied_grads(self.pipe.chunks.values(), self.pipe.tied_group)
        if self.engine.n > 1:  # DDP / ZeRO-1: the buckets the hooks launched, the rest, all waited for here, so
            self.engine._finish_grads()  # the graph ends with every reduction joined and step() has none to do
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
