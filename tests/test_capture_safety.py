"""Capture safety of the TP / SP micro-step (issue #30: tp2 + sp under --train.cuda_graph=true), checked on CPU.

graph.py captures `GraphedMicroStep._fwd_bwd` (forward under autocast + backward of one micro-step) after eager
warm-up calls of the same function. A CUDA graph capture breaks on what the host cannot record, and hangs where the
ranks disagree about communication. This test runs that exact region (warm-up calls, `_before_capture`, the call a
capture would record) of a tiny GPT built by parallel.parallelize, as train.py builds it, in 2 gloo processes, with
`CaptureProbe` watching every Python-level call, and asserts for the would-be-captured call:

  syncs        none of: Tensor.item / tolist / numpy / cpu / __bool__ / __int__ / __float__ / __index__,
               torch.equal / allclose / is_nonzero, .to("cpu"), torch.cuda.synchronize, Stream / Event
               synchronize (each a device-to-host wait; inside a capture it raises, and a rank that raises
               inside a capture leaves the other waiting in its next collective)
  dynamic      no data-dependent shapes: nonzero / argwhere / masked_select / unique / boolean-mask indexing
  host tensors no tensor made from host data (torch.tensor / as_tensor / from_numpy) and no device-less factory
               (torch.arange(k) with no device=: a CPU tensor in a GPU run) whose result meets the device tensors
               (an op mixing them, indexing with them, .to(device) / .cuda() / copy_ of them: a pageable H2D copy)
  rng          no RNG state reads or writes (torch.get_rng_state / set_rng_state / manual_seed, torch.cuda's):
               a replay re-runs none of them
  collectives  both ranks issue the same ordered list of (op, shapes, dtypes, group ranks, reduce op, async),
               the same list in the first warm-up call and in the captured call, and every async handle issued
               in the region is waited for inside it (an unjoined NCCL stream ends a capture with an error)

The same region with MoE layers (issue #44; notes/moe.md): one process (capacity, dropless, FP8 experts), tp2 + sp,
pp2, and ep2's exchange (capacity: fixed splits, no sync; dropless: its one documented split read).

Everything here is CPU and gloo: what it cannot see is listed in notes/tp.md ("SP under CUDA graphs"): whatever
the CUDA kernels, the caching allocator, NCCL or Triton do below Python.

    .venv/bin/python -m pytest -q tests/test_capture_safety.py
    .venv/bin/python tests/test_capture_safety.py      # prints every layout's report, offending sites included
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.autograd import _make_grads
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.distributed import spawn  # noqa: E402

T = torch.Tensor
SYNCS = {T.item, T.tolist, T.numpy, T.cpu, T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__,
         T.__array__, T.equal, T.allclose, T.is_nonzero, torch.equal, torch.allclose, torch.is_nonzero}
DYNAMIC = {T.nonzero, torch.nonzero, T.argwhere, torch.argwhere, T.masked_select, torch.masked_select, T.unique,
           torch.unique, T.unique_consecutive, torch.unique_consecutive}
FROM_HOST = {torch.tensor, torch.as_tensor, torch.from_numpy}  # host data: a copy from pageable memory
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn,
             torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided, torch.scalar_tensor}
MOVES = {T.to, T.cuda, T.copy_}
INDEXING = {T.__getitem__, T.__setitem__, T.index_select, torch.index_select, T.gather, torch.gather,
            T.index_add_, T.index_copy_, T.scatter_, T.scatter_add_}
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "batch_isend_irecv", "send", "recv", "barrier", "gather", "scatter",
               "all_gather_object", "broadcast_object_list")  # not isend / irecv: P2POp checks it is given them
# (pp.py's p2p goes through batch_isend_irecv, recorded with its ops' tensors)
RNG = [(torch, "get_rng_state"), (torch, "set_rng_state"), (torch, "manual_seed"), (torch, "seed"),
       (torch.random, "fork_rng"), (torch.cuda, "get_rng_state"), (torch.cuda, "set_rng_state"),
       (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"), (torch.cuda, "get_rng_state_all"),
       (torch.cuda, "set_rng_state_all")]
HOST_WAITS = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
              (torch.cuda.Stream, "query"), (torch.cuda.Event, "query")]


def _site() -> str:
    """file:line of the innermost frame of this repository's code (not tests/, not the venv), then its callers."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(ROOT)
              and not any(d in f.filename[len(ROOT):] for d in (os.sep + "tests" + os.sep, "site-packages"))]
    if not frames:
        return "<outside the repository>"
    chain = [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} ({f.name})" for f in reversed(frames[-4:])]
    return " <- ".join(chain)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _is_cpu_target(args, kwargs) -> bool:
    """.to(...) aimed at the host by name ("cpu" or torch.device("cpu") written out); a device object passed from
    the mesh cannot be told apart on a CPU run, so only literal strings count."""
    targets = [a for a in args if isinstance(a, str)] + [kwargs.get("device")]
    return any(isinstance(t, str) and t.startswith("cpu") for t in targets)


def _has_device(kwargs) -> bool:
    return kwargs.get("device") is not None


def _flat_tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _flat_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flat_tensors(o, out)
    return out


