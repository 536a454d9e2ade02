"""Activation checkpointing (nanopara/recompute.py): `full` and `selective` against `none`, and what they keep.

Numerics: on the CPU every recomputation repeats the forward's ops on the same inputs, so losses and every gradient
are bit-identical to `none` (torch.equal) in fp32 and under bf16 autocast, with dropout (the masks come back from
the RNG state), on TP/SP ranks (2 gloo processes, tp.py's per-rank dropout stream), under the DDP and ZeRO-3
engines (2 gloo processes, 3 AdamW steps: losses and weights), in pipeline chunks with
ZB-H1's split backward (input gradient, then weight gradients from the same retained graph), and with the Triton
kernels (interpreter).

Memory: the bytes of every tensor storage the blocks' forward allocated that is still alive when it returns (a
TorchDispatchMode with weak storage references: what a GPU's memory counter shows). Saved-tensor hooks cannot
count this from outside: only the innermost pair applies, and checkpointing installs its own.

    .venv/bin/python -m pytest -q tests/test_recompute.py -s   # -s prints the bytes per layer
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanopara import pp
from nanopara.config import ModelConfig
from nanopara.mesh import Mesh
from nanopara.model import GPT, TritonOps
from nanopara.recompute import apply_activation_checkpointing
from tests.distributed import spawn

B, T, V = 2, 16, 100


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(n_layer=3, n_head=4, n_embd=32, block_size=T, vocab_size=V, vocab_multiple=64,
                       kernels="torch", **kw)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, V, (B, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _train(mode: str, cfg: ModelConfig, autocast: bool = False, ops=None, micro: int = 2):
    """Losses and accumulated grads of `micro` forward/backward passes; dropout draws from the same seed."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if ops is not None:
        model._ops["cpu"] = ops
    apply_activation_checkpointing(model.transformer.h, mode)
    torch.manual_seed(1)
    losses = []
    for i in range(micro):
        x, y = _batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, want):
    (l1, g1), (l0, g0) = got, want
    assert g1.keys() == g0.keys()
    assert torch.equal(l1, l0), (l1, l0)
    for n in g0:
        assert torch.equal(g1[n], g0[n]), f"{n}: max diff {(g1[n] - g0[n]).abs().max().item():.3g}"


# ----------------------------------------------------------------------------------------------------------------
# one process

@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_mode_matches_none(mode, dropout, autocast):
    cfg = _cfg(dropout=dropout)
    _assert_same(_train(mode, cfg, autocast), _train("none", cfg, autocast))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_triton_kernels_match_none(mode):
    """The Triton op table (interpreter): fused add+LayerNorm, flash attention with its lse, dropout."""
    cfg = _cfg(dropout=0.1)
    got = _train(mode, cfg, ops=TritonOps(interpret=True), micro=1)
    _assert_same(got, _train("none", cfg, ops=TritonOps(interpret=True), micro=1))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_pipeline_chunks_with_split_backward(mode):
    """Two pp chunks in one process; the last runs ZB-H1's B (input grad, graph retained) then W (weight grads)."""
    def run(m):
        torch.manual_seed(0)
        model = GPT(_cfg(dropout=0.1))
        chunks = [pp.split_model(model, 2, r, layers=[2, 1])[0] for r in range(2)]
        for ch in chunks:
            apply_activation_checkpointing(ch.transformer.h.values(), m)
        x, y = _batch(0)
        torch.manual_seed(1)
        act = chunks[0](x)
        got = act.detach().requires_grad_()
        loss = chunks[1](got, y)
        dx = torch.autograd.grad(loss, got, retain_graph=True)[0]
        torch.autograd.backward(loss, inputs=[p for p in chunks[1].parameters()])
        act.backward(dx)
        grads = {f"{i}.{n}": p.grad.clone() for i, ch in enumerate(chunks) for n, p in ch.named_parameters()}
        return loss.detach(), grads
    _assert_same(run(mode), run("none"))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_awkward_shape_and_retained_graph(mode):
    """Odd sizes (B 3, T 7, C 24, 3 heads, 5 layers), bf16, dropout; the graph retained by a first backward
    (autograd.grad of the input, as ZB's B) and walked again (the weights): full's holders and selective's recipes
    serve both walks, and gradients equal none's."""
    cfg = ModelConfig(n_layer=5, n_head=3, n_embd=24, block_size=7, vocab_size=V, vocab_multiple=64,
                      kernels="torch", dropout=0.1)

    def run(m):
        torch.manual_seed(0)
        model = GPT(cfg)
        apply_activation_checkpointing(model.transformer.h, m)
        x = torch.randn(3, 7, 24, requires_grad=True)
        ops = model.ops_for(x.device)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r, h = x, None
            for block in model.transformer.h:
                r, h = block(r, ops, None, h)
            loss = (r.float() * 1.5 + h.float()).square().mean()
        dx = torch.autograd.grad(loss, x, retain_graph=True)[0]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        grads["x"] = dx
        return loss.detach(), grads
    _assert_same(run(mode), run("none"))


