"""DDP and ZeRO-1/2/3 against the single-process run; resume; resharding; memory formulas; tp rules.

Each distributed test spawns one gloo group (CPU, fp32) and runs many checks in it, because a spawn costs seconds.
The reference is SingleDevice in the pytest process on the same global batch (8 sequences per step).

Checked per layout (DDP, ZeRO-1/2/3 and ZeRO-3 with units of 2 blocks at dp 2 and 4, gradient accumulation 1 and
2): losses, grad norms and final weights against the reference; bucket reductions start inside backward (overlap)
and never on no_sync micro-steps; ZeRO-3 keeps at most 3 units gathered, every unit's gather was prefetched, and a
step's hooks, all-gathers and reduce-scatters are counted per unit (3 blocks in units of 2: 2 units, the last
partial); under DDP a parameter without a gradient in a step reduces as zeros (not its bucket slot's old
value); DDP and ZeRO-2 copy only the non-Linear gradients into their buffers (the Linear weights' are written
there by their casts, model.matmul_weight), and a weight used twice in a forward still gets both gradients;
memory_bytes() equals the ZeRO formulas; state_dict -> torch.save -> fresh engine -> load -> continue is bit-exact,
and a ZeRO-3 shard of another unit size is a clear error; ZeRO-3 shards -> unshard -> DDP continues;
sp_partial / tp_dim rules (SingleDevice at tp=2; DDP and ZeRO-3 at dp=2 x tp=2).
Memory (test_engines_free_memory_and_bound_transients): after `del engine, model` + gc nothing survives (weakrefs);
per step, ZeRO-1 reduces in place, ZeRO-2 holds no p.grad after backward, ZeRO-2/3 keep at most max_inflight
full-size copies in flight, ZeRO-3 frees every unit and leaves no autograd graph on the model; close() unhooks.
GPU (NCCL, bf16): `pytest tests/test_dp.py -m gpu` on 2+ GPUs.

Tolerance (measured, see LOSS_ATOL below): changing the layout changes the order of fp32 sums (a rank's mean over
its micro-batch, then a sum over ranks and micro-steps, versus one mean over 8 sequences; reduce-scatter chunks;
sharded norm terms), so gradients differ by ~1 ulp; Adam divides by sqrt(v), which turns ulp-level differences
of near-zero gradients into larger relative ones, and 20 steps compound them (dp 4 runs the first 10: DP4_STEPS).
Same-layout resume is bit-exact.
"""
import gc
import io
import json
import math
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

from nanopara.config import Config, ModelConfig
from nanopara.dp import DDP, SingleDevice
from nanopara.engine import param_kind
from nanopara.mesh import Mesh
from nanopara.model import GPT, Linear
from nanopara.parallel import build_engine
from nanopara.zero import Zero, unshard_model, unshard_optimizer
from nanopara.zero3 import PREFETCH
from tests.distributed import spawn as spawn_gloo

STEPS, BATCH, T, LR = 20, 8, 32, 3e-3
# dp 4 checks the same things over the first 10 steps: its 4 processes on the 2-core machine took 2.5x dp 2's
# whole 20 steps (gloo's messages, 4 ranks' context switches); what only shows after step 10, dp 2 checks
DP4_STEPS = 10
MODES = ["ddp", "zero1", "zero2", "zero3"]
UNIT_MODE = "zero3:u2"  # ZeRO-3 with parallel.zero3_unit_blocks=2 (3 layers: units of 2 blocks and 1)
# Worst differences to the single-process run after 20 steps, measured over dp in {2, 4}, accum in {1, 2}, all four
# modes, the ZeRO-3 -> DDP reshard and the fake-sp layouts (2-core CPU, torch 2.13): loss 1.4e-6 (3 ulp of ~5.5),
# weight 6.3e-6 (weights are O(0.02..1)), grad-norm relative 2.5e-7. Bounds: ~8x those.
LOSS_ATOL, WEIGHT_ATOL, NORM_RTOL = 1e-5, 5e-5, 2e-6
# DDP with parallel.reduce_dtype=bf16 (gradients rounded to bf16 before and during the sum): measured over dp in
# {2, 4}: loss 8.7e-5, weight 7.1e-3 (AdamW turns the rounding of near-cancelling sums into whole-lr steps on a
# few elements). Bounds: ~8x those.
BF16_LOSS_ATOL, BF16_WEIGHT_ATOL = 7e-4, 5e-2


def make_cfg(zero: int = 0) -> Config:
    cfg = Config(device="cpu", seed=0)
    # n_embd 18 / vocab 251: parameter counts that are not multiples of 4, so flat buffers need padding
    cfg.model = ModelConfig(n_layer=3, n_head=3, n_embd=18, block_size=T, vocab_size=251, vocab_multiple=1,
                            kernels="torch")
    cfg.train.lr, cfg.train.grad_clip, cfg.train.weight_decay = LR, 0.5, 0.1  # clip 0.5: active on most steps
    cfg.parallel.zero = zero
    cfg.parallel.zero3_unit_blocks = 1 if zero == 3 else 0  # one block a unit (auto would make this model one unit)
    cfg.parallel.bucket_mb = 4000 * 4 / 2 ** 20  # ~4000 floats: several buckets, one parameter split-free
    return cfg


