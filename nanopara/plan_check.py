"""The planner against measurement: the frozen manifest of end-to-end rows, predicted beside measured.

results/plan_manifest.jsonl holds one row per measured training step of nanopara's own trainer in results/ (the
layout, model, tokens a step, GPU, date and revision, step time, tokens/s, peak memory and whether that is torch's
max allocated or max reserved): built once by `python -m nanopara.plan_check --build` from the files named in
SOURCES, then frozen. A new measurement joins as a new row with its revision (`--append`; a faster revision is a
new row, not a failure of an older one). Left out, with the reason in the manifest's first line: other trainers'
baselines (torch DDP, torch.compile, torchao, nanoGPT), rows of trees older than their file's newest (`old_*`),
options the planner does not model (tp_overlap > 0), the old ZB-H1 (before zb.py), profiles and kernel rows. Peak
memory under a CUDA graph is not compared (the graph's pool is allocated before bench_layout resets the counter).
`check()` predicts each row (planner + plan_time with gpus.table()) and returns the table and the accuracy summary
that tests/test_plan.py asserts; `python -m nanopara.plan_check` prints it (results/plan_check.txt), `--classes` the
rows within 15 % by class (GPU, preset, axes, eager / graph, kernels, MoE, FP8, AC; results/plan_check_classes.txt).
"""
from __future__ import annotations

import argparse
import json
import os

from nanopara.plan_time import predict
from nanopara.planner import Layout, Model, Run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "results", "plan_manifest.jsonl")
GOAL = {"mem": 0.10, "time": 0.15, "share": 0.90, "worst": 0.30}


def model_of(row: dict) -> Model:
    from nanopara.presets import PRESETS
    m = PRESETS[row["preset"]]().model  # the preset's own shape, MoE width and shared experts included
    return Model(name=row["preset"], n_layer=m.n_layer, d=m.n_embd, n_head=m.n_head,
                 positions=row.get("block_size", 1024), experts=m.moe_experts, top_k=m.moe_top_k,
                 moe_every=m.moe_every, expert_ffn=m.moe_hidden, shared=m.moe_shared)


def run_of(row: dict) -> Run:
    lay = {k: v for k, v in row["layout"].items()}
    lay["pp_layers"] = tuple(lay.get("pp_layers", ()))
    lay.setdefault("fp8_filter", "all")  # rows from before train.fp8_filter=auto ran every Linear but lm_head in FP8
    return Run(model_of(row), Layout(**lay), seq=row["seq"], tokens_per_step=row["tokens_per_step"],
               gpu=row["gpu"])


def check(rows: list[dict] | None = None) -> dict:
    """Predicted against measured for every manifest row: per row the ratios, and the summary."""
    rows = rows if rows is not None else read()
    out = []
    for r in rows:
        p = predict(run_of(r))
        t_err = p["step_s"] * 1e3 / r["step_ms"] - 1
        mem = r.get("peak_gb")
        pred_mem = p["reserved_gb"] if r.get("peak_kind") == "max_reserved" else p["peak_gb"]
        m_err = pred_mem / mem - 1 if mem else None
        out.append({"id": r["id"], "row": r, "pred_ms": p["step_s"] * 1e3, "pred_gb": pred_mem, "time_err": t_err,
                    "mem_err": m_err, "bound": "host" if p["time"]["host_bound"] else "GPU"})
    return {"rows": out, "summary": summary(out)}


def summary(out: list[dict]) -> dict:
    t = [abs(o["time_err"]) for o in out]
    m = [abs(o["mem_err"]) for o in out if o["mem_err"] is not None]
    share = lambda xs, lim: sum(x <= lim for x in xs) / max(len(xs), 1)  # noqa: E731
    return {"rows": len(out), "mem_rows": len(m), "time_within": share(t, GOAL["time"]),
            "mem_within": share(m, GOAL["mem"]), "time_worst": max(t, default=0.0), "mem_worst": max(m, default=0.0),
            "time_over_30": [o["id"] for o in out if abs(o["time_err"]) > GOAL["worst"]],
            "mem_over_30": [o["id"] for o in out if o["mem_err"] is not None and abs(o["mem_err"]) > GOAL["worst"]]}


