"""Pipeline parallel: each schedule at several micro-batch counts m, its measured bubble against its formula, and pp
against dp and tp on the same model and GPUs.

    torchrun --nproc_per_node=2 bench/bench_pp.py --preset gpt_1b --micro_batch 2 --n_micro 4,8,16 \
        --schedules gpipe,1f1b,interleaved:2,interleaved:3,zb --compare dp,tp --out results/pp_gpt_1b.jsonl
    torchrun --nproc_per_node=2 bench/bench_pp.py --device cpu --preset tiny --micro_batch 1 --seq_len 32 ...  # smoke

Every configuration runs train.py's step (parallel.parallelize -> Trainer.forward_backward + step) on synthetic
tokens, bf16 autocast, model.kernels=torch (--kernels auto: the Triton kernels), pp = world and dp = 1. Per
schedule and m, rank 0 prints and --out appends one JSON object (written as each finishes: a crash keeps them):
  tok/s, MFU   the global batch (m x micro_batch x seq_len) over the slowest rank's wall time per step
  memory       peak per GPU (max over ranks); "act": peak - weights/optimizer states - 6 bytes a parameter (fp32
               grads, the bf16 weight casts), beside s*b*h*36 bytes per layer (nanopara's count: flash attention,
               fp32 residual stream; Korthikanti et al. 2022 count 34 + 5as/h) times the layer-micro-batches the
               schedule keeps alive at once (GPipe m, 1F1B p), first stage (the last also holds the logits)
  bubble       per rank, the pipeline's time (CUDA events around the pipeline schedule) minus the sum of its F/B/W times
               (events around each action), as a share of the pipeline time; "formula" is the schedule's share at
               unit costs (pp.bubble: (p-1)/(m+p-1) GPipe/1F1B, (p-1)/(vm+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1,
               i.e. (p-1)/m, (p-1)/(vm), (p-1)/(3m) of the ideal time); "p2p" = messages a rank sends per step x the
               time of one (a ping-pong of one activation between neighbours), as a share of the pipeline time
--layers auto balances the stages with lm_head + loss counted as 2V/(24C+4T) blocks of work (ANCHORS: gpt_1b 10/8).
--compare dp,tp: the same global batch with dp = world (DDP, m/world micro-steps) and tp = world (m micro-steps).
Order: the other schedules, then the comparisons, then GPipe (it holds m micro-batches: an out-of-memory there, which
leaves the other stage waiting in a receive, loses only GPipe rows). ~3 minutes per preset on 2 x H100.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import harness as H
from nanopara import pp
from nanopara.config import ConfigError
from nanopara.mesh import Mesh
from nanopara.parallel import check_layout
from nanopara.report import flops_per_token, peak_flops
from nanopara.schedules import bubble, build_schedule



def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt_1b", choices=sorted(H.PRESETS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--micro_batch", type=int, default=2)
    ap.add_argument("--seq_len", type=int, default=1024)
    # not --m: torchrun's own parser takes it for an ambiguous prefix of its --master-addr, --module, ...
    ap.add_argument("--n_micro", default="4,8,16", help="micro-batches per step m, comma-separated")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved:2,interleaved:3,zb", help="NAME[:v], comma-sep.")
    ap.add_argument("--compare", default="dp,tp", help="layouts at the same global batch ('' = none)")
    ap.add_argument("--compare_m", type=int, default=0, help="m of the comparisons (default: the largest)")
    ap.add_argument("--layers", default="auto", choices=["auto", "even"])
    ap.add_argument("--kernels", default="torch", choices=["torch", "auto"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="", help="append one JSON object per configuration")
    return ap.parse_args()


def make_cfg(args, layout: str, m: int, world: int, schedule: str = "1f1b", v: int = 1):
    """The preset at the same global batch (m micro-batches) for every layout: pp = world (stages balanced for the
    head with --layers auto), dp = world (m / world micro-steps) or tp = world; ConfigError where it cannot run."""
    keys = {"model.kernels": args.kernels, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq_len,
            "train.tokens_per_step": m * args.micro_batch * args.seq_len, "parallel.dp": 1}
    if layout == "pp":
        keys.update({"parallel.pp": world, "parallel.pp_schedule": schedule, "parallel.pp_virtual": v})
        keys["parallel.pp_layers"] = args.layers  # auto: config.stage_layers (the head counted), or even
    else:
        keys["parallel.dp" if layout == "dp" else "parallel.tp"] = world
    return H.make_cfg(args.preset, keys)


def live_layers(actions: list, layers: dict) -> int:
    """The most layer-micro-batches this rank keeps for backward at once (F done, its last B or W not yet run)."""
    release = "W" if any(a.op == "W" for a in actions) else "B"
    live = peak = 0
    for a in actions:
        live += layers[a.chunk] if a.op == "F" else -layers[a.chunk] if a.op == release else 0
        peak = max(peak, live)
    return peak


def p2p_ms(mesh, shape, iters: int = 20) -> float:
    """One activation each way between pp neighbours at once (as in 1F1B's steady state): ms per exchange."""
    prev, nxt = mesh.neighbours("pp")
    group, clock = mesh.groups["pp"], H.Clock(mesh.device)
    send = torch.randn(shape, device=mesh.device)
    recv = torch.empty_like(send)

    def once():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                         dist.P2POp(dist.irecv, recv, prev, group)]):
            w.wait()
    H.timed(once, 0, 3, device=mesh.device)
    a = clock()
    for _ in range(iters):
        once()
    b = clock()
    H.sync(mesh.device)
    return clock.ms(a, b) / iters


