"""A training step replayed as a CUDA graph (`--train.cuda_graph`, auto-on for tp / pp: parallel.use_cuda_graph).

Why: in eager mode the host launches every kernel of the step from Python; where that is slower than the GPU (small
micro-batches, tp, pipeline stages) the GPU idles. A graph records the launches once and replays them with one
call. Our Triton kernels launch their compiled binaries directly (kernels/launch.py), so a graph can record them.

GraphedMicroStep (one GPU, tp): `model(x, y)` under autocast and `(loss * scale).backward()`, x, y copied into static
buffers before each replay. Gradients accumulate in place into the existing .grad tensors (the engine zeroes them
in place: `engine.keep_grad_buffers`), or with one replay a step are written whole into tensors the capture made
(`overwrite`: no zeroing, no add); optimizer, clipping and logging stay eager. `warmup` eager calls first run
on a side stream (tuning, compiling, allocator), and their gradients are zeroed.
GraphedStep: a whole step per rank, captured by every rank at the same call, with dp > 1 its DDP / ZeRO-1 gradient
reduction too (the bucket hooks run during the capture, so it records their collectives). GraphedPipelineStep:
this rank's pipeline schedule (F/B/W, send/recv, the loss broadcast, the tied-weight sum; notes/pp.md).
GraphedAccumStep: the m micro-steps of a data-parallel step (with or without tp).
tp_streams=2 (parallel.tp_streams): each micro-step is tp_streams.split_fwd_bwd, two halves on two side streams,
which the capture records as two branches.

Limits, checked by parallel.check_layout: CUDA; cp = 1 and ZeRO <= 1 (the ring's and ZeRO-2/3's buffers are made
from Python between micro-steps); fixed shapes; no fp16 dynamic loss scaling; no dropout under sequence parallel
(RNG swaps from Python hooks). FP8: the weight casts are captured and run on every replay; activation scales and
delayed amax histories live on the device. Tested by tests/test_graph.py, tests/test_pp.py (GPU: graphed == eager)
and tests/test_capture_safety.py (CPU: tp2 +- sp, pp2, dp2, pp2 x dp2; no host sync or host copy in the captured
region, the same collectives each step, every reduction waited for inside it).
"""
from __future__ import annotations

import torch

from nanopara.tp_streams import make_streams, split_fwd_bwd


class GraphedMicroStep:
    """`step(x, y) -> loss`: one forward + backward, replayed from a CUDA graph captured on the first call.

    model: the module to run (the engine's model); amp: a callable returning the autocast context (or a null
    context); scale: the constant the loss is multiplied by before backward (1 / accumulation steps); engine: its
    gradients are kept allocated and zeroed in place. The returned loss is a static buffer overwritten by the next
    replay: read or accumulate it before calling again.
    """

    def __init__(self, model, amp, scale: float, engine, warmup: int = 3, tp_streams: int = 1,
                 overwrite: bool = False):
        self.model, self.amp, self.scale, self.engine, self.warmup = model, amp, scale, engine, warmup
        self.graph = None
        self.split = tp_streams > 1  # the batch in two halves on two streams, made once (the capture reuses them)
        self.streams = make_streams(engine.device) if self.split else None
        # one replay a step (no accumulation, one stream): captured with .grad unset, the backward writes each
        # gradient whole into the graph's own tensors, so nothing is zeroed or added into (an fp32 add and a memset
        # over every parameter a step otherwise: gpt_1b graphed ran 0.96x eager, results/fp8_e2e_compile_h100.txt)
        self.overwrite = overwrite and not self.split
        engine.keep_grad_buffers = True

    def _fwd_bwd(self, x, y):
        if self.split:
            return split_fwd_bwd(self.model, self.amp, x, y, self.scale, self.streams)
        with self.amp():
            _, loss = self.model(x, y)
        (loss.float() * self.scale).backward()
        return loss.detach()

    def _before_capture(self):
        """Between the eager warm-up and the capture (tests/test_capture_safety.py runs the same sequence on CPU:
        warm-up `_fwd_bwd` calls, this, then the `_fwd_bwd` a capture would record)."""
        if self.overwrite:
            self.engine.drop_grads()
            self.engine.grads_overwritten = True  # its step leaves the graph's .grad tensors as they are
        else:
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


