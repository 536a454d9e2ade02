"""Tensor parallelism (Megatron-LM) and sequence parallelism, applied to the single-device GPT from outside.

    model = apply_tp(GPT(cfg), mesh, sp=True)  # parallel.parallelize does this: each rank keeps its slices
    loss.backward()
    sync_partial_grads(model, mesh)            # SP, once per step, for hand-written loops only (engines do it)

Math (Shoeybi et al. 2019). A linear Y = X W^T with W (out, in) split over tp ranks:
  column-parallel: W split by rows (outputs):   Y_r = X W_r^T           -> every rank holds out/tp outputs
  row-parallel:    W split by columns (inputs): Y = sum_r X_r W_r^T     -> one all-reduce (comm.g)
Attention is c_attn column (rank r holds heads r*nh/tp .. (r+1)*nh/tp-1 of q, k and v) then c_proj row; the MLP
is c_fc column then c_proj row: per block, two all-reduces forward (g) and two backward (f). The GEMMs and their
collectives live in tp_linear.py, which overlaps them (`overlap` row blocks; parallel.tp_overlap).
Sequence parallel (Korthikanti et al. 2022): outside the TP regions each rank holds 1/tp of the tokens, a (B, T/tp,
C) tensor whose rows are tp_linear.py's contiguous layout; f/g become an all-gather / reduce-scatter. Replicated
parameters then see N/tp tokens each, so their gradients are partial sums over tp (`sp_partial`).
Vocab parallel: the tied wte/lm_head (Vp', C) is split by vocab rows; the loss combines per-shard max, sum-exp
and target logit, never the full logits, so `model(idx)` returns this rank's logit columns.

Contract with the engines (engine.py) and checkpoints, as attributes on the Parameter objects:
  p.tp_dim, p.tp_parts, p.tp_full_shape   sharded over tp (`shard`): grad-norm terms sum over tp; the rest once.
  p.sp_partial = True                     grad is a partial sum over tp: SUM it over tp once per optimizer step,
                                          after the last micro-step, before clipping (the engines do).
`shard_metadata` gives each shard's global slices; `gather_full_state_dict` / `load_full_state_dict` convert to and
from the single-device layout. Tests: tests/test_tp.py (gloo, CPU); bench/bench_tp.py; notes/tp.md.
"""
from __future__ import annotations

import fnmatch
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kernels.cross_entropy import ce_shard_grad_ref, ce_shard_grad_triton, ce_shard_stats_ref, ce_shard_stats_triton
from nanopara.comm import all_gather_along, all_reduce_sum, f, g
from nanopara.fp8 import FP8LinearFunction
from nanopara.model import GPT, matmul_weight
from nanopara.tp_linear import ColumnSP, ColumnTP, RowSP, RowTP, blocks, shard_rows, sp_all_gather, sp_scatter

# ----------------------------------------------------------------------------------------------------------------
# the plan: which module becomes what (walked by apply_tp in named_modules order)
#
# Trap 1: c_attn is ONE Linear whose outputs are [q heads | k heads | v heads]. Contiguous row blocks would give
#   rank 0 all of q and part of k. parts=3 splits each of the three blocks into tp chunks (whole heads) and
#   concatenates rank r's chunks, so the local output is again [q | k | v] for nh/tp heads.
# Trap 2: lm_head.weight IS wte.weight (tied). It is sharded once, by vocab rows, for the embedding; lm_head reuses
#   that same Parameter as a column-parallel layer whose outputs are vocab logits. Both grads land in one shard.
#   (Under pipeline parallelism the two ends live on different stages and need a grad all-reduce: pp.py.)

TP_PLAN = (
    # module path pattern            style      parts (blocks split separately along the sharded dim)
    ("transformer.wte",              "vocab",   1),
    ("transformer.h.*.attn.c_attn",  "column",  3),
    ("transformer.h.*.attn.c_proj",  "row",     1),
    ("transformer.h.*.mlp.c_fc",     "column",  1),
    ("transformer.h.*.mlp.c_proj",   "row",     1),
    ("lm_head",                      "head",    1),
)


