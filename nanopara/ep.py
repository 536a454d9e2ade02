"""Expert parallel: each rank of an ep group holds E/ep experts of every MoE layer; tokens travel to their experts
and back by all-to-all (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-Core's all-to-all dispatcher).

Layout (mesh.py): an ep group is a run of ep consecutive ranks of the dp x cp group; its rank i holds experts
[i*El, (i+1)*El), El = E/ep, as parameters of shape (El, ...) marked `p.ep_dim = 0`. The router and expert_bias
stay replicated. A local expert's gradient already sums every token of the ep group routed to it, so it reduces
over the "edp" group only (the dp*cp/ep ranks holding the same experts); replicated parameters reduce over dp x cp
as before, and engine.backward's one 1/(dp*cp) makes both means over the global batch. Grad norm: expert pieces'
squares are summed over ep (engine._global_sq), as tp shards' are over tp.

One MoE layer's forward (MoEMLP.forward -> layer.ep.experts -> `ep_experts`), routed over all E as on one device:
  1. the expert-sorted buffer xs (R, C): the rows for ep rank j are one contiguous slice (its experts' groups);
  2. counts: all_to_all_single of (ep, El) kept-row counts -> recv[s, e] = rows source s sends to local expert e;
     one host copy of both (the row splits are host ints) per layer per forward;
  3. rows: all_to_all_single with those variable splits (`AllToAll`, whose backward is the reverse exchange);
  4. received rows come (source, expert)-major: one index gather makes them (expert, source)-major, the local
     experts run on El groups (the grouped GEMM or moe.py's per-expert path), the inverse gather restores order;
  5. all_to_all back, zero rows appended up to R, and the usual unpermute-combine with the gates.
Every rank joins both collectives, in both directions, even when it sends or receives no row (ranks run the same
number of MoE forwards: train.py's validation and samples run on every rank in lockstep).

Callers: parallel.parallelize (apply_ep), moe.MoEMLP.forward; tests/test_ep.py, bench/bench_ep.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from nanopara.moe import moe_layers


@dataclass
class EPGroup:
    """What an MoE layer needs to run its local experts: the ep process group, its size and this rank's index."""
    group: object
    size: int
    rank: int
    n_experts: int  # E, over the whole group

    @property
    def local(self) -> int:
        return self.n_experts // self.size

    def experts(self, xs, offsets, run_local):
        return ep_experts(xs, offsets, self, run_local)


# ----------------------------------------------------------------------------------------------------------------
# the all-to-all with its autograd rule

