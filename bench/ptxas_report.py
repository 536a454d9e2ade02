"""Registers, spills and shared memory of the LayerNorm, attention, cross-entropy and grouped-GEMM tiles on sm_90a,
no GPU.

    python bench/ptxas_report.py [--json]

Each case compiles one kernel specialisation with Triton (target cuda 90, pointers and strides 16-divisible, as
at a real launch) and runs Triton's bundled ptxas -v on the PTX. Why it matters: these kernels are memory bound,
their speed follows the bytes in flight per SM, and for the non-pipelined tiles that is how many programs fit in
the register file. A loop around the one-tile forward raised it from 80 to 96 registers a thread and cost 13% at
16384 x 768 on an H200 (bench/sweep_layernorm.py); nothing on CPU showed it. tests/test_registers.py runs this
and holds each case to its bound. Needs no GPU; must run without TRITON_INTERPRET (it compiles real kernels).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

_LN_FWD = dict(X="*bf16", R="*fp32", H="*fp32", Y="*bf16", W="*fp32", B="*fp32", MEAN="*fp32", RSTD="*fp32",
               M="i32", C="i32", stride_x="i32", stride_r="i32", stride_h="i32", stride_y="i32", eps="fp32")
_LN_BWD = dict(X="*bf16", DY="*bf16", DH="*fp32", DX="*bf16", W="*fp32", MEAN="*fp32", RSTD="*fp32",
               DW_PART="*fp32", DB_PART="*fp32", M="i32", C="i32", ROWS_PER_GROUP="i32", stride_x="i32",
               stride_dy="i32", stride_dh="i32", stride_dx="i32")
_ATTN_PTRS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "DELTA"}
_CE_FWD = dict(Z="*bf16", DZ="*bf16", T="*i64", LOSS="*fp32", LSE="*fp32", SCALE="*fp32", stride_z="i32",
               stride_dz="i32", n_vocab="i32", n_cols_padded="i32", ignore_index="i32")

# name: (kernel, constexprs, num_warps, num_stages, register bound, spill bound). Register bounds: measured with
# triton 3.6 plus a few, or what keeps the intended programs resident (65536 registers per SM).
CASES = {
    # LayerNorm, the model's narrow rows, non-persistent (one tile a program): 80 / 72 registers measured
    "ln fwd 2x768 w2 one-tile": ("ln_fwd", dict(ADD_RESIDUAL=False, BLOCK_M=2, BLOCK_C=1024, STAGES=1,
                                                PROGRAMS_PER_SM=0), 2, 3, 84, 0),
    "ln fwd 4x768+res w4 one-tile": ("ln_fwd", dict(ADD_RESIDUAL=True, BLOCK_M=4, BLOCK_C=1024, STAGES=1,
                                                    PROGRAMS_PER_SM=0), 4, 3, 76, 0),
    # wide rows, persistent, 2 programs of 256 threads per SM: <= 128
    "ln fwd 1x8192 w8 S3 P2": ("ln_fwd", dict(ADD_RESIDUAL=False, BLOCK_M=1, BLOCK_C=8192, STAGES=3,
                                              PROGRAMS_PER_SM=2), 8, 3, 128, 0),
    # backward tiles the autotuner picked on an H200 (16384x768, 32768x768+res, 4096x8192): no spills
    "ln bwd 8x768 w4 S3": ("ln_bwd", dict(HAS_DH=False, BLOCK_M=8, BLOCK_C=1024, STAGES=3), 4, 3, 255, 0),
    "ln bwd 2x768+dh w4 S3": ("ln_bwd", dict(HAS_DH=True, BLOCK_M=2, BLOCK_C=1024, STAGES=3), 4, 3, 255, 0),
    "ln bwd 1x8192 w8 S3": ("ln_bwd", dict(HAS_DH=False, BLOCK_M=1, BLOCK_C=8192, STAGES=3), 8, 3, 255, 0),
    # attention, causal, the tiles tuned on an H200 (kernels/attention.py _TILES). D=64, 128 threads: <= 168 keeps
    # 3 programs per SM (forward 128, dq 159 measured), dk/dv 247 keeps 2
    "attn fwd D64 64x64 w4 s4": ("attn_fwd", dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64), 4, 4, 168, 0),
    "attn dq D64 64x64 w4 s3": ("attn_dq", dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64), 4, 3, 168, 0),
    "attn dkdv D64 64x64 w4 s3": ("attn_dkdv", dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64), 4, 3, 255, 0),
    # D=128 loads its tiles through TMA (kernels/attention.py TMA_MIN_BLOCK_D): no (BLOCK_D, BLOCK_N) pointer
    # tensors, so the dk/dv tile that spilled 28 B with pointer loads (255 registers) needs 243 and none
    "attn fwd D128 128x128 w8 s3 tma": ("attn_fwd", dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, TMA=True),
                                        8, 3, 255, 0),
    "attn dq D128 128x64 w8 s3 tma": ("attn_dq", dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, TMA=True), 8, 3, 255, 0),
    "attn dkdv D128 32x64 w4 s4 tma": ("attn_dkdv", dict(HEAD_DIM=128, BLOCK_M=32, BLOCK_N=64, TMA=True),
                                       4, 4, 255, 0),
    # fused cross-entropy (kernels/cross_entropy.py constants): both vocab walks pipelined (cp.async); 47 measured
    "ce fwd+grad 2048 w4 S3": ("ce_fwd", dict(WRITE_GRAD=True, BLOCK_V=2048, STAGES=3), 4, 3, 72, 0),
}


def pipelined_bytes(kind: str, consts: dict) -> int:
    """Shared memory the loop's cp.async buffers need: LayerNorm, STAGES - 1 tiles of each row stream (bf16 x /
    dy, fp32 residual or dh); cross-entropy, STAGES - 1 bf16 vocab chunks. A case compiled with less means Triton
    did not pipeline the tile loads. 0 otherwise."""
    if kind == "ce_fwd":  # STAGES - 1 bf16 vocab chunks
        return (consts["STAGES"] - 1) * consts["BLOCK_V"] * 2
    if kind == "ln_fwd":
        return (consts["STAGES"] - 1) * consts["BLOCK_M"] * consts["BLOCK_C"] * (6 if consts["ADD_RESIDUAL"] else 2)
    if kind == "ln_bwd":
        return (consts["STAGES"] - 1) * consts["BLOCK_M"] * consts["BLOCK_C"] * (8 if consts["HAS_DH"] else 4)
    return 0


def _attention_signature(fn, consts: dict) -> tuple[dict, dict]:
    """Argument types of an attention kernel as the model launches it (bf16 q/k/v/o and grads, fp32 lse/delta,
    int32 sizes and strides), and the last-dim strides, which the JIT specialises as the constant 1."""
    sig, ones = {}, {}
    for n in fn.arg_names:
        if n in consts:
            continue
        if n.startswith("stride") and n.endswith("d"):
            ones[n] = 1
        elif n in _ATTN_PTRS:
            sig[n] = "*fp32" if n in ("LSE", "DELTA") else "*bf16"
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
    return sig, ones


def _ptxas(compiled) -> dict:
    """{'regs', 'spill_bytes', 'smem_bytes'} of a kernel compiled for sm_90a: ptxas -v on its PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
            "smem_bytes": compiled.metadata.shared}


