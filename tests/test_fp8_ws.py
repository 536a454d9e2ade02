"""kernels/fp8_matmul_ws.py, the warp-specialised Gluon FP8 GEMM with promotion every 128 K (Hopper only).

CPU: every scaling's default config compiles for sm_90a with no spill and no wgmma that ptxas serialised or waited
on by itself (the failure modes of the Triton kernel's promoted K loop), within the shared memory a CTA may use.
GPU: each scaling and config against the reference and against the Triton kernel's precise path, at shapes that are
no tile multiple (M, N, K past 64 / 128 / 128 boundaries) and at a gpt_1b gradient shape, and the dispatch flag."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

_COMPILE = """
import json, sys, torch
sys.path.insert(0, "bench")
import ptxas_report as pr
from kernels import fp8_matmul_ws as ws
rows = {}
for name, block, b_rows, out in (("precise", False, 1, torch.bfloat16), ("precise_fp32_out", False, 1, torch.float32),
                                 ("block", True, 128, torch.bfloat16), ("block_1x128", True, 1, torch.float32)):
    cfg = ws.CONFIGS["block" if block else "precise"][0]
    rows[name] = dict(cfg=cfg, **pr.gluon_fp8_usage(cfg, block, b_rows, out))
print(json.dumps(rows))
"""


@pytest.mark.timeout_s(300)
def test_default_configs_compile_without_spills_or_serialised_wgmma():
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile real kernels
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this triton wheel ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows["precise"]["cfg"][2] == 1  # one wgmma in flight while the last one is promoted
    for name, r in rows.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert not r["ptxas_notes"], (name, r)  # C7515: every wgmma serialised; C7517: an injected wait
        assert r["smem_bytes"] <= 232448, (name, r)  # sm_90's 227 KB a CTA: else it cannot launch


def _operands(M, N, K, mode, a_dtype=E4M3):
    from kernels.fp8_quant import fp8_quantize
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-2, 2, K, device="cuda")
    w = torch.randn(N, K, device="cuda", generator=g)
    ga, gb = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ("1x128", "128x128"),
              "block_1x128": ("1x128", "1x128")}[mode]
    A, B = fp8_quantize(x, a_dtype, ga), fp8_quantize(w, E4M3, gb)
    return A.q, B.q, A.s, B.s


@pytest.mark.gpu
@pytest.mark.timeout_s(600)
@pytest.mark.parametrize("mode", ["tensor", "row", "block", "block_1x128"])
@pytest.mark.parametrize("M,N,K", [(1000, 1040, 1104), (130, 136, 128), (8192, 2048, 2048)])
def test_gpu_ws_gemm_matches_reference_and_triton(mode, M, N, K):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warp-specialised wgmma kernel: Hopper only")
    from kernels import fp8_matmul as fm
    from kernels import fp8_matmul_ws as ws
    a, b, sa, sb = _operands(M, N, K, mode, E5M2 if mode == "block_1x128" else E4M3)
    bias = torch.randn(N, device="cuda")
    block_scaled, b_rows, strides = fm._scaling(a, b, sa, sb)
    want = fm.fp8_matmul_ref(a, b, sa, sb, bias, torch.float32)
    triton_precise = fm.fp8_matmul_triton(a, b, sa, sb, bias, torch.float32, fast_accum=False)
    tol = dict(rtol=1e-4, atol=5e-4 * want.abs().max().item())  # test_fp8's measured wgmma error (2.05e-4 max)
    for cfg in ws.CONFIGS["block" if block_scaled else "precise"]:
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)  # every element must be written
            ws.launch(a, b, out, bias, sa, sb, block_scaled, b_rows, strides, config=cfg)
            msg = lambda m: f"{mode} {cfg} {out_dtype}: {m}"  # noqa: E731
            if out_dtype == torch.float32:
                torch.testing.assert_close(out, want, **tol, msg=msg)
                # the same 128-wide steps summed in the same order as the Triton kernel's promotion
                torch.testing.assert_close(out, triton_precise, rtol=1e-6, atol=1e-6 * want.abs().max().item(),
                                           msg=msg)
            else:
                torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=tol["atol"], msg=msg)


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
def test_gpu_ws_dispatch_flag(monkeypatch):
    """NANOPARA_FP8_WS=1 (fp8_matmul.WS) routes precise and block GEMMs to the Gluon kernel, fast ones not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warp-specialised wgmma kernel: Hopper only")
    from kernels import fp8_matmul as fm
    from kernels import fp8_matmul_ws as ws
    calls = []
    real = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fm, "WS", True)
    a, b, sa, sb = _operands(256, 256, 512, "tensor")
    want = fm.fp8_matmul_ref(a, b, sa, sb, None, torch.float32)
    got = fm.fp8_matmul(a, b, sa, sb, out_dtype=torch.float32, fast_accum=False)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4 * want.abs().max().item())
    fm.fp8_matmul(a, b, sa, sb, out_dtype=torch.float32, fast_accum=True)
    assert calls == [1]
    a, b, sa, sb = _operands(256, 256, 512, "block")
    fm.fp8_matmul(a, b, sa, sb, out_dtype=torch.float32)
    assert calls == [1, 1]


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("fp8", ["tensor", "row"])
def test_gpu_graphed_training_with_ws_matches_the_triton_path(fp8):
    """The trainer's graphed FP8 step (parallelize sets recipe.ws under a graph) against the eager Triton step: the
    same losses and weights (the two kernels sum the same 128-wide steps in the same order)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warp-specialised wgmma kernel: Hopper only")
    from tests.test_graph import _train
    eager_losses, eager_w = _train(False, 4, 2, fp8)
    ws_losses, ws_w = _train(True, 4, 2, fp8, ws=True)
    assert ws_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-5)
    assert ws_losses[-1] < ws_losses[0] - 0.1
    for k in eager_w:
        torch.testing.assert_close(ws_w[k], eager_w[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_parallelize_turns_ws_on_with_the_graph(monkeypatch):
    """parallelize: recipe.ws follows the step's CUDA graph (host cost paid once, at capture), off in eager."""
    from nanopara import parallel
    from nanopara.mesh import Mesh
    from nanopara.model import GPT
    from nanopara.presets import PRESETS
    cfg = PRESETS["tiny"]()
    cfg.model.n_layer = 1
    cfg.train.fp8, cfg.train.fp8_filter = "tensor", "all"
    trainer = parallel.parallelize(GPT(cfg.model), Mesh.build(device="cpu"), cfg)
    assert trainer.fp8 is not None and trainer.fp8.recipe.ws is False  # CPU: no graph
    monkeypatch.setattr(parallel, "use_cuda_graph", lambda *a, **k: (True, ""))
    monkeypatch.setattr(parallel, "Trainer", lambda *a, **k: k)  # the graph itself needs CUDA: stop before it
    assert parallel.parallelize(GPT(cfg.model), Mesh.build(device="cpu"), cfg)["fp8"].recipe.ws is True