def split_mode(mode: str) -> tuple[str, int]:
    """"zero3:uK" -> ("zero3", K): ZeRO-3 with units of K blocks; one of MODES -> (mode, 1)."""
    base, _, unit_blocks = mode.partition(":u")
    return base, int(unit_blocks or 1)


def mode_cfg(mode: str) -> Config:
    base, unit_blocks = split_mode(mode)
    cfg = make_cfg(zero=MODES.index(base))
    cfg.parallel.zero3_unit_blocks = unit_blocks
    return cfg


def make_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 251, (STEPS, BATCH, T + 1), generator=g)  # (steps, B, T+1)


def make_model(cfg: Config, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg.model)


def run(engine, tokens, first: int, last: int, rows, accum: int, scale: float = 1.0):
    """Train steps first..last-1 on `rows` of every global batch; returns (losses, norms) averaged over dp."""
    losses, norms = [], []
    for s in range(first, last):
        mine = tokens[s][rows]  # (B/parts, T+1)
        total = torch.zeros(())
        for m, mb in enumerate(mine.chunk(accum)):
            with engine.no_sync(m < accum - 1):
                _, loss = engine.model(mb[:, :-1], mb[:, 1:])
                engine.backward(loss * scale / accum)
            total += loss.detach() / accum
        if engine.group is not None:
            dist.all_reduce(total, group=engine.group)
            total /= engine.n
        losses.append(total.item())
        norms.append(engine.step(LR))
    return losses, norms


@pytest.fixture(scope="module")
def reference():
    """The single-process run: losses and norms of its STEPS steps, weights after DP4_STEPS and after STEPS."""
    cfg = make_cfg()
    mesh = Mesh.build(device="cpu")
    engine = SingleDevice(make_model(cfg), mesh, cfg)
    tokens = make_tokens()
    losses, norms = run(engine, tokens, 0, DP4_STEPS, slice(None), 1)
    half = {k: v.clone() for k, v in engine.full_model_state_dict().items()}
    more = run(engine, tokens, DP4_STEPS, STEPS, slice(None), 1)
    return {"losses": losses + more[0], "norms": norms + more[1],
            "weights_at": {DP4_STEPS: half, STEPS: engine.full_model_state_dict()}}


def first_steps(ref: dict, steps: int) -> dict:
    """The reference as a run of `steps` steps (the learning rate is constant: its first steps are that run)."""
    return {"losses": ref["losses"][:steps], "norms": ref["norms"][:steps], "weights": ref["weights_at"][steps]}


def _setup(rank, n, fn, *args):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames *_into_tensor; 2.11 has no new name
    try:
        fn(rank, n, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, n: int, *args):
    """fn(rank, n, *args) in n gloo processes (tests/distributed.py: success exits without gloo's teardown)."""
    spawn_gloo(_setup, n, fn, *args)


# ----------------------------------------------------------------------------------------------------------------
# the worker: everything one spawned group checks

