"""Expert parallel: each rank of an ep group holds E/ep experts of every MoE layer; tokens travel to their experts
and back by all-to-all (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-Core's all-to-all dispatcher).
Layout (mesh.py): an ep group is a run of ep consecutive ranks of the dp x cp group; its rank i holds experts
[i*El, (i+1)*El), El = E/ep, as parameters of shape (El, ...) marked `p.ep_dim = 0`. The router and expert_bias
stay replicated. A local expert's gradient already sums every token of the ep group routed to it, so it reduces
over the "edp" group only (the dp*cp/ep ranks holding the same experts); replicated parameters reduce over dp x cp
as before, and engine.backward's one 1/(dp*cp) makes both means over the global batch. Grad norm: expert pieces'
squares are summed over ep (engine._global_sq), as tp shards' are over tp.

One MoE layer's forward (MoEMLP.forward -> layer.ep.experts -> `ep_experts`), routed over all E as on one device:
  1. the expert-sorted buffer xs: the rows for ep rank j are one slice (its experts' groups);
  2. counts: all_to_all_single of the (ep, El) kept-row counts -> recv[s, e] (on the device);
  3. rows: all_to_all_single (`AllToAll`, whose backward is the reverse exchange). Dropless: the split sizes are read
     on the host, the layer's one host sync per forward. Capacity c: xs holds E x c rows (expert e's at e c, padded),
     every peer gets El x c rows: fixed splits, no host sync, the same shapes every step;
  4. received rows come (source, expert)-major: a device-side index (`expert_major`) and moe_route's row moves make
     them (expert, source)-major without padding, the local experts run on El groups (the grouped GEMM or moe.py's
     per-expert path), the inverse move restores the order (padding rows zero);
  5. all_to_all back, and the usual unpermute-combine with the gates.
Every rank joins both collectives, in both directions, even when it sends or receives no row (ranks run the same
number of MoE forwards: train.py's validation and samples run on every rank in lockstep). parallel.ep_chunks = J
(capacity only): steps 3-5 in J pieces of the slots, each exchange started asynchronously so that piece i+1's rows
travel while piece i's experts run, backward too (ep_experts_chunked). Callers: parallel.parallelize (apply_ep),
moe.MoEMLP.forward; tests/test_ep.py, bench/bench_ep.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanopara.moe import moe_layers


@dataclass
class EPGroup:
    """What an MoE layer needs to run its local experts: the ep process group, its size and this rank's index."""
    group: object
    size: int
    rank: int
    n_experts: int  # E, over the whole group
    chunks: int = 1  # capacity mode: the exchange and the local experts in this many pieces, pipelined
    fp8: bool = False  # the rows out in e4m3 with a scale per row (FP8Dispatch); the results come back as they are

    @property
    def local(self) -> int:
        return self.n_experts // self.size

    def padded(self, r, capacity: int):
        """(dest, rows, capacity') of the fixed-size buffer for route result r: moe_route.padded_dest's E x
        capacity rows, or with chunks > 1 its chunk-major form at capacity' = chunks x ceil(capacity / chunks)
        (chunk_major: the same kept rows, more padding when chunks does not divide capacity)."""
        from kernels import moe_route as mr
        if self.chunks == 1:
            return mr.padded_dest(r, capacity), self.n_experts * capacity, capacity
        cap = -(-capacity // self.chunks) * self.chunks
        return chunk_major(mr.padded_dest(r, cap), self.n_experts, cap, self.chunks), self.n_experts * cap, cap

    def experts(self, xs, offsets, run_local, capacity=None, triton=False):
        if capacity is not None and self.chunks > 1:
            return ep_experts_chunked(xs, offsets, self, run_local, capacity, triton)
        return ep_experts(xs, offsets, self, run_local, capacity, triton)


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


class FP8Dispatch(torch.autograd.Function):
    """fwd: all_to_all of x's rows as e4m3 with a power-of-two scale per row (kernels/fp8_quant.py: C + 4 bytes a
    row against bf16's 2C), back in x's dtype on arrival; bwd: the gradient's reverse exchange in its own dtype
    (straight through the rounding, as the experts' inputs in an FP8 recipe)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        from kernels.fp8_quant import fp8_quantize
        ctx.send, ctx.recv, ctx.group = send, recv, group
        t = fp8_quantize(x.contiguous(), granularity="row", pow2=True)
        got = all_to_all(torch.cat([t.q.view(torch.uint8), t.s.view(torch.uint8)], 1), send, recv, group)
        C = x.shape[1]
        q, s = got[:, :C].contiguous().view(t.q.dtype), got[:, C:].contiguous().view(torch.float32)
        return (q.float() * s).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return all_to_all(dy, ctx.recv, ctx.send, ctx.group), None, None, None


class Pending:
    """An all_to_all in flight (A2AStart -> A2AWait): its output buffer, valid once `work` is waited for."""
    work = None
    out = None


def _start(x: torch.Tensor, split: list, group, h: Pending) -> torch.Tensor:
    h.out = x.new_empty(sum(split), *x.shape[1:])
    h.work = dist.all_to_all_single(h.out, x.contiguous(), output_split_sizes=split, input_split_sizes=split,
                                    group=group, async_op=True)
    return h.out


class A2AStart(torch.autograd.Function):
    """fwd: start all_to_all(x) (equal splits both ways) and return its buffer, not yet valid; bwd: wait for the
    reverse exchange that A2AWait's backward started and return its buffer."""

    @staticmethod
    def forward(ctx, x, split, group, h):
        ctx.h = h
        return _start(x, split, group, h)

    @staticmethod
    def backward(ctx, g):
        ctx.h.work.wait()
        return ctx.h.out, None, None, None


class A2AWait(torch.autograd.Function):
    """fwd: wait for the exchange A2AStart began (the current stream waits; the host does not on GPU); bwd: start
    the reverse exchange of the gradient, so the compute between the two backwards overlaps it."""

    @staticmethod
    def forward(ctx, y, split, group, h):
        h.work.wait()
        ctx.split, ctx.group, ctx.h = split, group, h
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return _start(g, ctx.split, ctx.group, ctx.h), None, None, None


def exchange_async(x: torch.Tensor, split: list, group) -> tuple[torch.Tensor, Pending]:
    """(buffer, handle): an all_to_all started; `arrive` it before reading the buffer."""
    h = Pending()
    return A2AStart.apply(x, split, group, h), h


def arrive(buf: torch.Tensor, split: list, group, h: Pending) -> torch.Tensor:
    return A2AWait.apply(buf, split, group, h)


# ----------------------------------------------------------------------------------------------------------------
# one layer's dispatch -> local experts -> combine

def exchange_counts(kept: torch.Tensor, ep: EPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """kept (E,) rows this rank keeps per expert -> (send (ep, El): rows for ep rank j's experts, recv (ep, El):
    rows each source sends to each local expert), int64 on the device: one small all-to-all, no host copy."""
    send = kept.to(torch.int64).view(ep.size, ep.local)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    return send, recv


def expert_major(recv: torch.Tensor, rows: int, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest (rows, 1) int32, local offsets (El+1,) int32), device ops only. The received rows come source-major:
    segment (s, e) holds what source s sent to local expert e, recv[s, e] rows, back to back (dropless) or at the
    start of `capacity` rows (capacity: the rest is padding). dest[p] is row p's place in the (expert, source)-major
    buffer of this rank's experts (expert e's group: [offsets[e], offsets[e+1]), sources in rank order), -1 for
    padding: moe_route's permute / unpermute move the rows with it."""
    ep, El = recv.shape
    flat = recv.reshape(-1)  # (ep * El,) segment lengths in arrival order
    p = torch.arange(rows, device=recv.device)
    if capacity is None:
        ends = flat.cumsum(0)
        seg = torch.searchsorted(ends, p, right=True).clamp(max=max(ep * El - 1, 0))  # row p's segment
        pos = p - (ends - flat)[seg]  # its place within the segment
    else:
        seg, pos = p // max(capacity, 1), p % max(capacity, 1)
    offsets = F.pad(recv.sum(0).cumsum(0), (1, 0))  # (El + 1,) local expert groups
    base = (offsets[:-1][None, :] + recv.cumsum(0) - recv).reshape(-1)  # where segment (s, e) starts in them
    dest = torch.where(pos < flat[seg], base[seg] + pos, -1)
    return dest.to(torch.int32)[:, None], offsets.to(torch.int32)


def ep_experts(xs: torch.Tensor, offsets: torch.Tensor, ep: EPGroup, run_local, capacity: int | None = None,
               triton: bool = False) -> torch.Tensor:
    """The expert MLPs of the expert-sorted buffer xs, computed where the experts live: rows out by all-to-all,
    `run_local(rows, local_offsets (El+1,) int32)` on this rank's experts, rows back; returns xs's layout.
    capacity None (dropless): xs (R, C) grouped by offsets (E+1,) with no gap (R = offsets[E]); the row splits are
    read on the host: the layer's one host sync. capacity c: xs (E * c, C), expert e's rows at [e c, e c + kept_e)
    (moe_route.padded_dest); every peer gets El * c rows, padding included: fixed splits, no host sync, the same
    shapes every step (a CUDA graph can hold it). triton: moe_route's Triton row moves, else its references."""
    from kernels import moe_route as mr
    permute, unpermute = (mr.permute_triton, mr.unpermute_triton) if triton else (mr.permute_ref, mr.unpermute_ref)
    send, recv = exchange_counts(offsets[1:] - offsets[:-1], ep)
    if capacity is None:
        send_rows, recv_rows = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the host sync (split sizes)
    else:
        send_rows = recv_rows = [ep.local * capacity] * ep.size
    xr = (FP8Dispatch if ep.fp8 else AllToAll).apply(xs, send_rows, recv_rows, ep.group)  # (source, expert)-major
    dest, local_off = expert_major(recv, xr.shape[0], capacity)
    if ep.local == 1 and capacity is None:  # one local expert and no padding: already in its order
        yr = run_local(xr, local_off)
    else:
        yr = unpermute(run_local(permute(xr, dest, xr.shape[0]), local_off), dest, None)  # padding rows: zero
    return AllToAll.apply(yr, recv_rows, send_rows, ep.group)


def chunk_major(dest: torch.Tensor, n_experts: int, capacity: int, chunks: int) -> torch.Tensor:
    """padded_dest's place e x capacity + s -> chunk-major: chunk i holds slots [i cK, (i+1) cK) of every expert
    (cK = capacity / chunks) as an E x cK buffer of its own, the unchunked layout at capacity cK; -1 stays -1."""
    ck = capacity // chunks
    e, s = dest // capacity, dest % capacity
    return torch.where(dest >= 0, (s // ck) * (n_experts * ck) + e * ck + s % ck, -1).to(torch.int32)


def ep_experts_chunked(xs: torch.Tensor, offsets: torch.Tensor, ep: EPGroup, run_local, capacity: int,
                       triton: bool = False) -> torch.Tensor:
    """ep_experts in capacity mode, as ep.chunks pieces in a pipeline: xs chunk-major (chunk_major, capacity a
    multiple of chunks); piece i+1's rows travel while piece i's experts run, and piece i's results travel back
    while piece i+1's run (async all_to_alls: NCCL's stream beside the compute stream). The backward overlaps the
    same way (A2AWait starts each reverse exchange, A2AStart waits for it). Every rank issues the exchanges in the
    same order. Same rows, same sums per row as ep_experts: only the exchange is cut."""
    from kernels import moe_route as mr
    permute, unpermute = (mr.permute_triton, mr.unpermute_triton) if triton else (mr.permute_ref, mr.unpermute_ref)
    _, recv = exchange_counts(offsets[1:] - offsets[:-1], ep)  # (ep, El) kept rows, the whole capacity
    k, g = ep.chunks, ep.group
    ck = capacity // k
    split = [ep.local * ck] * ep.size
    parts = xs.chunk(k)  # contiguous: chunk-major
    going = [exchange_async(parts[0], split, g)]
    back = []
    for i in range(k):
        if i + 1 < k:
            going.append(exchange_async(parts[i + 1], split, g))
        buf, h = going[i]
        xr = arrive(buf, split, g, h)
        dest, local_off = expert_major((recv - i * ck).clamp(0, ck), xr.shape[0], ck)
        yr = unpermute(run_local(permute(xr, dest, xr.shape[0]), local_off), dest, None)  # padding rows: zero
        back.append(exchange_async(yr, split, g))
    return torch.cat([arrive(buf, split, g, h) for buf, h in back])


# ----------------------------------------------------------------------------------------------------------------
# sharding a single-device model's experts

def ep_group_of(mesh) -> EPGroup | None:
    """This rank's EPGroup (without the expert count), or None for ep = 1."""
    if mesh.sizes.get("ep", 1) == 1:
        return None
    return EPGroup(mesh.groups["ep"], mesh.sizes["ep"], mesh.coords["ep"], 0)


def apply_ep(model: nn.Module, mesh, chunks: int = 1, fp8: bool = False) -> dict:
    """Keep this rank's experts of every MoE layer (in place; the other ranks' slices are dropped) and attach the
    ep group to the layers (chunks, fp8: parallel.ep_chunks, parallel.ep_fp8). Returns the shard
    metadata checkpoints record: {name: {"dim": 0, "full_shape", "slices": [[lo, hi]], "ep", "ep_rank"}} (the same
    form as tp.shard_metadata's, consolidate.py places it)."""
    base = ep_group_of(mesh)
    meta = {}
    if base is None:
        return meta
    names = {id(m): n for n, m in model.named_modules()}
    for layer in moe_layers(model):
        E = layer.n_experts
        if E % base.size:
            raise ValueError(f"moe_experts={E} is not divisible by parallel.ep={base.size}")
        layer.ep = EPGroup(base.group, base.size, base.rank, E, chunks, fp8)
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
