"""ZeRO-1/2/3 (Rajbhandari et al. 2020): optimizer states, gradients and parameters sharded over dp x cp.

Built by dp.build_engine for parallel.zero = 1/2/3 (same interface and precision as dp.py's engines; the bytes
per rank are in dp.py's table). N = dp*cp ranks, r = this rank's index among them.

Flat buffers (`Flat`): a run of parameters laid end to end in one fp32 buffer of `padded` elements (a multiple
of N, zero padding at the end); rank r holds [lo, hi) = [r*padded/N, (r+1)*padded/N). Inside a buffer the
parameters are ordered decayed (2-D) first and then by tp kind, so a rank's slice meets each class in at most one
contiguous piece: AdamW steps a few views of the slice, and Adam's m, v are flat (padded/N,) buffers per Flat.

ZeRO-1 (P_os): DDP's buckets, but parameters are views of flat buffers. A bucket whose gradients are all in is
  reduce-scattered (async, overlapping backward; each rank receives the sum of its 1/N), each rank updates its
  slice, and the flat parameter buffers are all-gathered after the step. no_sync skips the reduction as in DDP.
  Both collectives run in place (f.grad's / f.param's own [lo, hi) is the shard), so ZeRO-1 adds no buffers.
ZeRO-2 (P_os+g): a bucket's full gradient exists only until its reduce-scatter ends (at most `max_inflight` = 2
  bucket copies at once: the older is drained before a third starts); the rank keeps its shard.
  ZeRO-2/3 reduce on every micro-step and accumulate shards (no_sync is a no-op for them: skipping the reduction
  would mean holding the full gradient, which is what they exist to avoid).
ZeRO-3 (P_os+g+p): units instead of buckets: the root (every parameter outside the blocks: wte = lm_head, wpe,
  ln_f) and each run of K = parallel.zero3_unit_blocks consecutive transformer blocks (the last run may be
  shorter; K > n_layer: one unit of all blocks). A rank keeps 1/N of each unit in fp32. A unit's weights are
  all-gathered by a forward pre-hook on its first block (the next PREFETCH units' gathers started), freed by the
  forward hook of its last block, gathered again by a hook on the gradient of whichever output of its last block
  gets one first (the previous PREFETCH units prefetched), freed once their gradient is reduce-scattered
  (comm.zero_gathered, whose backward starts the reduce-scatter asynchronously; at most 2 units' fp32 gradients
  are in flight, older ones are drained inside backward). The root stays gathered from forward through backward:
  the tied wte is used at both ends, so there is nothing to free in between. Gather dtypes: a unit's matrices in
  the compute dtype (bf16 under autocast: exactly the values autocast would cast fp32 weights to, so the numerics
  are DDP's, at half the bytes), its vectors (LayerNorm, biases) and the root in fp32 (layer_norm and the
  embeddings, hence the residual stream, stay fp32).
  K trades memory for host time: the hooks, gathers, zero_gathered nodes and reduce-scatters of a step scale with
  the number of units, and at small micro-batches their Python work per unit takes about as long as a block's
  GPU work (the forward is host-bound); but 1 + PREFETCH units of K blocks each are gathered at once, and a
  backward unit's bf16 gradient and fp32 copy are K blocks too. Checkpoints hold one flat per unit and dtype, so
  a "flat_shard" resumes only with the same K (and N); another K is a clear error: reshard through unshard_*.

Checkpoint form of anything sharded (ZeRO optimizer states; ZeRO-3 parameters):
    {"format": "flat_shard", "rank": r, "world": N, "step": int, "flats": [{"params": [[name, shape, offset], ...],
     "numel", "padded", "lo", "hi", <key>: (hi-lo,) tensor}]}     key: "param" or "exp_avg" / "exp_avg_sq"
`unshard_model` / `unshard_optimizer` turn all ranks' shards into dp.py's full forms (to reshard).

Tested by tests/test_dp.py (against the single-process run, resume, memory formulas); benchmarked against torch
DDP by bench/bench_dp.py.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from nanopara.comm import all_gather_flat, flat_views, zero_gathered
from nanopara.config import Config
from nanopara.dp import _BucketHooks, _buckets, _check_fp32, _Engine, _views, _weak, compute_dtype, param_kind
from nanopara.mesh import Mesh

# ZeRO-3 gathers this many units ahead of the one running (forward: the next units; backward: the previous ones).
# Each costs one more unit (K blocks) of bf16 weights. Measured on 4 x H200 (results/dp4_zero3_host.txt): 2 is no
# faster than 1 (0.94x vs 0.93-0.97x DDP in one call); the compute stream's idle gaps at block starts come from the
# host (which parallel.zero3_unit_blocks = K > 1 addresses: one unit's hook work per K blocks).
PREFETCH = 1


# ----------------------------------------------------------------------------------------------------------------
# flat buffers

class Flat:
    """Parameters laid end to end in one flat fp32 buffer, zero-padded to a multiple of N; rank r holds [lo, hi).

    Within the buffer, parameters are ordered decayed first, then by tp kind, so each (decay, kind) class is one
    contiguous range and a rank's slice meets every class in at most one piece (few optimizer tensors, one
    norm term per class).
    """

    def __init__(self, name: str, params: list, names: list, n: int, r: int):
        order = sorted(range(len(params)), key=lambda i: (params[i].dim() < 2, param_kind(params[i])))  # stable
        self.name, self.params, self.names = name, [params[i] for i in order], [names[i] for i in order]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.padded = -(-self.numel // n) * n
        self.shard = self.padded // n
        self.lo, self.hi = r * self.shard, (r + 1) * self.shard
        self.classes = []  # [start, end, decay, kind]
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            key = [p.dim() >= 2, param_kind(p)]
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
        return {"params": [[n, list(s), o] for n, s, o in zip(self.names, self.shapes, self.offsets)],
                "numel": self.numel, "padded": self.padded, "lo": self.lo, "hi": self.hi}

    def slice_of(self, full: dict, device) -> torch.Tensor:
        """This rank's [lo, hi) of the flat buffer built from {name: full tensor} (padding and missing names: 0)."""
        out = torch.zeros(self.shard, device=device)
        for name, off, size in zip(self.names, self.offsets, self.sizes):
            a, b = max(off, self.lo), min(off + size, self.hi)
            if a < b and name in full:
                out[a - self.lo:b - self.lo] = full[name].reshape(-1)[a - off:b - off].to(device, torch.float32)
        return out