def usage(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """{'regs', 'spill_bytes', 'smem_bytes'} of fn compiled for sm_90a. Pointers, strides and widths are
    16-divisible, as at a real launch (without that hint Triton cannot use cp.async for 2-byte elements)."""
    names = list(fn.arg_names)
    divisible = [n for n, t in signature.items()
                 if t.startswith("*") or n.startswith(("stride", "C", "ROWS")) or n in ("N", "K", "n_cols_padded")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return _ptxas(compiled)


SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB): a kernel needing more cannot launch


def gluon_attention_usage(kind: str, head_dim: int, cfg: tuple, causal: bool = True) -> dict:
    """{'regs', 'spill_bytes', 'smem_bytes'} of a kernels/attention_hopper.py kernel ("fwd": the forward for one
    CONFIGS candidate, "dkdv": the dK/dV kernel for one BWD_CONFIGS entry), compiled for sm_90a with bf16 host TMA
    descriptors of the model's shapes. 'regs' is the launch-level count (12 warps share the 64K registers: 168);
    setmaxnreg then moves the loader warp's to the two consumer warpgroups (240 each), and ptxas reports a spill
    wherever a partition does not fit its share."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from kernels import attention_hopper as ah

    def desc(rows, cols=head_dim, dtype=torch.bfloat16, gdtype=gl.bfloat16):
        x = torch.empty(16 * 1024, cols, dtype=dtype)  # stands in for the model's activations
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gdtype)
        return mangle_type(TensorDescriptor(x, list(x.shape), [cols, 1], [rows, cols], layout))
    if kind == "fwd":
        fn, (block_n, num_buf, pingpong) = ah._attn_fwd_ws_kernel, cfg
        descs = dict(q_desc=desc(ah.ROWS), k_desc=desc(block_n), v_desc=desc(block_n))
        consts = dict(BLOCK_N=block_n, NUM_BUF=num_buf, CAUSAL=causal, PINGPONG=pingpong)
        ptrs = {"O": "*bf16", "LSE": "*fp32"}
    else:
        fn, (block_q, num_buf) = ah._attn_bwd_dkdv_ws_kernel, cfg
        vec = desc(1, block_q, torch.float32, gl.float32)
        descs = dict(q_desc=desc(block_q), do_desc=desc(block_q), k_desc=desc(ah.ROWS), v_desc=desc(ah.ROWS),
                     l_desc=vec, d_desc=vec)
        consts = dict(BLOCK_Q=block_q, NUM_BUF=num_buf, CAUSAL=causal)
        ptrs = {"DK": "*bf16", "DV": "*bf16"}
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(descs, **ptrs, qk_scale="fp32", **({"sm_scale": "fp32"} if kind != "fwd" else {}))
    sig.update({k: "constexpr" for k in consts})
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    compiled = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return _ptxas(compiled)


def gluon_fp8_usage(cfg: tuple, block_scaled: bool, b_rows: int = 1, out_dtype=None) -> dict:
    """{'regs', 'spill_bytes', 'smem_bytes', 'ptxas_notes'} of kernels/fp8_matmul_ws.py's kernel for one CONFIGS
    entry, compiled for sm_90a with host TMA descriptors (e4m3 A, e5m2 B, bf16 out unless given). 'ptxas_notes':
    the C75xx codes ptxas printed (C7515: every wgmma serialised; C7517: a wait it injected). B's 1x128 scales
    (b_rows 1) come with unit column stride, as launch() passes them (Triton specialises a stride of 1)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from kernels import fp8_matmul_ws as ws
    a = torch.empty(4096, 2048, dtype=torch.float8_e4m3fn)
    b = torch.empty(2048, 2048, dtype=torch.float8_e5m2)
    descs = ws.descriptors(a, b, torch.empty(4096, 2048, dtype=out_dtype or torch.bfloat16), cfg[0])
    fn = ws._fp8_matmul_ws_kernel
    consts = dict(BLOCK_N=cfg[0], NUM_BUF=cfg[1], LAG=cfg[2], BLOCK_SCALED=block_scaled, B_SCALE_ROWS=b_rows,
                  HAS_BIAS=False, **({"stride_sbn": 1} if block_scaled and b_rows == 1 else {}))
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(zip(("a_desc", "b_desc", "c_desc"), map(mangle_type, descs)), SA="*fp32", SB="*fp32", BIAS="*fp32")
    sig.update({k: "constexpr" for k in consts})
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("SA", "SB", "BIAS")}
    compiled = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    return {**_ptxas(compiled), "ptxas_notes": sorted(set(re.findall(r"\((C75\d\d)\)", log)))}