class _Mode(TorchFunctionMode):
    def __init__(self, probe):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is T.backward:  # a mode is off while it handles a call: run the engine with a mode of its own on,
            # so the backward's Python (custom Functions, hooks) is recorded too
            (t, *rest), grad = args, kwargs.get("gradient")
            grad = rest[0] if rest and grad is None else grad
            grads = _make_grads((t,), (grad,), is_grads_batched=False)
            with _Mode(self.probe):
                _engine_run_backward((t,), grads, bool(kwargs.get("retain_graph")), False, (),
                                     allow_unreachable=True, accumulate_grad=True)
            return None
        out = func(*args, **kwargs)
        if self.probe.active:
            self.probe.torch_call(func, args, kwargs, out)
        return out


class _Work:
    """An async collective's handle that tells the probe when it is waited for."""

    def __init__(self, work, probe, idx):
        self._work, self._probe, self._idx = work, probe, idx

    def wait(self, *a, **k):
        self._probe.waited.add(self._idx)
        return self._work.wait(*a, **k)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CaptureProbe:
    """Records, while `region(label)` is open, the calls a CUDA graph capture cannot hold (see the module docstring)
    and the collectives issued; install() once per process (patches torch.distributed and the RNG / stream calls)."""

    def __init__(self):
        self.active = False
        self.events, self.collectives, self.waited = [], [], set()
        self._host = {}  # id -> weakref: tensors made on the host inside a region (and what is computed from them)
        self._saved = []

    # --- patching
    def _patch(self, obj, name, make):
        orig = getattr(obj, name, None)
        if orig is None:
            return
        self._saved.append((obj, name, orig))
        setattr(obj, name, make(orig))

    def install(self):
        for name in COLLECTIVES:
            self._patch(dist, name, lambda orig, name=name: self._collective(name, orig))
        for obj, name in RNG:
            self._patch(obj, name, lambda orig, name=name: self._plain("rng", f"{obj.__name__}.{name}", orig))
        for obj, name in HOST_WAITS:
            self._patch(obj, name, lambda orig, name=name, obj=obj: self._plain("sync", f"{obj.__name__}.{name}",
                                                                                  orig))
        return self

    def uninstall(self):
        for obj, name, orig in reversed(self._saved):
            setattr(obj, name, orig)
        self._saved = []

    def _plain(self, kind, what, orig):
        def wrapper(*args, **kwargs):
            if self.active:
                self._event(kind, what)
            return orig(*args, **kwargs)
        return wrapper

    def _collective(self, name, orig):
        def wrapper(*args, **kwargs):
            if not self.active:
                return orig(*args, **kwargs)
            group = kwargs.get("group")
            tensors = _flat_tensors([a for a in args if not isinstance(a, dist.ProcessGroup)], [])
            if name == "batch_isend_irecv":
                tensors = [op.tensor for op in args[0]]
            op = kwargs.get("op")
            sig = dict(op=name, shapes=[list(t.shape) for t in tensors], dtypes=[str(t.dtype) for t in tensors],
                       group=dist.get_process_group_ranks(group) if group is not None else "world",
                       reduce=str(op) if op is not None else None, async_op=bool(kwargs.get("async_op", False)),
                       site=_site())
            idx = len(self.collectives)
            self.collectives.append(sig)
            work = orig(*args, **kwargs)
            if sig["async_op"] and work is not None:
                return _Work(work, self, idx)
            return work
        return wrapper

    # --- recording
    def is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, tensors):
        for t in tensors:
            self._host[id(t)] = weakref.ref(t)

    def _event(self, kind, what):
        self.events.append(dict(kind=kind, what=what, site=_site()))

    def torch_call(self, func, args, kwargs, out):
        if func in SYNCS:
            return self._event("sync", _name(func))
        if func in DYNAMIC:
            return self._event("dynamic", _name(func))
        tensors = _flat_tensors(list(args) + list(kwargs.values()), [])
        host = [t for t in tensors if self.is_host(t)]
        outs = _flat_tensors(out, [])
        if func in FROM_HOST and not (args and isinstance(args[0], torch.Tensor)):
            where = "" if _has_device(kwargs) else ", left on the host"
            self._event("host_tensor", f"{_name(func)} (copy of host data{where})")
            if not _has_device(kwargs):
                self.mark_host(outs)
            return
        if func in FACTORIES and not _has_device(kwargs):
            self.mark_host(outs)  # harmless until it meets a device tensor (checked below)
            return
        if func is T.to and _is_cpu_target(args[1:], kwargs):
            return self._event("sync", "Tensor.to(cpu)")
        if func in (T.__getitem__, T.__setitem__):
            idx = args[1] if len(args) > 1 else None
            for t in _flat_tensors(idx if isinstance(idx, (tuple, list)) else [idx], []):
                if t.dtype == torch.bool and t.dim() > 0:
                    self._event("dynamic", "boolean-mask indexing")
        if host:
            if func in MOVES and (func is T.cuda or func is T.copy_ or self.is_host(args[0])):
                self._event("h2d", f"{_name(func)} of a tensor made on the host in the step")
                for t in outs:  # the copy is on the device (on a CPU run .to(cpu) returns the tensor itself)
                    self._host.pop(id(t), None)
                return
            device_side = [t for t in tensors if not self.is_host(t) and t.dim() > 0]
            if device_side:  # a host tensor meets device tensors: an implicit (pageable) copy or a device error
                return self._event("h2d", f"{_name(func)} mixes a tensor made on the host in the step with device "
                                          f"tensors")
            self.mark_host(outs)  # host-only arithmetic stays on the host

    @contextlib.contextmanager
    def region(self):
        """Record into fresh lists while the block runs; yields a dict filled with the results at exit."""
        res = {}
        self.events, self.collectives, self.waited = [], [], set()
        self.active = True
        try:
            with _Mode(self):
                yield res
        finally:
            self.active = False
            unwaited = [c for i, c in enumerate(self.collectives) if c["async_op"] and i not in self.waited]
            for c in unwaited:
                self.events.append(dict(kind="unwaited", what=f"async {c['op']} not waited in the region",
                                        site=c["site"]))
            res.update(events=self.events, collectives=self.collectives)