def unshard(shards: list[dict], key: str) -> dict:
    """Every rank's "flat_shard" dict (one layout) -> {param name: full tensor} of `key` ("param", "exp_avg", ..)."""
    shards = sorted(shards, key=lambda s: s["rank"])
    if [s["rank"] for s in shards] != list(range(shards[0]["world"])):
        raise ValueError(f"unshard needs the shards of all {shards[0]['world']} ranks, got ranks "
                         f"{[s['rank'] for s in shards]}")
    out = {}
    for i, flat in enumerate(shards[0]["flats"]):
        full = torch.cat([s["flats"][i][key] for s in shards])  # (padded,): the ranks' [lo, hi) in rank order
        for name, shape, off in flat["params"]:
            out[name] = full[off:off + math.prod(shape)].view(shape).clone()
    return out


def unshard_model(shards: list[dict]) -> dict:
    """All ranks' ZeRO-3 model_state_dict() -> {name: full tensor}, loadable by any engine."""
    return unshard(shards, "param")


def unshard_optimizer(shards: list[dict]) -> dict:
    """All ranks' ZeRO state_dict() -> the "full" optimizer format, loadable by any engine."""
    m, v = unshard(shards, "exp_avg"), unshard(shards, "exp_avg_sq")
    return {"format": "full", "step": shards[0]["step"],
            "state": {name: {"exp_avg": m[name], "exp_avg_sq": v[name]} for name in m}}


# ----------------------------------------------------------------------------------------------------------------
# ZeRO-1/2/3