def test_modes_keep_names_generation_and_reapplying():
    torch.manual_seed(0)
    model = GPT(_cfg())
    keys = model.state_dict().keys()
    with pytest.raises(ValueError, match="train.activation_checkpointing='partial'"):
        apply_activation_checkpointing(model.transformer.h, "partial")
    apply_activation_checkpointing(model.transformer.h, "full")
    apply_activation_checkpointing(model.transformer.h, "selective")  # replaces, does not nest
    assert model.state_dict().keys() == keys
    assert all(b.forward.__func__.__name__ == "_selective_forward" for b in model.transformer.h)
    assert copy.deepcopy(model).transformer.h[0].forward.__self__ is not model.transformer.h[0]
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 4, temperature=0)  # no_grad + KV cache
    assert out.shape == (1, 5)
    apply_activation_checkpointing(model.transformer.h, "none")
    assert all("forward" not in vars(b) for b in model.transformer.h)


# ----------------------------------------------------------------------------------------------------------------
# memory

class _LiveBytes(TorchDispatchMode):
    """Remembers every storage an op allocates (not views of its inputs); `live()`: bytes of those still alive."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {StorageWeakRef(t.untyped_storage()).cdata
               for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in ins:
                    self.refs.append((ref, t.untyped_storage().nbytes()))
        return out

    def live(self) -> int:
        gc.collect()
        return sum(dict((r.cdata, n) for r, n in self.refs if not r.expired()).values())


def _kept(mode: str, dropout: float, autocast: bool, n_layer: int, b=4, s=64, h=64) -> int:
    """Bytes a forward through the blocks leaves allocated for backward (its outputs excluded)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=n_layer, n_head=4, n_embd=h, block_size=s, vocab_size=V, kernels="torch",
                            dropout=dropout))
    apply_activation_checkpointing(model.transformer.h, mode)
    x = torch.randn(b, s, h, requires_grad=True)
    ops = model.ops_for(x.device)
    count = _LiveBytes()
    with count, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        r, m = x, None
        for block in model.transformer.h:
            r, m = block(r, ops, None, m)
    kept = count.live() - r.untyped_storage().nbytes() - m.untyped_storage().nbytes()
    (r.sum() + m.sum()).backward()  # and the graph is still whole
    return kept


def _kept_per_layer(mode, dropout, autocast, b=4, s=64, h=64) -> float:
    """What one more layer keeps (3 layers minus 2: the first block has no MLP input to keep), per s*b*h."""
    return (_kept(mode, dropout, autocast, 3) - _kept(mode, dropout, autocast, 2)) / (s * b * h)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_full_and_selective_keep_less(dropout, autocast):
    kept = {m: _kept_per_layer(m, dropout, autocast) for m in ("none", "selective", "full")}
    print(f"\nbytes kept per layer / (s*b*h), dropout {dropout}, {'bf16' if autocast else 'fp32'}: "
          + ", ".join(f"{m} {v:.2f}" for m, v in kept.items()))
    assert kept["full"] < kept["selective"] < kept["none"]
    # selective drops exactly the two LayerNorm outputs (h wide), the GELU output (4h) and the dropout masks
    # (on the CPU the scaled noise, in the activation dtype, not a 1-byte mask)
    e = 2 if autocast else 4
    assert kept["none"] - kept["selective"] == e * (6 + (2 if dropout else 0))
    if autocast:  # nanopara/recompute.py's arithmetic: none 36, selective 24, full 6, plus what does not scale
        # with s*b*h: the lse (4 bytes per head and token), LayerNorm mean/rstd (2 x 2 x 4 bytes per token), and the
        # bf16 weight copies the matmuls save (12 h^2 x 2 bytes per layer)
        b, s, h, a = 4, 64, 64, 4
        extra = 4 * a / h + 16 / h + 24 * h / (s * b)
        assert kept == {"none": 36 + extra + (4 if dropout else 0), "selective": 24 + extra, "full": 6}


# ----------------------------------------------------------------------------------------------------------------
# tensor (+ sequence) parallel, 2 gloo processes

