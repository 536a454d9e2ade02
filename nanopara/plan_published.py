"""Published H100 runs beside the planner's prediction for the same configuration (notes/planner.md's table).

The fabric is gpus.FABRIC, fixed from published link figures before these runs were compared (both clusters: 8 GPUs
a host on NVLink, 400 Gb/s RDMA a GPU); the GPU table is nanopara's (H100 SXM). Other trainers run their own
kernels: cuDNN attention and no host floor (`kernels="cudnn"`), GEMMs at the table's cuBLAS rates. Assumptions
made before comparing, stated per row: Llama 3's interleaved schedule at v = 4 (two-block chunks of its ~8 blocks a
stage), activation checkpointing the first of none / selective / full that fits (as plan_search), FSDP as ZeRO-3
(ZeRO-1 beside a pipeline: nanopara's pipelines take no ZeRO-2/3). torchtitan's GPUs are 96 GB HBM2e H100s at
500 W (its benchmark says its MFU is understated for that reason): the prediction uses the 700 W SXM table, so
it should read high there. Sources: Dubey et al. 2024 (arXiv 2407.21783) Table 4, and torchtitan's H100
benchmark page llama3_h100_202412 (pytorch/torchtitan, Dec 2024; Float8 rows use the fp8 table).
"""
from __future__ import annotations

from dataclasses import replace

from nanopara.plan_search import named_model
from nanopara.plan_time import predict
from nanopara.planner import Layout, Run, memory

# (label, model, GPUs, layout, seq, tokens a step, published TFLOP/s a GPU or tokens/s a GPU, what, source)
RUNS = [
    ("Llama 3 405B, 8,192 GPUs", "llama3_405b", 8192, dict(tp=8, pp=16, dp=64, schedule="interleaved", virtual=4,
                                                              zero=1), 8192, 16 * 2 ** 20, 430.0, "TFLOP/s",
     "Dubey et al. 2024, Table 4: 43 % MFU"),
    ("Llama 3 405B, 16,384 GPUs", "llama3_405b", 16384, dict(tp=8, pp=16, dp=128, schedule="interleaved",
                                                               virtual=4, zero=1), 8192, 16 * 2 ** 20, 400.0,
     "TFLOP/s", "Dubey et al. 2024, Table 4: 41 % MFU"),
    ("Llama 3 405B, 16,384 GPUs, 128k context", "llama3_405b", 16384, dict(tp=8, pp=16, cp=16, dp=8,
                                                                             schedule="interleaved", virtual=4,
                                                                             zero=1), 131072, 16 * 2 ** 20, 380.0,
     "TFLOP/s", "Dubey et al. 2024, Table 4: 38 % MFU"),
    ("Llama 3.1 8B, 8 GPUs, FSDP", "llama3_8b", 8, dict(dp=8, zero=3, micro_batch=2, ac="selective"), 8192,
     16 * 8192, 5762.0, "tok/s/GPU", "torchtitan Table 1 (eager, bf16)"),
    ("Llama 3.1 8B, 128 GPUs, FSDP", "llama3_8b", 128, dict(dp=128, zero=3, micro_batch=2, ac="selective"), 8192,
     256 * 8192, 5605.0, "tok/s/GPU", "torchtitan Table 3 (eager, bf16)"),
    ("Llama 3.1 70B, 256 GPUs, FSDP32 x TP8, Float8", "llama3_70b", 256,
     dict(dp=32, tp=8, sp=True, zero=3, micro_batch=16, ac="full", fp8="tensor", fp8_filter="all"), 8192,
     512 * 8192, 829.0,
     "tok/s/GPU", "torchtitan Table 4 (compile, Float8)"),
    ("Llama 3.1 405B, 512 GPUs, 3D, 1F1B, Float8", "llama3_405b", 512,
     dict(dp=8, tp=8, pp=8, sp=True, zero=1, micro_batch=1, ac="full", fp8="tensor", fp8_filter="all"), 8192,
     256 * 8192, 100.0,
     "tok/s/GPU", "torchtitan Table 5"),
    ("Llama 3.1 405B, 512 GPUs, 3D, interleaved, Float8", "llama3_405b", 512,
     dict(dp=8, tp=8, pp=8, sp=True, zero=1, micro_batch=1, ac="full", fp8="tensor", fp8_filter="all",
          schedule="interleaved", virtual=2), 8192, 256 * 8192, 128.0, "tok/s/GPU", "torchtitan Table 5"),
]


def compare() -> list[dict]:
    out = []
    for label, name, n, lay, seq, tokens, published, unit, source in RUNS:
        model = named_model(name)[0]
        base = Layout(kernels="cudnn", **{"micro_batch": 1, "sp": lay.get("tp", 1) > 1, **lay})
        run = Run(model, base, seq, tokens, "H100")
        if "ac" not in lay:  # the first that fits, as the search chooses
            for ac in ("none", "selective", "full"):
                run = Run(model, replace(base, ac=ac), seq, tokens, "H100")
                if memory(run)["fits"]:
                    break
        p = predict(run, n)
        tflops = model.flops_per_token(seq) * p["tokens_per_s"] / n / 1e12
        pred = tflops if unit == "TFLOP/s" else p["tokens_per_s"] / n
        out.append({"label": label, "unit": unit, "published": published, "predicted": pred,
                    "ratio": pred / published, "layout": run.layout.label(), "fits": p["fits"],
                    "reserved_gb": p["reserved_gb"], "mfu": p["mfu"], "source": source})
    return out


def render() -> str:
    lines = [f"{'run':50s} {'published':>10s} {'predicted':>10s} {'pred/pub':>8s}  layout as predicted"]
    for r in compare():
        lines.append(f"{r['label']:50s} {r['published']:10,.0f} {r['predicted']:10,.0f} {r['ratio']:8.2f}  "
                     f"{r['layout']} ({r['unit']}; {r['reserved_gb']:.0f} GB{'' if r['fits'] else ' DOES NOT FIT'};"
                     f" {r['source']})")
    return "\n".join(lines)
