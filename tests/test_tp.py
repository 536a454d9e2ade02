"""Tensor/sequence parallel (nanopara/tp.py, the tensor-parallel section of comm.py) against the single-device GPT.

Each distributed test spawns gloo processes on the CPU (fp32). Inside every process the single-device reference
is built from the same seed, so no tensors travel back to pytest; a failed assert fails the spawn. Several checks
share one process group to keep start-up cost down (~1 s per process).

Tiny GPT: vocab 250 (not divisible by 4; with vocab_multiple=1 the tp=4 run pads 250 -> 252), 2 layers, 4 heads,
n_embd 32, block 32.

Tolerances (fp32): a column-parallel output is compared exactly (each output element is the same dot product).
Everything that sums over tp ranks (row-parallel, all-reduced grads, the vocab-parallel loss) changes the order of
fp32 additions: measured max errors are ~1e-7 relative; we allow rtol 1e-5 / atol 1e-6 everywhere.
The training check steps SGD with momentum, not AdamW: the gradient of c_attn's key bias is exactly zero in exact
arithmetic (softmax is shift invariant), so both runs compute rounding noise (~1e-9) there, and AdamW's g/sqrt(v)
turns any noise into a full +-lr step (a 3e-5 difference at lr 1e-2, measured). AdamW is elementwise, so sharding
cannot change it beyond its input grads, which are compared.

    .venv/bin/python -m pytest tests/test_tp.py -q
"""
from __future__ import annotations

import copy
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanopara import tp as tpmod
from nanopara.comm import all_gather_seq, all_reduce_sum, reduce_scatter_seq
from nanopara.config import Config, ModelConfig
from nanopara.dp import DDP
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.parallel import parallelize
from nanopara.tp_linear import ColumnSP, ColumnTP, RowSP, RowTP, blocks, shard_rows, sp_gather, sp_scatter
from tests.distributed import processes

TOL = dict(rtol=1e-5, atol=1e-6)


def _cfg(**kw) -> ModelConfig:
    c = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=250, kernels="torch")
    for k, v in kw.items():
        setattr(c, k, v)
    return c


# ----------------------------------------------------------------------------------------------------------------
# spawning

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # 2-4 processes share 2 cores
    try:
        fn()
        dist.barrier()  # every rank done before any tears down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter finalization: on a loaded machine a gloo thread still alive at static destruction
    # occasionally aborted a finished worker ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, world):
    processes(_entry, world, fn, world, _free_port())


# ----------------------------------------------------------------------------------------------------------------
# helpers run inside the workers