def signature(collectives) -> list:
    """What must agree across ranks and steps (the call sites are for reading)."""
    return [(c["op"], c["shapes"], c["dtypes"], c["group"], c["reduce"], c["async_op"]) for c in collectives]


# ----------------------------------------------------------------------------------------------------------------
# the layouts and the worker

LAYOUTS = {  # label -> (parallel flags, train flags, model flags)
    "tp2": (dict(), dict(), dict()),
    "tp2_sp": (dict(sp=True), dict(), dict()),
    "tp2_sp_keep": (dict(sp=True, sp_keep_gathered=True), dict(), dict()),
    "tp2_overlap2": (dict(tp_overlap=2), dict(), dict()),
    "tp2_sp_overlap2": (dict(sp=True, tp_overlap=2), dict(), dict()),
    "tp2_sp_fp8": (dict(sp=True), dict(fp8="tensor"), dict()),
    "tp2_sp_fp8_row": (dict(sp=True), dict(fp8="row"), dict()),
    "tp2_sp_bf16": (dict(sp=True), dict(dtype="bf16"), dict()),
    "tp2_sp_dropout": (dict(sp=True), dict(), dict(dropout=0.1)),  # known: refused with cuda_graph (parallel.py)
    "old_sp_positions": (dict(sp=True), dict(), dict()),  # the probe's own check: SP positions built on the host
    "tp2_sp_moe": (dict(sp=True), dict(), dict(n_embd=16, moe_experts=4, moe_top_k=2, moe_every=2, moe_capacity=1.0,
                                                moe_impl="triton", moe_bias_rate=0.01)),  # test_moe_* below
    "tp2_streams2": (dict(tp_streams=2), dict(), dict()),  # tp_streams.py: two halves, block by block
    "tp2_sp_streams2": (dict(sp=True, tp_streams=2), dict(), dict()),
}


def _old_sp_positions(self, pos):
    """SeqShardedPositions.forward as it was before its host-to-device copy was removed (a pageable copy every
    forward): the probe must flag it in the captured call."""
    from nanopara.tp_linear import blocks, shard_rows
    s = self.state
    B, T = s.batch, pos.shape[0]
    rows = shard_rows(B * T, s.rank, s.tp, blocks(B * T // s.tp, s.chunks))
    return torch.nn.functional.embedding(pos[(rows % T).to(pos.device)], self.weight).view(B, T // s.tp, -1)


def _run_layout(label, mesh, warmup=2):
    from nanopara.config import Config, ModelConfig
    from nanopara.graph import GraphedMicroStep
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    par, train, model_kw = LAYOUTS[label]
    cfg = Config(device="cpu", seed=0)
    cfg.model = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=250, kernels="torch")
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    cfg.parallel.tp = 2
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    torch.manual_seed(0)
    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    engine = trainer.engine
    if label == "old_sp_positions":
        import types
        wpe = engine.model.transformer.wpe
        wpe.forward = types.MethodType(_old_sp_positions, wpe)
    micro = GraphedMicroStep(engine.model, trainer.amp, 0.5, engine, warmup=warmup,
                             tp_streams=cfg.parallel.tp_streams)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen)
    y = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen)
    micro.x, micro.y = x.clone(), y.clone()  # graph.py's static inputs
    probe = PROBE
    steps = []
    for i in range(warmup):  # graph.py's eager warm-up (on a side stream there)
        with probe.region() as res:
            micro._fwd_bwd(micro.x, micro.y)
        steps.append(dict(phase=f"warmup{i}", **res))
    try:
        micro._before_capture()
    except ValueError as e:  # graph.py refuses this layout before capturing
        engine.close()
        return steps, str(e)
    with probe.region() as res:  # what torch.cuda.graph would record
        loss = micro._fwd_bwd(micro.x, micro.y)
    steps.append(dict(phase="capture", **res))
    assert torch.isfinite(loss), label
    engine.close()
    return steps, None


def _compare(label, steps, rank, world):
    """Collective lists per phase from every rank (all_gather_object, outside any region): the mismatches."""
    mine = [signature(s["collectives"]) for s in steps]
    every = [None] * world
    dist.all_gather_object(every, mine)
    problems = []
    for phase, seqs in zip([s["phase"] for s in steps], zip(*every)):
        for r in range(1, world):
            if json.dumps(seqs[r]) != json.dumps(seqs[0]):
                n = next((i for i, (a, b) in enumerate(zip(seqs[0], seqs[r])) if a != b), min(len(seqs[0]),
                                                                                            len(seqs[r])))
                problems.append(f"{label} {phase}: rank {r} differs from rank 0 at collective {n} "
                                f"({len(seqs[r])} vs {len(seqs[0])} issued)")
    if json.dumps(mine[0]) != json.dumps(mine[-1]):
        problems.append(f"{label}: rank {rank}'s captured call issues other collectives than its first warm-up call")
    return problems


PROBE = None


