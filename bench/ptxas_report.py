"""Registers, spills and shared memory of the LayerNorm kernels' tiles on sm_90a (H100/H200), without a GPU.

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

_FWD = dict(X="*bf16", R="*fp32", H="*fp32", Y="*bf16", W="*fp32", B="*fp32", MEAN="*fp32", RSTD="*fp32",
            M="i32", C="i32", stride_x="i32", stride_r="i32", stride_h="i32", stride_y="i32", eps="fp32")
_BWD = dict(X="*bf16", DY="*bf16", DH="*fp32", DX="*bf16", W="*fp32", MEAN="*fp32", RSTD="*fp32",
            DW_PART="*fp32", DB_PART="*fp32", M="i32", C="i32", ROWS_PER_GROUP="i32", stride_x="i32",
            stride_dy="i32", stride_dh="i32", stride_dx="i32")

# name: (kernel, constexprs, num_warps, register bound). Bounds: measured (triton 3.6) + a few registers, or the
# budget that keeps the intended programs resident (65536 registers per SM).
CASES = {
    # the model's narrow rows, non-persistent (one tile a program): 80 / 72 registers measured
    "fwd 2x768 w2 one-tile": ("fwd", dict(ADD_RESIDUAL=False, BLOCK_M=2, BLOCK_C=1024, STAGES=1,
                                          PROGRAMS_PER_SM=0), 2, 84),
    "fwd 4x768+res w4 one-tile": ("fwd", dict(ADD_RESIDUAL=True, BLOCK_M=4, BLOCK_C=1024, STAGES=1,
                                              PROGRAMS_PER_SM=0), 4, 76),
    # wide rows, persistent, 2 programs of 256 threads per SM: <= 128
    "fwd 1x8192 w8 S3 P2": ("fwd", dict(ADD_RESIDUAL=False, BLOCK_M=1, BLOCK_C=8192, STAGES=3, PROGRAMS_PER_SM=2),
                            8, 128),
    # backward tiles the autotuner picked on an H200 (16384x768, 32768x768+res, 4096x8192): no spills
    "bwd 8x768 w4 S3": ("bwd", dict(HAS_DH=False, BLOCK_M=8, BLOCK_C=1024, STAGES=3), 4, 255),
    "bwd 2x768+dh w4 S3": ("bwd", dict(HAS_DH=True, BLOCK_M=2, BLOCK_C=1024, STAGES=3), 4, 255),
    "bwd 1x8192 w8 S3": ("bwd", dict(HAS_DH=False, BLOCK_M=1, BLOCK_C=8192, STAGES=3), 8, 255),
}


def pipelined_bytes(kind: str, consts: dict) -> int:
    """Shared memory the loop's cp.async buffers need: STAGES - 1 tiles of each row stream (bf16 x / dy, fp32
    residual or dh). A case compiled with less means Triton did not pipeline the tile loads."""
    per_elem = 2 + (4 if consts.get("ADD_RESIDUAL") else 0) if kind == "fwd" else 2 + 2 + (4 if consts["HAS_DH"] else 0)
    return (consts["STAGES"] - 1) * consts["BLOCK_M"] * consts["BLOCK_C"] * per_elem


def usage(fn, signature: dict, constexprs: dict, num_warps: int) -> dict:
    """{'regs', 'spill_bytes', 'smem_bytes'} of fn compiled for sm_90a."""
    names = list(fn.arg_names)
    divisible = [n for n, t in signature.items() if t.startswith("*") or n.startswith(("stride", "C", "ROWS"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
            "smem_bytes": compiled.metadata.shared}


def report() -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("ptxas_report compiles real kernels: run it without TRITON_INTERPRET=1")
    from kernels import layernorm as ln
    kernels = {"fwd": (ln._layernorm_fwd_kernel.fn, _FWD), "bwd": (ln._layernorm_bwd_kernel.fn, _BWD)}
    rows = []
    for name, (kind, consts, warps, bound) in CASES.items():
        fn, sig = kernels[kind]
        rows.append({"case": name, "bound": bound, "pipelined_bytes": pipelined_bytes(kind, consts),
                     **usage(fn, sig, {"HAS_BIAS": True, **consts}, warps)})
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
        print(f"{r['case']:>28}: {r['regs']:3d} registers (bound {r['bound']}), spills {r['spill_bytes']} B, "
              f"shared {r['smem_bytes']} B (pipelined tiles need {r['pipelined_bytes']})")


if __name__ == "__main__":
    main()
