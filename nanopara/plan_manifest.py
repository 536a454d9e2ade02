"""Builds results/plan_manifest.jsonl, the planner's frozen set of measured end-to-end rows, from results/ files.

Run once (`python -m nanopara.plan_check --build`); afterwards the manifest is the record and new rows are
appended with their revision (`--append`: APPENDED's rows not in it yet; frozen rows stay). One reader per
benchmark format: bench_layout.py rows (their train.py flags parsed by nanopara/cli.py), bench_pp.py,
bench_dp.py, bench_tp.py, bench_ep.py, bench_recompute.py, bench_fp8_e2e.py, bench_gpt.py, bench_moe.py's step
and bench/ab_train.sh rows. What is left out and why: plan_check's docstring, and the first line of
the manifest. Peak memory is torch's max allocated in every source here (bench/harness.py peak_gb, train.py's
peak_mem_gb) but for the rows that recorded max reserved too (none of the step rows so far).
"""
from __future__ import annotations

import json
import os

from nanopara.cli import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "results")
SKIPPED = ("left out: other trainers' baselines (torch DDP, torch.compile, torchao, nanoGPT), trees older than "
           "their file's newest (old_*, tp2_gpt_1b_h100's machine 1, cp2_16k_h100_2's 'before' rows, fp8_e2e's "
           "block mode before the fix), "
           "tp_overlap > 0 and tp_streams = 2 (not modelled), the ZB-H1 rows before zb.py, profiles and kernel rows; "
           "memory not compared under CUDA graphs (bench_layout resets the peak after the graph's pool is allocated)")


