"""ZeRO-3 (P_os+g+p, Rajbhandari et al. 2020): parameters sharded too, gathered unit by unit around their use.

Zero3 is zero.py's engine (flat buffers, sharded AdamW, reduce-scattered gradient shards, checkpoints) with units
instead of buckets: the root (every parameter outside the blocks: wte = lm_head, wpe, ln_f) and each run of K =
parallel.zero3_unit_blocks consecutive transformer blocks (the last run may be shorter; K > n_layer: one unit of
all blocks; 0, the default: K from UNIT_MIN_PARAMS). A rank keeps 1/N of each unit in fp32.
Protocol per unit: all-gathered by a forward pre-hook on its first block (the next PREFETCH units' gathers
started), freed by the forward hook of its last block; gathered again by a hook on the gradient of whichever
output of its last block gets one first (the previous PREFETCH units prefetched); freed once its gradient is
reduce-scattered (comm.zero_gathered, whose backward starts the reduce-scatter asynchronously; at most 2 units'
fp32 gradients in flight, older ones drained inside backward). The root stays gathered from forward through
backward: the tied wte is used at both ends. Gather dtypes: a unit's matrices in the compute dtype (bf16 under
autocast: exactly the values autocast would cast fp32 weights to, so the numerics are DDP's, at half the bytes),
its vectors (LayerNorm, biases) and the root in fp32 (the residual stream stays fp32). Under expert parallel
(ep.py) a unit's experts are flats of their own over the edp group (the ranks holding the same experts; a group
of one when each expert has one holder: comm.py then copies instead of communicating).

K trades memory for host time: the hooks, gathers and reduce-scatters of a step scale with the number of units
(at small micro-batches a unit's Python work takes about as long as a block's GPU work), while 1 + PREFETCH units
of K blocks are gathered at once. Checkpoints hold one flat per unit and dtype, so a "flat_shard" resumes only
with the same K (and N); another K is a clear error: reshard through zero.unshard_*.

model_state_dict() is this rank's fp32 master shards in zero.py's "flat_shard" form; full_model_state_dict()
gathers every parameter (collective). Tests: tests/test_dp.py, tests/test_comm.py (comm.zero_gathered).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from nanopara.comm import all_gather_flat, flat_views, zero_gathered
from nanopara.config import Config
from nanopara.buckets import Flat, reduce_group
from nanopara.engine import compute_dtype, weak_method
from nanopara.mesh import Mesh
from nanopara.zero import Zero

# ZeRO-3 gathers this many units ahead of the one running (forward: the next units; backward: the previous ones).
# Each costs one more unit (K blocks) of bf16 weights; 2 measured no faster than 1 (4 x H200, GPT-2 124M).
PREFETCH = 1
# parallel.zero3_unit_blocks=0 (auto) puts this many parameters or more in a unit: GPT-2 124M's blocks (7.1M each)
# in units of 3, gpt2_350m / 774m's in 2, gpt2_1558m and larger one block a unit. A unit's host work is about
# constant while its GPU work grows with its parameters: one 124M block a unit leaves the forward host-bound at
# B=16 (0.85-0.93x our DDP against 0.95-1.01x with units of 3 blocks, 2 and 4 x H200).
UNIT_MIN_PARAMS = 20_000_000


def auto_unit_blocks(blocks: list[nn.Module]) -> int:
    """The fewest consecutive blocks holding >= UNIT_MIN_PARAMS parameters (all of them if the model is smaller)."""
    per_block = max(sum(p.numel() for p in blocks[0].parameters()), 1) if blocks else 1
    return max(1, min(len(blocks), -(-UNIT_MIN_PARAMS // per_block)))


class Zero3(Zero):
    """ZeRO-3 over the dp x cp group: units of blocks gathered by hooks around their forward and backward."""

    max_inflight = 4  # reduce-scatters in flight: 2 units of 2 flats (matrices, vectors)

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        super().__init__(model, mesh, cfg, stage=3)  # builds the units (_make_flats) and the sharded optimizer

    def _make_flats(self):
        self._make_units(self.model, compute_dtype(self.cfg, self.device))

    def _param_shard(self, f: Flat) -> torch.Tensor:
        return f.master

    def _after_backward(self):
        self._drain()

    def _wait_inflight(self):
        self._drain()

    def _after_step(self):
        pass  # the master shards were updated in place; the next forward gathers them

    def _extra_params(self):
        return [f.master for f in self.flats] + [f.full for f in self.flats]

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
        k = self.unit_blocks = self.cfg.parallel.zero3_unit_blocks or auto_unit_blocks(blocks)
        chunks = [blocks[a:a + k] for a in range(0, len(blocks), k)]  # [first, .., last] block of each unit
        specs = [[("root", [p for p in self.params if id(p) not in block_of], torch.float32)]]
        for u, chunk in enumerate(chunks):
            mine = [p for p in self.params if block_of.get(id(p), -1) // k == u]
            name = f"h[{u * k}:{u * k + len(chunk)}]"
            unit = []
            for kind, ps in (("", [p for p in mine if not hasattr(p, "ep_dim")]),  # expert parallel (ep.py): this
                             (".experts", [p for p in mine if hasattr(p, "ep_dim")])):  # rank's experts, flats of
                unit += [(f"{name}{kind}.matrices", [p for p in ps if p.dim() >= 2], dtype),  # their own over edp
                         (f"{name}{kind}.vectors", [p for p in ps if p.dim() < 2], torch.float32)]
            specs.append(unit)
        self.flats, self.units, self.param_objs = [], [], {}
        self.anchor = torch.zeros(0, device=self.device, requires_grad=True)  # makes backward reach every unit
        for spec in specs:
            unit = []
            for name, params, gather_dtype in spec:
                if not params:
                    continue
                group, n, r = reduce_group(self, params)  # dp x cp, or the edp group for experts
                f = Flat(name, params, [self.names[id(p)] for p in params], n, r)
                f.group = group
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
        # hooks must not keep the engine alive
        pre, post = weak_method(self, "_pre_forward"), weak_method(self, "_post_forward")
        self._pre_backward_weak = weak_method(self, "_pre_backward")
        self._on_unit_grad_weak = weak_method(self, "_on_unit_grad")
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
                f.pending = (*all_gather_flat(f.master, f.group, f.gather_dtype), None)
                continue
            f.full.untyped_storage().resize_(f.padded * f.full.element_size())
            # autograd saved views of f.full in forward; refilling it with the same values must not count as an
            # in-place edit. The backend may write (bumping the version) any time before the wait: restore after.
            keep = torch.autograd._unsafe_preserve_version_counter(f.full)
            f.pending = (*all_gather_flat(f.master, f.group, f.gather_dtype, out=f.full), keep)

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
                views = zero_gathered(self.anchor, full, f.group, functools.partial(self._on_unit_grad_weak, f),
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
        for f in self.flats:
            if f.pending is not None:
                self._wait(f)
            self._free(f)

    # ---- checkpoints (the optimizer state is zero.py's)
    def model_state_dict(self) -> dict:
        return {"format": "flat_shard", "rank": self.r, "world": self.n,
                "flats": [{**f.meta(), "param": f.master} for f in self.flats]}

    def load_model_state_dict(self, sd: dict) -> None:
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
        """{name: full fp32 tensor} on every rank: each flat's master shards all-gathered (collective)."""
        out = {}
        for f in self.flats:
            full, work, _ = all_gather_flat(f.master, f.group, torch.float32)
            work.wait()
            for name, view, shape in zip(f.names, full.split(f.sizes + [f.padded - f.numel]), f.shapes):
                out[name] = view.view(shape).clone()
        return out