def _tp_worker(rank, world):
    torch.set_num_threads(1)
    from nanopara.tp import apply_tp
    mesh = Mesh.build(tp=world, device="cpu")
    kept = {}
    for sp in (False, True):  # SP with dropout installs tp.py's per-rank dropout stream
        results = {}
        for mode in ("none", "full", "selective"):
            torch.manual_seed(0)
            model = apply_tp(GPT(_cfg(dropout=0.1)), mesh, sp=sp)
            apply_activation_checkpointing(model.transformer.h, mode)
            losses = []
            for i in range(2):
                x, y = _batch(i)
                count = _LiveBytes()
                with count:
                    _, loss = model(x, y)
                kept[sp, mode] = count.live()
                loss.backward()
                losses.append(loss.detach())
            results[mode] = torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}
        for mode in ("full", "selective"):
            _assert_same(results[mode], results["none"])
        assert kept[sp, "full"] < kept[sp, "selective"] < kept[sp, "none"], kept
    if rank == 0:
        print("\nbytes kept by a forward, tp=2, rank 0: " + ", ".join(f"{'sp ' if sp else ''}{m} {v}"
                                                                    for (sp, m), v in kept.items()))
    dist.barrier()
    dist.destroy_process_group()


def test_tensor_parallel_matches_none():
    spawn(_tp_worker, 2)


def _dp_worker(rank, world):
    """DDP and ZeRO-3 engines (ZeRO-3 frees each unit's weights after its forward and refills them for its
    backward, where the recomputation reads them): three AdamW steps, losses and weights equal to none's."""
    torch.set_num_threads(1)
    from nanopara.config import Config
    from nanopara.parallel import build_engine
    mesh = Mesh.build(dp=world, device="cpu")
    for zero in (0, 3):
        results = {}
        for mode in ("none", "full", "selective"):
            cfg = Config()
            cfg.model = _cfg(dropout=0.1)
            cfg.parallel.zero, cfg.parallel.zero3_unit_blocks = zero, 2
            torch.manual_seed(0)
            model = GPT(cfg.model)
            apply_activation_checkpointing(model.transformer.h, mode)
            engine = build_engine(model, mesh, cfg)
            losses = []
            for step in range(3):
                x, y = _batch(10 * step + rank)
                torch.manual_seed(100 + step)
                _, loss = engine.model(x, y)
                engine.backward(loss)
                engine.step(1e-2)
                losses.append(loss.detach())
            results[mode] = torch.stack(losses), engine.full_model_state_dict()
            engine.close()
        for mode in ("full", "selective"):
            _assert_same(results[mode], results["none"])
    dist.barrier()
    dist.destroy_process_group()


def test_data_parallel_engines_match_none():
    spawn(_dp_worker, 2)


# ----------------------------------------------------------------------------------------------------------------
# bench/bench_recompute.py's search (the GPU run itself is the lead's)

@pytest.mark.parametrize("limit, start", [(77, 8), (5, 8), (300, 8), (1, 1)])
def test_bench_max_batch_search(monkeypatch, limit, start):
    import argparse
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_recompute
    probes = []
    monkeypatch.setattr(bench_recompute, "fits", lambda *a: probes.append(a[-1]) or a[-1] <= limit)
    args = argparse.Namespace(max_batch=1024, search_frac=32)
    lo, hi = bench_recompute.max_batch(None, None, args, start)
    assert lo <= limit < hi and hi - lo <= max(1, lo // 32), (lo, hi, probes)
    assert len(probes) <= 16


def test_bench_profile_smoke_on_cpu(tmp_path, capsys, monkeypatch):
    """bench_recompute.py --profile on CPU: every mode gets a profiled step whose span splits into busy + idle."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_recompute
    # the presets at a 512-token vocabulary: the same script end to end, without GPT-2's 50257-row lm_head, its
    # cross-entropy and AdamW, which were ~8 of the 11 s its CPU steps took
    make_cfg = bench_recompute.H.make_cfg
    monkeypatch.setattr(bench_recompute.H, "make_cfg",
                        lambda preset, overrides=None: make_cfg(preset, {"model.vocab_size": 512, **(overrides or {})}))
    out = tmp_path / "r.jsonl"
    bench_recompute.main(["--device=cpu", "--presets=tiny", "--parity_preset=tiny", "--profile", "--quick",
                          "--no_search", "--batch=2", "--seq=32", f"--out={out}"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prof = [r for r in rows if r.get("section") == "mode"]
    assert [r["mode"] for r in prof] == ["none", "full", "selective"]
    for r in prof:
        assert r["prof_kernels"] > 0 and r["prof_top"], r
        assert abs(r["prof_busy_ms"] + r["prof_idle_ms"] - r["prof_span_ms"]) < 1e-6 and r["prof_idle_ms"] >= 0
    assert "profile tiny selective: span" in capsys.readouterr().out