class Zero(_BucketHooks, _Engine):
    """ZeRO stage 1, 2 or 3 over the dp x cp group (see the module docstring)."""

    sharded_grads = True

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config, stage: int):
        super().__init__(model, mesh, cfg)
        _check_fp32(self.params)
        self.stage, self.label = stage, f"ZeRO-{stage}"
        self._src = dist.get_global_rank(self.group, 0)
        self._works = []  # (flat, work, reduced shard, sent): reduce-scatters in flight
        # ZeRO-2/3 hold a full-size fp32 copy per reduction in flight: at most this many (2 buckets; ZeRO-3's 2
        # units of 2 flats), so the gradients alive at once stay O(bucket/unit), never O(model)
        self.max_inflight = 2 if stage < 3 else 4
        if stage < 3:
            groups = _buckets(self.params[::-1], int(cfg.parallel.bucket_mb * 2 ** 20) // 4)
            self.flats = [Flat(f"bucket{i}", b, [self.names[id(p)] for p in b], self.n, self.r)
                          for i, b in enumerate(groups)]
            for f in self.flats:
                f.param = self._flatten(f)
                for p, view in zip(f.params, _views(f.param, f.sizes)):
                    p.data = view.view(p.shape)  # the module's parameter now lives in the flat buffer
                if stage == 1:
                    f.grad = torch.zeros(f.padded, device=self.device)
                    for p, view in zip(f.params, _views(f.grad, f.sizes)):
                        p.grad = view.view(p.shape)
                else:
                    f.grad_shard = torch.zeros(f.shard, device=self.device)
            self._install_hooks([f.params for f in self.flats])
        else:
            self._make_units(model, compute_dtype(cfg, self.device))
        self._make_optimizer()

    def _flatten(self, f: Flat) -> torch.Tensor:
        buf = torch.zeros(f.padded, device=self.device)
        for p, view in zip(f.params, _views(buf, f.sizes)):
            view.copy_(p.detach().reshape(-1))
        dist.broadcast(buf, src=self._src, group=self.group)  # replicas start identical
        return buf

    def _make_optimizer(self):
        """AdamW over views of this rank's slices; m and v are views of flat (shard,) buffers, set up front."""
        t, fused = self.cfg.train, self.device.type == "cuda"
        by_decay = {True: [], False: []}
        for f in self.flats:
            p_shard = f.master if self.stage == 3 else f.param[f.lo:f.hi]
            g_shard = f.grad[f.lo:f.hi] if self.stage == 1 else f.grad_shard
            f.exp_avg, f.exp_avg_sq = torch.zeros(f.shard, device=self.device), torch.zeros(f.shard, device=self.device)
            f.pieces = []
            for x, y, decay, kind in f.owned():
                piece = p_shard[x:y]
                piece.grad = g_shard[x:y]
                by_decay[decay].append(piece)
                f.pieces.append((piece, x, y, kind))
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((by_decay[True], t.weight_decay),
                                                                    (by_decay[False], 0.0)) if ps]
        if not groups:
            return  # this rank's slices are all padding: nothing to update
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused,
                                           foreach=False if not fused else None)
        for f in self.flats:
            for piece, x, y, _ in f.pieces:  # AdamW initialises only empty states, so it uses these views
                step = torch.zeros((), dtype=torch.float32, device=self.device if fused else "cpu")
                self.optimizer.state[piece] = {"step": step, "exp_avg": f.exp_avg[x:y],
                                               "exp_avg_sq": f.exp_avg_sq[x:y]}

    # ---- gradients of ZeRO-1/2: one reduce-scatter per bucket
    def _counts_now(self) -> bool:
        return self._sync or self.stage == 2

    def _launch(self, i):
        f = self.flats[i]
        if self.stage == 1:  # in place: the input is f.grad (p.grad views, accumulated over the micro-steps) and
            # the output its own [lo, hi) (NCCL and gloo reduce in place when recv = send + r*shard): no copy
            out = f.grad[f.lo:f.hi]
            return f, dist.reduce_scatter_tensor(out, f.grad, group=self.group, async_op=True), out, None
        self._drain(keep=self.max_inflight - 1)  # bounds the full-size bucket copies alive at once
        sent = torch.zeros(f.padded, device=self.device)  # (padded,): one bucket, alive until its reduction ends
        for p, view in zip(f.params, _views(sent, f.sizes)):
            if p.grad is not None:
                view.copy_(p.grad.reshape(-1))
            p.grad = None  # ZeRO-2: the full gradient is freed; only the reduced shard is kept
        out = sent[f.lo:f.hi]  # in place, as above
        return f, dist.reduce_scatter_tensor(out, sent, group=self.group, async_op=True), out, sent

    def _before_backward(self):
        if self.stage == 1:
            self._check_single_sync()

    def _after_backward(self):
        if self.stage == 1 and self._sync:
            self._launch_ready(force=True)
        elif self.stage >= 2:
            if self.stage == 2:
                self._launch_ready(force=True)
                self._reset_buckets()
            self._drain()

    def _drain(self, keep: int = 0):
        """Wait for all but the newest `keep` reduce-scatters in flight; ZeRO-2/3 accumulate each into its
        persistent gradient shard and drop the full-size input (ZeRO-1 reduced into f.grad's own slice).

        On NCCL, wait() only orders the compute stream after the collective (the CPU does not block), so draining
        inside backward costs no overlap beyond making a reduction finish `keep` buckets/units later."""
        while len(self._works) > keep:
            f, work, out, _ = self._works.pop(0)
            work.wait()
            if self.stage >= 2:
                f.grad_shard.add_(out)

    def _wait_inflight(self):
        self._drain()
        if self.stage < 3:
            self._reset_buckets()

    def _finish_grads(self):
        if self.stage == 1:
            self._launch_ready(force=True)
            self._drain()
            self._reset_buckets()
        else:
            self._drain()

    def _grad_pieces(self):
        return [(piece.grad, kind) for f in self.flats for piece, _, _, kind in f.pieces]

    def _after_step(self):
        if self.stage == 3:
            return  # the master shards were updated in place; forward gathers them
        # in place (the input is the output's own [lo, hi), which NCCL and gloo allow): no (shard,) copies
        works = [dist.all_gather_into_tensor(f.param, f.param[f.lo:f.hi], group=self.group, async_op=True)
                 for f in self.flats]
        for work in works:
            work.wait()

    def _zero_grads(self):
        for f in self.flats:
            (f.grad if self.stage == 1 else f.grad_shard).zero_()

    def _extra_params(self):
        return [f.master for f in self.flats] + [f.full for f in self.flats] if self.stage == 3 else []

    def _extra_grads(self):
        return [f.grad_shard for f in self.flats] if self.stage >= 2 else []

    def _optim_state(self):
        return [t for f in self.flats for t in (f.exp_avg, f.exp_avg_sq)]

    # ---- ZeRO-3: units, gathered around their forward and backward
    def _make_units(self, model: nn.Module, dtype: torch.dtype):
        """Unit 0: the root (every parameter outside the blocks), one fp32 flat. Unit u >= 1: blocks (u-1)K ..
        uK-1 (K = parallel.zero3_unit_blocks; fewer in the last unit) as two flats, their matrices gathered in the
        compute dtype (the values autocast would cast them to anyway, so the numerics are DDP's) and their vectors
        (LayerNorm, biases: layer_norm runs in fp32 under autocast) in fp32."""
        blocks = list(model.transformer.h) if hasattr(model, "transformer") and hasattr(model.transformer, "h") else []
        owners = {}  # id(p) -> [(module, attribute)]: the tied weight has two owners
        for mod in model.modules():
            for attr, p in mod._parameters.items():
                if p is not None and p.requires_grad:
                    owners.setdefault(id(p), []).append((mod, attr))
        block_of = {}
        for i, b in enumerate(blocks):
            for p in b.parameters():
                if block_of.setdefault(id(p), i) != i:
                    raise ValueError("ZeRO-3: a parameter is shared by two transformer blocks")
        k = self.cfg.parallel.zero3_unit_blocks
        chunks = [blocks[a:a + k] for a in range(0, len(blocks), k)]  # [first, .., last] block of each unit
        specs = [[("root", [p for p in self.params if id(p) not in block_of], torch.float32)]]
        for u, chunk in enumerate(chunks):
            mine = [p for p in self.params if block_of.get(id(p), -1) // k == u]
            name = f"h[{u * k}:{u * k + len(chunk)}]"
            specs.append([(f"{name}.matrices", [p for p in mine if p.dim() >= 2], dtype),
                          (f"{name}.vectors", [p for p in mine if p.dim() < 2], torch.float32)])
        self.flats, self.units, self.param_objs = [], [], {}
        self.anchor = torch.zeros(0, device=self.device, requires_grad=True)  # makes backward reach every unit
        for spec in specs:
            unit = []
            for name, params, gather_dtype in spec:
                if not params:
                    continue
                f = Flat(name, params, [self.names[id(p)] for p in params], self.n, self.r)
                f.master = self._flatten(f)[f.lo:f.hi].clone()  # fp32 (shard,); the full buffer is dropped
                f.grad_shard = torch.zeros(f.shard, device=self.device)
                f.owners = [owners[id(p)] for p in f.params]
                f.gather_dtype, f.pending = gather_dtype, None
                for p, own in zip(f.params, f.owners):
                    for mod, attr in own:
                        del mod._parameters[attr]  # the module reads a view of the gathered buffer from now on
                    self.param_objs[self.names[id(p)]] = p  # kept for its attributes (tp_dim, ...) only
                    p.data = torch.empty(0, device=self.device)
                f.full = torch.empty(f.padded, dtype=gather_dtype, device=self.device)
                f.idle = flat_views(f.full, f.shapes)  # bound outside forward: right shapes and dtype, and once
                self._free(f)                         # the storage is released, no memory
                unit.append(f)
            self.flats += unit
            self.units.append(unit)
        self.params = []
        pre, post = _weak(self, "_pre_forward"), _weak(self, "_post_forward")  # hooks must not keep the engine alive
        self._pre_backward_weak, self._on_unit_grad_weak = _weak(self, "_pre_backward"), _weak(self, "_on_unit_grad")
        for i, (first, last) in enumerate([(model, model)] + [(c[0], c[-1]) for c in chunks]):  # unit i's ends
            self._handles += [first.register_forward_pre_hook(lambda m, args, i=i: pre(i)),
                              last.register_forward_hook(lambda m, args, out, i=i: post(i, out))]

    @staticmethod
    def _bind(f: Flat, views):
        for view, own in zip(views, f.owners):
            for mod, attr in own:
                setattr(mod, attr, view)

    def _free(self, f: Flat):
        """Release a unit's gathered memory and bind the module attributes to storage-less placeholders: the views
        bound in forward carry the autograd node of comm.zero_gathered, which must not outlive the step."""
        self._bind(f, f.idle)
        f.full.untyped_storage().resize_(0)

    def _gather(self, unit: list, into_own: bool = False):
        """Start the all-gathers of a unit's shards: into new buffers (forward) or their own storage (backward)."""
        for f in unit:
            if f.pending is not None:
                continue
            if not into_own:
                f.pending = (*all_gather_flat(f.master, self.group, f.gather_dtype), None)
                continue
            f.full.untyped_storage().resize_(f.padded * f.full.element_size())
            # autograd saved views of f.full in forward; refilling it with the same values must not count as an
            # in-place edit. The backend may write (bumping the version) any time before the wait: restore after.
            keep = torch.autograd._unsafe_preserve_version_counter(f.full)
            f.pending = (*all_gather_flat(f.master, self.group, f.gather_dtype, out=f.full), keep)

    @staticmethod
    def _wait(f: Flat) -> torch.Tensor:
        full, work, _, keep = f.pending
        f.pending = None
        work.wait()
        if keep is not None:
            keep.__exit__()
        return full

    def _pre_forward(self, i: int):
        if i == 0:  # a new forward: drop prefetches left by an interrupted one (weights may have changed since)
            for f in self.flats:
                if f.pending is not None and self._wait(f) is f.full:
                    self._free(f)
        self._gather(self.units[i])
        for j in range(i + 1, min(i + 1 + PREFETCH, len(self.units))):
            self._gather(self.units[j])  # prefetch: the next units' gathers overlap this unit's compute
        for f in self.units[i]:
            full = f.full = self._wait(f)
            if torch.is_grad_enabled():
                views = zero_gathered(self.anchor, full, self.group, functools.partial(self._on_unit_grad_weak, f),
                                      f.shapes)
            else:
                views = flat_views(full, f.shapes)
            self._bind(f, views)

    def _post_forward(self, i: int, out):
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t)]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in outs)
        if i > 0 or not needs_grad:  # with grad, the root is freed once its gradient is reduce-scattered
            for f in self.units[i]:
                self._free(f)
        if i > 0 and needs_grad:  # a unit's last block returns (residual, pending MLP output): whichever grad first
            pre_backward = self._pre_backward_weak
            for t in outs:
                if t.requires_grad:
                    t.register_hook(lambda grad, i=i: pre_backward(i))

    def _pre_backward(self, i: int):
        if all(f.pending is None and f.full.untyped_storage().nbytes() for f in self.units[i]):
            return  # another output's hook of this unit ran first: already gathered for this backward
        self._gather(self.units[i], into_own=True)
        for j in range(i - 1, max(i - 1 - PREFETCH, 0), -1):
            self._gather(self.units[j], into_own=True)  # prefetch the units whose backward comes next
        for f in self.units[i]:
            self._wait(f)

    def _on_unit_grad(self, f: Flat, work, out, sent):
        self._works.append((f, work, out, sent))
        self._free(f)
        self._drain(keep=self.max_inflight)  # the unit-size fp32 gradients alive at once stay bounded

    def close(self) -> None:
        super().close()
        if self.stage == 3:
            for f in self.flats:
                if f.pending is not None:
                    self._wait(f)
                self._free(f)

    # ---- checkpoints
    def _step_count(self) -> int:
        for f in self.flats:
            for piece, *_ in f.pieces:
                return int(self.optimizer.state[piece]["step"])
        return 0

    def _check_layout(self, sd: dict):
        ok = sd.get("world") == self.n and sd.get("rank") == self.r and len(sd["flats"]) == len(self.flats) and \
            all({k: a[k] for k in ("params", "numel", "padded", "lo", "hi")} == b.meta()
                for a, b in zip(sd["flats"], self.flats))
        if not ok:
            raise ValueError(f"flat shard of rank {sd.get('rank')}/{sd.get('world')} does not match this engine's "
                             f"layout (rank {self.r}/{self.n}): resume with the saved run's dp x cp and its "
                             f"parallel.bucket_mb (ZeRO-1/2) or parallel.zero3_unit_blocks (ZeRO-3), or load the "
                             f"unshard_* full form instead")

    def state_dict(self) -> dict:
        return {"format": "flat_shard", "rank": self.r, "world": self.n, "step": self._step_count(),
                "flats": [{**f.meta(), "exp_avg": f.exp_avg, "exp_avg_sq": f.exp_avg_sq} for f in self.flats]}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("format") == "flat_shard":
            self._check_layout(sd)
            for f, s in zip(self.flats, sd["flats"]):
                f.exp_avg.copy_(s["exp_avg"])
                f.exp_avg_sq.copy_(s["exp_avg_sq"])
        elif sd.get("format") == "full":
            for f in self.flats:
                f.exp_avg.copy_(f.slice_of({k: v["exp_avg"] for k, v in sd["state"].items()}, self.device))
                f.exp_avg_sq.copy_(f.slice_of({k: v["exp_avg_sq"] for k, v in sd["state"].items()}, self.device))
        else:
            raise ValueError(f"unknown optimizer state format {sd.get('format')!r}")
        for f in self.flats:
            for piece, *_ in f.pieces:
                self.optimizer.state[piece]["step"].fill_(float(sd["step"]))

    def model_state_dict(self) -> dict:
        if self.stage < 3:
            return super().model_state_dict()
        return {"format": "flat_shard", "rank": self.r, "world": self.n,
                "flats": [{**f.meta(), "param": f.master} for f in self.flats]}

    def load_model_state_dict(self, sd: dict) -> None:
        if self.stage < 3:
            return super().load_model_state_dict(sd)
        if sd.get("format") == "flat_shard":
            self._check_layout(sd)
            for f, s in zip(self.flats, sd["flats"]):
                f.master.copy_(s["param"])
            return
        missing = [name for f in self.flats for name in f.names if name not in sd]
        if missing:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:3]}")
        for f in self.flats:
            f.master.copy_(f.slice_of(sd, self.device))

    def full_model_state_dict(self) -> dict:
        if self.stage < 3:
            return super().full_model_state_dict()
        out = {}
        for f in self.flats:
            full, work, _ = all_gather_flat(f.master, self.group, torch.float32)
            work.wait()
            for name, view, shape in zip(f.names, full.split(f.sizes + [f.padded - f.numel]), f.shapes):
                out[name] = view.view(shape).clone()
        return out