def _jsonl(name):
    with open(os.path.join(RES, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def _json(name):
    with open(os.path.join(RES, name)) as f:
        return json.load(f)


def _gpu(name: str) -> str:
    return "H200" if "H200" in name else "H100"


def _lay(**kw) -> dict:
    base = dict(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, sp=False, schedule="1f1b", virtual=1, pp_layers=[],
                micro_batch=1, ac="none", fp8="none", graph=False, kernels="triton", cp_impl="ring", sp_keep=False)
    base.update(kw)
    return base


def _row(id_, source, preset, lay, seq, tokens, gpu, n_gpu, date, rev, step_ms, peak, note="", block=1024):
    return {"id": id_, "source": source, "preset": preset, "seq": seq, "block_size": block, "tokens_per_step": tokens,
            "layout": lay, "gpu": _gpu(gpu), "n_gpu": n_gpu, "date": str(date)[:10], "revision": rev,
            "step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1e3, "peak_gb": peak,
            "peak_kind": "max_allocated", "note": note}


def from_flags(flags: list, n_gpu: int) -> tuple:
    cfg = parse_args(list(flags))
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = n_gpu // (p.tp * p.pp * p.cp)
    layers = [int(x) for x in p.pp_layers.split(",")] if p.pp_layers.strip() not in ("", "auto") else []
    lay = _lay(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, sp=p.sp, schedule=p.pp_schedule,
               virtual=p.pp_virtual, pp_layers=layers, micro_batch=t.micro_batch, ac=t.activation_checkpointing,
               fp8=t.fp8, graph=str(t.cuda_graph).lower() in ("true", "on"),
               kernels="torch" if m.kernels == "torch" else "triton",
               cp_impl=p.cp_impl, sp_keep=p.sp_keep_gathered)
    tokens = t.tokens_per_step or t.micro_batch * t.seq_len * dp
    return cfg, lay, tokens, p.tp_overlap


def layout_rows(name: str, skip=()) -> list:
    out = []
    for i, r in enumerate(_jsonl(name)):
        if r["label"].startswith("old_") or i in skip or r.get("machine") == 1:  # machine 1: before host fixes
            continue
        cfg, lay, tokens, overlap = from_flags(r["flags"], r["n_gpu"])
        if overlap or cfg.parallel.tp_streams > 1:  # (not modelled)
            continue
        rev = f"tree {r.get('tree', '.')}" + (f", machine {r['machine']}" if "machine" in r else "")
        peak = None if lay["graph"] else r["peak_mem_gb"]
        out.append(_row(f"{name.split('.')[0]}:{r['label']}" + (f"#{r['machine']}" if "machine" in r else "")
                        + (f"#{i}" if name.startswith("cp2_16k") else ""), name, cfg.preset, lay,
                        cfg.train.seq_len, tokens, r["gpu"], r["n_gpu"], r["date"], rev, r["step_ms"], peak,
                        block=cfg.model.block_size))
    return out


def pp_rows(name: str, kernels: str, date_rev: str) -> list:
    out = []
    for r in _jsonl(name):
        sched, v = (r["schedule"].split(":") + ["1"])[:2]
        if r["layout"] == "pp" and sched == "zb" and kernels == "torch":
            continue  # the first ZB-H1 (before zb.py): superseded
        n = r["world"]
        kw = dict(pp=n, schedule=sched, virtual=int(v), pp_layers=[int(x) for x in r["pp_layers"].split(",")]) \
            if r["layout"] == "pp" else dict(dp=n) if r["layout"] == "dp" else dict(tp=n)
        lay = _lay(micro_batch=r["micro_batch"], kernels=kernels, **kw)
        out.append(_row(f"{name.split('.')[0]}:{r['layout']}_{r['schedule']}_m{r['m']}", name, r["preset"], lay,
                        r["seq_len"], r["tokens_per_step"], "NVIDIA H100", n, date_rev, date_rev, r["step_ms"],
                        max(r["peak_gb"])))
    return out


def build(path: str) -> list:
    rows = []
    for name in ("layouts4_gpt_1b_h100.jsonl", "layouts4_cp_h100.jsonl", "tp2_gpt_1b_h100.jsonl",
                 "tp2_graph_gpt_1b_h100.jsonl", "cp4_16k_h100_2.jsonl"):
        rows += layout_rows(name)
    rows += layout_rows("cp2_16k_h100_2.jsonl", skip=(1, 2))
    rows += pp_rows("pp_gpt_1b_h100.jsonl", "torch", "2026-11-26") + pp_rows("pp_gpt2_1558m_h100.jsonl", "torch",
                                                                            "2026-11-26")
    rows += pp_rows("pp4_gpt_1b_h100.jsonl", "torch", "2026-11-26")
    rows += pp_rows("pp2_zb_gpt_1b_h100.jsonl", "triton", "2026-11-27")
    rows += pp_rows("pp4_zb_gpt_1b_h100.jsonl", "triton", "2026-11-27")
    for name in ("dp4_h100_acc_1gpu.json", "dp4_h100_acc.json"):
        d = _json(name)
        for i, r in enumerate(d["rows"]):
            mode = r["mode"]
            if mode == "torch_ddp":
                continue
            zero = {"ddp": 0, "zero1": 1, "zero2": 2}.get(mode, 3)
            lay = _lay(dp=d["gpus"], zero=zero, micro_batch=d["micro_batch"], kernels="torch")
            tokens = d["micro_batch"] * d["seq_len"] * d["accum"] * d["gpus"]
            rows.append(_row(f"{name.split('.')[0]}:{mode}#{i}", name, "gpt2_124m", lay, d["seq_len"], tokens,
                             d["device"], d["gpus"], d["date"], d["date"], r["step_ms"], r["peak_GB"]))
    for name in ("tp124_2.json", "tp124_4.json", "tp124sp_2.json", "tp124sp_4.json"):
        d = _json(name)
        tokens = d["micro_batch"] * d["seq_len"]
        lay = _lay(tp=d["n_gpu"], sp=d["sp"], micro_batch=d["micro_batch"], kernels="torch")
        rows.append(_row(f"{name.split('.')[0]}:tp", name, d["preset"], lay, d["seq_len"], tokens, d["gpu"],
                         d["n_gpu"], d["date"], d["date"], d["tp"]["step_ms"], d["tp"]["peak_mem_gb"]))
    d = _json("tp124_2.json")
    rows.append(_row("tp124_2:1gpu", "tp124_2.json", "gpt2_124m", _lay(micro_batch=32, kernels="torch"), 1024,
                     32768, d["gpu"], 1, d["date"], d["date"], 32768 / d["baseline"]["tokens_per_s"] * 1e3,
                     d["baseline"]["peak_mem_gb"]))
    d = _json("ep4_gpt2_moe_h100.json")
    for r in d["rows"]:
        kw = {"single": {}, "dp4": dict(dp=4), "ep4": dict(dp=4, ep=4), "ep2": dict(dp=4, ep=2)}[r["layout"]]
        lay = _lay(micro_batch=r["micro_batch"], **kw)
        tokens = r["micro_batch"] * r["seq_len"] * lay["dp"]
        rows.append(_row(f"ep4_gpt2_moe_h100:{r['layout']}", "ep4_gpt2_moe_h100.json", "gpt2_moe", lay,
                         r["seq_len"], tokens, d["gpu"], r["gpus"], d["date"], d["date"][:10], r["step_ms"],
                         r["peak_gb"]))
    for name in ("recompute_h100.jsonl", "recompute_h100_2.jsonl", "recompute_h100_3.jsonl",
                 "recompute_h100_4.jsonl"):
        for i, r in enumerate(_jsonl(name)):
            if r.get("section") != "mode" or not r.get("step_ms"):
                continue
            lay = _lay(micro_batch=r["batch"], ac=r["mode"])
            rows.append(_row(f"{name.split('.')[0]}:{r['preset']}_{r['mode']}#{i}", name, r["preset"], lay,
                             r["seq"], r["batch"] * r["seq"], r["gpu"], 1, r["date"], r["date"], r["step_ms"],
                             r["peak_mem_gb"]))
    for name in ("fp8_e2e_h100.jsonl", "fp8_block_fix_h100.jsonl"):
        for r in _jsonl(name):
            if r.get("section") != "throughput" or r["mode"] not in ("bf16", "tensor", "row", "block") or \
                    (name.startswith("fp8_e2e") and r["mode"] == "block"):
                continue
            lay = _lay(micro_batch=r["batch"], fp8="none" if r["mode"] == "bf16" else r["mode"])
            rows.append(_row(f"{name.split('.')[0]}:{r['preset']}_{r['mode']}", name, r["preset"], lay, r["seq"],
                             r["batch"] * r["seq"], r["gpu"], 1, r["date"], r["date"], r["step_ms"],
                             r["peak_mem_gb"]))
    for name in ("e2e_h200.jsonl", "e2e_h100.jsonl"):
        for i, r in enumerate(_jsonl(name)):
            if not r["mode"].startswith("triton") or "compile" in r["mode"]:
                continue
            graph = "graph=1" in r["mode"]
            lay = _lay(micro_batch=r["batch"], graph=graph)
            rows.append(_row(f"{name.split('.')[0]}:{r['mode']}#{i}", name, r["preset"], lay, r["seq"],
                             r["batch"] * r["seq"], r["gpu"], 1, r["date"], r["date"], r["step_ms"],
                             None if graph else r["peak_mem_gb"]))
    ab = {"gpt2_124m": ("gpt2_124m", _lay(micro_batch=32), 32768, 1),
          "gpt_1b_tp2_graph": ("gpt_1b", _lay(tp=2, micro_batch=8, graph=True), 32768, 2),
          "gpt_1b_pp2_mb2": ("gpt_1b", _lay(pp=2, micro_batch=2), 32768, 2)}
    for r in _jsonl("step_object_ab_h200.jsonl"):
        preset, lay, tokens, n = ab[r["run"]]
        rows.append(_row(f"step_object_ab_h200:{r['run']}", "step_object_ab_h200.jsonl", preset, lay, 1024, tokens,
                         r["gpu"], n, r["date"], "this tree of 2026-11-28 (train.py, metrics.jsonl)",
                         tokens / r["tok_s_new"] * 1e3, None if lay["graph"] else r["peak_mem_gb_new"],
                         note="train.py's own run"))
    seen = {}
    for r in rows:  # the same label measured twice in one file (another host, a repeat): #2, #3, ...
        seen[r["id"]] = seen.get(r["id"], 0) + 1
        if seen[r["id"]] > 1:
            r["id"] += f"#{seen[r['id']]}"
    with open(path, "w") as f:
        f.write("# " + SKIPPED + "\n")
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


# rows measured after the build: (file, revision); appended by `append`, never rebuilt
APPENDED = [("scaleout_pp_graph_h200.jsonl", "git 557d434 + the pipeline CUDA graph (next commit), scaleout_h200.txt"),
            ("scaleout_tp_h200.jsonl", "git 557d434 + the pipeline CUDA graph (next commit), scaleout_h200.txt"),
            ("moe_step_graph_h200.jsonl", "tree after 273b1d4 (MoE step state on the device), moe_step_graph_h200.txt"),
            ("scaleout_2_h200.jsonl", "tree of 8eb229d (dp2 ZeRO-1, tp2 graph), scaleout_2_h200.txt"),
            ("moe_step_profile_h100.jsonl", "tree of 70fb83d, moe_step_profile_h100.txt"),
            ("moe_step_overwrite_h100.jsonl",
             "tree of 6fcffe2 (graph writes its gradients), moe_step_overwrite_h100.txt"),
            ("fp8_e2e_fused_h100.jsonl", "tree of 6fcffe2 (graph writes its gradients), fp8_e2e_fused_h100.txt"),
            ("fp8_e2e_3b_124m_h100.jsonl", "tree of 6fcffe2, fp8_e2e_3b_124m_h100.txt"),
            ("fp8_ws_h200.jsonl", "tree of 7191812, fp8_ws_h200.txt"),
            ("fp8_ws_e2e_h100.jsonl", "tree of 7902a86, fp8_ws_e2e_h100.txt"),
            ("fp8_e2e_rowblock_h100.jsonl", "tree of 418ff5f, fp8_e2e_rowblock_h100.txt"),
            ("moe_wgrad_db_h100.jsonl", "tree of 418ff5f (wgrad's db on the tensor cores), moe_wgrad_db_h100.txt"),
            ("moe_fine_step_h100.jsonl", "tree of 418ff5f (wgrad's db on the tensor cores), moe_fine_step_h100.txt"),
            # the FP8 rows of the runs with the FP8 code the planner models (the Gluon GEMMs in graphed steps, the
            # Linears fp8_filter picks): held out from gpus.fp8_linear, which comes from fp8_linear_graph_h100
            ("fp8_ws_e2e_h100.jsonl#fp8", "tree of 7902a86, fp8_ws_e2e_h100.txt"),
            ("fp8_e2e_rowblock_h100.jsonl#fp8", "tree of 418ff5f, fp8_e2e_rowblock_h100.txt")]


def bf16_rows(name: str, rev: str) -> list:
    """bench_fp8_e2e.py's bf16 rows, eager and graphed (its FP8 rows run the auto filter's share of the Linears in
    FP8, which the planner does not model), one micro-step of 1,024-token sequences; the preset's own checkpointing."""
    from nanopara.presets import PRESETS
    out = []
    for i, r in enumerate(_jsonl(name)):
        if r.get("section") != "throughput" or r.get("mode") not in ("bf16", "bf16+graph") or "step_ms" not in r:
            continue
        tokens = round(r["tokens_per_s"] * r["step_ms"] / 1e3)
        graph = r["mode"] == "bf16+graph"
        lay = _lay(micro_batch=tokens // 1024, graph=graph, ac=PRESETS[r["preset"]]().train.activation_checkpointing)
        out.append(_row(f"{name.split('.')[0]}:{r['preset']}_{r['mode']}#{i}", name, r["preset"], lay, 1024, tokens,
                        r["gpu"], 1, r["date"], rev, r["step_ms"], None if graph else r["peak_mem_gb"],
                        note="bench_fp8_e2e.py bf16 row"))
    return out


def fp8_rows(name: str, rev: str) -> list:
    """bench_fp8_e2e.py's FP8 rows (tensor / row / block, delayed scaling or not: the planner does not tell them
    apart, eager or graphed; not torchao's), the filter as the run's: auto or its globs."""
    from nanopara.presets import PRESETS
    out = []
    for i, r in enumerate(_jsonl(name)):
        parts = str(r.get("mode", "")).split("+")
        if r.get("section") != "throughput" or parts[0] not in ("tensor", "row", "block") or "step_ms" not in r \
                or not set(parts[1:]) <= {"delayed", "graph"}:
            continue
        tokens = round(r["tokens_per_s"] * r["step_ms"] / 1e3)
        graph = "graph" in parts
        lay = _lay(micro_batch=tokens // 1024, graph=graph, fp8=parts[0], fp8_filter=r.get("fp8_filter") or "auto",
                   ac=PRESETS[r["preset"]]().train.activation_checkpointing)
        out.append(_row(f"{name.split('.')[0]}:{r['preset']}_{r['mode']}#{i}", name, r["preset"], lay, 1024, tokens,
                        r["gpu"], 1, r["date"], rev, r["step_ms"], None if graph else r["peak_mem_gb"],
                        note=f"bench_fp8_e2e.py FP8 row, {r.get('fp8_share')} Linears in FP8"))
    return out


def moe_step_rows(name: str, rev: str) -> list:
    """bench_moe.py's step rows; where a file holds both grouped-wgrad db paths, the default one (tensor cores), and
    never a profiled step's row."""
    out = []
    for r in _jsonl(name):
        if r.get("section") != "step" or "mode" not in r or r.get("wgrad_db_mma") is False or r.get("profiled"):
            continue
        graph = r["mode"] == "graph"
        tokens = r["micro_batch"] * r["seq_len"]
        out.append(_row(f"{name.split('.')[0]}:{r['mode']}_c{r['capacity']}", name, r["preset"],
                        _lay(micro_batch=r["micro_batch"], graph=graph), r["seq_len"], tokens, r["gpu"], 1,
                        r["date"], rev, r["step_ms"], None if graph else r["peak_gb"], note="bench_moe.py step"))
    return out


def append(path: str) -> list:
    """Append APPENDED's rows that the manifest does not hold yet (by id); returns the rows added."""
    with open(path) as f:
        have = {json.loads(line)["id"] for line in f if line.strip() and not line.startswith("#")}
    new = []
    for name, rev in APPENDED:
        rows = moe_step_rows(name, rev) if name.startswith(("moe_step", "moe_wgrad", "moe_fine")) else \
            fp8_rows(name.split("#")[0], rev) if name.endswith("#fp8") else \
            bf16_rows(name, rev) if name.startswith(("fp8_e2e", "fp8_ws")) else layout_rows(name)
        for r in rows:
            r["revision"] = rev
            if r["id"] not in have:
                new.append(r)
                have.add(r["id"])
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in new)
    return new
