"""parallelize(model, mesh, cfg) -> engine: the one place where parallelism is applied to the single-device GPT.

DESIGN.md section 4's order, one call per step:

    1. TP (+SP)                  tp.apply_tp: column/row-parallel Linears, vocab-parallel embedding + loss
    2. CP                        context parallel (ring attention): the next step here
    3. PP split                  this rank's pipeline stage: the next step here
    4. activation checkpointing  the next step here
    5. DP / ZeRO                 build_engine: SingleDevice, DDP (dp.py), ZeRO-1/2 (zero.py), ZeRO-3 (zero3.py)

The model comes built on the host with identical weights on every rank (same seed); TP slices it before it moves
to mesh.device, so no GPU ever holds more than its shard. The engine owns the optimizer and the gradient
reduction over dp x cp (engine.py's interface); `engine.tp_shards` says which global slice of each tp-sharded
tensor this rank holds (checkpoint metadata; {} without TP).

check_layout(cfg, world, device_type) -> micro-steps per optimizer step: the checks that need the world size or the
device (degrees, batch arithmetic, CUDA graphs), cheap and run before any process group exists (train.py, and
`make train` before it launches N processes). Config.check has run before it.

Callers: train.py; tests/test_parallel_train.py runs every layout end to end through it.
"""
from __future__ import annotations

import torch.nn as nn

from nanopara.config import Config, ConfigError
from nanopara.dp import DDP, SingleDevice
from nanopara.mesh import Mesh, check_degrees
from nanopara.tp import apply_tp, shard_metadata
from nanopara.zero import Zero
from nanopara.zero3 import Zero3


def check_layout(cfg: Config, world: int, device_type: str) -> int:
    """Micro-steps per optimizer step of this layout on `world` processes of `device_type` ("cuda" or "cpu");
    one clear line (MeshError / ConfigError) for a layout that cannot run."""
    p, t = cfg.parallel, cfg.train
    dp = check_degrees(world, dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)["dp"]
    per_micro = t.micro_batch * t.seq_len * dp  # global tokens of one micro-step (cp ranks share their sequences)
    tokens_per_step = t.tokens_per_step or per_micro
    if tokens_per_step % per_micro:
        raise ConfigError(f"train.tokens_per_step={tokens_per_step} is not a multiple of micro_batch*seq_len*dp = "
                          f"{t.micro_batch}*{t.seq_len}*{dp} = {per_micro}")
    if t.cuda_graph and device_type != "cuda":  # graph.py; its config-only limits are in Config.check
        raise ConfigError("train.cuda_graph=true needs a CUDA device")
    if t.cuda_graph and world > 1:
        raise ConfigError("train.cuda_graph=true supports one GPU only (dp = tp = 1): data/tensor parallel engines "
                          "launch communication from Python hooks that a graph replay would skip")
    return tokens_per_step // per_micro


def build_engine(model: nn.Module, mesh: Mesh, cfg: Config):
    """SingleDevice for dp*cp == 1 (any tp), else DDP (parallel.zero=0), ZeRO-1/2 (Zero) or ZeRO-3 (Zero3)."""
    if mesh.dp * mesh.cp == 1:
        return SingleDevice(model, mesh, cfg)
    if cfg.parallel.zero == 0:
        return DDP(model, mesh, cfg)
    if cfg.parallel.zero == 3:
        return Zero3(model, mesh, cfg)
    return Zero(model, mesh, cfg, stage=cfg.parallel.zero)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config):
    """Apply the mesh's parallelism to a single-device model, in DESIGN's order; returns its engine."""
    # 1. tensor parallel (+ sequence parallel): each rank keeps its slices of the full weights
    if mesh.tp > 1:
        model = apply_tp(model, mesh, sp=cfg.parallel.sp)
    tp_shards = shard_metadata(model, mesh)
    # 2. context parallel: the sequence split over the cp group goes here (ring attention)
    if mesh.cp > 1:
        raise NotImplementedError("context parallel (parallel.cp > 1) is not implemented yet")
    # 3. pipeline parallel: the split into this rank's stage goes here
    if mesh.pp > 1:
        raise NotImplementedError("pipeline parallel (parallel.pp > 1) is not implemented yet")
    # 4. activation checkpointing of the blocks goes here
    model.to(mesh.device)
    # 5. data parallel / ZeRO over dp x cp: the engine owns the optimizer and the gradient reduction
    engine = build_engine(model, mesh, cfg)
    engine.tp_shards = tp_shards
    return engine