def _worker(rank, world, labels, out_dir):
    global PROBE
    torch.set_num_threads(1)
    from nanopara.mesh import Mesh
    mesh = Mesh.build(tp=2, device="cpu")
    PROBE = CaptureProbe().install()
    report = {}
    try:
        for label in labels:
            steps, refused = _run_layout(label, mesh)
            report[label] = dict(steps=steps, refused=refused, mismatch=_compare(label, steps, rank, world))
    finally:
        PROBE.uninstall()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


def run(labels) -> dict:
    """{rank: {label: {"steps": [...], "mismatch": [...]}}} from 2 gloo processes."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, list(labels), d)
        return {r: json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)}


def summarize(reports) -> str:
    lines = []
    for label in next(iter(reports.values())):
        for rank, rep in reports.items():
            for s in rep[label]["steps"]:
                ev = s["events"]
                lines.append(f"{label:16s} rank {rank} {s['phase']:8s}: {len(s['collectives']):3d} collectives, "
                             f"{len(ev)} events")
                seen = set()
                for e in ev:
                    key = (e["kind"], e["what"], e["site"])
                    if key not in seen:
                        seen.add(key)
                        n = sum(1 for o in ev if (o["kind"], o["what"], o["site"]) == key)
                        lines.append(f"    {e['kind']:11s} {e['what']}  x{n}  at {e['site']}")
            for m in rep[label]["mismatch"]:
                lines.append(f"    MISMATCH {m}")
            if rep[label]["refused"]:
                lines.append(f"    refused by graph.py before capture: {rep[label]['refused']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# the test

CHECKED = ("tp2", "tp2_sp", "tp2_sp_keep", "tp2_overlap2", "tp2_sp_overlap2", "tp2_sp_fp8", "tp2_sp_bf16")


def test_tp_sp_micro_step_is_capture_safe():
    """The region graph.py captures, under tp2 / tp2+sp (keep_gathered, overlap, FP8 tensor scaling, bf16 autocast):
    nothing that syncs the host or copies host data in, and the same collectives on both ranks, warm-up and
    capture alike. SP with dropout swaps RNG states inside the region: graph.py and check_layout refuse it."""
    reports = run(CHECKED + ("tp2_sp_dropout", "old_sp_positions"))
    text = summarize(reports)
    print(text)
    for rank, rep in reports.items():
        old = [e for e in rep["old_sp_positions"]["steps"][-1]["events"]]  # the bug fixed before: caught
        assert [e["kind"] for e in old] == ["h2d"] and old[0]["site"].startswith("nanopara/model.py"), old
        drop = rep["tp2_sp_dropout"]
        assert drop["refused"] and {e["kind"] for e in drop["steps"][-1]["events"]} == {"rng"}, text
        assert all("nanopara/tp.py" in e["site"] for e in drop["steps"][-1]["events"])
        for label in CHECKED:
            steps = rep[label]["steps"]
            assert not rep[label]["mismatch"] and not rep[label]["refused"], text
            cap = steps[-1]
            assert cap["phase"] == "capture"
            assert not cap["events"], f"{label} rank {rank}: {cap['events']}"
            assert cap["collectives"], label  # the probe saw the TP collectives at all
            for s in steps[:-1]:  # warm-up: only the first call's one-off host work (SP's cached row positions)
                assert all(e["kind"] in ("h2d", "host_tensor") for e in s["events"]), (label, s["events"])
    # SP issues its all-gathers / reduce-scatters; TP alone only all-reduces
    sp_ops = {c["op"] for c in reports[0]["tp2_sp"]["steps"][-1]["collectives"]}
    tp_ops = {c["op"] for c in reports[0]["tp2"]["steps"][-1]["collectives"]}
    assert tp_ops == {"all_reduce"} and "all_reduce" in sp_ops  # the loss's two all-reduces
    assert sp_ops & {"all_gather_into_tensor", "all_gather_single"} and \
        sp_ops & {"reduce_scatter_tensor", "reduce_scatter_single"}  # (torch 2.13 renamed them *_single)


def test_tp_streams_micro_step_is_capture_safe():
    """parallel.tp_streams=2 (tp_streams.split_fwd_bwd in GraphedMicroStep._fwd_bwd), tp2 +- sp: the region a
    capture records makes no host sync or host copy, both ranks issue the same collectives, warm-up and capture
    alike, and each half issues tp2's own: twice as many, on half the rows."""
    reports = run(("tp2", "tp2_sp", "tp2_streams2", "tp2_sp_streams2"))
    text = summarize(reports)
    print(text)
    for rank, rep in reports.items():
        for label in ("tp2_streams2", "tp2_sp_streams2"):
            steps = rep[label]["steps"]
            assert not rep[label]["mismatch"] and not rep[label]["refused"], text
            assert steps[-1]["phase"] == "capture" and not steps[-1]["events"], (label, rank, steps[-1]["events"])
            for s in steps[:-1]:  # warm-up: only the first call's one-off host work (SP's cached row positions)
                assert all(e["kind"] in ("h2d", "host_tensor") for e in s["events"]), (label, s["events"])
            one = rep[label.replace("_streams2", "")]["steps"][-1]["collectives"]
            two = steps[-1]["collectives"]
            assert len(two) == 2 * len(one) and {c["op"] for c in two} == {c["op"] for c in one}, label
            if label == "tp2_streams2":  # the all-reduced activations (B, T, C): B = 2 rows, 1 a half
                rows = [{c["shapes"][0][0] for c in cs if len(c["shapes"][0]) == 3} for cs in (one, two)]
                assert rows == [{2}, {1}], rows


