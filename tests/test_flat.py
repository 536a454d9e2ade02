"""nanopara/flat.py (`train.optimizer=flat`) and kernels/adamw.py's options for it.

CPU: the kernel (interpreter) with decay on a range, a bf16 copy, the unscale divisor, the skip flag and the step on
the device, against adamw_ref; the engine against SingleDevice with torch.optim.AdamW (the same ops in the same
order on CPU: the parameters after several accumulated, clipped steps agree to fp32 rounding), dense and MoE, both
step paths (norm first; the GPU's norm-last path with device scalars, run here on CPU); gradient destinations; the
bf16 shadow under CPU autocast (what the matmuls read, a stale one never read); checkpoints in both directions.
GPU (`-m gpu`): the flat engine against torch's fused AdamW at bf16, eager and under a CUDA graph.
"""
import pytest
import torch

from kernels.adamw import adamw_ref, adamw_step_triton_
from nanopara.config import Config, ConfigError, ModelConfig
from nanopara.flat import FlatSingle
from nanopara.mesh import Mesh
from nanopara.model import GPT, matmul_weight
from nanopara.parallel import build_engine, check_layout
from nanopara.trainer import autocast

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _bufs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * s for s in (1.0, 1e-2, 1e-3, 1e-6)]  # p, g, m, v (v >= 0 below)


@pytest.mark.parametrize("n,n_decay,n16", [(3000, 1234, 1234), (4096 + 77, 4096 + 5, 4096 + 5), (50, 0, 0)])
def test_kernel_options_match_the_reference(n, n_decay, n16):
    p, g, m, v = _bufs(n)
    v = v.abs()
    a = [t.clone() for t in (p, g, m, v)]
    b = [t.clone() for t in (p, g, m, v)]
    scale, step = torch.tensor(3.0), torch.tensor(4.0)
    a16, b16 = torch.zeros(n16, dtype=torch.bfloat16), torch.zeros(n16, dtype=torch.bfloat16)
    adamw_step_triton_(*a, **HP, step=step, n_decay=n_decay, p16=a16 if n16 else None, grad_scale=scale,
                       found_inf=torch.tensor(0.0))
    adamw_ref(*b, **HP, step=4, n_decay=n_decay, p16=b16 if n16 else None, grad_scale=scale)
    for x, y, what in zip(a[::2], b[::2], ("p", "m")):  # (decay moves p by lr * wd = 3e-4 of itself: seen)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6 * y.abs().max().item(), msg=what)
    torch.testing.assert_close(a[3], b[3], rtol=1e-6, atol=0.0)
    assert torch.equal(a16, a[0][:n16].to(torch.bfloat16))  # the copy is the updated weights, rounded as .to
    before = [t.clone() for t in a]
    adamw_step_triton_(*a, **HP, step=step, n_decay=n_decay, grad_scale=scale, found_inf=torch.tensor(1.0))
    assert all(torch.equal(x, y) for x, y in zip(a, before))  # the skip flag leaves every buffer as it was


def _cfg(optimizer, moe=False, clip=0.05, dtype="fp32"):
    cfg = Config(device="cpu")
    cfg.model = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64, kernels="torch")
    if moe:
        cfg.model.moe_experts, cfg.model.moe_top_k, cfg.model.moe_every = 4, 2, 2
    cfg.train.grad_clip, cfg.train.optimizer, cfg.train.dtype = clip, optimizer, dtype
    return cfg


def _run(optimizer, moe=False, steps=4, async_step=False, dtype="fp32", engine_out=None):
    cfg = _cfg(optimizer, moe, dtype=dtype)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    engine.async_step = async_step  # the GPU path: the divisor and the skip flag as tensors, the norm read last
    amp = autocast(cfg, torch.device("cpu"))[0]
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for micro in range(2):
            x = torch.randint(0, 64, (2, 8), generator=gen)
            with engine.no_sync(micro == 0), amp():
                _, loss = model(x, x)
            engine.backward(loss / 2)
        norms.append(float(engine.step(1e-2)))
    if engine_out is not None:
        engine_out.append(engine)
    return model, norms


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("async_step", [False, True], ids=["norm-first", "norm-last"])
def test_flat_engine_matches_single_device(moe, async_step):
    ref, n_ref = _run("torch", moe)
    out = []
    flat, n_flat = _run("flat", moe, async_step=async_step, engine_out=out)
    assert isinstance(out[0], FlatSingle)
    assert n_flat == pytest.approx(n_ref, rel=1e-5) and n_ref[0] > 0.05  # clipping was active
    for (name, a), b in zip(ref.named_parameters(), flat.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    opt = out[0].optimizer
    assert float(opt.step_t) == 4
    assert all(p.data_ptr() - opt.p.data_ptr() == 4 * o for p, o in zip(opt.params, opt.offsets))  # views of it
    assert all(o % 64 == 0 for o in opt.offsets) and opt.n_decay % 64 == 0  # aligned views, wide kernel accesses


def test_linear_weight_gradients_land_in_place():
    cfg = _cfg("flat")
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    engine.backward(loss)
    g = engine.optimizer.g
    inside = lambda t: g.data_ptr() <= t.data_ptr() < g.data_ptr() + 4 * g.numel()  # noqa: E731
    assert all(inside(p.grad) for p in model.parameters())
    linear = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith(("c_attn", "c_fc", "c_proj")))
    assert engine.copied == sum(p.numel() for p in model.parameters()) - linear  # only the rest was copied
    norm = engine.step(1e-2)
    assert norm > 0 and all(p.grad is None for p in model.parameters())