def traced_step(trainer, batches, clock, spans: list) -> None:
    """trainer's step with timestamps: the pipeline's actions (Pipeline.clock / trace), its start, and the tied
    embedding's gradient sum (pp.sync_tied_grads, wrapped for the step) that follows the schedule."""
    pipe, marks, orig = trainer.pipeline, {}, pp.sync_tied_grads

    def tied(*a):
        marks["b"] = clock()
        orig(*a)
        marks["c"] = clock()
    pipe.clock, pipe.trace, pp.sync_tied_grads = clock, [], tied
    try:
        a = clock()
        trainer.forward_backward(batches)  # ends in the loss broadcast: every rank's end waits for the last
    finally:
        pipe.clock, pp.sync_tied_grads = None, orig
    spans.append((a, marks["b"], marks["c"], pipe.trace))
    trainer.step(1e-4, sync=False)


def run(cfg, mesh, args) -> dict:
    """Warm-up, then timed steps of one configuration; this rank's numbers."""
    trainer, n_params = H.build_trainer(cfg, mesh)
    pipe, dev, clock, spans = trainer.pipeline, mesh.device, H.Clock(mesh.device), []
    batches = H.synthetic_batches(cfg, trainer.accum, dev, seed=mesh.dp_rank)
    H.timed(lambda: H.train_step(trainer, batches), 0, args.warmup, device=dev)
    static = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    step = (lambda: traced_step(trainer, batches, clock, spans)) if pipe else (lambda: H.train_step(trainer, batches))
    t = H.timed(step, args.steps, device=dev)
    cuda = dev.type == "cuda"
    rec = {"step_s": t["step_s"], "peak_gb": t["peak_gb"] if cuda else None,
           "static_gb": static / H.GB if cuda else None, "n_params": n_params,
           "stage_params": sum(p.numel() for p in trainer.engine.params)}
    if pipe is not None:
        window = [clock.ms(a, b) for a, b, _, _ in spans]
        busy = [sum(clock.ms(s, e) for _, s, e in trace) for _, _, _, trace in spans]
        rec["bubble"] = sum(w - b for w, b in zip(window, busy)) / sum(window)
        rec["pipe_ms"] = sum(window) / len(window)
        rec["tied_ms"] = sum(clock.ms(b, c) for _, b, c, _ in spans) / len(spans)
        for op in "FBW":
            rec[f"{op}_ms"] = [clock.ms(s, e) for _, _, _, trace in spans for a, s, e in trace if a.op == op]
        rec["live_layers"] = live_layers(pipe.actions, {c: len(r) for c, r in enumerate(trainer.pp_layers)})
        rec["sends"] = sum(len(st[1]) for st in pipe.program if st[0] == "post")
        rec["p2p_ms"] = p2p_ms(mesh, pipe.act_shape)
        rec["formula"] = bubble(build_schedule(cfg.parallel.pp_schedule, mesh.pp, trainer.accum,
                                               cfg.parallel.pp_virtual))
    trainer.close()
    trainer.engine.close()
    del trainer, pipe, batches
    H.free()
    return rec


