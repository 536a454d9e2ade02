"""parallel.tp_streams=2 (nanopara/tp_streams.py): each micro-batch as two halves, block by block, trains like one.

Through parallel.parallelize and the Trainer (what train.py runs), on 2 (tp2 +- sp) and 4 (dp2 x tp2, DDP and
ZeRO-1) gloo processes, fp32: tp_streams=2 against tp_streams=1 on the same batches, a few AdamW steps.
Tolerances: the halves change only the order of fp32 sums (each weight's gradient is the sum of the two halves'
sums instead of one sum over all rows; the loss the mean of two means). Measured (tp2 +- sp, torch 2.13 CPU): losses
equal, gradients within 6e-8, weights within 3.2e-7 after 3 steps; allowed: tests/test_tp.py's rtol 1e-5 / atol
1e-6 for losses and gradients, atol 5e-5 for the weights (as tests/test_parallel_train.py),
except c_attn's key bias, whose exact gradient is 0 (softmax is shift invariant): both runs feed their own rounding
noise to AdamW, which turns it into +-lr steps (tests/test_tp.py's docstring), so only its q and v thirds count.
The GPU test runs the same comparison on 2 GPUs over NCCL, eager and under train.cuda_graph=true (the two
streams captured as two branches), and the bf16 Triton path against tp_streams=1.
Config refusals: one ConfigError line each (Config.check; train.py for loss-masked shards).

    .venv/bin/python -m pytest -q tests/test_tp_streams.py
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from nanopara.cli import parse_args
from nanopara.config import Config, ConfigError, ModelConfig
from tests.distributed import spawn

TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHT_ATOL = 5e-5


def _trainer(mesh, streams: int, sp=False, zero=0, graph="false", dtype="auto", kernels="torch", n_embd=32, T=16):
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    cfg = Config(device=mesh.device.type, seed=0)
    cfg.model = ModelConfig(n_layer=2, n_head=4, n_embd=n_embd, block_size=32, vocab_size=250, kernels=kernels)
    p, t = cfg.parallel, cfg.train
    p.tp, p.dp, p.sp, p.zero, p.tp_streams, p.bucket_mb = mesh.tp, mesh.dp, sp, zero, streams, 0.01  # several buckets
    t.micro_batch, t.seq_len, t.tokens_per_step = 4, T, 2 * 4 * T * mesh.dp  # two micro-steps a step
    t.cuda_graph, t.dtype, t.sample_tokens = graph, dtype, 0
    cfg.check()
    torch.manual_seed(0)
    return parallelize(GPT(cfg.model), mesh, cfg)


def _summed(p, mesh) -> torch.Tensor:
    """p's gradient; under SP a replicated parameter's summed over tp (the engine does so in step()): each rank's
    partial sum covers other rows when the batch is halved (tp_linear.py's row layout is per half)."""
    g = p.grad.detach().clone()
    if getattr(p, "sp_partial", False):
        torch.distributed.all_reduce(g, group=mesh.tp_group)
    return g


def _train(mesh, streams: int, steps: int = 3, graph_flow: bool = False, **kw) -> dict:
    """Losses, gradients before each update (dp = 1), final weights, and the blocks' (index, rows) calls of a step.
    graph_flow (dp > 1): each step is graph.GraphedAccumStep's `_step`, run eagerly (what its capture records: the
    micro-steps, then the engine's reduction; Trainer.step then reduces nothing), as tests/test_capture_safety.py."""
    from nanopara.graph import GraphedAccumStep
    from nanopara.trainer import mean_over
    trainer = _trainer(mesh, streams, **kw)
    graphed = GraphedAccumStep(trainer.model, trainer.amp, trainer.engine, tp_streams=streams) if graph_flow else None
    calls = []
    for i, block in enumerate(trainer.model.transformer.h):  # block hooks: the GPT's own forward hooks are refused
        block.register_forward_pre_hook(lambda m, args, i=i: calls.append((i, args[0].shape[0])))
    gen = torch.Generator().manual_seed(1 + mesh.dp_rank)  # the tp ranks of a replica read the same tokens
    T = trainer.cfg.train.seq_len
    batches = [tuple(torch.randint(0, 250, (4, T), generator=gen) for _ in range(2)) for _ in range(trainer.accum)]
    out = dict(losses=[], grads=[], calls=None)
    for _ in range(steps):  # the same batches every step: the loss falls
        if graphed is None:
            out["losses"].append(trainer.forward_backward(batches).item())
        else:
            graphed.xs, graphed.ys, graphed.scale = [x for x, _ in batches], [y for _, y in batches], 1 / trainer.accum
            out["losses"].append(mean_over(graphed._step(), mesh).item())
        if out["calls"] is None:
            out["calls"] = list(calls)
        if mesh.dp == 1:  # under dp > 1 tp_streams=2 reduces in step(), tp_streams=1 in the last backward
            out["grads"].append({n: _summed(p, mesh) for n, p in trainer.model.named_parameters()})
        trainer.step(1e-2)
    trainer.engine.wait_params()  # ZeRO-1's prefetched gathers (zero.py) may still be writing the parameters
    out["weights"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.close()
    trainer.engine.close()
    return out


def _q_and_v(name: str, w: torch.Tensor) -> torch.Tensor:
    """c_attn's bias without its key third (this rank's [q | k | v] heads); any other tensor as it is."""
    if not name.endswith("attn.c_attn.bias"):
        return w
    third = w.numel() // 3
    return torch.cat([w[:third], w[2 * third:]])


def _block_by_block(one: dict, two: dict) -> bool:
    """The block calls of a step: one stream runs blocks 0, 1 on 4 rows; two streams run each block for A, then
    for B, on 2 rows each, as many times (micro-steps, and a graph's eager warm-up and capture calls)."""
    k = len(one["calls"]) // 2
    return k > 0 and one["calls"] == [(0, 4), (1, 4)] * k and two["calls"] == [(0, 2), (0, 2), (1, 2), (1, 2)] * k


def _compare(one: dict, two: dict, where: str, tol=TOL, weight_atol=WEIGHT_ATOL):
    assert _block_by_block(one, two), (where, one["calls"], two["calls"])
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), **tol,
                               msg=lambda m: f"{where} losses {two['losses']} vs {one['losses']}: {m}")
    for step, (g1, g2) in enumerate(zip(one["grads"], two["grads"])):
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], **tol, msg=lambda m: f"{where} step {step} grad {name}: {m}")
    for name, w in one["weights"].items():
        torch.testing.assert_close(_q_and_v(name, two["weights"][name]), _q_and_v(name, w), rtol=0, atol=weight_atol,
                                   msg=lambda m: f"{where} weight {name}: {m}")
    assert one["losses"][-1] < one["losses"][0], (where, one["losses"])  # it trains at all