def shard(full: torch.Tensor, dim: int, parts: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's piece: view `dim` as `parts` equal blocks, take chunk `rank` of `tp` of each, concatenate."""
    n = full.shape[dim] // (parts * tp)
    return torch.cat([full.narrow(dim, (j * tp + rank) * n, n) for j in range(parts)], dim)


def unshard(pieces: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """Inverse of `shard`: pieces[r] is rank r's piece."""
    n = pieces[0].shape[dim] // parts
    return torch.cat([pc.narrow(dim, j * n, n) for j in range(parts) for pc in pieces], dim)


def global_slices(p: torch.Tensor, rank: int, tp: int) -> list[list[int]]:
    """[start, stop) ranges along p.tp_dim of the full tensor that rank's piece holds, in order."""
    n = p.tp_full_shape[p.tp_dim] // (p.tp_parts * tp)
    return [[(j * tp + rank) * n, (j * tp + rank + 1) * n] for j in range(p.tp_parts)]


def _sharded_param(full: torch.Tensor, dim: int, parts: int, rank: int, tp: int) -> nn.Parameter:
    p = nn.Parameter(shard(full.detach(), dim, parts, rank, tp).clone())  # clone: the full tensor can be freed
    p.tp_dim, p.tp_parts, p.tp_full_shape = dim, parts, tuple(full.shape)
    return p


# ----------------------------------------------------------------------------------------------------------------
# layers

class _TPState:
    """Shared by all TP layers of one model: the group, the overlap's row blocks (tp_linear.py; 0 = no overlap),
    switches that generate() flips, and the batch size of the current forward (set by the embedding under SP)."""

    def __init__(self, group, tp: int, rank: int, sp: bool, chunks: int = 0, keep_gathered: bool = False):
        self.group, self.tp, self.rank, self.sp, self.chunks = group, tp, rank, sp, chunks
        self.keep_gathered = keep_gathered  # SP column layers keep their gathered input for dW (no regather)
        self.gather_logits = False
        self.batch = None


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W's output rows split over tp; x replicated, or an SP shard (tp_linear.py).
    FP8 (fp8.apply_fp8 attaches `fp8_state`): the collective, then FP8LinearFunction on this rank's shard; scales
    are per shard (the weight shard's own amax): each GEMM dequantizes its output before any reduction, so a scale
    shared over tp would cost an all-reduce of amaxes per cast and change nothing but the rounding. No overlap."""
    takes_fp8 = True
    fp8_state = None  # fp8.attach_fp8's instance attribute shadows it: no failing nn.Module.__getattr__ per forward

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: _TPState):
        super().__init__()
        self.weight, self.bias, self.state = weight, bias, state

    def forward(self, x):  # (B, T, in) or the SP shard (B, T/tp, in) -> (B, T, out/tp)
        s = self.state
        if self.fp8_state is not None:
            x = sp_all_gather(x, s.group, s.chunks) if s.sp else f(x, s.group)
            return FP8LinearFunction.apply(x, self.weight, self.bias, self)
        if s.sp:
            return ColumnSP.apply(x, matmul_weight(self.weight), self.bias, s.group, s.chunks, s.keep_gathered)
        return ColumnTP.apply(x, matmul_weight(self.weight), self.bias, s.group, s.chunks)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W's input columns split over tp; b replicated, added once after the reduce.
    FP8: FP8LinearFunction on this rank's input columns (per-row scales of X then cover a row's in/tp columns),
    then the all-reduce, or the reduce-scatter under SP, of its bf16 output."""
    takes_fp8 = True
    fp8_state = None  # fp8.attach_fp8's instance attribute shadows it: no failing nn.Module.__getattr__ per forward

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: _TPState):
        super().__init__()
        self.weight, self.bias, self.state = weight, bias, state

    def forward(self, x):  # (B, T, in/tp) -> (B, T, out), or the SP shard (B, T/tp, out)
        s = self.state
        if self.fp8_state is not None:
            y = FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), self.weight, None, self)  # (N, out), fresh
            y = sp_scatter(y.view(*x.shape[:-1], -1), s.group, s.chunks) if s.sp else \
                g(y, s.group).view(*x.shape[:-1], -1)
        else:
            y = (RowSP if s.sp else RowTP).apply(x, matmul_weight(self.weight), None, s.group, s.chunks)
        b = self.bias
        return y if b is None else y + (b if b.dtype == y.dtype else b.to(y.dtype))  # autocast's dtype, as nn.Linear


class ParallelLMHead(ColumnParallelLinear):
    """Tied lm_head: column-parallel over the vocab shard of wte; logits stay sharded unless generate() asks."""

    def forward(self, x):  # -> (B, T, Vp'/tp), or (B, T, Vp') while generating
        y = super().forward(x)
        return all_gather_along(y, -1, self.state.group) if self.state.gather_logits else y