class GraphedStep:
    """`step(xs, ys, scale) -> loss`: a whole optimizer step's micro-batches (`_body`) and, with dp > 1 (DDP or
    ZeRO-1), the gradient reduction, replayed from one CUDA graph per rank (captured on the first call, by every rank
    of the step's groups at the same call). xs / ys: token ids / targets per micro-batch (None where a pipeline
    stage reads none), copied into static buffers before each replay; scale: the loss factor (constant: fp16's
    dynamic scale is refused). The reduction: the engine's bucket hooks run during the capture, so each bucket's
    collective is recorded where the backward completed it; the rest, and every wait, at the end of the step
    (engine._finish_grads; engine.reduced_in_graph makes step() skip its own). The returned loss is a static
    buffer overwritten by the next replay."""

    def __init__(self, engine, fp8=None, warmup: int = 2):
        self.engine, self.fp8, self.warmup = engine, fp8, warmup
        self.graph, self.scale = None, None
        engine.keep_grad_buffers = True
        engine.zero_grad_buffers()  # DDP: every .grad becomes its bucket slot now, before anything is captured
        engine.reduced_in_graph = engine.n > 1

    def _body(self) -> torch.Tensor:
        raise NotImplementedError

    def _step(self):
        self.engine._live = set()  # as step() leaves it: the warm-up steps run back to back, with no step() between
        loss = self._body()
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
        self.engine.wait_params()  # ZeRO prefetch: a replay runs no hooks; the stream waits for every gather
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


class GraphedPipelineStep(GraphedStep):
    """pp.Pipeline.step over this rank's schedule (every micro-batch's F/B/W, the send/recv batches, the loss
    broadcast) plus the tied-weight gradient sum, as one graph per rank."""

    def __init__(self, pipe, engine, fp8=None, warmup: int = 2):
        super().__init__(engine, fp8, warmup)
        self.pipe = pipe

    def _body(self) -> torch.Tensor:
        from nanopara.pp import sync_tied_grads
        with self.engine.no_sync():
            loss = self.pipe.step(self.xs, self.ys, self.scale)
        sync_tied_grads(self.pipe.chunks.values(), self.pipe.tied_group)
        return loss


class GraphedAccumStep(GraphedStep):
    """The m micro-steps of a data-parallel step (with or without tp), each forward under autocast and backward
    through the engine (no_sync but for the last), as one graph per rank: one replay launches the step's kernels
    and its dp collectives. scale: the loss factor of each micro-batch (1 / m: engine.backward takes 1 / (dp*cp))."""

    def __init__(self, model, amp, engine, fp8=None, warmup: int = 2, tp_streams: int = 1):
        super().__init__(engine, fp8, warmup)
        self.model, self.amp = model, amp
        self.split = tp_streams > 1
        self.streams = make_streams(engine.device) if self.split else None

    def _body(self) -> torch.Tensor:
        loss = torch.zeros((), device=self.xs[0].device)
        for i, (x, y) in enumerate(zip(self.xs, self.ys)):
            with self.engine.no_sync(i < len(self.xs) - 1 or self.split):  # split: reduced by _step, after the join
                if self.split:
                    step_loss = split_fwd_bwd(self.model, self.amp, x, y, self.scale, self.streams,
                                              self.engine.backward)
                else:
                    with self.amp():
                        _, step_loss = self.model(x, y)
                    self.engine.backward(step_loss.float() * self.scale)
            loss = loss + step_loss.detach().float()
        return loss / len(self.xs)