def report() -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("ptxas_report compiles real kernels: run it without TRITON_INTERPRET=1")
    from kernels import attention as at
    from kernels import cross_entropy as ce
    from kernels import layernorm as ln
    kernels = {"ln_fwd": ln._layernorm_fwd_kernel.fn, "ln_bwd": ln._layernorm_bwd_kernel.fn,
               "attn_fwd": at._attn_fwd_kernel.fn, "attn_dq": at._attn_bwd_dq_kernel.fn,
               "attn_dkdv": at._attn_bwd_dkdv_kernel.fn, "ce_fwd": ce._ce_fwd_kernel}
    rows = []
    for name, (kind, consts, warps, stages, reg_bound, spill_bound) in CASES.items():
        fn = kernels[kind]
        if kind.startswith("ln"):
            sig, consts = (_LN_FWD if kind == "ln_fwd" else _LN_BWD), {"HAS_BIAS": True, **consts}
        elif kind == "ce_fwd":
            sig = _CE_FWD
        else:
            consts = {"BLOCK_D": consts["HEAD_DIM"], "CAUSAL": True, "TMA": False, **consts}
            if kind == "attn_dq":
                consts["GROUP"] = 8
            sig, ones = _attention_signature(fn, consts)
            consts = {**consts, **ones}
        rows.append({"case": name, "reg_bound": reg_bound, "spill_bound": spill_bound,
                     "pipelined_bytes": pipelined_bytes(kind, consts), **usage(fn, sig, consts, warps, stages)})
    # the Gluon forward (Hopper): every candidate config, no spills, and its K/V ring + Q slots within the 227 KB.
    # 128 x 128 S / P / O tiles at D128 spill 8-20 bytes: one or two scalars stored before an item's last P V and
    # reloaded in its epilogue, outside the key-block loop (nvdisasm of the sm_90a cubin), so once per
    # 16 blocks at T4096; a spill inside the loop would need more than that
    from kernels import attention_hopper as ah
    for d, cands in ah.CONFIGS.items():
        for cfg in [c for c in cands if c != ah.TRITON]:
            ring = (2 * cfg[1] + 1) * cfg[0] * d * 2 + 4 * ah.ROWS * d * 2  # NUM_BUF K + NUM_BUF + 1 V + 2 x 2 Q
            rows.append({"case": f"gluon attn fwd D{d} {cfg[0]}x{cfg[1]}{' pingpong' if cfg[2] else ''}",
                         "reg_bound": 168, "spill_bound": 24 if cfg[0] * d >= 128 * 128 else 0,
                         "pipelined_bytes": ring, "smem_bound": SMEM_LIMIT, **gluon_attention_usage("fwd", d, cfg)})
    for d, cands in ah.BWD_CONFIGS.items():
        for cfg in cands:  # NUM_BUF x (Q + dO) + 2 K/V slots x 2 halves x (K + V)
            ring = cfg[1] * 2 * cfg[0] * d * 2 + 8 * ah.ROWS * d * 2
            rows.append({"case": f"gluon attn dkdv D{d} {cfg[0]}x{cfg[1]}", "reg_bound": 168, "spill_bound": 0,
                         "pipelined_bytes": ring, "smem_bound": SMEM_LIMIT,
                         **gluon_attention_usage("dkdv", d, cfg)})
    # the MoE grouped GEMM's TMA forward (kernels/grouped_gemm.py), tile and K loops flattened into one pipelined
    # loop: the autotuner's forward candidates must compile for sm_90 without real spills (the GELU' dgrad
    # epilogue spills 396-648 B there, so _flatten_prune keeps it unflattened). Shared memory: stages x (A + B)
    # tiles of the pipeline plus the half-width store tile
    from kernels import grouped_gemm as gg
    sig = dict(A="*bf16", B="*bf16", BIAS="*bf16", C="*bf16", PRE="*bf16", OFFSETS="*i32", N="i32", K="i32",
               E="i32", R_BUCKET="i32", stride_am="i32", stride_be="i32", stride_bd1="i32", stride_biase="i32",
               stride_cm="i32", stride_pm="i32")
    for (bm, bn, warps, stages), epi, spill in (((128, 256, 8, 3), 0, 0), ((128, 256, 8, 3), 1, 16),
                                               ((128, 128, 8, 4), 1, 0), ((128, 64, 4, 4), 1, 0)):
        consts = dict(HAS_BIAS=True, EPILOGUE=epi, INPUT_PRECISION="ieee", TRANS_B=True, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=64, GROUP_M=8, PROGRAMS_PER_SM=1, FLATTEN=True)
        rows.append({"case": f"grouped fwd{' +gelu' if epi else ''} {bm}x{bn} w{warps} s{stages} flat",
                     "reg_bound": 255, "spill_bound": spill, "smem_bound": SMEM_LIMIT,
                     "pipelined_bytes": (stages - 1) * (bm + bn) * 64 * 2,
                     **usage(gg._grouped_mm_tma_kernel.fn, {n: sig[n] for n in sig if n not in consts}, consts,
                             warps, stages)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = ap.parse_args()
    rows = report()
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['case']:>36}: {r['regs']:3d} registers (bound {r['reg_bound']}), spills {r['spill_bytes']} B "
              f"(bound {r['spill_bound']}), shared {r['smem_bytes']} B (pipelined tiles need {r['pipelined_bytes']})")


if __name__ == "__main__":
    main()