class VocabParallelEmbedding(nn.Module):
    """wte over vocab rows start..start+Vp'/tp-1: ids elsewhere look up zeros, then sum over tp (g, or RS under SP)."""

    def __init__(self, weight: nn.Parameter, start: int, state: _TPState):
        super().__init__()
        self.weight, self.start, self.state = weight, start, state

    def forward(self, idx):  # (B, T) -> (B, T, C), or the SP shard (B, T/tp, C)
        s = self.state
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if not s.sp:
            return g(e, s.group)
        if idx.shape[1] % s.tp:
            raise ValueError(f"sequence parallel needs the sequence length {idx.shape[1]} to be divisible by "
                             f"parallel.tp={s.tp}")
        s.batch = idx.shape[0]  # for SeqShardedPositions, called next (wte(idx) + wpe(pos))
        return sp_scatter(e, s.group, s.chunks)


class SeqShardedPositions(nn.Module):
    """wpe under SP: the positions of this rank's rows of the SP layout only (its gradient is a partial sum)."""

    def __init__(self, weight: nn.Parameter, state: _TPState):
        super().__init__()
        self.weight, self.state = weight, state
        self._cols = {}  # (B, T, device) -> column in the sequence of each of this rank's rows, made once

    def forward(self, pos):  # (T,) -> the SP shard (B, T/tp, C), or (T, C) with SP switched off
        s = self.state
        if not s.sp:
            return F.embedding(pos, self.weight)
        if s.batch is None:
            raise RuntimeError("SeqShardedPositions runs after the vocab-parallel embedding (wte(idx) + wpe(pos))")
        B, T = s.batch, pos.shape[0]
        key = (B, T, pos.device)
        if key not in self._cols:  # built on the device: a host-to-device copy every step would stall the host
            rows = shard_rows(B * T, s.rank, s.tp, blocks(B * T // s.tp, s.chunks))
            self._cols[key] = (rows % T).to(pos.device)
        return F.embedding(pos[self._cols[key]], self.weight).view(B, T // s.tp, -1)


# ----------------------------------------------------------------------------------------------------------------
# vocab-parallel cross-entropy: loss_i = log(sum_v exp(z_iv)) - z_i,target, with z split by columns over tp

class _VocabParallelCE(torch.autograd.Function):
    """Mean CE over rows with target != -1 from vocab-sharded logits; columns >= n_vocab never count (fp32 math).
    Each shard's statistics (row max, sum-exp, target logit) and gradient come from kernels/cross_entropy.py: the
    Triton shard kernels (one read of the logits for the statistics, one read + write for the gradient; the torch
    ops they replaced made ~10 passes over an fp32 copy, ~5 ms a step at gpt_1b's 8192 x 25152 shard) or their
    PyTorch references. The statistics go out in two collectives: the max, then sum-exp and target logit."""

    @staticmethod
    def forward(ctx, logits, targets, start, n_vocab, group, triton):
        real = max(0, min(n_vocab - start, logits.shape[1]))  # this shard's real (non-padding) columns
        if real > 0:
            stats_fn = ce_shard_stats_triton if triton else ce_shard_stats_ref
            row_max, sumexp, zt = stats_fn(logits, targets, start, real)
        else:  # a shard of padding only: contributes nothing
            row_max = torch.full(targets.shape, float("-inf"), device=logits.device)
            sumexp, zt = torch.zeros_like(row_max), torch.zeros_like(row_max)
        m = row_max.clone()  # the global max: exp never overflows
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        stats = torch.stack([sumexp * (row_max - m).exp(), zt])  # sum-exp rescaled to the global max
        all_reduce_sum(stats, group)
        lse = stats[0].log() + m
        valid = targets != -1
        count = valid.sum().float()  # 0 valid rows -> nan, as F.cross_entropy
        loss = torch.where(valid, lse - stats[1], 0.0).sum() / count
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.start, ctx.real, ctx.triton = start, real, triton
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # dloss/dz_iv = (softmax_iv - [v == target_i]) / count on valid rows
        logits, targets, lse, count = ctx.saved_tensors
        if ctx.real == 0:
            return torch.zeros_like(logits), None, None, None, None, None
        grad = (ce_shard_grad_triton if ctx.triton else ce_shard_grad_ref)(logits, targets, ctx.start, ctx.real, lse,
                                                                            grad_loss / count)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, start: int, n_vocab: int, group, kernels: str = "torch"):
    """logits (N, Vl): this rank's vocab columns start..start+Vl-1; targets (N,) global ids, -1 ignored.
    kernels="triton": the shard kernels (CUDA, or the interpreter on CPU); else their PyTorch references."""
    return _VocabParallelCE.apply(logits, targets, start, n_vocab, group, kernels == "triton")


def _tp_loss_fn(self, logits, targets):  # replaces GPT.loss_fn on a TP model
    s = self.tp_state
    Vl = logits.shape[-1]
    kernels = "triton" if logits.is_cuda and self.cfg.kernels != "torch" else "torch"
    return vocab_parallel_cross_entropy(logits.reshape(-1, Vl), targets.reshape(-1), s.rank * Vl,
                                        self.cfg.vocab_size, s.group, kernels)


def _tp_generate(self, *args, **kwargs):
    """GPT.generate on a TP model: logits gathered over the vocab, SP off (a single new token cannot be split)."""
    s = self.tp_state
    sp, s.sp, s.gather_logits = s.sp, False, True
    try:
        return GPT.generate(self, *args, **kwargs)
    finally:
        s.sp, s.gather_logits = sp, False


class _PerRankDropoutRng:
    """Forward hooks: run the model's forward on this tp rank's own RNG stream, then restore the shared one.

    Without SP every dropout of this GPT acts on activations replicated over tp, so the tp ranks must draw the same
    masks: they do, because every rank seeds the default generator alike and makes the same calls. With SP every
    dropout acts on a sequence shard (and any inside TP regions on a head/hidden shard), so masks must differ per
    tp rank: apply_tp installs these hooks (only when dropout > 0), seeded from torch.initial_seed() and the rank.
    """

    def __init__(self, rank: int):
        self.rank, self.own, self.saved = rank, None, None

    @staticmethod
    def _get(dev):
        return torch.get_rng_state(), (torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)

    @staticmethod
    def _set(state, dev):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], dev)

    def enter(self, module, args):
        if not module.training:
            return
        self.dev = next(module.parameters()).device
        self.saved = self._get(self.dev)
        if self.own is None:  # first forward: derive this rank's stream from the shared seed
            torch.manual_seed(torch.initial_seed() + 1_000_003 * (self.rank + 1))
        else:
            self._set(self.own, self.dev)

    def exit(self, module, args, out):
        if self.saved is not None:
            self.own = self._get(self.dev)
            self._set(self.saved, self.dev)
            self.saved = None