def test_shadow_is_what_the_matmuls_read_and_a_stale_one_never_is():
    cfg = _cfg("flat", dtype="bf16")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    amp = autocast(cfg, torch.device("cpu"))[0]
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        with amp():
            _, loss = model(x, x)
        engine.backward(loss)
        engine.step(1e-2)
    w = model.transformer.h[0].mlp.c_fc.weight
    assert torch.equal(w.shadow, w.detach().to(torch.bfloat16))
    with amp(), torch.no_grad():
        assert matmul_weight(w) is w.shadow
        logits = model(x)[0]
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        w.add_(1.0)  # a write outside the optimizer: the shadow is stale
    with amp(), torch.no_grad():
        assert matmul_weight(w) is w
    engine.load_model_state_dict(saved)  # a load writes the shadow again
    with amp(), torch.no_grad():
        assert matmul_weight(w) is w.shadow and torch.equal(w.shadow, saved["transformer.h.0.mlp.c_fc.weight"].to(
            torch.bfloat16))
        torch.testing.assert_close(model(x)[0], logits, rtol=0, atol=0)
        engine.close()  # no shadows: autocast casts the same values
        assert matmul_weight(w) is w
        torch.testing.assert_close(model(x)[0], logits, rtol=0, atol=0)


@pytest.mark.parametrize("src,dst", [("flat", "torch"), ("torch", "flat")])
def test_checkpoints_move_between_optimizers(src, dst):
    ref, _ = _run(src, steps=4)
    out = []
    _, _ = _run(src, steps=2, engine_out=out)
    sd, msd = out[0].state_dict(), out[0].model_state_dict()
    assert sd["format"] == "full" and sd["step"] == 2
    cfg = _cfg(dst)
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    engine.load_model_state_dict({k: v.clone() for k, v in msd.items()})
    engine.load_state_dict(sd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # the same batches as _run: the first two steps' are drawn and dropped
        xs = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(2)]
        if _ < 2:
            continue
        for micro, x in enumerate(xs):
            with engine.no_sync(micro == 0):
                _, loss = model(x, x)
            engine.backward(loss / 2)
        engine.step(1e-2)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_flat_refuses_layouts_with_replicas_or_a_pipeline():
    cfg = _cfg("flat")
    cfg.parallel.dp = 2
    with pytest.raises(ConfigError, match="train.optimizer=flat runs one replica"):
        check_layout(cfg, 2, "cpu")
    cfg.parallel.dp, cfg.parallel.pp = 1, 2
    cfg.model.n_layer = 2
    with pytest.raises(ConfigError, match="pp=2"):
        check_layout(cfg, 2, "cpu")
    cfg.train.optimizer = "adam"
    with pytest.raises(ConfigError, match="train.optimizer must be torch|flat"):
        cfg.check()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_flat_matches_fused_adamw_on_gpu(graph):
    from nanopara.graph import GraphedMicroStep
    out = {}
    for opt in ("torch", "flat"):
        cfg = Config(device="cuda")
        cfg.model = ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=512)
        cfg.train.optimizer, cfg.train.grad_clip = opt, 0.5
        torch.manual_seed(0)
        model = GPT(cfg.model).cuda()
        engine = build_engine(model, Mesh.build(device="cuda"), cfg)
        amp = autocast(cfg, torch.device("cuda"))[0]
        step = GraphedMicroStep(model, amp, 1.0, engine, overwrite=True) if graph else None
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(6):
            x = torch.randint(0, 512, (4, 64), device="cuda", generator=gen)
            if step is not None:
                loss = step(x, x)
            else:
                with amp():
                    _, loss = model(x, x)
                engine.backward(loss)
            losses.append(float(loss))
            engine.step(1e-3)
        out[opt] = losses, [p.detach().clone() for p in model.parameters()]
    assert out["flat"][0] == pytest.approx(out["torch"][0], rel=2e-3)
    for a, b in zip(out["torch"][1], out["flat"][1]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)


