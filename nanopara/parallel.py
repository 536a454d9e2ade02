"""parallelize(model, mesh, cfg) -> Trainer: the one place where parallelism is applied to the single-device GPT.

The order (one call each):

    1. TP (+SP)                  tp.apply_tp: column/row-parallel Linears, vocab-parallel embedding + loss
    2. CP                        cp.apply_cp: ring attention (zigzag chunks), positions, count-weighted loss
    2b. EP                       ep.apply_ep: this rank's E/ep experts of every MoE layer (their grads reduce over edp)
    3. PP split                  pp.split_model: this rank's chunks as one pp.Stage, and their pp.Pipeline
    4. activation checkpointing  recompute.apply_activation_checkpointing on this rank's blocks (none|full|selective)
    4b. FP8 (train.fp8)          fp8.apply_fp8 on this rank's Linears (the Trainer re-casts weights after each step)
    5. DP / ZeRO                 build_engine: SingleDevice, DDP (dp.py), ZeRO-1/2 (zero.py), ZeRO-3 (zero3.py)

The model comes built on the host with identical weights on every rank (same seed); TP slices it and PP keeps this
rank's stage before it moves to mesh.device, so no GPU ever holds more than its shard. The engine owns the optimizer
and the gradient reduction over dp x cp (engine.py); the Trainer (trainer.py) wraps it with everything else a step
needs: micro-steps, autocast, the CUDA graph, the pipeline schedule, the FP8 and MoE hooks, checkpoint metadata.

check_layout(cfg, world, device_type) -> micro-steps per optimizer step: the checks that need the world size or the
device (degrees, batch arithmetic, the pipeline's micro-batches, CUDA graphs), cheap and run before any process
group exists (train.py, and `make train` before it launches N processes). Config.check has run before it.
Callers: train.py, bench/; tests/test_parallel_train.py and tests/test_pp.py run every layout end to end.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nanopara.config import Config, ConfigError, stage_layers
from nanopara.cp import apply_cp, keep_kv as cp_keep_kv, ring_of, shard_stage_inputs
from nanopara.dp import DDP, SingleDevice
from nanopara.engine import weak_method
from nanopara.ep import apply_ep
from nanopara.fp8 import FP8Recipe, apply_fp8
from nanopara.fp8_filter import fp8_share, resolve_filter, share_line
from nanopara.mesh import Mesh, check_degrees
from nanopara.pp import Pipeline, Stage, build_schedule, embedding_group, split_layers, split_model
from nanopara.recompute import apply_activation_checkpointing
from nanopara.tp import apply_tp, shard_metadata
from nanopara.trainer import Trainer, autocast
from nanopara.zero import Zero, zero_prefetch
from nanopara.zero3 import Zero3


def check_layout(cfg: Config, world: int, device_type: str) -> int:
    """Micro-steps per optimizer step of this layout on `world` processes of `device_type` ("cuda" or "cpu");
    one clear line (MeshError / ConfigError) for a layout that cannot run."""
    p, t = cfg.parallel, cfg.train
    dp = check_degrees(world, dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)["dp"]
    if (dp * p.cp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide dp*cp = {dp}*{p.cp} (expert parallel is carved out of the "
                          f"data-parallel ranks)")
    per_micro = t.micro_batch * t.seq_len * dp  # global tokens of one micro-step (cp ranks share their sequences)
    tokens_per_step = t.tokens_per_step or per_micro
    if tokens_per_step % per_micro:
        raise ConfigError(f"train.tokens_per_step={tokens_per_step} is not a multiple of micro_batch*seq_len*dp = "
                          f"{t.micro_batch}*{t.seq_len}*{dp} = {per_micro}")
    if p.ep_chunks > 1 and (p.ep == 1 or cfg.model.moe_capacity == 0):  # ep.py: fixed splits, cut into pieces
        raise ConfigError(f"parallel.ep_chunks={p.ep_chunks} pipelines expert parallel's exchanges in capacity mode: "
                          f"it needs parallel.ep > 1 and model.moe_capacity > 0 (got ep={p.ep}, "
                          f"moe_capacity={cfg.model.moe_capacity})")
    if p.ep_fp8 and (p.ep == 1 or p.ep_chunks > 1):  # ep.py's FP8Dispatch
        raise ConfigError(f"parallel.ep_fp8=true sends expert parallel's rows in FP8: it needs parallel.ep > 1 and "
                          f"the unpipelined exchange (parallel.ep_chunks=1); got ep={p.ep}, ep_chunks={p.ep_chunks}")
    if t.optimizer == "flat" and (dp * p.cp > 1 or p.pp > 1):  # flat.py
        raise ConfigError(f"train.optimizer=flat runs one replica without a pipeline (dp*cp = 1, pp = 1); this layout "
                          f"has dp={dp} cp={p.cp} pp={p.pp}: use train.optimizer=torch")
    if t.cuda_graph == "true" and device_type != "cuda":  # graph.py; its config-only limits are in Config.check
        raise ConfigError("train.cuda_graph=true needs a CUDA device")
    if t.cuda_graph == "true" and (p.cp > 1 or p.zero > 1):  # DDP / ZeRO-1's reduction is captured with the step
        raise ConfigError("train.cuda_graph=true supports tensor, pipeline and data parallel with DDP or ZeRO-1 "
                          "(the whole step is one graph, the gradient reduction included); not context parallel "
                          "or ZeRO-2/3 (their engines free, gather and re-create buffers from Python between "
                          "micro-steps, which a replay would skip)")
    if t.cuda_graph == "true" and p.sp and cfg.model.dropout > 0:  # tp._PerRankDropoutRng: nothing of it would replay
        raise ConfigError("train.cuda_graph=true with parallel.sp=true and model.dropout > 0: each tp rank's dropout "
                          "RNG is swapped in and out by Python hooks around every forward (CUDA RNG state reads "
                          "and writes), which a capture cannot record: set model.dropout=0 or turn one of the two off")
    if p.zero_prefetch == "true" and (p.zero not in (1, 2) or p.tp_streams > 1 or t.compile):
        raise ConfigError("parallel.zero_prefetch=true applies to ZeRO-1/2 (parallel.zero=1|2; ZeRO-3 gathers its own "
                          "units) without parallel.tp_streams=2 or train.compile (they bypass or trace its hooks)")
    m = tokens_per_step // per_micro
    if p.pp > 1:  # the micro-batches are the pipeline's: 1F1B-type schedules need m >= pp, interleaved m % pp == 0
        try:
            build_schedule(p.pp_schedule, p.pp, m, p.pp_virtual)
        except ValueError as e:
            raise ConfigError(f"{e} (micro-batches per step = tokens_per_step / (micro_batch*seq_len*dp) = "
                              f"{tokens_per_step} / {per_micro})") from None
    return m


def use_cuda_graph(cfg: Config, world: int, device_type: str, fp8_linears: int = 0) -> tuple[bool, str]:
    """(whether the step runs from a CUDA graph (graph.py), why not) for train.cuda_graph: true / false as given
    (check_layout refuses an impossible true), auto on where it pays and is safe: tensor or pipeline parallel with
    dp = cp = 1 on CUDA (measured, results/scaleout_h200.txt: pp2 at micro-batch 2 1.88x its eager step; one GPU at
    the default micro-batch gains nothing, so it stays eager; on one GPU too: an MoE in capacity mode on the Triton
    path, results/moe_step_graph_h200.txt, 2.16x, and FP8 in tensor or row mode with any Linear in FP8
    (fp8_linears), results/compose_partial_h100.txt, 1.29x: its casts are many small launches). The reason names
    what keeps auto off."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if t.cuda_graph != "auto":
        return t.cuda_graph == "true", ""
    moe_fixed = m.moe_experts > 0 and m.moe_capacity > 0 and m.moe_impl in ("auto", "triton")
    fp8_graphed = fp8_linears > 0 and t.fp8 in ("tensor", "row")  # (block: no graphed GPU test yet)
    if device_type != "cuda" or (p.tp * p.pp == 1 and not moe_fixed and not fp8_graphed):
        return False, ""
    why = [reason for off, reason in (
        (world != p.tp * p.pp, "data or context parallel (with DDP or ZeRO-1 and cp = 1, train.cuda_graph=true "
                               "graphs the whole step, the reduction included: not yet measured on GPUs)"),
        (t.dtype == "fp16", "fp16's loss scale changes between steps"),
        (t.compile, "train.compile"),
        (m.moe_experts > 0 and not (m.moe_capacity > 0 and m.moe_impl in ("auto", "triton")),
         "MoE without a capacity or with a PyTorch moe_impl (dropless is graphable with train.cuda_graph=true; "
         "auto waits for its measurement)"),
        (p.sp and m.dropout > 0, "sequence parallel with dropout (per-rank RNG swaps)")) if off]
    return not why, "; ".join(why)