def all_to_all(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """Rows x (sum(send), ...) -> (sum(recv), ...): send[j] consecutive rows go to rank j of `group`, recv[j] come
    from it, in rank order."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """fwd: all_to_all(x, send, recv); bwd: all_to_all(dy, recv, send) (the gradients retrace the rows' path)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, dy):
        return all_to_all(dy, ctx.recv, ctx.send, ctx.group), None, None, None


# ----------------------------------------------------------------------------------------------------------------
# one layer's dispatch -> local experts -> combine

def exchange_counts(kept: torch.Tensor, ep: EPGroup) -> tuple[list, torch.Tensor]:
    """kept (E,) rows this rank keeps per expert -> (rows sent to each ep rank (host list), recv (ep, El) host
    tensor: rows each source sends to each local expert). One small all-to-all and one host copy."""
    send_counts = kept.to(torch.int64).view(ep.size, ep.local)  # (ep, El): row j goes to ep rank j
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    both = torch.stack([send_counts, recv_counts]).cpu()  # the one host sync of the layer
    return both[0].sum(1).tolist(), both[1]


def source_to_expert_order(recv: torch.Tensor, device) -> torch.Tensor:
    """Index p with xr[p] (expert, source)-major, for xr the received rows, which come (source, expert)-major;
    recv (ep, El) host counts."""
    ep, El = recv.shape
    start = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).view(ep, El)  # where segment (s, e) starts in xr
    lengths, starts = recv.t().reshape(-1), start.t().reshape(-1)  # segments in (e, s) order
    seg_base = starts - (lengths.cumsum(0) - lengths)  # row i of segment q: xr row starts[q] + (i - its out start)
    total = int(lengths.sum())
    idx = torch.repeat_interleave(seg_base, lengths) + torch.arange(total)
    return idx.to(device)


def ep_experts(xs: torch.Tensor, offsets: torch.Tensor, ep: EPGroup, run_local) -> torch.Tensor:
    """The expert MLPs of the expert-sorted buffer xs (R, C) with group bounds offsets (E+1,), computed where the
    experts live: rows out by all-to-all, `run_local(rows, local_offsets (El+1,) int32)` on this rank's experts,
    rows back. Returns (R, C); rows past offsets[E] are zero."""
    R = xs.shape[0]
    kept = offsets[1:] - offsets[:-1]  # (E,)
    send, recv = exchange_counts(kept, ep)
    n_kept = sum(send)
    xr = AllToAll.apply(xs[:n_kept], send, recv.sum(1).tolist(), ep.group)  # (sum recv, C) (source, expert)-major
    local_off = torch.tensor([0] + recv.sum(0).cumsum(0).tolist(), dtype=torch.int32, device=xs.device)  # (El+1,)
    if ep.local > 1:
        order = source_to_expert_order(recv, xs.device)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        yr = run_local(xr[order], local_off)[inv]
    else:
        yr = run_local(xr, local_off)
    ys = AllToAll.apply(yr, recv.sum(1).tolist(), send, ep.group)  # (n_kept, C) back in xs's row order
    if R > n_kept:  # capacity mode: the buffer's unused tail
        ys = torch.cat([ys, ys.new_zeros(R - n_kept, ys.shape[1])])
    return ys


# ----------------------------------------------------------------------------------------------------------------
# sharding a single-device model's experts

def ep_group_of(mesh) -> EPGroup | None:
    """This rank's EPGroup (without the expert count), or None for ep = 1."""
    if mesh.sizes.get("ep", 1) == 1:
        return None
    return EPGroup(mesh.groups["ep"], mesh.sizes["ep"], mesh.coords["ep"], 0)


def apply_ep(model: nn.Module, mesh) -> dict:
    """Keep this rank's experts of every MoE layer (in place; the other ranks' slices are dropped) and attach the
    ep group to the layers. Returns the shard metadata checkpoints record: {name: {"dim": 0, "full_shape",
    "slices": [[lo, hi]], "ep", "ep_rank"}} (the same form as tp.shard_metadata's, consolidate.py places it)."""
    base = ep_group_of(mesh)
    meta = {}
    if base is None:
        return meta
    names = {id(m): n for n, m in model.named_modules()}
    for layer in moe_layers(model):
        E = layer.n_experts
        if E % base.size:
            raise ValueError(f"moe_experts={E} is not divisible by parallel.ep={base.size}")
        layer.ep = EPGroup(base.group, base.size, base.rank, E)
        lo, hi = base.rank * layer.ep.local, (base.rank + 1) * layer.ep.local
        for lin_name in ("c_fc", "c_proj"):
            lin = getattr(layer.experts, lin_name)
            for pname in ("weight", "bias"):
                p = getattr(lin, pname)
                if p is None:
                    continue
                q = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
                q.ep_dim = 0
                if getattr(p, "sp_partial", False):  # tp + sp (tp.apply_tp ran first): still summed over tp
                    q.sp_partial = True
                setattr(lin, pname, q)
                full = f"{names[id(layer)]}.experts.{lin_name}.{pname}"
                meta[full] = {"dim": 0, "full_shape": list(p.shape), "slices": [[lo, hi]], "ep": base.size,
                              "ep_rank": base.rank}
    return meta


def is_expert(p: torch.Tensor) -> bool:
    """An ep-sharded expert parameter (its gradient reduces over the edp group, its norm sums over ep)."""
    return hasattr(p, "ep_dim")


@torch.no_grad()
def gather_experts(model: nn.Module, mesh) -> dict:
    """{name: full tensor} of every expert parameter, on every rank (collective over the ep group): the
    single-device layout, for tests and sample-time checks."""
    ep = ep_group_of(mesh)
    out = {}
    for name, p in model.named_parameters():
        if not is_expert(p):
            continue
        parts = [torch.empty_like(p) for _ in range(ep.size)]
        dist.all_gather(parts, p.detach().contiguous(), group=ep.group)
        out[name] = torch.cat(parts)
    return out