def test_check_layout_refuses_sp_dropout_under_a_graph():
    from nanopara.config import ConfigError
    from nanopara.presets import PRESETS
    from nanopara.parallel import check_layout
    cfg = PRESETS["tiny"]()
    cfg.train.cuda_graph, cfg.parallel.tp, cfg.parallel.sp = "true", 2, True
    assert check_layout(cfg, 2, "cuda") == 1  # SP without dropout: captured (the test above)
    cfg.model.dropout = 0.1
    with pytest.raises(ConfigError, match="dropout"):
        check_layout(cfg, 2, "cuda")
    cfg.parallel.sp = False  # TP alone: every rank draws the same masks from the shared generator, in the graph
    assert check_layout(cfg, 2, "cuda") == 1


def _probe_graphed_step(step, engine, warmup: int = 2) -> list:
    """graph.GraphedStep's capture sequence under PROBE: `warmup` eager `_step` calls, the in-place zeroing, then the
    `_step` a capture would record; one report per phase."""
    steps = []
    for i in range(warmup):
        with PROBE.region() as res:
            step._step()
        steps.append(dict(phase=f"warmup{i}", **res))
    engine.zero_grad_buffers()
    with PROBE.region() as res:
        loss = step._step()
    steps.append(dict(phase="capture", **res))
    assert torch.isfinite(loss)
    return steps


def _pp_worker(rank, world, schedules, out_dir):
    """graph.GraphedPipelineStep's region on 2 gloo pp ranks: warm-up `_step` calls, the in-place zeroing, then the
    `_step` a capture would record (the whole step of this rank's schedule, the tied-weight sum included)."""
    global PROBE
    torch.set_num_threads(1)
    from nanopara.config import Config, ModelConfig
    from nanopara.graph import GraphedPipelineStep
    from nanopara.mesh import Mesh
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    mesh = Mesh.build(pp=2, device="cpu")
    PROBE = CaptureProbe().install()
    report = {}
    try:
        for schedule in schedules:
            cfg = Config(device="cpu", seed=0)
            cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=250, kernels="torch")
            cfg.parallel.pp, cfg.parallel.pp_schedule = 2, schedule
            cfg.parallel.pp_virtual = 2 if schedule == "interleaved" else 1
            cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = 2, 16, 4 * 2 * 16
            torch.manual_seed(0)
            trainer = parallelize(GPT(cfg.model), mesh, cfg)
            gen = torch.Generator().manual_seed(1)
            batches = [tuple(torch.randint(0, 250, (2, 16), generator=gen) for _ in range(2)) for _ in range(4)]
            step = GraphedPipelineStep(trainer.pipeline, trainer.engine, warmup=2)
            step.xs, step.ys = trainer._stage_data(batches)
            step.scale = 1.0
            report[schedule] = _probe_graphed_step(step, trainer.engine)
            trainer.engine.close()
    finally:
        PROBE.uninstall()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout_s(120)
def test_pipeline_step_is_capture_safe():
    """The region graph.GraphedPipelineStep captures (pp2: 1F1B, ZB-H1, interleaved): no host sync, no host data,
    no RNG state, and each rank issues the same send/recv batches in the capture as in its first warm-up step (the
    two ranks' lists differ, sends against receives; schedules.simulate shows they pair)."""
    schedules = ("1f1b", "zb", "interleaved")
    with tempfile.TemporaryDirectory() as d:
        spawn(_pp_worker, 2, schedules, d)
        reports = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
    for rank, rep in enumerate(reports):
        for schedule in schedules:
            steps = rep[schedule]
            cap = steps[-1]
            assert not cap["events"], (schedule, rank, cap["events"])
            ops = [c["op"] for c in cap["collectives"]]
            assert ops.count("batch_isend_irecv") >= 4 and "broadcast" in ops, (schedule, ops)  # p2p + the loss
            assert "all_reduce" in ops, (schedule, ops)  # the tied weight's two halves, summed in the step
            assert signature(steps[0]["collectives"]) == signature(cap["collectives"]), (schedule, rank)