def _local(ref: torch.Tensor, p: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's shard of a full single-device tensor, laid out like the TP parameter p."""
    if not hasattr(p, "tp_dim"):
        return ref
    if hasattr(p, "tp_unpadded_rows"):  # vocab rows TP padding added: zero in the weight and in its grad
        ref = torch.cat([ref, ref.new_zeros(p.tp_full_shape[0] - ref.shape[0], *ref.shape[1:])])
    return tpmod.shard(ref, p.tp_dim, p.tp_parts, mesh.tp_rank, mesh.tp)


def _batch(gen, B, T, V):
    x = torch.randint(0, V, (B, T), generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    y[torch.rand(B, T, generator=gen) < 0.2] = -1  # ignored targets (SFT masking)
    return x, y


def _check_training(mesh, cfg: ModelConfig, sp: bool, steps=3, accum=2, B=2, T=16, lr=0.1, tol=TOL, overlap=0,
                    keep=False):
    """A few SGD steps with grad accumulation and clipping: losses, logits, grads, norms, weights vs one process.

    With mesh.dp > 1 the reference runs the dp shards of the batch one after another and averages, which is what
    a data-parallel engine does; the grads are averaged over mesh.dp_group by hand here.
    """
    torch.manual_seed(0)
    ref = GPT(cfg).to(mesh.device)
    model = tpmod.apply_tp(copy.deepcopy(ref), mesh, sp=sp, overlap=overlap, keep_gathered=keep)
    tp_params = dict(model.named_parameters())
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=0.1) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accum):
            shards = [_batch(gen, B, T, cfg.vocab_size) for _ in range(mesh.dp)]  # same on every rank
            for d, (x, y) in enumerate(shards):
                x, y = x.to(mesh.device), y.to(mesh.device)
                ref_logits, ref_loss = ref(x, y)
                (ref_loss / (accum * mesh.dp)).backward()
                if d == mesh.dp_rank:
                    logits, loss = model(x, y)
                    (loss / accum).backward()
                    torch.testing.assert_close(loss, ref_loss, **tol)
                    vl = logits.shape[-1]  # this rank's vocab columns
                    want = F.pad(ref_logits, (0, vl * mesh.tp - ref_logits.shape[-1]))  # TP vocab padding
                    torch.testing.assert_close(logits, want[..., mesh.tp_rank * vl:(mesh.tp_rank + 1) * vl], **tol)
        tpmod.sync_partial_grads(model, mesh)
        if mesh.dp > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mesh.dp_group)
                p.grad /= mesh.dp
        for name, p in tp_params.items():
            torch.testing.assert_close(p.grad, _local(ref.get_parameter(name).grad, p, mesh), **tol,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        norm = tpmod.grad_norm_sq(model, mesh).sqrt()
        torch.testing.assert_close(norm, norm_ref, **tol)
        for p in model.parameters():  # the same clipping, from the TP norm
            p.grad.mul_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    full = tpmod.gather_full_state_dict(model, mesh)
    want = ref.state_dict()
    assert full.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(full[k], want[k], **tol, msg=lambda m: f"weight {k}: {m}")
    return ref, model


# ----------------------------------------------------------------------------------------------------------------
# worker bodies

def _collectives(mesh):
    """comm.py's SP pair: forward and backward against what the rank-ordered concatenation/sum must give."""
    n, r, grp = mesh.tp, mesh.tp_rank, mesh.tp_group
    xs = [torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(i)) for i in range(n)]  # every rank's input
    c = torch.randn(2, 3 * n, 5, generator=torch.Generator().manual_seed(99))
    x = xs[r].clone().requires_grad_()
    y = all_gather_seq(x, grp)
    assert torch.equal(y, torch.cat(xs, 1))
    (y * c).sum().backward()  # every rank's loss uses c: the grad of x_r sums n copies of c's chunk r
    torch.testing.assert_close(x.grad, n * c[:, 3 * r:3 * (r + 1)], **TOL)
    x = torch.cat(xs, 1).mul(r + 1).requires_grad_()  # (2, 3n, 5), rank r holds (r+1) * the concatenation
    y = reduce_scatter_seq(x, grp)
    torch.testing.assert_close(y, torch.cat(xs, 1)[:, 3 * r:3 * (r + 1)] * sum(range(1, n + 1)), **TOL)
    (y * c[:, 3 * r:3 * (r + 1)]).sum().backward()
    torch.testing.assert_close(x.grad, c, **TOL)  # all-gather of every rank's chunk of c