def build_engine(model: nn.Module, mesh: Mesh, cfg: Config):
    """SingleDevice (FlatSingle: train.optimizer=flat) for dp*cp == 1 (any tp), else DDP (parallel.zero=0),
    ZeRO-1/2 (Zero) or ZeRO-3 (Zero3)."""
    if mesh.dp * mesh.cp == 1:
        if cfg.train.optimizer == "flat":
            from nanopara.flat import FlatSingle
            return FlatSingle(model, mesh, cfg)
        return SingleDevice(model, mesh, cfg)
    if cfg.parallel.zero == 0:
        return DDP(model, mesh, cfg)
    if cfg.parallel.zero == 3:
        return Zero3(model, mesh, cfg)
    return Zero(model, mesh, cfg, stage=cfg.parallel.zero)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> Trainer:
    """Apply the mesh's parallelism to a single-device model, in the order above; returns its Trainer."""
    p = cfg.parallel
    # 1. tensor parallel (+ sequence parallel): each rank keeps its slices of the full weights
    if mesh.tp > 1:
        model = apply_tp(model, mesh, sp=p.sp, overlap=p.tp_overlap, keep_gathered=p.sp_keep_gathered)
    # 2. context parallel: ring attention over the cp group; each cp rank takes its zigzag chunks of the sequences
    #    (the GPT's forward does, or under pp the first and last chunks: shard_stage_inputs below)
    if mesh.cp > 1:
        model = apply_cp(model, mesh, pipeline=mesh.pp > 1, impl=p.cp_impl, keep_kv=cp_keep_kv(p))
    # 2b. expert parallel: this rank keeps E/ep experts of every MoE layer (ep.py); dropped before moving to device
    if p.ep != mesh.sizes.get("ep", 1):
        raise ConfigError(f"parallel.ep={p.ep} but the mesh has ep={mesh.sizes.get('ep', 1)}: build it with "
                          f"Mesh.build(..., ep=cfg.parallel.ep)")
    ep_shards = apply_ep(model, mesh, p.ep_chunks, p.ep_fp8)
    # 3. pipeline parallel: this rank's chunks (pp_virtual of them under interleaved 1F1B) replace the model; the
    #    caller drops the GPT, so the other stages' weights go
    chunks = None
    if mesh.pp > 1:
        chunks = split_model(model, mesh.pp, mesh.pp_rank, p.pp_virtual, stage_layers(cfg))
        model = Stage(chunks)
        if mesh.cp > 1:
            for ch in chunks:
                ch.register_forward_pre_hook(shard_stage_inputs(ring_of(mesh)), with_kwargs=True)
    # 4. activation checkpointing of this rank's blocks (GPT: a ModuleList; a Stage: a ModuleDict by global index)
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(list(model.transformer["h"].children()), cfg.train.activation_checkpointing)
    # 4b. FP8 (train.fp8): this rank's Linears (the whole model, or the pipeline stage's) swapped for FP8Linear,
    #     the same Parameters, so the engine, checkpoints and a bf16 resume see no difference; lm_head stays, and
    #     by default (fp8_filter=auto) so does every Linear too small to gain (fp8.py's measured rule)
    fp8 = _apply_fp8(model, cfg, mesh)
    model.to(mesh.device)
    tp_shards = shard_metadata(model, mesh)  # after the split: this stage's names
    ep_shards = {k: v for k, v in ep_shards.items() if k in dict(model.named_parameters())}  # pp: the stage's own
    # 5. data parallel / ZeRO over dp x cp: the engine owns the optimizer and the gradient reduction
    engine = build_engine(model, mesh, cfg)
    pipe = pp_layers = None
    if chunks is not None:
        pipe = build_pipeline(engine, chunks, mesh, cfg)
        pp_layers = [list(r) for r in split_layers(cfg.model.n_layer, mesh.pp, p.pp_virtual, stage_layers(cfg))]
    graph, why = use_cuda_graph(cfg, mesh.world, mesh.device.type, fp8_share(model)["fp8_linears"] if fp8 else 0)
    if fp8 is not None:  # the promoted GEMMs' Gluon kernel where its host cost is paid once, at capture: gpt_1b
        fp8.recipe.ws = graph  # tensor + delayed + graph 1.150x -> 1.263x bf16 (H200, results/fp8_ws_h200.txt)
    if why and mesh.rank == 0:  # the fast path is not taken: say so once, and run the eager step
        print(f"train.cuda_graph=auto: eager step, because of {why}", flush=True)
    why = zero_prefetch(cfg, mesh.device.type)[1]
    if why and mesh.rank == 0:
        print(f"parallel.zero_prefetch=auto: off (the all-gathers are waited for after the step), because of {why}",
              flush=True)
    return Trainer(engine, mesh, cfg, check_layout(cfg, mesh.world, mesh.device.type), pipeline=pipe,
                   pp_layers=pp_layers, tp_shards=tp_shards, ep_shards=ep_shards, fp8=fp8, graph=graph)