def _dp_worker(rank, world, pp, out_dir):
    """dp2 x pp (pp 2: 4 ranks; pp 1: 2 ranks), DDP and ZeRO-1: the graph's flow (graph.GraphedPipelineStep or
    GraphedAccumStep: `_step`, whose end reduces the gradients; then Trainer.step, which then reduces nothing) trains
    exactly as the eager step does, and its region is capture-safe with every bucket's reduction issued and waited
    for inside it."""
    global PROBE
    torch.set_num_threads(1)
    from nanopara.config import Config, ModelConfig
    from nanopara.graph import GraphedAccumStep, GraphedPipelineStep
    from nanopara.mesh import Mesh
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    from nanopara.trainer import mean_over
    mesh = Mesh.build(pp=pp, dp=2, device="cpu")
    report = {}

    def build(zero, graphed=True):
        cfg = Config(device="cpu", seed=0)
        cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=250, kernels="torch")
        cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.bucket_mb = pp, 2, zero, 0.05
        cfg.parallel.zero_prefetch = "true" if zero == 1 else "auto"  # as on CUDA (auto is off on CPU)
        cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = 2, 16, 4 * 2 * 16 * 2
        torch.manual_seed(0)
        trainer = parallelize(GPT(cfg.model), mesh, cfg)
        if not graphed:
            return trainer, None, None
        if pp > 1:
            return trainer, GraphedPipelineStep(trainer.pipeline, trainer.engine), 1.0 / trainer.engine.n
        return trainer, GraphedAccumStep(trainer.model, trainer.amp, trainer.engine), 1.0 / trainer.accum

    def stage(trainer, batches):
        if pp > 1:
            return trainer._stage_data(batches)
        return [x for x, _ in batches], [y for _, y in batches]

    gen = torch.Generator().manual_seed(1 + mesh.dp_rank)
    data = [[tuple(torch.randint(0, 250, (2, 16), generator=gen) for _ in range(2)) for _ in range(4)]
            for _ in range(3)]
    for zero in (0, 1):
        runs = []
        for graphed in (False, True):
            trainer, step, scale = build(zero, graphed)
            losses = []
            for batches in data:
                if step is None:
                    loss = trainer.forward_backward(batches)
                else:
                    step.xs, step.ys = stage(trainer, batches)
                    step.scale = scale  # what Trainer passes
                    loss = mean_over(step._step(), mesh)
                trainer.step(1e-2)
                losses.append(loss.item())
            trainer.engine.wait_params()  # ZeRO-1's prefetched all-gathers: read parameters only after them
            runs.append((losses, [q.detach().clone() for q in trainer.model.parameters()]))
            trainer.engine.close()
        (plain, w_plain), (graph, w_graph) = runs
        assert plain == graph, (zero, plain, graph)
        assert all(torch.equal(a, b) for a, b in zip(w_plain, w_graph)), zero
        total = torch.stack([w.double().sum() for w in w_graph]).sum().reshape(1)  # the dp replicas saw other
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]                # data: equal weights after
        dist.all_gather(both, total, group=mesh.dp_group)                            # the steps = reduced grads
        assert torch.equal(both[0], both[1]), (zero, both)
        trainer, step, scale = build(zero)
        step.xs, step.ys = stage(trainer, data[0])
        step.scale = scale
        PROBE = CaptureProbe().install()
        try:
            steps = _probe_graphed_step(step, trainer.engine)
        finally:
            PROBE.uninstall()
        report[f"zero{zero}"] = dict(steps=steps, losses=plain)
        if zero == 1 and pp == 1:  # prefetch (parallel.zero_prefetch=true): after an eager step the gathers
            trainer.forward_backward(data[1])  # are in flight; a forward's hooks wait for them (no sync, no
            trainer.step(1e-2)  # collective), and the wait a graph's replay is preceded by adds none either
            pending = len(trainer.engine._pending)
            PROBE = CaptureProbe().install()
            try:
                with PROBE.region() as res:
                    with trainer.amp():
                        trainer.model(*[t for t in data[2][0]])
                with PROBE.region() as res_wait:
                    trainer.engine.wait_params()
            finally:
                PROBE.uninstall()
            report["prefetch"] = dict(pending=pending, left=len(trainer.engine._pending), forward=res,
                                      wait=res_wait)
        trainer.engine.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


def _check_dp_reports(reports):
    for rank, rep in enumerate(reports):
        for zero, op in (("zero0", "all_reduce"), ("zero1", "reduce_scatter")):
            steps = rep[zero]["steps"]
            cap = steps[-1]
            assert not cap["events"], (zero, rank, cap["events"])  # unwaited reductions would be events
            ops = [c["op"] for c in cap["collectives"]]
            dp_ops = [c for c in cap["collectives"] if c["op"].startswith(op) and c["async_op"]]
            assert len(dp_ops) >= 2, (zero, ops)  # several buckets (bucket_mb=0.05), launched from the hooks
            assert signature(steps[0]["collectives"]) == signature(cap["collectives"]), (zero, rank)
        if "prefetch" in rep:  # ZeRO-1's parameter gathers waited by the forward's hooks: no sync, no collective
            pre = rep["prefetch"]
            assert pre["pending"] >= 2 and pre["left"] == 0, pre
            for res in (pre["forward"], pre["wait"]):
                assert not res["events"] and not res["collectives"], res


@pytest.mark.timeout_s(120)
def test_data_parallel_step_is_capture_safe_and_trains_alike():
    """dp2 under train.cuda_graph=true (graph.GraphedAccumStep): every micro-step and DDP's / ZeRO-1's bucket
    reductions in one graph, each waited for inside it, no host sync; driven eagerly, the graph's flow (reduction
    at the end of the step, none in Trainer.step) equals the eager step bit for bit."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_dp_worker, 2, 1, d)
        _check_dp_reports([json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)])


@pytest.mark.timeout_s(180)
def test_pipeline_step_with_data_parallel_is_capture_safe_and_trains_alike():
    """pp2 x dp2 under train.cuda_graph=true: the captured step holds DDP's / ZeRO-1's bucket reductions, each
    waited for inside it (the probe flags an async handle left unwaited), with no host sync; driven eagerly, the
    graph's flow (reduction at the end of the step, none in Trainer.step) equals the eager pipeline bit for bit."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_dp_worker, 4, 2, d)
        _check_dp_reports([json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(4)])