def summarize(cfg, args, layout: str, name: str, m: int, ranks: list, world: int, device) -> dict:
    """One row from every rank's numbers: throughput from the slowest rank, memory from the fullest."""
    t, mc = cfg.train, cfg.model
    tokens = m * t.micro_batch * t.seq_len
    step_s = max(r["step_s"] for r in ranks)
    tok_s = tokens / step_s
    peak = peak_flops(device)
    row = {"layout": layout, "schedule": name, "m": m, "world": world, "preset": args.preset,
           "micro_batch": t.micro_batch, "seq_len": t.seq_len, "tokens_per_step": tokens, "tok_s": tok_s,
           "step_ms": step_s * 1e3,
           "mfu": flops_per_token(mc, ranks[0]["n_params"], t.seq_len) * tok_s / (world * peak) if peak else 0.0,
           "peak_gb": [r["peak_gb"] for r in ranks], "static_gb": [r["static_gb"] for r in ranks]}
    if layout == "pp":
        per_layer = t.seq_len * t.micro_batch * mc.n_embd  # s*b*h
        r0 = ranks[0]
        mean = {op: [x for r in ranks for x in r[f"{op}_ms"]] for op in "FBW"}  # over all ranks' actions
        row.update({f"{op}_ms": sum(v) / len(v) if v else 0.0 for op, v in mean.items()})
        row.update(pp_layers=cfg.parallel.pp_layers, bubble=[r["bubble"] for r in ranks], formula=r0["formula"],
                   pipe_ms=[r["pipe_ms"] for r in ranks], tied_ms=[r["tied_ms"] for r in ranks],
                   p2p_ms=r0["p2p_ms"], sends=[r["sends"] for r in ranks],
                   p2p_share=[r["sends"] * r["p2p_ms"] / r["pipe_ms"] for r in ranks],
                   live_layers=[r["live_layers"] for r in ranks],
                   act_gb=None if r0["peak_gb"] is None else
                   [r["peak_gb"] - r["static_gb"] - 6 * r["stage_params"] / H.GB for r in ranks],
                   act_formula_gb=r0["live_layers"] * per_layer * 36 / H.GB,
                   act_paper_gb=r0["live_layers"] * per_layer * (34 + 5 * mc.n_head * t.seq_len / mc.n_embd) / H.GB)
    return row


def line(row: dict) -> str:
    name = row["schedule"] if row["layout"] == "pp" else f"{row['layout']}{row['world']}"
    mem = "" if row["peak_gb"][0] is None else f"  peak {max(row['peak_gb']):6.2f} GB"
    head = (f"{name:<14} m={row['m']:<3} {row['tok_s']:>10,.0f} tok/s  MFU {row['mfu'] * 100:5.1f}%  "
            f"{row['step_ms']:8.1f} ms{mem}")
    if row["layout"] != "pp":
        return head
    if row["act_gb"] is not None:
        head += f"  act {row['act_gb'][0]:6.2f} (formula {row['act_formula_gb']:6.2f}) GB"
    return (head + "  bubble "
            + "/".join(f"{b * 100:4.1f}" for b in row["bubble"]) + f"% (formula {row['formula'] * 100:4.1f}%, p2p "
            + "/".join(f"{s * 100:3.1f}" for s in row["p2p_share"]) + f"%)  F/B/W {row['F_ms']:.2f}/{row['B_ms']:.2f}/"
            f"{row['W_ms']:.2f} ms")


def main():
    args = parse()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    meshes = {}

    def mesh_for(layout):  # one mesh (process groups) per layout, made on every rank in the same order
        if layout not in meshes:
            meshes[layout] = Mesh.build(dp=world if layout == "dp" else 1, pp=world if layout == "pp" else 1,
                                        tp=world if layout == "tp" else 1, device=args.device)
        return meshes[layout]
    mesh = mesh_for("pp")
    ms = [int(x) for x in args.n_micro.split(",")]
    scheds = [(s.split(":")[0], int(s.split(":")[1]) if ":" in s else 1) for s in args.schedules.split(",")]
    plan = [("pp", s, v, m) for s, v in scheds if s != "gpipe" for m in ms]
    plan += [(lay, lay, 1, args.compare_m or max(ms)) for lay in args.compare.split(",") if lay]
    plan += [("pp", s, v, m) for s, v in scheds if s == "gpipe" for m in ms]
    H.printer(mesh)(H.banner(f"bench_pp {args.preset}: micro_batch {args.micro_batch}, seq_len {args.seq_len}, kernels "
                             f"{args.kernels}, {args.warmup} warm-up + {args.steps} timed steps", mesh), flush=True)
    for layout, name, v, m in plan:
        label = f"{name}:{v}" if v > 1 else name
        try:
            cfg = make_cfg(args, layout, m, world, name, v)
            check_layout(cfg, world, mesh.device.type)
        except ConfigError as e:  # the same on every rank: skip it everywhere
            if mesh.is_main:
                print(f"{label:<14} m={m:<3} skipped: {e}", flush=True)
            continue
        local = run(cfg, mesh_for(layout), args)
        ranks = [local]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, local)
        if mesh.is_main:
            row = summarize(cfg, args, layout, label, m, ranks, world, mesh.device)
            print(line(row), flush=True)
            H.append_jsonl(args.out, row)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