def row_classes(row: dict) -> dict:
    """The classes a manifest row falls in, for grouping the misses: GPU, preset, layout axes, eager or graphed,
    kernels, dense or MoE, FP8 mode, activation checkpointing."""
    lay = row["layout"]
    axes = "+".join(k for k in ("tp", "pp", "cp", "dp", "ep") if lay[k] > 1) or "1gpu"
    return {"gpu": row["gpu"], "preset": row["preset"], "axis": axes, "mode": "graph" if lay["graph"] else "eager",
            "kernels": lay["kernels"], "moe": "moe" if row["preset"] == "gpt2_moe" else "dense", "fp8": lay["fp8"],
            "ac": lay["ac"]}


def classes(res: dict) -> dict:
    """{"class=value": [rows, within 15 %, under-predicted past it, over-predicted past it]}, "all" first."""
    out = {"all": [0, 0, 0, 0]}
    for o in res["rows"]:
        e = o["time_err"]
        col = 1 if abs(e) <= GOAL["time"] else 2 if e < 0 else 3
        for key in ["all"] + [f"{k}={v}" for k, v in row_classes(o["row"]).items()]:
            c = out.setdefault(key, [0, 0, 0, 0])
            c[0] += 1
            c[col] += 1
    return {"all": out.pop("all"), **dict(sorted(out.items()))}


def render_classes(res: dict) -> str:
    lines = [f"{'class':24s} {'rows':>4s} {'within':>6s} {'under':>5s} {'over':>4s}"]
    lines += [f"{k:24s} {n:4d} {w:6d} {u:5d} {o:4d}" for k, (n, w, u, o) in classes(res).items()]
    return "\n".join(lines)


def read(path: str = MANIFEST) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def render(res: dict) -> str:
    lines = [f"{'id':44s} {'GPU':5s} {'n':>2s} {'meas ms':>8s} {'pred ms':>8s} {'time':>6s} {'meas GB':>8s} "
             f"{'pred GB':>8s} {'mem':>6s}  bound"]
    for o in res["rows"]:
        r = o["row"]
        mem = f"{r['peak_gb']:8.1f} {o['pred_gb']:8.1f} {o['mem_err']:+6.1%}" if o["mem_err"] is not None else \
            f"{'-':>8s} {o['pred_gb']:8.1f} {'-':>6s}"
        flag = " *" if abs(o["time_err"]) > GOAL["time"] or (o["mem_err"] or 0) > GOAL["mem"] or \
            (o["mem_err"] or 0) < -GOAL["mem"] else ""
        lines.append(f"{o['id'][:44]:44s} {r['gpu']:5s} {r['n_gpu']:2d} {r['step_ms']:8.1f} {o['pred_ms']:8.1f} "
                     f"{o['time_err']:+6.1%} {mem}  {o['bound']}{flag}")
    s = res["summary"]
    lines += ["", f"rows {s['rows']} (memory compared on {s['mem_rows']}); step time within 15 %: "
              f"{s['time_within']:.0%}, worst {s['time_worst']:.0%}; peak memory within 10 %: {s['mem_within']:.0%}, "
              f"worst {s['mem_worst']:.0%}; goal: >= 90 % of rows within, none past 30 %",
              "step time within 15 % by GPU: " + ", ".join(
                  f"{g} {sum(abs(o['time_err']) <= GOAL['time'] for o in res['rows'] if o['row']['gpu'] == g)} of "
                  f"{sum(o['row']['gpu'] == g for o in res['rows'])}"
                  for g in sorted({o["row"]["gpu"] for o in res["rows"]})),
              f"time past 30 %: {', '.join(s['time_over_30']) or 'none'}",
              f"memory past 30 %: {', '.join(s['mem_over_30']) or 'none'}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="rebuild results/plan_manifest.jsonl from results/")
    ap.add_argument("--append", action="store_true", help="append plan_manifest.APPENDED's new rows")
    ap.add_argument("--classes", action="store_true", help="the rows within 15 %% step time by class instead")
    args = ap.parse_args(argv)
    if args.build:
        from nanopara.plan_manifest import build
        build(MANIFEST)
    if args.append:
        from nanopara.plan_manifest import append
        append(MANIFEST)
    print(render_classes(check()) if args.classes else render(check()))


if __name__ == "__main__":
    main()