def test_probe_catches_what_it_claims():
    """The probe itself: a sync, a data-dependent shape, a host tensor meeting a device tensor, an RNG read and an
    unwaited async handle are all reported (in one process, no group needed for these)."""
    probe = CaptureProbe().install()
    try:
        x = torch.randn(4)
        with probe.region() as res:
            x.sum().item()
            bool(x.sum() > 0)
            torch.nonzero(x > 0)
            x[x > 0]
            idx = torch.arange(2)  # no device=: a host tensor in a GPU run
            x[idx]  # ... indexing a device tensor: an implicit pageable copy
            torch.tensor([1.0, 2.0], device=x.device)
            torch.get_rng_state()
            x.to("cpu")
            torch.arange(4, device=x.device)[idx % 2]  # still host-derived
        kinds = [e["kind"] for e in res["events"]]
        assert kinds == ["sync", "sync", "dynamic", "dynamic", "h2d", "host_tensor", "rng", "sync", "h2d"], kinds
        assert all("test_capture_safety" not in e["site"] for e in res["events"])
        with probe.region() as res:  # what the TP code does: device-side factories, no reads
            y = torch.arange(4, device=x.device) % 3
            z = x.new_empty(4).copy_(x)
            (y.float() + z).sum()
        assert res["events"] == [], res["events"]
    finally:
        probe.uninstall()


# ----------------------------------------------------------------------------------------------------------------
# MoE (issue #44): the layer's Triton path (routing, permute, grouped GEMM, combine: the interpreter on CPU) inside
# GraphedMicroStep's region, and expert parallel's exchange (ep2, 2 gloo processes)

MOE_MODEL = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=97, kernels="torch", moe_experts=4,
                 moe_top_k=2, moe_every=2, moe_impl="triton", moe_bias_rate=0.01)  # one MoE layer (block 1)
MOE_LAYOUTS = {  # label -> (model flags, train flags); 16 tokens x top-2 over 4 experts: capacity 8 drops some
    "moe_capacity": (dict(moe_capacity=1.0), dict()),
    "moe_dropless": (dict(moe_capacity=0.0), dict()),
    "moe_capacity_fp8": (dict(moe_capacity=1.0), dict(fp8="row", fp8_filter="*.experts")),
    "moe_sorted": (dict(moe_capacity=1.0, moe_impl="sorted"), dict()),  # the PyTorch reference: host bounds
}


def _moe_trainer(mesh, model_kw, train_kw=None, parallel_kw=None):
    from nanopara.config import Config, ModelConfig
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    cfg = Config(device="cpu", seed=0)
    cfg.model = ModelConfig(**{**MOE_MODEL, **model_kw})
    for k, v in (train_kw or {}).items():
        setattr(cfg.train, k, v)
    for k, v in (parallel_kw or {}).items():
        setattr(cfg.parallel, k, v)
    torch.manual_seed(0)
    return parallelize(GPT(cfg.model), mesh, cfg)


def _moe_steps(trainer, probe, seed, warmup=1, capture=True) -> list:
    """GraphedMicroStep's region (warm-up `_fwd_bwd` calls, `_before_capture`, the captured call; capture=False: no
    `_before_capture`, for engines without graphs), then Trainer.step's MoE work (bias update, stats)."""
    from nanopara.graph import GraphedMicroStep
    from nanopara.moe import set_aux_grad_scale, step_stats, update_expert_bias
    model = trainer.engine.model
    micro = GraphedMicroStep(model, trainer.amp, 0.5, trainer.engine, warmup=warmup)
    set_aux_grad_scale(model, 0.5)  # the Trainer sets it before each step, eagerly
    gen = torch.Generator().manual_seed(seed)
    micro.x, micro.y = (torch.randint(0, 97, (2, 8), generator=gen) for _ in range(2))
    steps = []
    for i in range(warmup + 1):
        if i == warmup and capture:
            micro._before_capture()
        with probe.region() as res:
            loss = micro._fwd_bwd(micro.x, micro.y)
        steps.append(dict(phase="capture" if i == warmup else f"warmup{i}", **res))
        assert torch.isfinite(loss)
    groups = trainer._moe_groups  # Trainer.step's MoE lines: loads summed over the data-parallel ranks

    def all_reduce(t):
        for g in groups:
            dist.all_reduce(t, group=g)
    with probe.region() as res:
        update_expert_bias(model, all_reduce if groups else None)
        stats = step_stats(model)
    steps.append(dict(phase="after_step", **res))
    assert set(stats) == {"moe_aux", "moe_z", "moe_drop", "moe_load_min", "moe_load_max"}
    return steps


@pytest.mark.timeout_s(90)
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # the interpreter's
def test_moe_micro_step_is_capture_safe():
    """One process, the MoE layer on its Triton path (capacity, dropless, FP8 experts): no host sync, no
    data-dependent shape, no host data, no RNG state in the region a capture records, nor in Trainer.step's MoE
    work after it; the step's state lands in buffers written in place (load, stat). The PyTorch reference path
    (moe_impl=sorted) is caught reading group bounds on the host (graphs refuse it: config._check_moe)."""
    from nanopara.mesh import Mesh
    from nanopara.moe import moe_layers
    mesh = Mesh.build(device="cpu")
    probe = CaptureProbe().install()
    try:
        for label, (model_kw, train_kw) in MOE_LAYOUTS.items():
            trainer = _moe_trainer(mesh, model_kw, train_kw)
            (layer,) = moe_layers(trainer.engine.model)
            steps = _moe_steps(trainer, probe, seed=1)
            events = {s["phase"]: s["events"] for s in steps}
            if label == "moe_sorted":
                kinds = {(e["kind"], e["site"].split(" ")[0].split(":")[0]) for e in events["capture"]}
                assert kinds == {("sync", "nanopara/moe.py"), ("dynamic", "kernels/moe_route.py")}, events
                continue
            assert not any(events.values()), (label, events)
            assert not any(s["collectives"] for s in steps), label
            assert layer.stats and layer.expert_bias.abs().sum() > 0, label  # written by the region's forwards
            trainer.engine.close()
    finally:
        probe.uninstall()