def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_memory(engine, mode: str, psi: int, n: int):
    """ZeRO paper's bytes per rank for fp32 params/grads and fp32 Adam m, v (the table of Engine.memory_bytes)."""
    mem = engine.memory_bytes()
    if mode == "ddp":
        assert mem == {"params": 4 * psi, "grads": 4 * psi, "optim": 8 * psi}, mem
        return
    padded = sum(f.padded for f in engine.flats)  # Ψ'
    assert psi <= padded < psi + n * len(engine.flats)
    assert n != 4 or padded > psi  # the test model is built so that padding is exercised
    expect = {"zero1": (4 * padded, 4 * padded), "zero2": (4 * padded, 4 * padded // n),
              "zero3": (4 * padded // n, 4 * padded // n)}[mode]
    assert (mem["params"], mem["grads"]) == expect, (mode, mem, expect)
    assert mem["optim"] == 8 * padded // n, (mode, mem)  # m, v are flat (shard,) buffers, padding included


def _spy(engine, mode: str) -> dict:
    """Record, without changing behaviour, when gradient collectives start and how many ZeRO-3 units are gathered."""
    seen = {"in_backward": [], "live": [], "prefetched": [], "gathers": 0, "reduce_scatters": 0}
    if mode != "zero3":
        launch = engine._launch

        def spy_launch(i):
            seen["in_backward"].append(torch._C._current_graph_task_id() != -1)  # -1: not inside backward
            return launch(i)
        engine._launch = spy_launch
        return seen
    live = lambda: sum(any(f.full.untyped_storage().nbytes() > 0 for f in u) for u in engine.units)
    pre_forward, pre_backward, gather, on_unit_grad = (engine._pre_forward, engine._pre_backward, engine._gather,
                                                       engine._on_unit_grad)

    def spy_forward(i):
        seen["prefetched"].append(i == 0 or all(f.pending is not None for f in engine.units[i]))
        pre_forward(i)
        seen["live"].append(live())

    def spy_backward(i):  # runs once per unit output with a gradient: only the first call of a unit gathers
        if not all(f.pending is None and f.full.untyped_storage().nbytes() for f in engine.units[i]):
            seen["prefetched"].append(i == len(engine.units) - 1 or all(f.pending is not None for f in engine.units[i]))
        pre_backward(i)
        seen["live"].append(live())

    def spy_gather(unit, into_own=False):
        seen["gathers"] += sum(f.pending is None for f in unit)  # the all-gathers this call starts
        gather(unit, into_own)

    def spy_unit_grad(*args):
        seen["reduce_scatters"] += 1
        on_unit_grad(*args)
    engine._pre_forward, engine._pre_backward, engine._gather, engine._on_unit_grad = (
        spy_forward, spy_backward, spy_gather, spy_unit_grad)
    return seen


def _check_schedule(engine, mode: str, seen: dict, accum: int, steps: int):
    if mode == "zero3":  # root + the running unit + PREFETCH more; every unit's gather was prefetched
        assert max(seen["live"]) <= 2 + PREFETCH and all(seen["prefetched"]), seen
        assert all(f.full.untyped_storage().nbytes() == 0 for f in engine.flats)  # all freed after the step
        # units from the config, not the engine, so per-block units cannot pass as units of K: two forward hooks
        # a unit; per micro-step the root's flat once, each unit's two (matrices, vectors) in forward and again
        # in backward; one reduce-scatter a flat
        units = -(-engine.cfg.model.n_layer // engine.cfg.parallel.zero3_unit_blocks)
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.model.modules())
        assert len(engine.units) == 1 + units and hooks == 2 * (1 + units), (len(engine.units), hooks)
        per_step = (steps * accum * (1 + 4 * units), steps * accum * (1 + 2 * units))
        assert (seen["gathers"], seen["reduce_scatters"]) == per_step, (seen["gathers"], seen["reduce_scatters"])
        return
    per_step = len(engine.flats if mode != "ddp" else engine.buckets) * (accum if mode == "zero2" else 1)
    assert len(seen["in_backward"]) == steps * per_step  # ddp/zero1: nothing on no_sync micro-steps
    assert all(seen["in_backward"])  # every bucket started while backward was still running: overlap


def _worker(rank, n, ref, out_path):
    tokens, errs, steps = make_tokens(), {}, len(ref["losses"])  # (the reference's steps: STEPS or DP4_STEPS)
    mesh = Mesh.build(dp=n, device="cpu")
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    psi = sum(p.numel() for p in make_model(make_cfg()).parameters())  # the tied weight once
    saved = {}
    for mode in MODES + [UNIT_MODE]:
        cfg, kind = mode_cfg(mode), split_mode(mode)[0]
        for accum in (1, 2):
            engine = build_engine(make_model(cfg), mesh, cfg)
            assert isinstance(engine, DDP if mode == "ddp" else Zero)
            seen = _spy(engine, kind)
            losses, norms = run(engine, tokens, 0, steps, rows, accum)
            _check_schedule(engine, kind, seen, accum, steps)
            weights = engine.full_model_state_dict()
            e = {"loss": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
                 "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
                 "weight": _max_diff(weights, ref["weights"])}
            errs[f"{mode} dp{n} accum{accum}"] = e
            assert e["loss"] < LOSS_ATOL and e["weight"] < WEIGHT_ATOL and e["norm_rel"] < NORM_RTOL, (mode, e)
            _check_memory(engine, kind, psi, n)
            if accum == 1:
                uninterrupted = (losses, weights)

        # resume on the same layout: state -> bytes (weights_only) -> fresh engine of another init -> continue
        engine = build_engine(make_model(cfg), mesh, cfg)
        first, _ = run(engine, tokens, 0, steps // 2, rows, 1)
        buf = io.BytesIO()
        torch.save({"model": engine.model_state_dict(), "engine": engine.state_dict()}, buf)
        buf.seek(0)
        state = saved[mode] = torch.load(buf, weights_only=True)
        engine = build_engine(make_model(cfg, seed=7), mesh, cfg)
        engine.load_model_state_dict(state["model"])
        engine.load_state_dict(state["engine"])
        second, _ = run(engine, tokens, steps // 2, steps, rows, 1)
        assert first + second == uninterrupted[0], f"{mode}: resumed losses differ"
        resumed = engine.full_model_state_dict()
        assert all(torch.equal(resumed[k], uninterrupted[1][k]) for k in resumed), f"{mode}: resumed weights differ"
    # a ZeRO-3 shard saved with units of 1 block does not load into units of 2 (the last engine): a clear error
    assert engine.cfg.parallel.zero3_unit_blocks == 2
    for load, key in ((engine.load_model_state_dict, "model"), (engine.load_state_dict, "engine")):
        with pytest.raises(ValueError, match="zero3_unit_blocks"):
            load(saved["zero3"][key])

    # ZeRO-3 with a deeper prefetch queue: same losses, at most root + 1 + 2 units gathered
    import nanopara.zero3 as zero_mod
    zero_mod.PREFETCH, prefetch = 2, zero_mod.PREFETCH
    try:
        cfg = make_cfg(zero=3)
        engine = build_engine(make_model(cfg), mesh, cfg)
        seen = _spy(engine, "zero3")
        losses, _ = run(engine, tokens, 0, steps // 2, rows, 1)
        assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) < LOSS_ATOL
        assert max(seen["live"]) == 4 and all(seen["prefetched"]), seen
    finally:
        zero_mod.PREFETCH = prefetch

    # the default parallel.zero3_unit_blocks=0 (auto): this model's 3 small blocks make one unit
    cfg = make_cfg(zero=3)
    cfg.parallel.zero3_unit_blocks = 0
    engine = build_engine(make_model(cfg), mesh, cfg)
    assert engine.unit_blocks == 3 and len(engine.units) == 2
    engine.close()

    # DDP with gradient destinations (parallel.grad_dests=on; off by default for DDP): the same training
    cfg = make_cfg(zero=0)
    cfg.parallel.grad_dests = "on"
    for accum in (1, 2):
        engine = build_engine(make_model(cfg), mesh, cfg)
        assert engine._dest_params
        losses, norms = run(engine, tokens, 0, steps, rows, accum)
        errs[f"ddp grad_dests=on dp{n} accum{accum}"] = e = {
            "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
            "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
            "weight": _max_diff(engine.full_model_state_dict(), ref["weights"])}
        assert e["loss"] < LOSS_ATOL and e["weight"] < WEIGHT_ATOL and e["norm_rel"] < NORM_RTOL, e
        engine.close()

    # DDP with bf16 gradient reduction: every reduced gradient is a bf16 value (the sum did go through bf16), and
    # training stays within bf16 rounding of the fp32 run
    cfg = make_cfg(zero=0)
    cfg.parallel.reduce_dtype = "bf16"
    engine = build_engine(make_model(cfg), mesh, cfg)
    losses, _ = run(engine, tokens, 0, steps, rows, 1)
    errs[f"ddp bf16-reduce dp{n}"] = e = {"loss": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
                                          "weight": _max_diff(engine.full_model_state_dict(), ref["weights"])}
    assert e["loss"] < BF16_LOSS_ATOL and e["weight"] < BF16_WEIGHT_ATOL, e
    mb = tokens[0][rows]
    engine.backward(engine.model(mb[:, :-1], mb[:, 1:])[1])
    engine._finish_grads()
    grads = [p.grad for p in engine.params]
    assert all(torch.equal(g, g.bfloat16().float()) for g in grads) and any(g.abs().sum() > 0 for g in grads)
    engine.step(LR)

    # DDP hands gradients over into bucket slots that keep the last step's values: a parameter without a gradient
    # in a step must reduce as zeros, not as what its slot held
    lin = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
    engine = build_engine(lin, mesh, make_cfg())
    x = torch.ones(2, 3)
    engine.backward(lin[1](lin[0](x)).sum())
    engine.step(LR)
    engine.backward(lin[1](x).sum())  # lin[0] unused
    engine._finish_grads()
    assert all(torch.count_nonzero(p.grad) == 0 for p in lin[0].parameters())
    assert all(torch.count_nonzero(p.grad) > 0 for p in lin[1].parameters())
    engine.step(LR)

    _check_grad_destinations(mesh, tokens[0][rows])

    # reshard: ZeRO-3 shards of every rank -> full form -> a DDP engine continues
    cfg = make_cfg(zero=3)
    engine = build_engine(make_model(cfg), mesh, cfg)
    run(engine, tokens, 0, steps // 2, rows, 1)
    shards = [None] * n
    dist.all_gather_object(shards, (engine.model_state_dict(), engine.state_dict()))
    full_model = unshard_model([s[0] for s in shards])
    assert _max_diff(full_model, engine.full_model_state_dict()) == 0.0
    ddp_cfg = make_cfg(zero=0)
    ddp = build_engine(make_model(ddp_cfg, seed=7), mesh, ddp_cfg)
    ddp.load_model_state_dict(full_model)
    ddp.load_state_dict(unshard_optimizer([s[1] for s in shards]))
    run(ddp, tokens, steps // 2, steps, rows, 1)
    errs[f"zero3->ddp reshard dp{n}"] = {"weight": _max_diff(ddp.full_model_state_dict(), ref["weights"])}
    assert errs[f"zero3->ddp reshard dp{n}"]["weight"] < WEIGHT_ATOL

    _check_tp_rules(rank, n, ref, tokens, errs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(errs, f, indent=1)


def _expected_copies(engine, micro_steps: int) -> int:
    """Gradient elements DDP / ZeRO-2 copy into their buffers: DDP once a step, ZeRO-2 every micro-step except a
    bucket of one unpadded parameter (sent as is); with destinations on, not the Linear weights (but the tied one)."""
    tied = engine.model.transformer.wte.weight
    linear = {id(m.weight) for m in engine.model.modules() if isinstance(m, Linear)} - {id(tied)}
    if not engine._dest_params:
        linear = set()
    if isinstance(engine, DDP):
        return sum(p.numel() for p in engine.params if id(p) not in linear)
    return micro_steps * sum(p.numel() for f in engine.flats if not (len(f.params) == 1 and f.padded == f.numel)
                             for p in f.params if id(p) not in linear)


def _check_grad_destinations(mesh, mb):
    """With gradient destinations (parallel.grad_dests: on for DDP, the default auto for ZeRO-2) the Linear weights
    (not the tied wte/lm_head) get their gradients made inside the bucket / send buffer, so only the other
    parameters are copied there (`engine.copied`); a weight used twice in one forward still gets the sum of its
    two gradients. Without them (DDP's default auto, ZeRO-2 with off) every gradient is copied."""
    for zero, dests in ((0, "auto"), (2, "off")):
        cfg = make_cfg(zero)
        cfg.parallel.grad_dests = dests
        engine = build_engine(make_model(cfg), mesh, cfg)
        assert engine._dest_params == [] and not any(hasattr(p, "grad_into") for p in engine.params)
        engine.backward(engine.model(mb[:, :-1], mb[:, 1:])[1])
        engine._finish_grads()
        assert engine.copied == _expected_copies(engine, 1) > sum(p.numel() for p in engine.params) // 2
        engine.close()
    for zero, dests in ((0, "on"), (2, "auto")):
        cfg = make_cfg(zero)
        cfg.parallel.grad_dests = dests
        model = make_model(cfg)
        engine = build_engine(model, mesh, cfg)
        tied = model.transformer.wte.weight
        assert [p for p in engine._dest_params] == [p for p in engine.params if p is not tied]
        assert all(hasattr(p, "grad_into") for p in engine._dest_params)
        for micro in range(2):  # DDP: the first micro-step's gradients land in their slots, the second adds there
            with engine.no_sync(micro == 0):
                engine.backward(engine.model(mb[:, :-1], mb[:, 1:])[1])
        engine._finish_grads()
        assert engine.copied == _expected_copies(engine, 2), (zero, engine.copied, _expected_copies(engine, 2))
        engine.step(LR)
        engine.close()
        assert not any(hasattr(p, "grad_into") for p in model.parameters())

        # one weight used twice: the second use gets no destination, autograd sums both
        torch.manual_seed(3)
        lin, x = torch.nn.ModuleList([Linear(3, 3), Linear(3, 3)]), torch.randn(2, 3)
        w, b, w1, _ = ref = [p.detach().clone().requires_grad_() for p in lin.parameters()]
        F = torch.nn.functional
        (F.linear(F.linear(x, w, b), w, b).sum() * w1.sum()).backward()  # lin[1]: a factor, one use
        cfg = make_cfg(zero)
        cfg.parallel.grad_dests = dests
        engine = build_engine(lin, mesh, cfg)
        engine.backward(lin[0](lin[0](x)).sum() * lin[1].weight.sum())
        engine._finish_grads()
        grads = {k: torch.zeros_like(r) if r.grad is None else r.grad for (k, _), r in zip(lin.named_parameters(), ref)}
        if zero == 0:  # lin[1].bias got no gradient: it reduces as zeros
            assert all(torch.allclose(p.grad, grads[k]) for k, p in lin.named_parameters())
        else:
            assert all(torch.allclose(f.grad_shard, f.slice_of(grads, "cpu")) for f in engine.flats)
        engine.close()


def _check_tp_rules(rank, n, ref, tokens, errs):
    """Fake tensor parallel: tp ranks hold the same full model and split the batch; every parameter is marked
    sp_partial, so the engine must sum their grads over tp (and count them once in the norm) to match the
    reference. With 4 ranks this runs as dp=2 x tp=2 for DDP and ZeRO-3 (sp sums on shards)."""
    layouts = [("single", 1, 2)] if n == 2 else [("ddp", 2, 2), ("zero3", 2, 2)]
    for mode, dp, tp in layouts:
        mesh = Mesh.build(dp=dp, tp=tp, device="cpu")
        cfg = make_cfg(zero=0 if mode in ("single", "ddp") else 3)
        model = make_model(cfg)
        for p in model.parameters():
            p.sp_partial = True
        engine = build_engine(model, mesh, cfg)
        part = mesh.dp_rank * tp + mesh.tp_rank
        rows = slice(part * BATCH // (dp * tp), (part + 1) * BATCH // (dp * tp))
        losses, norms = run(engine, tokens, 0, len(ref["losses"]), rows, 1, scale=1.0 / tp)
        e = {"weight": _max_diff(engine.full_model_state_dict(), ref["weights"]),
             "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref["norms"]))}
        errs[f"fake-sp {mode} dp{dp} tp{tp}"] = e
        assert e["weight"] < WEIGHT_ATOL and e["norm_rel"] < NORM_RTOL, (mode, e)

    # the norm rule for tp-sharded parameters: squares summed over tp, replicated ones counted once
    mesh = Mesh.build(dp=n // 2, tp=2, device="cpu")
    lin = torch.nn.Linear(3, 5)
    lin.weight.tp_dim = 0
    engine = build_engine(lin, mesh, make_cfg())
    engine.model.weight.grad = torch.full((5, 3), float(mesh.tp_rank + 1))
    engine.model.bias.grad = torch.full((5,), 2.0)
    pieces = [(p.grad, param_kind(p)) for p in lin.parameters()]
    assert abs(engine._global_sq(pieces).item() ** 0.5 - (15 * (1 + 4) + 5 * 4) ** 0.5) < 1e-5


# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_dp_matches_single_process(reference, n, tmp_path):
    out = tmp_path / "errors.json"
    spawn(_worker, n, first_steps(reference, STEPS if n == 2 else DP4_STEPS), str(out))
    errs = json.loads(out.read_text())
    for k, v in errs.items():
        print(f"{k:28s} " + " ".join(f"{m}={x:.2e}" for m, x in v.items()))


@pytest.mark.parametrize("preset, k", [("gpt2_124m", 3), ("gpt2_350m", 2), ("gpt2_774m", 2), ("gpt2_1558m", 1),
                                       ("gpt_1b", 1), ("tiny", None)])
def test_zero3_auto_unit_size_follows_the_block_size(preset, k):
    """parallel.zero3_unit_blocks=0: the fewest blocks with >= UNIT_MIN_PARAMS parameters (a small model: all)."""
    from nanopara.cli import parse_args
    from nanopara.zero3 import UNIT_MIN_PARAMS, auto_unit_blocks
    cfg = parse_args([f"--preset={preset}"])
    with torch.device("meta"):
        blocks = list(GPT(cfg.model).transformer.h)
    got = auto_unit_blocks(blocks)
    per_block = sum(p.numel() for p in blocks[0].parameters())
    assert got == (k or cfg.model.n_layer), (preset, got, per_block)
    assert got * per_block >= UNIT_MIN_PARAMS or got == len(blocks)
    assert got == 1 or (got - 1) * per_block < UNIT_MIN_PARAMS


def test_bad_layout_and_formats_are_clear_errors(reference):
    cfg = make_cfg()
    mesh = Mesh.build(device="cpu")
    engine = SingleDevice(make_model(cfg), mesh, cfg)
    with pytest.raises(ValueError, match="unshard_optimizer"):
        engine.load_state_dict({"format": "flat_shard", "flats": []})
    with pytest.raises(ValueError, match="missing"):
        engine.load_model_state_dict({"transformer.wte.weight": torch.zeros(1)})
    sd = engine.state_dict()
    assert sd["format"] == "full" and sd["step"] == 0


# ----------------------------------------------------------------------------------------------------------------
# memory: nothing outlives an engine; the transients of a step (CPU allocator events, gloo)

def _alive_after_delete(mode: str, mesh, tokens, rows) -> list:
    """Build an engine, train 2 steps, delete it and its model: names of the objects still alive (weakrefs)."""
    cfg = make_cfg(zero=MODES.index(mode))
    model = make_model(cfg)
    engine = build_engine(model, mesh, cfg)
    run(engine, tokens, 0, 2, rows, 1)
    refs = {"engine": weakref.ref(engine), "model": weakref.ref(model), "optimizer": weakref.ref(engine.optimizer)}
    refs.update({f"param {i}": weakref.ref(p) for i, p in enumerate(model.parameters())})  # ZeRO-3: none left
    refs.update({f"{f.name}.{k}": weakref.ref(getattr(f, k)) for f in getattr(engine, "flats", [])
                 for k in FLAT_BUFFERS if hasattr(f, k)})  # comprehensions: no loop variable keeps one alive
    refs.update({f"bucket {i}": weakref.ref(b) for i, b in enumerate(getattr(engine, "bufs", []))})
    del engine, model  # no close(): the hooks must not keep anything alive on their own
    for _ in range(40):
        gc.collect()
        alive = [k for k, r in refs.items() if r() is not None]
        if not alive:
            break
        # gloo's worker thread lets go of a finished collective (and its tensors) a moment after wait() returns;
        # on a loaded 2-core CI machine that moment was seen ("zero1: bucket4.param alive"). A leak stays for good.
        time.sleep(0.05)
    return alive


FLAT_BUFFERS = ("param", "grad", "grad_shard", "master", "full", "exp_avg", "exp_avg_sq")


def mem_cfg(zero: int) -> Config:
    """8 blocks of ~12.7k parameters (~11% of Ψ each: ZeRO-3 units) and buckets of ~6k floats, so "bounded by a
    few buckets / units" and "the whole model" are far apart."""
    cfg = make_cfg(zero)
    cfg.model = ModelConfig(n_layer=8, n_head=2, n_embd=32, block_size=T, vocab_size=251, vocab_multiple=1,
                            kernels="torch")
    cfg.parallel.bucket_mb = 6000 * 4 / 2 ** 20
    return cfg


def _check_step_buffers(mode: str, mesh, rank: int) -> float:
    """One step's buffers, checked at the hook points (a CPU stand-in for an allocator trace: gloo's collectives
    copy internally, so CPU allocator totals would not say what NCCL holds). Returns the most full-size gradient
    elements held by reductions in flight at once, as a fraction of Ψ."""
    cfg = mem_cfg(MODES.index(mode))
    engine = build_engine(make_model(cfg), mesh, cfg)
    x = torch.randint(0, 251, (1, 4), generator=torch.Generator().manual_seed(rank))  # (1, 4)
    psi = sum(f.numel for f in engine.flats) if mode != "ddp" else sum(p.numel() for p in engine.params)
    inflight = [0]
    if mode == "zero1":  # reduce-scatters run in place on f.grad: no buffer of their own
        launch = engine._launch

        def spy(i):
            f, work, out, sent = launch(i)
            assert sent is None and out.untyped_storage().data_ptr() == f.grad.untyped_storage().data_ptr()
            return f, work, out, sent
        engine._launch = spy
    if mode in ("zero2", "zero3"):  # full-size gradient copies in flight, counted at every new reduction
        hook = "_launch" if mode == "zero2" else "_on_unit_grad"
        orig = getattr(engine, hook)

        def spy(*args):
            out = orig(*args)
            new = [out] if mode == "zero2" else []  # ZeRO-2's newest is returned, not yet in _works
            inflight.append(sum(w[3].numel() for w in engine._works + new))
            return out
        setattr(engine, hook, spy)

    _, loss = engine.model(x, x)
    engine.backward(loss)
    if mode == "zero2":  # every full gradient went into a reduce-scatter and was dropped
        assert all(p.grad is None for p in engine.params), "ZeRO-2 kept a full gradient after backward"
    if mode == "zero3":  # blocks freed as their gradients left; nothing the model holds refers to the graph
        assert all(f.full.untyped_storage().nbytes() == 0 for u in engine.units[1:] for f in u)
        held = [t for m in engine.model.modules() for t in vars(m).values() if torch.is_tensor(t)]
        assert held and all(t.grad_fn is None for t in held), "module attributes keep the autograd graph"
    del loss
    engine.step(LR)
    if mode == "zero3":
        assert all(f.full.untyped_storage().nbytes() == 0 for f in engine.flats)  # every unit freed
    if mode != "ddp":
        assert not engine._works  # nothing in flight between steps
        biggest = max(f.padded for f in engine.flats)
        # bounded by max_inflight buckets (ZeRO-2) / unit flats (ZeRO-3), never the whole model's gradient
        assert max(inflight) <= getattr(engine, "max_inflight", 0) * biggest < psi, (mode, inflight, biggest, psi)
    return max(inflight) / psi


def _memory_worker(rank, n, out_path):
    mesh = Mesh.build(dp=n, device="cpu")
    tokens, rows = make_tokens(), slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    res = {}
    for mode in MODES:
        alive = _alive_after_delete(mode, mesh, tokens, rows)
        assert not alive, f"{mode}: still alive after del + gc.collect(): {alive}"
        res[mode] = _check_step_buffers(mode, mesh, rank)
    # close(): hooks removed, so a second engine on the same model is the only one that reacts
    cfg = make_cfg(zero=2)
    model = make_model(cfg)
    first = build_engine(model, mesh, cfg)
    first.close()
    second = build_engine(model, mesh, cfg)
    run(second, tokens, 0, 1, rows, 1)
    assert sum(first._ready) == 0 and not first._works  # its hooks never ran
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


def test_engines_free_memory_and_bound_transients(tmp_path):
    out = tmp_path / "mem.json"
    spawn(_memory_worker, 2, str(out))
    for mode, frac in json.loads(out.read_text()).items():
        print(f"{mode:6s} full-size gradient copies in flight at most {frac:.3f} Ψ")


# ----------------------------------------------------------------------------------------------------------------
# GPU (NCCL, bf16 autocast): `pytest tests/test_dp.py -m gpu` on a machine with 2+ GPUs

def _gpu_worker(rank, n):
    from nanopara.comm import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    mesh = Mesh.build(dp=n, device="cuda")
    dev, group = mesh.device, mesh.dp_group
    for dtype in (torch.bfloat16, torch.float32):  # integer values: sums are exact, the ring must equal NCCL
        for size in (1, 7, 1001, (1 << 20) + 3):
            x = torch.randint(-50, 50, (size,), device=dev).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            assert torch.equal(ring_all_reduce(x.clone(), group), ref), (dtype, size)
            big = torch.randint(-50, 50, (n * size,), device=dev).to(dtype)
            ref = torch.empty(size, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(ref, big, group=group)
            assert torch.equal(ring_reduce_scatter(torch.empty_like(ref), big, group), ref)
            ref = torch.empty(n * size, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(ref, x, group=group)
            assert torch.equal(ring_all_gather(torch.empty_like(ref), x, group), ref)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (STEPS, BATCH, 129), generator=g)
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    curves = {}
    for mode, kernels in [("ddp", "torch"), ("ddp+dests", "torch"), ("zero1", "torch"), ("zero2", "torch"),
                          ("zero3", "torch"), ("zero3", "auto"), ("zero3:u3", "torch")]:  # u3: units of 3 and 1 blocks
        cfg = Config(seed=0)
        cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1000, kernels=kernels)
        mode, dests = mode.partition("+dests")[:2]  # "ddp+dests": parallel.grad_dests=on
        cfg.parallel.grad_dests = "on" if dests else "auto"
        base, cfg.parallel.zero3_unit_blocks = split_mode(mode)
        cfg.train.lr, cfg.parallel.zero, cfg.parallel.bucket_mb = 1e-3, MODES.index(base), 0.25
        torch.manual_seed(0)
        with torch.device(dev):
            model = GPT(cfg.model)
        psi = sum(p.numel() for p in model.parameters())
        engine = build_engine(model, mesh, cfg)
        losses = []
        for s in range(STEPS):
            xy = tokens[s][rows].to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = engine.model(xy[:, :-1], xy[:, 1:])
            engine.backward(loss)
            engine.step(cfg.train.lr)
            losses.append(loss.item())
            if s == 0 and mode in ("ddp", "zero2"):  # with destinations, bf16 -> fp32 casts wrote the Linear
                assert bool(engine._dest_params) == (mode == "zero2" or bool(dests))  # weights' gradients
                assert engine.copied == _expected_copies(engine, 1), (mode, engine.copied)
        _check_memory(engine, base, psi, n)
        curves[f"{mode}{dests}/{kernels}"] = losses
    ref = curves["ddp/torch"]
    # the engines compute the same bf16 matmuls on the same (autocast-rounded) weights and differ only in the order
    # of fp32 sums, which bf16 rounding of activations amplifies; the Triton kernels (auto) differ from torch's
    # ops at bf16 level. 1e-2 relative on the loss over 20 steps is far above both and far below a wrong update.
    for k, losses in curves.items():
        worst = max(abs(a - b) / b for a, b in zip(losses, ref))
        assert worst < 1e-2, (k, worst, losses, ref)


@pytest.mark.gpu
def test_engines_on_nccl_bf16():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_gpu_worker, 2)


# A training step issued while a long sleep kernel holds the GPU: if the host gets back before the sleep ends,
# nothing in the step waited for the GPU (train.py reads a step's numbers one step late, so the GPU never idles
# between steps waiting for the host). This catches driver-level waits too (a pageable copy, cudaFree), which
# torch.cuda.set_sync_debug_mode does not see; that mode runs alongside to name the op where it can.

def host_waited(fn, dev) -> bool:
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(1 << 31)  # ~1 s at H100 clocks: far longer than issuing a small model's step
    busy = torch.cuda.Event()
    busy.record()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waited = busy.query()
    torch.cuda.synchronize(dev)
    return waited


def _train_step(engine, xy, cfg, group=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = engine.model(xy[:, :-1], xy[:, 1:])
    engine.backward(loss)
    loss = loss.detach().float()
    if group is not None:  # train.py's loss mean over dp
        dist.all_reduce(loss, group=group)
    return loss, engine.step(cfg.train.lr, sync=False)


def _no_wait_check(mesh, modes, n) -> dict:
    dev, waited = mesh.device, {}
    tokens = torch.randint(0, 1000, (4, 129), generator=torch.Generator().manual_seed(mesh.rank)).pin_memory()
    for mode in modes:
        cfg = Config(seed=0)
        cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1000, kernels="torch")
        base, cfg.parallel.zero3_unit_blocks = split_mode(mode)
        cfg.train.lr, cfg.parallel.zero = 1e-3, MODES.index(base)
        torch.manual_seed(0)
        with torch.device(dev):
            engine = build_engine(GPT(cfg.model), mesh, cfg)
        group = mesh.dp_group if n > 1 else None
        for _ in range(3):  # warm-up: allocations, the fused AdamW's state, NCCL's communicators
            _train_step(engine, tokens.to(dev), cfg, group)
        waited[mode] = host_waited(lambda: _train_step(engine, tokens.to(dev, non_blocking=True), cfg, group), dev)
        assert host_waited(lambda: _train_step(engine, tokens.to(dev), cfg, group)[1].item(), dev)  # the probe works
        loss, norm = _train_step(engine, tokens.to(dev), cfg, group)
        assert torch.is_tensor(norm) and math.isfinite(norm.item()) and math.isfinite(loss.item())
        engine.close()
    return waited


@pytest.mark.gpu
def test_a_step_never_waits_for_the_gpu():
    """One GPU: the SingleDevice step (on 2 x H100 neither it nor a 128 KB batch copy from pageable memory waited)."""
    waited = _no_wait_check(Mesh.build(device="cuda"), ["ddp"], 1)  # dp=1: build_engine gives SingleDevice
    assert not any(waited.values()), waited


def _no_wait_worker(rank, n):
    mesh = Mesh.build(dp=n, device="cuda")
    waited = _no_wait_check(mesh, MODES + ["zero3:u2"], n)
    print(rank, waited)
    assert not any(waited.values()), waited


@pytest.mark.gpu
def test_a_step_never_waits_for_the_gpu_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_no_wait_worker, 2)
