"""One single-device GPT state dict from a checkpoint of any layout the trainer writes (no process group needed).

    sd, model_cfg = full_model_state("runs/tiny")        # a run directory (its ckpt/latest), ckpt/ or a step_N/
    model = GPT(model_cfg); model.load_state_dict(sd)

A checkpoint is meta.json (config, layout = mesh sizes) plus rank_NNNNN.pt per rank, each holding that rank's
"model" state, its grid coordinates ("mesh") and, under TP, which global slices its tensors hold ("tp_shards").
Ranks sit on the grid [pp, dp, cp, tp], tp fastest (mesh.py). Reassembly, per pipeline stage s and tp rank t:
  replicated over dp x cp (one process, DDP, ZeRO-1/2): {name: tensor} of the (dp 0, cp 0) rank;
  ZeRO-3: every dp x cp rank's "flat_shard" joined by zero.unshard_model;
  expert parallel: each expert tensor from the dp x cp ranks' pieces, placed at the rows "ep_shards" names;
then over tp: each sharded tensor's pieces placed at the slices its tp_shards entry names (c_attn's q, k, v
blocks are split per head, so a piece is several slices); then over pp: the stages' tensors keep their
single-device names (pp.Stage), so they are merged, and the last stage's copy of the tied weight (lm_head.weight,
the same values as the first stage's wte) is dropped. The vocab-parallel wte's TP padding rows are dropped to the
model's padded vocabulary, and the result is checked key by key against the model the config builds.
Shards are memory-mapped: the optimizer states in them are never read. reshard.full_optimizer_state: AdamW's m, v in
engine.py's "full" form, joined the same way by reshard.Source (which a resume under another layout uses).

Called by sample.py; tested by tests/test_sample.py against the running engines' own gathers.
"""
from __future__ import annotations

import os

import torch

from nanopara import checkpoint
from nanopara.checkpoint import CheckpointError
from nanopara.config import ModelConfig
from nanopara.mesh import AXES, grid_coords
from nanopara.model import GPT
from nanopara.zero import unshard, unshard_model


def resolve(path: str) -> tuple[str, str]:
    """(step directory, note) from a run directory, its ckpt/ folder, or a step directory itself. A run directory
    gives the checkpoint ckpt/latest names, or the newest complete one when that is damaged (the note says so)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"no such run or checkpoint directory: {path}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a run or checkpoint directory")
    name = os.path.basename(os.path.normpath(path))
    if os.path.exists(os.path.join(path, "meta.json")) or name.startswith(("step_", "tmp-step_")):
        return path, ""  # a step directory (check_complete says if it is incomplete)
    run = os.path.dirname(os.path.normpath(path)) if name == "ckpt" else path
    if not os.path.isdir(os.path.join(run, "ckpt")):
        raise CheckpointError(f"{path} holds no checkpoint (no meta.json and no ckpt/ folder)")
    try:
        return checkpoint.find_resume(run)
    except CheckpointError:
        raise CheckpointError(f"no complete checkpoint under {os.path.join(run, 'ckpt')}") from None


def model_config(meta: dict, path: str) -> ModelConfig:
    """The ModelConfig a checkpoint was trained with (keys this version does not know are ignored)."""
    saved = meta.get("config", {}).get("model") if isinstance(meta.get("config"), dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: meta.json has no model config")
    known = ModelConfig.__dataclass_fields__
    try:
        return ModelConfig(**{k: v for k, v in saved.items() if k in known})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json's model config is invalid: {e}") from None


def _layout(meta: dict, path: str) -> dict:
    lay = meta.get("layout")
    if not isinstance(lay, dict) or not all(isinstance(lay.get(k), int) and lay[k] >= 1
                                            for k in ("world", *AXES)):
        raise CheckpointError(f"checkpoint {path}: unknown layout {lay!r} in meta.json")
    sizes = {ax: lay[ax] for ax in AXES}
    if sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"] != lay["world"]:
        raise CheckpointError(f"checkpoint {path}: layout {lay} does not multiply to its world size")
    return sizes


def _load_shard(path: str, rank: int, sizes: dict) -> dict:
    file = os.path.join(path, f"rank_{rank:05d}.pt")
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path} has no shard for rank {rank} ({file})")
    try:  # mmap: only the tensors that are used get read from disk
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated/corrupt archive, not a torch file
        why = (str(e).strip().splitlines() or [""])[0][:200]  # torch's messages run over several lines
        raise CheckpointError(f"checkpoint shard {file} is corrupt or unreadable: {type(e).__name__}: {why}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"checkpoint shard {file} holds no model state")
    want = grid_coords(rank, sizes)
    have = state.get("mesh")
    if isinstance(have, dict) and {ax: have.get(ax) for ax in AXES} != want:
        raise CheckpointError(f"checkpoint shard {file} was written by the rank at {have}, expected {want}")
    return state


# ----------------------------------------------------------------------------------------------------------------
# reassembly

def _dp_full(models: list[dict], file: str, ep: int = 1) -> tuple[dict, list[dict] | None]:
    """{name: tensor} of one tp rank from its dp x cp ranks' model states (listed in dp x cp order), and under
    ZeRO-3 with expert parallel each ep rank's {name: its experts} (their flats are sharded over edp), else None."""
    fmt = models[0].get("format")
    if fmt is None:  # replicated: every dp x cp rank holds the same tensors
        return dict(models[0]), None
    if fmt != "flat_shard":
        raise CheckpointError(f"checkpoint shard {file}: unknown model state format {fmt!r}")
    if any(m.get("format") != "flat_shard" or m.get("world") != len(models) for m in models):
        raise CheckpointError(f"checkpoint shard {file}: ZeRO-3 shards over {models[0].get('world')} ranks, but the "
                              f"layout has {len(models)} data-parallel ranks per tp rank")
    if ep > 1:
        return unshard(models, "param", ep)
    return unshard_model(models), None