def test_expert_weights_read_their_shadow_too():
    """The grouped GEMMs' autograd Functions cast the expert weights with kernels.grouped_gemm.as_dtype: the
    shadow while it is current, a cast otherwise."""
    from kernels.grouped_gemm import as_dtype
    cfg = _cfg("flat", moe=True, dtype="bf16")
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    w = model.transformer.h[1].mlp.experts.c_fc.weight  # (E, 4C, C): decayed, so it has a shadow
    assert as_dtype(w, torch.bfloat16) is w.shadow and torch.equal(w.shadow, w.detach().to(torch.bfloat16))
    assert as_dtype(w, torch.float16) is not w.shadow  # another dtype: a cast
    with torch.no_grad():
        w.mul_(2.0)
    assert as_dtype(w, torch.bfloat16) is not w.shadow
    engine.optimizer.refresh_shadow()
    assert as_dtype(w, torch.bfloat16) is w.shadow and torch.equal(w.shadow, w.detach().to(torch.bfloat16))


@pytest.mark.parametrize("linear", [False, True], ids=["mlp", "linear"])
def test_grouped_wgrad_writes_into_the_engines_slot(linear):
    """The grouped GEMMs' backward (interpreter) writes each expert weight's dW into `w.grad_into(w)` (an engine's
    slot: autograd keeps it as w.grad, no copy), the same values as without one; a later micro-step (w.grad set)
    accumulates as before."""
    import kernels.grouped_gemm as gg
    E, C, H, sizes = 3, 16, 24, [5, 0, 9]
    offsets = gg.offsets_of(sizes, "cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), C, generator=gen)
    shapes = [(E, H, C), (E, H), (E, C, H), (E, C)][:2 if linear else 4]

    def run(dests: bool):
        ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)) * 0.1)
              for i, s in enumerate(shapes)]
        slots = {}
        if dests:
            for p in ps[::2]:
                slots[id(p)] = torch.full(p.shape, float("nan"))
                p.grad_into = lambda w: None if w.grad is not None else slots[id(w)].view_as(w)
        for _ in range(2):  # two micro-steps: the second accumulates into the first's
            y = gg.grouped_linear_triton(x, *ps, offsets) if linear else gg.grouped_mlp_triton(x, *ps, offsets)
            y.square().sum().backward()
        return ps, slots
    ref, _ = run(False)
    got, slots = run(True)
    for p in got[::2]:
        assert p.grad.data_ptr() == slots[id(p)].data_ptr()
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


_ADAMW_PTX = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import adamw
fn = adamw._adamw_kernel
out = {}
for name, on in (("plain", False), ("flat", True)):
    consts = dict(HAS_MASK=False, HAS_P16=on, HAS_GS=on, HAS_SKIP=on, DEVICE_STEP=on, BLOCK=adamw.BLOCK)
    ptrs = dict(P="*fp32", G="*fp32", M="*fp32", V="*fp32", MASK="*u8", P16="*i16", GS="*fp32", SKIP="*fp32",
                STEP="*fp32")
    sig = {n: ptrs.get(n, "i64" if n in ("n", "n_decay", "n16") else "fp32") for n in fn.arg_names if n not in consts}
    attrs = {(list(fn.arg_names).index(n),): [["tt.divisibility", 16]] for n in ("P", "G", "M", "V", "P16", "n",
                                                                                "n_decay", "n16")}
    src = ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[name] = dict(v4_loads=ptx.count("ld.global.v4.b32"), v4_stores=ptx.count("st.global.v4.b32"),
                     stores=ptx.count("st.global"))
print(json.dumps(out))
"""


def test_adamw_kernel_compiles_for_hopper_with_wide_accesses():
    """kernels/adamw.py's kernel with every flat.py option on, compiled for sm_90 here (no GPU): it compiles (the
    skip flag's early return included) and p, g, m, v still move in 16-byte accesses, the bf16 copy too."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile real kernels
    proc = subprocess.run([sys.executable, "-c", _ADAMW_PTX], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(got)
    plain, flat = got["plain"], got["flat"]
    assert plain["v4_loads"] >= 4 * 4 and plain["v4_stores"] >= 3 * 4, plain  # 16 elements a thread: 4 x v4 each
    assert flat["v4_loads"] >= plain["v4_loads"] and flat["v4_stores"] >= plain["v4_stores"] + 2, flat