def _apply_fp8(model: nn.Module, cfg: Config, mesh: Mesh):
    """fp8.apply_fp8 per train.fp8 / train.fp8_filter (auto: fp8.py's measured per-shape rule at this rank's tokens
    a micro-step); says once which share of the Linears runs in FP8; returns the FP8State (its step() after each
    update) or None."""
    t = cfg.train
    if t.fp8 == "none":
        return None
    tokens = t.micro_batch * t.seq_len // cfg.parallel.cp  # M of every Linear's GEMM (sp gathers the sequence back)
    apply_fp8(model, t.fp8, filter=resolve_filter(t.fp8_filter, t.fp8, tokens, mesh.device.type),
              recipe=FP8Recipe(mode=t.fp8, grad_dtype=t.fp8_grad, delayed=t.fp8_delayed))
    share = fp8_share(model)
    if mesh.rank == 0:
        print(share_line(share, t.fp8, t.fp8_filter, tokens, mesh.device.type), flush=True)
    if not share["fp8_linears"] and t.fp8_filter.strip() != "auto" and cfg.parallel.pp == 1:
        raise ConfigError(f"train.fp8_filter={t.fp8_filter!r} selects no Linear (names look like "
                          f"transformer.h.0.mlp.c_fc)")
    return model.fp8


# ----------------------------------------------------------------------------------------------------------------
# pipeline parallel: the step and validation through this rank's stage

def build_pipeline(engine, chunks: list, mesh: Mesh, cfg: Config) -> Pipeline:
    """The Pipeline of this rank's chunks, with the engine's gradient reduction hooked to each chunk's last backward
    and the embedding group of the tied weight (collective: every rank of the mesh calls it)."""
    t, amp = cfg.train, autocast(cfg, mesh.device)[0]
    # every message: the residual stream of one micro-batch, fp32 under autocast, sharded along T under SP
    T = t.seq_len // mesh.cp  # this cp rank's zigzag chunks
    act = (t.micro_batch, T // mesh.tp if cfg.parallel.sp else T, cfg.model.n_embd)
    sync = weak_method(engine, "sync_from_now")
    pipe = Pipeline(chunks, mesh, cfg.parallel.pp_schedule, check_layout(cfg, mesh.world, mesh.device.type), act,
                    torch.float32, on_last_backward=lambda chunk, params: sync(params), amp=amp)
    pipe.tied_group = embedding_group(mesh)
    return pipe