def _join_experts(full: dict, states: list[dict], file: str, local: list[dict] | None = None) -> dict:
    """Expert parallel (ep.py): each expert tensor of `full` (one rank's E/ep experts) replaced by all E, placed
    from the dp x cp ranks' pieces at the expert rows their "ep_shards" entries name (one piece per ep rank).
    local: ZeRO-3's experts per ep rank (_dp_full); else each rank's model state holds its own."""
    for name, m0 in (states[0].get("ep_shards") or {}).items():
        pieces = {}
        for st in states:
            m = st["ep_shards"][name]
            piece = local[m["ep_rank"]][name] if local is not None else st["model"][name]
            pieces.setdefault(m["ep_rank"], (piece, m))
        if sorted(pieces) != list(range(m0["ep"])):
            raise CheckpointError(f"checkpoint shard {file}: {name} is split over ep={m0['ep']} ranks, found the "
                                  f"pieces of ep ranks {sorted(pieces)}")
        full[name] = _place(name, [pieces[i][0] for i in range(m0["ep"])],
                            [{**pieces[i][1], "tp": m0["ep"], "tp_rank": i} for i in range(m0["ep"])], m0["ep"])
    return full


def _place(name: str, pieces: list[torch.Tensor], metas: list[dict], tp: int) -> torch.Tensor:
    """The full tensor of a tp-sharded parameter from every tp rank's piece and its recorded global slices."""
    m0 = metas[0]
    dim, full_shape = m0["dim"], list(m0["full_shape"])
    full = torch.empty(full_shape, dtype=pieces[0].dtype)
    covered = torch.zeros(full_shape[dim], dtype=torch.int32)
    for t, (piece, m) in enumerate(zip(pieces, metas)):
        if m.get("tp") != tp or m.get("tp_rank") != t or m["dim"] != dim or list(m["full_shape"]) != full_shape:
            raise CheckpointError(f"{name}: tp rank {t}'s shard metadata {m} does not match tp rank 0's {m0}")
        at = 0
        for lo, hi in m["slices"]:
            full.narrow(dim, lo, hi - lo).copy_(piece.narrow(dim, at, hi - lo))
            covered[lo:hi] += 1
            at += hi - lo
        if at != piece.shape[dim]:
            raise CheckpointError(f"{name}: tp rank {t} holds {piece.shape[dim]} rows along dim {dim}, its slices "
                                  f"name {at}")
    if not bool((covered == 1).all()):
        raise CheckpointError(f"{name}: the tp ranks' slices do not cover the tensor exactly once")
    return full