def _tp2_worker(rank, world):
    from nanopara.mesh import Mesh
    mesh = Mesh.build(tp=2, device="cpu")
    for sp in (False, True):
        _compare(_train(mesh, 1, sp=sp), _train(mesh, 2, sp=sp), f"tp2 sp={sp}")
    trainer = _trainer(mesh, 2)
    batch = (torch.zeros(4, 16, dtype=torch.long),) * 2
    with pytest.raises(ValueError, match="tp_streams=2 averages the mean losses of two equal halves"):
        trainer.forward_backward([batch, batch], weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="tp_streams=2 averages"):
        trainer.forward_backward([batch, batch], loss_fn=lambda model, b: model(*b)[1])
    trainer.engine.close()
    mesh.destroy()


def _dp2_tp2_worker(rank, world):
    from nanopara.mesh import Mesh
    mesh = Mesh.build(dp=2, tp=2, device="cpu")
    for zero in (0, 1):  # the backward under no_sync; the reduction after the join, in step() or at the graph's end
        one = _train(mesh, 1, zero=zero)
        _compare(one, _train(mesh, 2, zero=zero), f"dp2 x tp2 zero={zero}")
        _compare(one, _train(mesh, 2, zero=zero, graph_flow=True), f"dp2 x tp2 zero={zero} GraphedAccumStep")
    mesh.destroy()


@pytest.mark.timeout_s(120)
def test_tp2_streams2_trains_like_one_stream():
    """tp2 and tp2 + sp: the same losses, gradients and weights as tp_streams=1; the blocks run block by block
    (A's block 0, B's block 0, A's block 1, ...), on B/2 rows; loss weights and a loss_fn are refused."""
    spawn(_tp2_worker, 2)


@pytest.mark.timeout_s(120)
def test_dp2_tp2_streams2_trains_like_one_stream():
    """dp2 x tp2 with DDP and ZeRO-1: the gradient reduction deferred to step(), or to the end of GraphedAccumStep's
    step, gives the same losses and weights."""
    spawn(_dp2_tp2_worker, 4)


def test_forward_and_backward_alternate_block_by_block():
    """split_fwd_bwd's order, what lets one half compute while the other's collective runs (one NCCL stream runs
    them in issue order): forward A0 B0 A1 B1 A2 B2, and autograd, taking the newest ready node first, runs the
    backward B2 A2 B1 A1 B0 A0. One process, no tp: the order is the function's own."""
    import contextlib
    from nanopara.model import GPT
    from nanopara.tp_streams import split_fwd_bwd
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=3, n_head=2, n_embd=16, block_size=16, vocab_size=50, kernels="torch"))
    fwd, bwd = [], []

    def hook(block, args, out, i):
        half = "AB"[sum(1 for j, _ in fwd if j == i)]
        fwd.append((i, half))
        out[0].register_hook(lambda g: bwd.append((i, half)))
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda b, a, o, i=i: hook(b, a, o, i))
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    split_fwd_bwd(model, contextlib.nullcontext, x, x, 1.0, None)
    assert fwd == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert bwd == [(2, "B"), (2, "A"), (1, "B"), (1, "A"), (0, "B"), (0, "A")]


