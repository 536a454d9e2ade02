"""The planner for train.py's own configuration: `train.py --plan`, and the measured/predicted ratio of every run.

`python train.py --plan [keys]` (or under torchrun) prints the prediction for the run those keys describe on
WORLD_SIZE GPUs of this machine's kind (H100 where no GPU is visible) and exits before any work: no process group,
no data, no model. Every GPU run also asks `expected_step_s` once; the step reporter (report.py) then writes the
predicted step time and measured / predicted into each metrics.jsonl step record after the first steps
(`plan_step_s`, `plan_ratio`), so every run checks the model. A configuration the planner cannot take (a GPU not in
its table, CPU runs) records nothing. plan.py uses `predict_config` for a layout given as train.py's keys.
"""
from __future__ import annotations

import os

from nanopara import gpus as G
from nanopara.config import Config, stage_layers
from nanopara.plan_time import predict
from nanopara.planner import Layout, Model, PlanError, Run

WARMUP_STEPS = 3  # steps of a run before the ratio is recorded (autotuning, allocator growth, NCCL setup)


def run_of_config(cfg: Config, world: int, gpu: str, fabric: dict | None = None) -> Run:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    inner = p.tp * p.pp * p.cp
    dp = world // inner if p.dp == -1 else p.dp
    if dp < 1 or dp * inner != world:
        raise PlanError(f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp}" + (f" x dp={p.dp}" if p.dp != -1 else "") +
                        f" does not divide into {world} GPUs")
    graph = str(t.cuda_graph).lower()  # "auto": graphed where the trainer graphs by default (tp or pp, dp = cp = 1)
    graph = graph in ("true", "on") or (graph == "auto" and (p.tp > 1 or p.pp > 1) and dp == 1 and p.cp == 1)
    lay = Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, sp=p.sp, schedule=p.pp_schedule,
                 virtual=p.pp_virtual, pp_layers=tuple(stage_layers(cfg) or ()), micro_batch=t.micro_batch,
                 ac=t.activation_checkpointing, fp8=t.fp8, graph=graph,
                 fp8_filter=t.fp8_filter.strip() or "all",
                 kernels="torch" if m.kernels == "torch" else "triton", cp_impl=p.cp_impl,
                 sp_keep=p.sp_keep_gathered, reduce_bytes=2 if p.reduce_dtype == "bf16" else 4, optimizer=t.optimizer)
    tokens = t.tokens_per_step or t.micro_batch * t.seq_len * dp
    return Run(Model.from_config(m, cfg.preset), lay, t.seq_len, tokens, gpu, fabric or dict(G.FABRIC))


def predict_config(cfg: Config, world: int, gpu: str, fabric: dict | None = None) -> dict:
    return predict(run_of_config(cfg, world, gpu, fabric), world)


def _this_gpu() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "H100"


def fmt_layout(p: dict) -> str:
    """A prediction as lines: memory items, then time items (plan.py and train.py --plan)."""
    m, t = p["memory"], p["time"]
    lines = [f"memory on the fullest GPU (pp stage {m['stage']}): {p['reserved_gb']:.1f} GB reserved of "
             f"{m['capacity'] / 1e9:.1f} -> {'fits' if p['fits'] else 'DOES NOT FIT'}"]
    lines += [f"  {k:16s} {v / 1e9:8.2f} GB" for k, v in m["items"].items() if v > 0]
    lines += [f"step {p['step_s'] * 1e3:.1f} ms ({'host-bound' if t['host_bound'] else 'GPU-bound'}), "
              f"{p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%} on {p['gpu']}"]
    lines += [f"  {k:16s} {v * 1e3:8.2f} ms  {v / p['step_s']:5.1%}" for k, v in t["items"].items() if v >= 5e-6]
    return "\n".join(lines)


def print_plan(cfg: Config) -> dict:
    """train.py --plan: the prediction for this run, printed on rank 0; then train.py exits."""
    world, gpu = int(os.environ.get("WORLD_SIZE", "1")), _this_gpu()
    p = predict_config(cfg, world, gpu)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"plan for {cfg.preset or 'custom'} on {world} x {gpu} (nanopara/planner.py; python plan.py for more):")
        print(fmt_layout(p))
    return p


def expected_step_s(cfg: Config, mesh, log) -> float | None:
    """Predicted seconds a step for the run train() is starting; None where the planner has no answer."""
    if mesh.device.type != "cuda":
        return None
    try:
        p = predict_config(cfg, mesh.world, _this_gpu())
    except (PlanError, ValueError, KeyError) as e:
        log(f"planner: no prediction for this run ({e})")
        return None
    log(f"planner: {p['step_s'] * 1e3:.1f} ms a step predicted, {p['tokens_per_s']:,.0f} tok/s, peak "
        f"{p['peak_gb']:.1f} GB (metrics.jsonl: plan_ratio = measured / predicted from step {WARMUP_STEPS})")
    return p["step_s"]