def _layers(mesh):
    """Column exact, row close, per-head c_attn, SP column (saved shard + regather), every grad."""
    torch.manual_seed(0)
    ref = GPT(_cfg())
    model = tpmod.apply_tp(copy.deepcopy(ref), mesh, sp=False)
    r, n = mesh.tp_rank, mesh.tp
    x = torch.randn(3, 7, 32)  # same on every rank (same seed)
    ops = ref.ops_for(x.device)

    # column-parallel c_fc: this rank's outputs are exactly the unsharded layer's columns
    lin, col = ref.transformer.h[0].mlp.c_fc, model.transformer.h[0].mlp.c_fc
    assert isinstance(col, tpmod.ColumnParallelLinear)
    assert torch.equal(col(x), lin(x)[..., r * 128 // n:(r + 1) * 128 // n])

    # per-head c_attn: local output is [q | k | v] of heads r*nh/tp.. (exact), attention output equals the full one
    hs, nh = 8, 4
    qkv_ref = ref.transformer.h[0].attn.c_attn(x).view(3, 7, 3, nh, hs)  # (B, T, q|k|v, nh, hs)
    want = qkv_ref[:, :, :, r * nh // n:(r + 1) * nh // n].reshape(3, 7, -1)  # (B, T, 3 * nh/tp * hs)
    assert torch.equal(model.transformer.h[0].attn.c_attn(x), want)
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    c = torch.randn(3, 7, 32)
    ya = ref.transformer.h[0].attn(xa, ops)
    yb = model.transformer.h[0].attn(xb, ops)
    torch.testing.assert_close(yb, ya, **TOL)
    (ya * c).sum().backward()
    (yb * c).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, **TOL)  # f's all-reduce of the input grad
    for name in ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"):
        p = model.transformer.h[0].attn.get_parameter(name)
        torch.testing.assert_close(p.grad, _local(ref.transformer.h[0].attn.get_parameter(name).grad, p, mesh),
                                   **TOL)

    # row-parallel mlp.c_proj on this rank's slice of the hidden activations
    h = torch.randn(3, 7, 128, requires_grad=True)
    lin, row = ref.transformer.h[1].mlp.c_proj, model.transformer.h[1].mlp.c_proj
    hl = h.detach()[..., r * 128 // n:(r + 1) * 128 // n].clone().requires_grad_()
    torch.testing.assert_close(row(hl), lin(h), **TOL)
    c = torch.randn(3, 7, 32)
    (lin(h) * c).sum().backward()
    (row(hl) * c).sum().backward()
    torch.testing.assert_close(hl.grad, h.grad[..., r * 128 // n:(r + 1) * 128 // n], **TOL)
    torch.testing.assert_close(row.weight.grad, _local(lin.weight.grad, row.weight, mesh), **TOL)
    torch.testing.assert_close(row.bias.grad, lin.bias.grad, **TOL)

    # SP column-parallel: input is this rank's rows of the SP layout; grads of the shard and the weight match the
    # full layer, with and without overlap (3 blocks where they divide the rows, else fewer: 12 rows -> 3, 6 -> 3)
    lin = ref.transformer.h[1].mlp.c_fc
    for chunks, (B, T) in ((0, (3, 8)), (3, (3, 8)), (4, (1, 12))):
        state = tpmod._TPState(mesh.tp_group, n, r, sp=True, chunks=chunks)
        w = tpmod._sharded_param(lin.weight, 0, 1, r, n)
        b = tpmod._sharded_param(lin.bias, 0, 1, r, n)
        sp_col = tpmod.ColumnParallelLinear(w, b, state)
        lin.zero_grad()
        x = torch.randn(B, T, 32, requires_grad=True)
        rows = shard_rows(B * T, r, n, blocks(B * T // n, chunks))
        xs = x.detach().reshape(-1, 32)[rows].view(B, T // n, 32).clone().requires_grad_()
        c = torch.randn(B, T, 128)
        out = sp_col(xs)
        torch.testing.assert_close(out, lin(x)[..., r * 128 // n:(r + 1) * 128 // n], **TOL)
        (lin(x) * c).sum().backward()
        (out * c[..., r * 128 // n:(r + 1) * 128 // n]).sum().backward()
        torch.testing.assert_close(xs.grad.reshape(-1, 32), x.grad.reshape(-1, 32)[rows], **TOL)
        torch.testing.assert_close(w.grad, _local(lin.weight.grad, w, mesh), **TOL)
        torch.testing.assert_close(b.grad, _local(lin.bias.grad, b, mesh), **TOL)


def _overlap_layout(mesh):
    """tp_linear.py: the SP layout round trip, and each overlapped GEMM (blocks of rows, async collectives) equal
    to its synchronous one-block form, forward and backward, at shapes whose rows split unevenly."""
    n, r, grp = mesh.tp, mesh.tp_rank, mesh.tp_group
    assert [blocks(12, c) for c in (0, 1, 2, 3, 4, 5, 7)] == [1, 1, 2, 3, 4, 4, 6]
    full = torch.arange(2 * 12 * 3, dtype=torch.float32).view(2, 12, 3)  # (B, T, C), the same on every rank
    for chunks in (0, 2, 3):
        rows = shard_rows(24, r, n, blocks(24 // n, chunks))
        assert sorted(torch.cat([shard_rows(24, q, n, blocks(24 // n, chunks)) for q in range(n)]).tolist()) \
            == list(range(24))  # the shards partition the rows
        xs = sp_scatter(full, grp, chunks)  # sum of n copies, this rank's rows
        assert xs.shape == (2, 12 // n, 3)
        assert torch.equal(xs.reshape(-1, 3), n * full.reshape(-1, 3)[rows])
        assert torch.equal(sp_gather(xs, grp, chunks), n * full)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(10, 6, generator=gen)
    bias = torch.randn(10, generator=gen)
    B, T = 3, 10  # 30 rows, 30/n per rank: 3 blocks of 5 at tp=2
    X = torch.randn(B, T, 6, generator=gen)  # the same on every rank; SP shards are rows of it
    C = torch.randn(B, T, 10, generator=gen)  # the loss sum(y * C), over the full rows
    for fn in (ColumnSP, RowSP, ColumnTP, RowTP):
        outs = []
        for chunks in (0, 3):
            rows = shard_rows(B * T, r, n, blocks(B * T // n, chunks))
            x = X * (r + 1)  # differs per rank: RowSP/RowTP sum the ranks' partial products
            if fn is ColumnSP:
                x = X.reshape(-1, 6)[rows].view(B, T // n, 6)
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            bi = bias.clone().requires_grad_() if fn in (ColumnSP, ColumnTP) else None
            y = fn.apply(xi, wi, bi, grp, chunks)
            c = C.reshape(-1, 10)[rows].view(y.shape) if fn is RowSP else C
            (y * c).sum().backward()
            yf, dx = y.reshape(-1, 10), xi.grad.reshape(-1, 6)
            if fn is RowSP:  # compare in full-row order: every rank's rows of the full result
                yf = all_reduce_sum(torch.zeros(B * T, 10).index_copy(0, rows, yf), grp)
            if fn is ColumnSP:
                dx = all_reduce_sum(torch.zeros(B * T, 6).index_copy(0, rows, dx), grp)
            outs.append([yf, dx, wi.grad] + ([bi.grad] if bi is not None else []))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{fn.__name__}: {m}")
    # keep_gathered: dW from the input kept in forward equals dW from the input gathered again in backward
    rows = shard_rows(B * T, r, n, blocks(B * T // n, 3))
    runs = []
    for keep in (False, True):
        xi = X.reshape(-1, 6)[rows].view(B, T // n, 6).clone().requires_grad_()
        wi, bi = w.clone().requires_grad_(), bias.clone().requires_grad_()
        y = ColumnSP.apply(xi, wi, bi, grp, 3, keep)
        (y * C).sum().backward()
        runs.append((y, xi.grad, wi.grad, bi.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _vocab_ce(mesh):
    """Vocab-parallel CE == F.cross_entropy over the real vocab, padding columns huge, targets -1 ignored."""
    r, n = mesh.tp_rank, mesh.tp
    V, Vp, N = 250, 256, 37
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(N, Vp, generator=gen) * 3
    logits[:, V:] = 1e4  # padding columns: would dominate the loss if they counted
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -1
    targets[1] = V - 1  # the last real id sits in the last shard, next to the padding
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full[:, :V], targets, ignore_index=-1)
    want.backward()
    vl = Vp // n
    for kernels in ("torch", "triton"):  # triton: the shard kernels in the interpreter (widths not 16-divisible)
        local = logits[:, r * vl:(r + 1) * vl].clone().requires_grad_()
        got = tpmod.vocab_parallel_cross_entropy(local, targets, r * vl, V, mesh.tp_group, kernels)
        torch.testing.assert_close(got, want, **TOL)
        got.backward()
        torch.testing.assert_close(local.grad, full.grad[:, r * vl:(r + 1) * vl], **TOL)
        # bf16 logits: fp32 math inside, grad returned in bf16
        lb = logits[:, r * vl:(r + 1) * vl].bfloat16().requires_grad_()
        got = tpmod.vocab_parallel_cross_entropy(lb, targets, r * vl, V, mesh.tp_group, kernels)
        wb = F.cross_entropy(logits.bfloat16().float()[:, :V], targets, ignore_index=-1)
        torch.testing.assert_close(got, wb, **TOL)
        got.backward()
        assert lb.grad.dtype == torch.bfloat16


def _generate_and_dropout(mesh):
    """generate() gathers logits (greedy tokens equal the reference); SP dropout uses a per-rank stream."""
    torch.manual_seed(0)
    ref = GPT(_cfg())
    model = tpmod.apply_tp(copy.deepcopy(ref), mesh, sp=True)
    idx = torch.randint(0, 250, (2, 4), generator=torch.Generator().manual_seed(5))
    assert torch.equal(model.generate(idx, 6, temperature=0), ref.generate(idx, 6, temperature=0))
    assert model.tp_state.sp and not model.tp_state.gather_logits  # switched back

    model = tpmod.apply_tp(GPT(_cfg(dropout=0.2)), mesh, sp=True)
    x = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(6))
    before = torch.get_rng_state()
    loss1 = model(x, x)[1]
    assert torch.equal(torch.get_rng_state(), before)  # the shared (replicated) stream is untouched
    loss2 = model(x, x)[1]
    assert loss1.item() != loss2.item()  # the per-rank stream advanced between forwards


def _autocast_bf16(mesh):
    """Under bf16 autocast (the GPU path) both SP and plain TP run and stay near the reference.

    Tolerance: bf16 keeps 8 mantissa bits (relative rounding 4e-3 per op) and TP rounds partial sums separately;
    measured: loss differs by 2.4e-5, each parameter's grad by at most 8e-3 of its norm (we allow 1e-3, 5e-2).
    """
    torch.manual_seed(0)
    ref = GPT(_cfg()).to(mesh.device)
    dev = mesh.device.type
    x, y = (t.to(mesh.device) for t in _batch(torch.Generator().manual_seed(7), 2, 16, 250))
    with torch.autocast(dev, dtype=torch.bfloat16):
        ref_loss = ref(x, y)[1]
    ref_loss.backward()
    for sp in (False, True):
        model = tpmod.apply_tp(copy.deepcopy(ref), mesh, sp=sp)
        model.zero_grad()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        tpmod.sync_partial_grads(model, mesh)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-3)
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.float32, name
            want = _local(ref.get_parameter(name).grad, p, mesh)
            assert (p.grad - want).norm() <= 5e-2 * want.norm() + 1e-6, name


def _worker_tp2():
    mesh = Mesh.build(tp=2, device="cpu")
    _collectives(mesh)
    _layers(mesh)
    _overlap_layout(mesh)
    _vocab_ce(mesh)
    _generate_and_dropout(mesh)
    _autocast_bf16(mesh)
    for sp in (False, True):
        _check_training(mesh, _cfg(), sp)
        _check_training(mesh, _cfg(), sp, steps=2, B=3, T=10, overlap=4, keep=sp)  # 15 rows per rank: 3 blocks of 5


def _worker_4():
    mesh = Mesh.build(tp=4, device="cpu")
    for sp in (False, True):  # vocab 250 padded only to 250 -> TP pads to 252 (63 rows per rank)
        _check_training(mesh, _cfg(vocab_multiple=1), sp, steps=2, overlap=2 if sp else 0)

    mesh = Mesh.build(dp=2, tp=2, device="cpu")  # new groups on the same 4 processes
    ref, model = _check_training(mesh, _cfg(), sp=True, steps=2, accum=2)
    # checkpoint metadata: every shard, put at its global slices, rebuilds the full tensor
    meta = tpmod.shard_metadata(model, mesh)
    assert meta["lm_head.weight"] == meta["transformer.wte.weight"]
    full = tpmod.gather_full_state_dict(model, mesh)
    for name, m in meta.items():
        t = full[name]
        if name in ("transformer.wte.weight", "lm_head.weight"):
            t = F.pad(t, (0, 0, 0, m["full_shape"][0] - t.shape[0]))
        pieces = [t.narrow(m["dim"], a, b - a) for a, b in m["slices"]]
        assert torch.equal(torch.cat(pieces, m["dim"]), model.get_parameter(name).detach())
    # load_full_state_dict is the inverse of gather_full_state_dict
    other = tpmod.apply_tp(GPT(_cfg()), mesh, sp=True)
    tpmod.load_full_state_dict(other, mesh, full)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    _parallelize(mesh)


def _parallelize(mesh):
    """parallel.parallelize on dp 2 x tp 2 + SP: the engine wraps the tp-sharded model (TP before DP: its buffers
    hold shards), and the Trainer's tp_shards is the checkpoint metadata of those shards."""
    cfg = Config(device="cpu", seed=0)
    cfg.model = _cfg()
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.sp = 2, 2, True
    torch.manual_seed(0)
    full = sum(p.numel() for p in GPT(cfg.model).parameters())
    torch.manual_seed(0)
    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    engine = trainer.engine
    assert isinstance(engine, DDP) and engine.n == 2
    assert isinstance(engine.model.transformer.h[0].mlp.c_fc, tpmod.ColumnParallelLinear)
    assert trainer.tp_shards == tpmod.shard_metadata(engine.model, mesh) and "lm_head.weight" in trainer.tp_shards
    assert sum(b.numel() for b in engine.bufs) == sum(p.numel() for p in engine.params) < full
    assert all(getattr(p, "sp_partial", False) != hasattr(p, "tp_dim") for p in engine.params)
    engine.close()


# ----------------------------------------------------------------------------------------------------------------
# tests

def test_tp2_layers_ce_generate_training():
    _spawn(_worker_tp2, 2)


def _worker_one_block():
    """tp_linear.py's one-block paths (k == 1: no block views or lists), asynchronous too (chunks=1; or rows that
    no block count up to `chunks` divides) and with keep_gathered, equal to the blocked overlap (chunks=3)."""
    mesh = Mesh.build(tp=2, device="cpu")
    n, r, grp = mesh.tp, mesh.tp_rank, mesh.tp_group
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(10, 6, generator=gen), torch.randn(10, generator=gen)
    B, T = 3, 10  # 15 rows per rank: chunks 1 and 2 give one block, chunks 3 gives three
    X, C = torch.randn(B, T, 6, generator=gen), torch.randn(B, T, 10, generator=gen)
    for fn in (ColumnSP, RowSP, ColumnTP, RowTP):
        outs = []
        for chunks, keep in ((3, False), (0, False), (1, False), (2, False), (0, True), (1, True)):
            if keep and fn is not ColumnSP:
                continue
            rows = shard_rows(B * T, r, n, blocks(B * T // n, chunks))
            x = X.reshape(-1, 6)[rows].view(B, T // n, 6) if fn is ColumnSP else X * (r + 1)
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            bi = bias.clone().requires_grad_() if fn in (ColumnSP, ColumnTP) else None
            y = fn.apply(xi, wi, bi, grp, chunks, *([keep] if fn is ColumnSP else []))
            (y * (C.reshape(-1, 10)[rows].view(y.shape) if fn is RowSP else C)).sum().backward()
            yf, dx = y.reshape(-1, 10), xi.grad.reshape(-1, 6)
            if fn is RowSP:
                yf = all_reduce_sum(torch.zeros(B * T, 10).index_copy(0, rows, yf), grp)
            if fn is ColumnSP:
                dx = all_reduce_sum(torch.zeros(B * T, 6).index_copy(0, rows, dx), grp)
            outs.append([yf, dx, wi.grad] + ([bi.grad] if bi is not None else []))
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{fn.__name__}: {m}")


def test_tp2_one_block_paths():
    _spawn(_worker_one_block, 2)


def test_tp4_and_dp2_tp2():
    _spawn(_worker_4, 4)


def _worker_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons: no TF32 rounding in either run
    mesh = Mesh.build(tp=2, device="cuda")
    for sp in (False, True):  # cuBLAS picks different kernels for sharded shapes: fp32 sums in another order
        _check_training(mesh, _cfg(), sp, tol=dict(rtol=1e-4, atol=1e-5))
        _check_training(mesh, _cfg(), sp, tol=dict(rtol=1e-4, atol=1e-5), B=3, T=10, overlap=4)  # async NCCL
    _autocast_bf16(mesh)
    for sp in (False, True):
        for overlap, kernels in ((4, "torch"), (0, "torch"), (0, "triton")):  # one-block SP paths, Triton kernels
            _graphed(mesh, sp, overlap, kernels)
        _fp8(mesh, sp)


def _fp8(mesh, sp: bool):
    """train.fp8 under tp2 (+sp) on the GPU: the column/row-parallel linears cast their shards (the Triton FP8
    kernels), train within FP8's error of the bf16 run, and the weight casts happen once per step."""
    from nanopara.parallel import parallelize
    runs = {}
    for mode in ("none", "tensor", "row"):
        cfg = Config(device="cuda", seed=0)
        cfg.model = _cfg()
        cfg.model.n_embd, cfg.model.n_head = 128, 4  # FP8 GEMMs want K a multiple of 16
        cfg.parallel.tp, cfg.parallel.sp, cfg.train.fp8 = 2, sp, mode
        cfg.train.cuda_graph = "false"  # eager: the cast counter below is Python's (graphed: tests/test_graph.py)
        if mode != "none":  # a tiny model: the per-shape rule (fp8_filter=auto) would pick no Linear
            cfg.train.fp8_filter = "all"
        torch.manual_seed(0)
        trainer = parallelize(GPT(cfg.model), mesh, cfg)
        engine = trainer.engine
        gen = torch.Generator().manual_seed(1)
        x, y = (t.to(mesh.device) for t in _batch(gen, 4, 32, cfg.model.vocab_size))
        losses = []
        for _ in range(6):  # the Trainer: bf16 autocast on CUDA, the FP8 weight casts renewed after each step
            losses.append(trainer.forward_backward([(x, y)]).item())
            trainer.step(3e-3)  # 1e-2 spiked the bf16 loss at step 3 (2 x H100), which FP8 then tracked to 0.18
        if mode != "none":
            tp_layers = [m for m in engine.model.modules() if getattr(m, "fp8_state", None) is not None
                         and isinstance(m, (tpmod.ColumnParallelLinear, tpmod.RowParallelLinear))]
            assert len(tp_layers) == 4 * cfg.model.n_layer and engine.model.fp8.casts == 6 * len(tp_layers)
        runs[mode] = losses
        engine.close()
    for mode in ("tensor", "row"):
        diff = max(abs(a - b) for a, b in zip(runs[mode], runs["none"]))
        assert 0 < diff < 0.05 and runs[mode][-1] < runs[mode][0], (mode, sp, runs)


def _graphed(mesh, sp: bool, overlap: int = 4, kernels: str = "torch"):
    """TP (+SP, overlapped or not) forward + backward replayed from a CUDA graph, NCCL kernels recorded in it, trains
    exactly like eager mode: the replay launches the same kernels in the same order on the same inputs."""
    from nanopara.graph import GraphedMicroStep
    from nanopara.parallel import build_engine
    cfg = Config(device="cuda", seed=0)
    cfg.model = _cfg(kernels=kernels, n_embd=64)  # Triton kernels: widths a multiple of 16
    cfg.parallel.tp, cfg.parallel.sp = 2, sp
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = tpmod.apply_tp(GPT(cfg.model), mesh, sp=sp, overlap=overlap).to(mesh.device)
        engine = build_engine(model, mesh, cfg)
        amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
        micro = GraphedMicroStep(engine.model, amp, 1.0, engine) if graphed else None
        gen = torch.Generator().manual_seed(1)
        x, y = (t.to(mesh.device) for t in _batch(gen, 4, 32, cfg.model.vocab_size))
        losses = []
        for _ in range(4):
            if micro is not None:
                loss = micro(x, y)
            else:
                with amp():
                    loss = engine.model(x, y)[1]
                engine.backward(loss.float())
            losses.append(loss.item())
            engine.step(1e-2)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (eager, w_eager), (graph, w_graph) = runs
    where = f"sp={sp} overlap={overlap} kernels={kernels}"
    assert graph == pytest.approx(eager, rel=1e-5, abs=1e-5) and graph[-1] < graph[0], (where, graph, eager)
    for a, b in zip(w_graph, w_eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_tp2_nccl_gpu():
    """The same checks on 2 GPUs over NCCL (fp32), and the bf16 autocast path (SDPA, bf16 collectives)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_worker_gpu, 2)


def _fake_mesh(tp: int) -> Mesh:
    """A mesh without process groups: apply_tp's checks must fail before any communication."""
    sizes = {"pp": 1, "dp": 1, "cp": 1, "tp": tp}
    return Mesh(0, tp, 0, torch.device("cpu"), sizes, {ax: 0 for ax in sizes}, groups={"tp": None})


def test_clear_errors():
    with pytest.raises(ValueError, match=r"n_head=4 and the MLP width 4\*n_embd=128 must be divisible by tp=3"):
        tpmod.apply_tp(GPT(_cfg()), _fake_mesh(3))
    model = tpmod.apply_tp(GPT(_cfg()), _fake_mesh(2), sp=True)
    with pytest.raises(ValueError, match="sequence length 5 to be divisible by parallel.tp=2"):
        model(torch.zeros(1, 5, dtype=torch.long))