# ----------------------------------------------------------------------------------------------------------------
# refusals

TP2 = ["--parallel.tp=2", "--parallel.tp_streams=2"]


@pytest.mark.parametrize("argv, message", [
    (["--parallel.tp_streams=3"], r"^--parallel.tp_streams=3 is out of range: it must be 1 or 2$"),
    (["--parallel.tp_streams=2"], r"^parallel.tp_streams=2 needs parallel.tp > 1 "),
    (TP2 + ["--train.micro_batch=3"], r"needs train.micro_batch=3 divisible by it"),
    (TP2 + ["--parallel.pp=2"], r"needs parallel.pp = 1 and parallel.cp = 1"),
    (TP2 + ["--parallel.cp=2"], r"needs parallel.pp = 1 and parallel.cp = 1"),
    (TP2 + ["--model.moe_experts=4"], r"needs a dense model"),
    (TP2 + ["--train.fp8=tensor"], r"needs train.fp8=none"),
    (TP2 + ["--train.compile=true"], r"needs train.compile=false"),
    (TP2 + ["--parallel.zero=2"], r"needs parallel.zero <= 1"),
    (TP2 + ["--parallel.grad_dests=on"], r"needs parallel.grad_dests=auto\|off"),
    (TP2 + ["--parallel.sp=true", "--model.dropout=0.1"], r"needs model.dropout=0 under parallel.sp=true"),
])
def test_refusals_are_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(argv)
    assert "\n" not in str(e.value)


def test_allowed_layouts_pass_the_checks():
    for extra in ([], ["--parallel.sp=true"], ["--parallel.zero=1"], ["--parallel.tp_overlap=2"],
                  ["--model.dropout=0.1"], ["--train.activation_checkpointing=full"]):
        assert parse_args(TP2 + extra).parallel.tp_streams == 2


def test_train_py_refuses_loss_masked_shards(tmp_path):
    """SFT shards weight each micro-batch by its trained-token count; the halves would need theirs too."""
    import train
    from nanopara.data import mask_path, write_mask, write_shard
    for split in ("train", "val"):
        path = str(tmp_path / f"m_{split}_000000.bin")
        write_shard(path, np.arange(4000) % 250)
        write_mask(mask_path(path), np.ones(4000), 16)
    cfg = parse_args(TP2 + ["--preset=tiny", "--device=cpu", f"--data.dataset={tmp_path / 'm_*.bin'}",
                            "--train.seq_len=16", "--train.cuda_graph=false"])
    mesh = types.SimpleNamespace(dp_rank=0, dp=1)
    with pytest.raises(ConfigError, match=r"^parallel.tp_streams=2 with loss-masked \(SFT\) shards"):
        train.build_loaders(cfg, mesh, lambda msg: None)
    cfg.parallel.tp_streams = 1
    assert train.build_loaders(cfg, mesh, lambda msg: None)[0].masks is not None


# ----------------------------------------------------------------------------------------------------------------
# GPU

def _gpu_worker(rank, world):
    from nanopara.mesh import Mesh
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons: no TF32 rounding in either run
    torch.backends.cudnn.allow_tf32 = False
    mesh = Mesh.build(tp=2, device="cuda")
    gpu_tol = dict(rtol=1e-4, atol=1e-5)  # cuBLAS picks other kernels for B/2 rows: fp32 sums in another order
    for sp in (False, True):
        for graph in ("false", "true"):  # eager; the two streams captured as two branches of one graph
            one, two = (_train(mesh, s, sp=sp, graph=graph, dtype="fp32") for s in (1, 2))
            _compare(one, two, f"gpu tp2 sp={sp} cuda_graph={graph}", tol=gpu_tol, weight_atol=1e-4)
        # the run it is built for: bf16 autocast, Triton kernels (tests/test_tp.py's _graphed shapes), graphed:
        # bf16 rounds the halves' GEMMs and sums differently (~4e-3 relative an op): near one stream, and training
        one, two = (_train(mesh, s, steps=4, sp=sp, graph="true", kernels="triton", n_embd=64, T=32) for s in (1, 2))
        assert _block_by_block(one, two), (one["calls"], two["calls"])
        diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
        assert diff < 5e-2 and two["losses"][-1] < two["losses"][0], (sp, one["losses"], two["losses"])
    mesh.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout_s(600)  # 12 short runs, the first ones compiling and tuning the Triton kernels
def test_tp2_streams2_nccl_gpu_eager_and_graphed():
    """tp2 (+- sp) with tp_streams=2 on 2 GPUs over NCCL equals tp_streams=1, eager and under train.cuda_graph=true
    (GraphedMicroStep capturing both streams' work and their NCCL kernels), fp32; bf16 + Triton kernels stay near."""
    spawn(_gpu_worker, 2)