# ----------------------------------------------------------------------------------------------------------------
# apply

def _plan_for(name: str):
    for pattern, style, parts in TP_PLAN:
        if fnmatch.fnmatchcase(name, pattern):
            return style, parts
    return None, 1


def apply_tp(model: GPT, mesh, sp: bool = False, overlap: int = 0, keep_gathered: bool = False) -> GPT:
    """Shard a GPT in place over mesh.tp_group (slicing its full weights, identical on every rank); returns it.
    overlap: row blocks per GEMM whose collectives overlap the next block's GEMM (tp_linear.py); 0 = off.
    keep_gathered (SP): column layers keep the gathered input for dW instead of gathering it again in backward."""
    cfg = model.cfg
    if mesh.tp == 1:
        return model
    if cfg.n_head % mesh.tp or (4 * cfg.n_embd) % mesh.tp:  # whole heads and MLP columns per rank (Config.check
        # says the same for the command line; this guards direct callers, whom `shard` would silently truncate)
        raise ValueError(f"apply_tp: model.n_head={cfg.n_head} and the MLP width 4*n_embd={4 * cfg.n_embd} must be "
                         f"divisible by tp={mesh.tp}")
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise ValueError("apply_tp expects GPT-2's tied wte/lm_head weight (the vocab shard is made once for both)")
    tp, rank = mesh.tp, mesh.tp_rank
    state = model.tp_state = _TPState(mesh.tp_group, tp, rank, sp, overlap, keep_gathered)
    vp = (cfg.padded_vocab + tp - 1) // tp * tp  # padded_vocab is a multiple of 128, so usually vp == padded_vocab
    vocab_weight = None
    with torch.no_grad():
        for name, mod in list(model.named_modules()):
            style, parts = _plan_for(name)
            if style is None:
                continue
            if style == "vocab":
                w = mod.weight
                full = torch.cat([w, w.new_zeros(vp - w.shape[0], w.shape[1])]) if vp > w.shape[0] else w  # (vp, C)
                vocab_weight = _sharded_param(full, 0, 1, rank, tp)
                vocab_weight.tp_unpadded_rows = cfg.padded_vocab  # gather_full_state_dict trims back to this
                new = VocabParallelEmbedding(vocab_weight, rank * (vp // tp), state)
            elif style == "head":
                new = ParallelLMHead(vocab_weight, None, state)  # the wte shard itself: stays tied
            elif style == "column":  # weight (out, in): split the outputs; bias split with them
                bias = None if mod.bias is None else _sharded_param(mod.bias, 0, parts, rank, tp)
                new = ColumnParallelLinear(_sharded_param(mod.weight, 0, parts, rank, tp), bias, state)
            else:  # row: split the inputs; the bias is added once, after the reduction
                new = RowParallelLinear(_sharded_param(mod.weight, 1, parts, rank, tp), mod.bias, state)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        if sp:
            model.transformer.wpe = SeqShardedPositions(model.transformer.wpe.weight, state)
    for block in model.transformer.h:
        block.attn.n_head = cfg.n_head // tp
        if sp and hasattr(block.mlp, "aux_shards"):  # MoE: experts stay whole on every rank; under SP each rank
            block.mlp.aux_shards = tp                # routes its own T/tp tokens (moe.py's aux_shards)
    for p in model.parameters():
        if sp and not hasattr(p, "tp_dim"):  # under SP every replicated parameter sees only T/tp tokens
            p.sp_partial = True
    model.loss_fn = types.MethodType(_tp_loss_fn, model)
    model.generate = types.MethodType(_tp_generate, model)
    if sp and cfg.dropout > 0:
        rng = _PerRankDropoutRng(rank)
        model.register_forward_pre_hook(rng.enter)
        model.register_forward_hook(rng.exit)
    return model


# ----------------------------------------------------------------------------------------------------------------
# gradients, state

def sync_partial_grads(model: nn.Module, mesh) -> None:
    """SUM over tp the grads of `sp_partial` parameters, one collective per dtype; once per optimizer step."""
    if mesh.tp == 1:
        return
    by_dtype = {}
    for p in model.parameters():
        if getattr(p, "sp_partial", False) and p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([gr.reshape(-1) for gr in grads])  # (sum numel,): ~6 small tensors per layer, one call
        all_reduce_sum(flat, mesh.tp_group)
        for gr, part in zip(grads, flat.split([gr.numel() for gr in grads])):
            gr.copy_(part.view_as(gr))


def grad_norm_sq(model: nn.Module, mesh) -> torch.Tensor:
    """Squared global L2 grad norm on a TP model: sharded grads summed over tp, replicated ones counted once."""
    sharded = torch.zeros((), device=next(model.parameters()).device)
    replicated = torch.zeros_like(sharded)
    for p in model.parameters():
        if p.grad is not None:
            sq = p.grad.detach().float().pow(2).sum()
            if hasattr(p, "tp_dim"):
                sharded += sq
            else:
                replicated += sq
    return all_reduce_sum(sharded, mesh.tp_group) + replicated


def shard_metadata(model: nn.Module, mesh) -> dict:
    """name -> where this rank's piece sits in the full tensor (for checkpoint metadata); replicated names absent."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if hasattr(p, "tp_dim"):
            out[name] = {"tp": mesh.tp, "tp_rank": mesh.tp_rank, "dim": p.tp_dim, "parts": p.tp_parts,
                         "full_shape": list(p.tp_full_shape), "slices": global_slices(p, mesh.tp_rank, mesh.tp)}
    return out


def gather_full_state_dict(model: nn.Module, mesh) -> dict:
    """Full, unsharded parameters in the single-device GPT layout (names, shapes, padded vocab); collective over tp."""
    out, done = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):  # keeps the tied lm_head.weight key
        if id(p) not in done:
            t = p.detach()
            if hasattr(p, "tp_dim") and mesh.tp > 1:
                pieces = [torch.empty_like(t) for _ in range(mesh.tp)]
                dist.all_gather(pieces, t.contiguous(), group=mesh.tp_group)
                t = unshard(pieces, p.tp_dim, p.tp_parts)
                t = t[:getattr(p, "tp_unpadded_rows", t.shape[0])]  # drop the rows only TP padding added
            done[id(p)] = t.clone()
        out[name] = done[id(p)]
    return out


def load_full_state_dict(model: nn.Module, mesh, sd: dict) -> None:
    """Copy a full single-device state dict into a TP model: each rank keeps its slices (the inverse of gather)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in sd:
                raise KeyError(f"full state dict has no {name}")
            full = sd[name].to(p.device, p.dtype)
            if hasattr(p, "tp_dim"):
                pad = p.tp_full_shape[0] - full.shape[0] if hasattr(p, "tp_unpadded_rows") else 0
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad > 0 else full
                full = shard(full, p.tp_dim, p.tp_parts, mesh.tp_rank, mesh.tp)
            p.copy_(full)