def _stage_full(path: str, states: list, sizes: dict, s: int) -> dict:
    """{name: full tensor} of pipeline stage s: each tp rank's dp x cp shards joined, then the tp pieces placed."""
    tp, world = sizes["tp"], len(states)
    per_tp, tp_meta = [], []
    for t in range(tp):
        ranks = [r for r in range(world)  # the dp x cp ranks of tp rank t, stage s
                 if grid_coords(r, sizes)["tp"] == t and grid_coords(r, sizes)["pp"] == s]
        file = os.path.join(path, f"rank_{ranks[0]:05d}.pt")
        ep = max([m.get("ep", 1) for m in (states[ranks[0]].get("ep_shards") or {}).values()], default=1)
        full, local = _dp_full([states[r]["model"] for r in ranks], file, ep)
        per_tp.append(_join_experts(full, [states[r] for r in ranks], file, local))
        tp_meta.append(states[ranks[0]].get("tp_shards") or {})
    if tp > 1 and not tp_meta[0]:
        raise CheckpointError(f"checkpoint {path}: tp={tp} but its shards carry no tp_shards metadata")
    return {name: _place(name, [p[name] for p in per_tp], [m[name] for m in tp_meta], tp) if name in tp_meta[0]
            else t0 for name, t0 in per_tp[0].items()}  # else: replicated over tp


def full_model_state(ckpt_path: str) -> tuple[dict, ModelConfig]:
    """(state dict of a single-device GPT, its ModelConfig) from a run, ckpt/ or step directory of any layout."""
    path, _ = resolve(ckpt_path)
    meta = checkpoint.check_complete(path)  # meta.json readable, every shard of the size written
    cfg = model_config(meta, path)
    sizes = _layout(meta, path)
    world = sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]
    states = [_load_shard(path, r, sizes) for r in range(world)]  # every shard opened: a broken one is reported
    try:
        full = {}
        for s in range(sizes["pp"]):  # pipeline stages: disjoint names, but for the tied copy
            stage = _stage_full(path, states, sizes, s)
            if s > 0:
                stage.pop("lm_head.weight", None)  # the last stage's copy of the tied wte
            twice = sorted(set(stage) & set(full))
            if twice:
                raise CheckpointError(f"checkpoint {path}: pipeline stage {s} holds {twice[:3]} too")
            full.update(stage)
        for s in range(sizes["pp"]):  # persistent buffers (MoE's expert_bias): replicated within a stage
            first = min(r for r in range(world) if grid_coords(r, sizes)["pp"] == s)
            full.update(states[first].get("buffers") or {})
        return _check_against_model(full, cfg, path), cfg
    except CheckpointError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:  # odd contents
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint {path} is malformed: {type(e).__name__}: {why}") from None


def _check_against_model(full: dict, cfg: ModelConfig, path: str) -> dict:
    """Every key of GPT(cfg).state_dict() with its shape; TP's vocab padding rows dropped; lm_head tied to wte."""
    with torch.device("meta"):  # shapes only: no memory, no init
        want = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    extra = sorted(set(full) - set(want))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensors the model does not have: {extra[:3]}")
    out = {}
    for name, shape in want.items():
        if name == "lm_head.weight" and name not in full:
            continue  # tied: set below
        if name not in full:
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        t = full[name]
        if name == "transformer.wte.weight" and t.dim() == 2 and t.shape[0] > shape[0]:
            t = t[:shape[0]]  # rows only TP padding added (vocab rounded up to a multiple of tp)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(t.shape)}, the model config gives "
                                  f"{shape}")
        out[name] = t.detach().to(torch.float32, copy=True).contiguous()  # copy: never a view of the mmap
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