def _ep_worker(rank, world, labels, out_dir):
    global PROBE
    torch.set_num_threads(1)
    from nanopara.mesh import Mesh
    mesh = Mesh.build(dp=2, ep=2, device="cpu")
    PROBE = CaptureProbe().install()
    report = {}
    try:
        for label in labels:
            cap = 1.0 if label == "ep2_capacity" else 0.0
            trainer = _moe_trainer(mesh, dict(moe_capacity=cap), parallel_kw=dict(dp=2, ep=2))
            with trainer.engine.no_sync():  # DDP's hooks are not this test's (graphs refuse dp > 1)
                steps = _moe_steps(trainer, PROBE, seed=1 + rank, capture=False)  # each rank its own tokens
            report[label] = dict(steps=steps, mismatch=_compare(label, steps[:-1], rank, world))
            trainer.engine.close()
    finally:
        PROBE.uninstall()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout_s(90)
def test_tp_sp_moe_micro_step_is_capture_safe():
    """tp2 + sp with an MoE layer (each tp rank routes its own T/tp tokens through whole experts, Triton path): the
    region graph.py captures holds no host sync and both ranks issue the same collectives, warm-up and capture."""
    rep = run(("tp2_sp_moe",))
    text = summarize(rep)
    for rank, r in rep.items():
        lay = r["tp2_sp_moe"]
        assert not lay["mismatch"] and not lay["refused"], text
        assert not lay["steps"][-1]["events"] and lay["steps"][-1]["collectives"], text


def _pp_moe_worker(rank, world, out_dir):
    """graph.GraphedPipelineStep's region (as _pp_worker) on pp2 1F1B with an MoE layer on each stage: the pipeline
    sets each layer's aux scale per micro-batch inside the region (moe.py keeps it in a device buffer)."""
    global PROBE
    torch.set_num_threads(1)
    from nanopara.graph import GraphedPipelineStep
    from nanopara.mesh import Mesh
    mesh = Mesh.build(pp=2, device="cpu")
    PROBE = CaptureProbe().install()
    steps = []
    try:
        trainer = _moe_trainer(mesh, dict(n_layer=4, moe_capacity=1.0),
                               dict(micro_batch=2, seq_len=8, tokens_per_step=2 * 2 * 8),
                               dict(pp=2, pp_schedule="1f1b", pp_layers="2,2"))
        gen = torch.Generator().manual_seed(1)
        batches = [tuple(torch.randint(0, 97, (2, 8), generator=gen) for _ in range(2)) for _ in range(2)]
        step = GraphedPipelineStep(trainer.pipeline, trainer.engine, warmup=1)
        step.xs, step.ys = trainer._stage_data(batches)
        step.scale = 1.0
        steps += _probe_graphed_step(step, trainer.engine, warmup=1)
        trainer.engine.close()
    finally:
        PROBE.uninstall()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(steps, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout_s(90)
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_pipeline_moe_step_is_capture_safe():
    """pp2 (1F1B, 2 micro-batches) with an MoE layer per stage on its Triton path: GraphedPipelineStep's region
    holds no host sync, host data or RNG state, and each rank repeats its warm-up's send/recv batches."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_pp_moe_worker, 2, d)
        reports = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
    for rank, steps in enumerate(reports):
        assert not any(s["events"] for s in steps), (rank, [s["events"] for s in steps])
        assert signature(steps[0]["collectives"]) == signature(steps[1]["collectives"]), rank
        assert [c["op"] for c in steps[1]["collectives"]].count("batch_isend_irecv") >= 2  # 2 micro-batches


@pytest.mark.timeout_s(120)
def test_expert_parallel_capacity_exchange_is_capture_safe():
    """ep2 (2 gloo processes, each routing its own tokens): in capacity mode the MoE layer's exchange has fixed
    splits (E_local x capacity rows per peer), so the region holds no host sync and both ranks issue the same
    all-to-alls, of the same shapes, in the warm-up and the would-be capture. Dropless reads its split sizes on
    the host: exactly one sync per MoE layer forward, at ep.py's split read (documented there), and nothing else."""
    labels = ("ep2_capacity", "ep2_dropless")
    with tempfile.TemporaryDirectory() as d:
        spawn(_ep_worker, 2, labels, d)
        reports = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
    for rank, rep in enumerate(reports):
        cap, drop = rep["ep2_capacity"], rep["ep2_dropless"]
        assert not cap["mismatch"], cap["mismatch"]
        assert not any(s["events"] for s in cap["steps"]), [s["events"] for s in cap["steps"]]
        ops = [c["op"] for c in cap["steps"][-2]["collectives"]]
        assert ops.count("all_to_all_single") == 5, ops  # counts, rows out and back; the backward's two
        for s in drop["steps"][:-1]:
            assert [(e["kind"], e["site"].split(" ")[0].split(":")[0]) for e in s["events"]] == \
                [("sync", "nanopara/ep.py")], (rank, s["events"])
        assert not drop["steps"][-1]["events"]

if __name__ == "__main__":
    print(summarize(run(sys.argv[1:] or LAYOUTS)))
