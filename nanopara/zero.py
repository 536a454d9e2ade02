"""ZeRO-1/2 (Rajbhandari et al. 2020): optimizer states, then gradients, sharded over the dp x cp group.

Built by parallel.build_engine for parallel.zero = 1/2 (zero3.py's Zero3 extends it); the interface of every engine
(engine.py); N = dp*cp ranks. Parameters live in flat fp32 buffers (buckets.Flat), one per gradient bucket; rank r
owns [lo, hi) of each and steps AdamW on views of that slice (m, v: flat (padded/N,) buffers per Flat).

ZeRO-1 (P_os): a bucket whose gradients are all in is reduce-scattered (async, overlapping backward; each rank
  receives the sum of its 1/N), each rank updates its slice, and the flat parameter buffers are all-gathered after
  the step. no_sync skips the reduction as in DDP. Both collectives run in place (f.grad's / f.param's own [lo, hi)
  is the shard), so ZeRO-1 adds no buffers. Prefetch (parallel.zero_prefetch, ZeRO-1/2): the gathers are issued in
  forward order and each is waited for (stream-level) by its flat's first reader's forward pre-hook, overlapping
  the next forward; any other reader of parameters (checkpoints, a CUDA graph's replay) calls `wait_params` first.
ZeRO-2 (P_os+g): a bucket's full gradient exists only until its reduce-scatter ends (at most `max_inflight` = 2
  bucket copies at once); the rank keeps its shard. The Linear weights' gradient casts write into the bucket's send
  buffer (gradient destinations, Engine._set_grad_dests; parallel.grad_dests=off: none), the other gradients are
  copied in at launch. The backward's last reductions stay in flight beside the next micro-step's forward. ZeRO-2
  reduces every micro-step and accumulates shards (no_sync is a no-op: it would hold the full gradient).

Expert parallel (ep.py): expert flats are sharded over the edp group instead of dp x cp (same layout to resume).
Checkpoint form of anything sharded (ZeRO optimizer states; ZeRO-3 parameters):
    {"format": "flat_shard", "rank": r, "world": N, "step": int, "flats": [{"params": [[name, shape, offset], ...],
     "numel", "padded", "lo", "hi", <key>: (hi-lo,) tensor}]}     key: "param" or "exp_avg" / "exp_avg_sq"
`unshard_model` / `unshard_optimizer` turn all ranks' shards into engine.py's full forms (to reshard). Tested by
tests/test_dp.py (against the single process, resume, memory), tests/test_zero_prefetch.py; bench/; notes/dp.md.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from nanopara.config import Config
from nanopara.buckets import BucketHooks, Flat, grad_buckets, reduce_group, views
from nanopara.engine import Engine, NoWork, check_fp32, weak_method
from nanopara.mesh import Mesh


def zero_prefetch(cfg: Config, device_type: str = "cuda") -> tuple[bool, str]:
    """(whether ZeRO-1/2's parameter all-gathers overlap the next forward, why auto left them off) for
    parallel.zero_prefetch: true / false as given (parallel.check_layout refuses an impossible true); auto: on for
    ZeRO-1/2 on CUDA (the same numerics: only where the step waits for the gathers moves) except where a forward
    does not run through the hooked blocks, below. Never ZeRO-3 (zero3.py gathers its own units). Off on CPU: gloo
    has no stream to overlap on, and code that reads parameters right after step() then sees them settled."""
    p = cfg.parallel
    if p.zero not in (1, 2) or p.zero_prefetch != "auto":
        return p.zero in (1, 2) and p.zero_prefetch == "true", ""
    if device_type != "cuda":
        return False, ""
    why = [reason for off, reason in (
        (p.tp_streams > 1, "parallel.tp_streams=2 (its two streams run the model's stages, not its hooked forward)"),
        (cfg.train.compile, "train.compile (the waiting hooks would be traced into the compiled graph)")) if off]
    return not why, "; ".join(why)

# ----------------------------------------------------------------------------------------------------------------
# checkpoints: every rank's shards -> full tensors

def unshard(shards: list[dict], key: str, ep: int = 1) -> dict | tuple[dict, list[dict]]:
    """Every rank's "flat_shard" dict (one layout) -> {param name: full tensor} of `key` ("param", "exp_avg", ..).
    Expert flats (ep.py, ZeRO-3 under expert parallel) are sharded over the edp group instead, the ranks holding the
    same experts (dp x cp positions j, j + ep, j + 2 ep, ...): with ep > 1 also returns, per ep rank j, {name: its
    experts' tensors}."""
    shards = sorted(shards, key=lambda s: s["rank"])
    if [s["rank"] for s in shards] != list(range(shards[0]["world"])):
        raise ValueError(f"unshard needs the shards of all {shards[0]['world']} ranks, got ranks "
                         f"{[s['rank'] for s in shards]}")
    out, experts = {}, [{} for _ in range(ep)]
    for i, flat in enumerate(shards[0]["flats"]):
        for j, dest in ([(0, out)] if not flat.get("expert") else enumerate(experts)):
            held = shards if not flat.get("expert") else shards[j::ep]  # (the edp group of ep rank j)
            full = torch.cat([s["flats"][i][key] for s in held])  # (padded,): the ranks' [lo, hi) in rank order
            for name, shape, off in flat["params"]:
                dest[name] = full[off:off + math.prod(shape)].view(shape).clone()
    return (out, experts) if ep > 1 else out


def unshard_model(shards: list[dict]) -> dict:
    """All ranks' ZeRO-3 model_state_dict() -> {name: full tensor}, loadable by any engine."""
    return unshard(shards, "param")


def unshard_optimizer(shards: list[dict]) -> dict:
    """All ranks' ZeRO state_dict() -> the "full" optimizer format, loadable by any engine."""
    m, v = unshard(shards, "exp_avg"), unshard(shards, "exp_avg_sq")
    return {"format": "full", "step": shards[0]["step"],
            "state": {name: {"exp_avg": m[name], "exp_avg_sq": v[name]} for name in m}}


# ----------------------------------------------------------------------------------------------------------------
# ZeRO-1/2

class Zero(BucketHooks, Engine):
    """ZeRO stage 1 or 2 over the dp x cp group (see the module docstring); stage 3 is zero3.Zero3."""

    sharded_grads = True
    # ZeRO-2 holds a full-size fp32 copy per reduction in flight: at most this many buckets, so the gradients
    # alive at once stay O(bucket), never O(model)
    max_inflight = 2

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config, stage: int):
        super().__init__(model, mesh, cfg)
        check_fp32(self.params)
        self.stage, self.label = stage, f"ZeRO-{stage}"
        self._works = []  # (flat, work, reduced shard, sent): reduce-scatters in flight
        self._pending = {}  # flat index -> its parameter all-gather in flight (prefetch: waited at first use)
        self._make_flats()
        self._make_optimizer()
        self.prefetch = stage < 3 and zero_prefetch(cfg, mesh.device.type)[0]
        if self.prefetch:
            self._install_prefetch()

    def _make_flats(self):
        """One Flat per gradient bucket; the module's parameters become views of the flat parameter buffers."""
        if self.stage not in (1, 2):
            raise ValueError("ZeRO-3 is zero3.Zero3 (parallel.build_engine picks it for parallel.zero=3)")
        groups = grad_buckets(self.params, int(self.cfg.parallel.bucket_mb * 2 ** 20) // 4)
        self.flats = []
        for i, b in enumerate(groups):  # expert buckets (ep.py) shard over their replicas (edp), the rest over dp x cp
            group, n, r = reduce_group(self, b)
            self.flats.append(Flat(f"bucket{i}", b, [self.names[id(p)] for p in b], n, r))
            self.flats[-1].group = group
        for f in self.flats:
            f.param = self._flatten(f)
            for p, view in zip(f.params, views(f.param, f.sizes)):
                p.data = view.view(p.shape)  # the module's parameter now lives in the flat buffer
            if self.stage == 1:
                f.grad = torch.zeros(f.padded, device=self.device)
                for p, view in zip(f.params, views(f.grad, f.sizes)):
                    p.grad = view.view(p.shape)
            else:
                f.grad_shard = torch.zeros(f.shard, device=self.device)
        self._install_hooks([f.params for f in self.flats])
        if self.stage == 2:  # each bucket's send buffer, made when its first gradient comes (_grad_dest)
            self._send = [None] * len(self.flats)
            self._at = {id(p): (i, off) for i, f in enumerate(self.flats) for p, off in zip(f.params, f.offsets)}
            if self.cfg.parallel.grad_dests != "off":
                self._set_grad_dests(self.params)

    def _flatten(self, f: Flat) -> torch.Tensor:
        buf = torch.zeros(f.padded, device=self.device)
        for p, view in zip(f.params, views(buf, f.sizes)):
            view.copy_(p.detach().reshape(-1))
        group = getattr(f, "group", self.group)  # ZeRO-3's flats: dp x cp
        if group is not None:  # replicas start identical
            dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        return buf

    def _make_optimizer(self):
        """AdamW over views of this rank's slices; m and v are views of flat (shard,) buffers, set up front."""
        t, fused = self.cfg.train, self.device.type == "cuda"
        by_decay = {True: [], False: []}
        for f in self.flats:
            p_shard = self._param_shard(f)
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

    def _param_shard(self, f: Flat) -> torch.Tensor:
        """The fp32 parameters this rank updates: its slice of the flat buffer (ZeRO-3: its master shard)."""
        return f.param[f.lo:f.hi]

    # ---- gradients: one reduce-scatter per bucket
    def _counts_now(self, p) -> bool:
        return super()._counts_now(p) or self.stage == 2

    def _launch(self, i):
        f = self.flats[i]
        if self.stage == 1:  # in place: the input is f.grad (p.grad views, accumulated over the micro-steps) and
            # the output its own [lo, hi) (NCCL and gloo reduce in place when recv = send + r*shard): no copy
            out = f.grad[f.lo:f.hi]
            return f, self._reduce_scatter(out, f.grad, f.group), out, None
        self._drain(keep=self.max_inflight - 1)  # bounds the full-size bucket copies alive at once
        # (padded,): one bucket, alive until its reduction ends. Gradients written into it by their casts
        # (_grad_dest) stay; the others are copied in. No destination given: one cat kernel; one parameter
        # and no padding (the tied wte): its own gradient is the buffer.
        sent, self._send[i] = self._send[i], None
        if sent is not None:
            at = sent.data_ptr()  # views only where a gradient is missing or elsewhere (host time: see host_dp.py)
            for p, off, size in zip(f.params, f.offsets, f.sizes):
                if p.grad is None:
                    sent[off:off + size].zero_()
                elif p.grad.data_ptr() != at + off * sent.element_size():
                    sent[off:off + size].copy_(p.grad.reshape(-1))
                    self.copied += size
            sent[f.numel:].zero_()
        elif len(f.params) == 1 and f.padded == f.numel and f.params[0].grad is not None:
            sent = f.params[0].grad.reshape(-1)
        else:
            sent = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=self.device)
                              for p in f.params] + [torch.zeros(f.padded - f.numel, device=self.device)])
            self.copied += sum(p.numel() for p in f.params if p.grad is not None)
        for p in f.params:
            p.grad = None  # ZeRO-2: the full gradient is freed; only the reduced shard is kept
            self._given.discard(id(p))
        out = sent[f.lo:f.hi]  # in place, as above
        return f, self._reduce_scatter(out, sent, f.group), out, sent

    @staticmethod
    def _reduce_scatter(out, full, group):
        """Async reduce-scatter of `full` into `out`, its own slice; over a group of one (experts that one rank
        holds, ep = dp x cp) `out` is all of `full` already."""
        return NoWork() if group is None else dist.reduce_scatter_tensor(out, full, group=group, async_op=True)

    def _grad_dest(self, p):
        """ZeRO-2: p's range of its bucket's send buffer (made by the bucket's first request), once per micro-step."""
        if p.grad is not None or id(p) in self._given:
            return None
        self._given.add(id(p))
        i, off = self._at[id(p)]
        if self._send[i] is None:
            self._send[i] = torch.empty(self.flats[i].padded, device=self.device)
        return self._send[i][off:off + p.numel()].view_as(p)

    def _before_backward(self):
        if self.stage == 1:
            self._check_single_sync()

    def _after_backward(self):
        if self.stage == 1 and self._sync:
            self._launch_ready(force=True)
        elif self.stage == 2:  # the last buckets' reductions stay in flight: under gradient accumulation they
            # overlap the next micro-step's forward (its first launch, or the step, drains them)
            self._launch_ready(force=True)
            self._reset_buckets()

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
        self._reset_buckets()
        if self.stage == 2:  # a backward that did not finish may have left send buffers and destinations given
            self._send, self._given = [None] * len(self.flats), set()

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
        # in place (the input is the output's own [lo, hi), which NCCL and gloo allow): no (shard,) copies
        if self.prefetch:  # in the order the next forward reads the flats; each waited by its first reader
            self.wait_params()
            for i in self._gather_order:
                f = self.flats[i]
                self._pending[i] = dist.all_gather_into_tensor(f.param, f.param[f.lo:f.hi], group=f.group,
                                                               async_op=True)
            return
        works = [dist.all_gather_into_tensor(f.param, f.param[f.lo:f.hi], group=f.group, async_op=True)
                 for f in self.flats if f.group is not None]
        for work in works:
            work.wait()

    # ---- parameter prefetch (parallel.zero_prefetch): the all-gathers overlap the next forward
    def _install_prefetch(self):
        """Each flat's first reader in forward order: the block (a module of transformer.h) that holds its earliest
        parameter, or the root (the model; a pipeline stage's chunks) for the parameters outside the blocks, whose
        forward runs before its blocks'. A forward pre-hook on each reader waits for its flats' gathers, which
        _after_step issues in that order (the flats are in backward order: buckets.grad_buckets)."""
        roots = list(getattr(self.model, "chunks", None) or [self.model])  # pp.Stage runs only through its chunks
        reader, rank, k = {}, {}, 0  # id(p) -> module whose pre-hook waits for it; id(module) -> forward position
        for root in roots:
            rank[id(root)], k = k, k + 1
            for p in root.parameters():
                reader.setdefault(id(p), root)
            h = root.transformer["h"] if hasattr(root, "transformer") and "h" in root.transformer else []
            for block in (h.values() if isinstance(h, nn.ModuleDict) else h):
                rank[id(block)], k = k, k + 1
                for p in block.parameters():
                    reader[id(p)] = block
        first = {}  # flat index -> its first reader
        for i, f in enumerate(self.flats):
            mods = [reader.get(id(p), roots[0]) for p in f.params]  # (a parameter no root holds: at the start)
            first[i] = min(mods, key=lambda m: rank[id(m)])
        self._gather_order = sorted((i for i, f in enumerate(self.flats) if f.group is not None),
                                    key=lambda i: (rank[id(first[i])], -i))
        self._waits = {}  # id(module) -> the flats its pre-hook waits for
        for i in self._gather_order:
            self._waits.setdefault(id(first[i]), []).append(i)
        hook = weak_method(self, "_wait_before")
        for m in {id(first[i]): first[i] for i in self._gather_order}.values():
            self._handles.append(m.register_forward_pre_hook(hook))

    def _wait_before(self, module, args):
        for i in self._waits.get(id(module), ()):
            work = self._pending.pop(i, None)
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the gather (no host sync)

    def wait_params(self) -> None:
        while self._pending:
            self._pending.pop(next(iter(self._pending))).wait()

    def _zero_grads(self):
        for f in self.flats:
            (f.grad if self.stage == 1 else f.grad_shard).zero_()

    def _extra_grads(self):
        return [f.grad_shard for f in self.flats] if self.stage >= 2 else []

    def _optim_state(self):
        return [t for f in self.flats for t in (f.exp_avg, f.exp_avg_sq)]

    # ---- checkpoints
    def _step_count(self) -> int:
        for f in self.flats:
            for piece, *_ in f.pieces:
                return int(self.optimizer.state[piece]["step"])
        return 0

    def _check_layout(self, sd: dict):
        keys = ("params", "numel", "padded", "lo", "hi", "expert")
        ok = sd.get("world") == self.n and sd.get("rank") == self.r and len(sd["flats"]) == len(self.flats) and \
            all({k: a.get(k) for k in keys} == {k: b.meta().get(k) for k in keys}
                for a, b in zip(sd["flats"], self.flats))
        if not ok:
            raise ValueError(f"flat shard of rank {sd.get('rank')}/{sd.get('world')} does not match this engine's "
                             f"layout (rank {self.r}/{self.n}): resume with the saved run's dp x cp and its "
                             f"parallel.bucket_mb (ZeRO-1/2) or parallel.zero3_unit_blocks (ZeRO-3), or load the "
                             f"unshard_* full form instead")

    def state_dict(self) -> dict:
        self.wait_params()
        return {"format": "flat_shard", "rank": self.r, "world": self.n, "step": self._step_count(),
                "flats": [{**f.meta(), "exp_avg": f.exp_avg, "exp_avg_sq": f.exp_avg_sq} for f in self.flats]}

    def load_state_dict(self, sd: dict) -> None:
        self.wait_params()
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
