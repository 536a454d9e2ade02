"""Resume under any layout: a checkpoint written by one layout loaded into a Trainer of another.

    step = restore_training(path, mesh, trainer, loader)   # train.py's --resume (collective)
    for name, states in full_state(path): ...      # single-device tensors, one name at a time (tests, tools)

Same layout (grid sizes, and every rank's shard in the form its Trainer holds: names, tp/ep slices, pp chunks,
ZeRO flat ranges): each rank loads its own shard, bit-exact. Otherwise every rank builds its own part from the saved
shards, tensor by tensor: `Source` memory-maps every shard (nothing is read until used) and joins one single-device
tensor of "param", "exp_avg" or "exp_avg_sq" at a time: ZeRO's flat [lo, hi) pieces of the dp x cp ranks (experts':
of their edp ranks), then the tp slices, then the ep rows; pipeline stages hold disjoint names (the last stage's
lm_head.weight copy equals the tied wte). `_cut` keeps this rank's tp slices / ep rows, and the pieces are laid out
in the form this rank's engine writes (by name, or ZeRO's "flat_shard" of its own [lo, hi)), so the Trainer loads
a same-layout state. A rank holds its own part plus one full tensor at a time (ZeRO-3 reads only the parameters
that meet its shard), never the whole checkpoint. Also carried: AdamW's step, the loss scale, the MoE buffers, the
loader's position in global samples (data.py: the order depends on the sample index only, so dp, cp and the
micro-batch may change under the same global batch), and the RNG streams: rank r continues saved rank r mod the
saved world (only dropout draws from them while training).
Exactness: parameters and AdamW states are copied: bit-equal to the saved ones under any layout. The continued
losses are bit-equal where the new layout sums the same numbers in the same order (the same layout; measured too:
DDP -> ZeRO-1/2 at dp 2, 1F1B -> GPipe); a change of dp, cp, micro-batch, tp, sp, pp degree or split, ep or ZeRO-3
sums in another order, and they agree to fp32 rounding (tests/test_reshard.py). MoE's aux loss and capacity are per
micro-batch: keep its rows per rank (train.micro_batch) for equal losses. FP8 amax histories (fp8_delayed): the
same layout loads each rank's own (exact); another takes per linear the max over the saved ranks' (fp8.merge_amax).
Format: in every shard and meta.json (1 = unrecorded); a newer one is one clear error (checkpoint.check_format).
"""
from __future__ import annotations

import os

import torch

from nanopara import checkpoint, consolidate
from nanopara.checkpoint import FORMAT, CheckpointError, check_format  # noqa: F401 (FORMAT: tests)
from nanopara.fp8 import merge_amax
from nanopara.model import GPT

KEYS = ("param", "exp_avg", "exp_avg_sq")
_ODD = (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError)  # malformed contents


def _fresh(x):
    """A deep copy of nested dicts/lists whose tensors own their memory (never a view of a memory-mapped shard)."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, dict):
        return {k: _fresh(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_fresh(v) for v in x)
    return x


# ----------------------------------------------------------------------------------------------------------------
# the saved side: every shard memory-mapped, one single-device tensor at a time

class Source:
    """The checkpoint at `path` (any layout): `full(name, key)` joins one single-device tensor from its pieces."""

    def __init__(self, path: str, meta: dict | None = None):
        meta = meta if meta is not None else checkpoint.verify(path, checksums=False)
        self.path, self.meta = path, meta
        self.sizes = consolidate._layout(meta, path)
        self.cfg = consolidate.model_config(meta, path)
        world = self.sizes["pp"] * self.sizes["dp"] * self.sizes["cp"] * self.sizes["tp"]
        self.states = [consolidate._load_shard(path, r, self.sizes) for r in range(world)]  # mmap: nothing read yet
        check_format(meta, self.states[0], path)
        with torch.device("meta"):  # shapes only
            self.shapes = {k: tuple(v.shape) for k, v in GPT(self.cfg).state_dict().items()}
        self.direct, self.flat, self.metas, self.step = {}, {}, {}, 0
        try:
            for st in self.states:
                self._index(st)
        except _ODD as e:
            raise CheckpointError(f"checkpoint {path} is malformed: {type(e).__name__}: {e}") from None

    def _index(self, st: dict) -> None:
        """Record where this shard's tensors sit: (name, key) -> {(tp rank, ep rank): tensor or flat pieces}."""
        tp, ep = st.get("tp_shards") or {}, st.get("ep_shards") or {}

        def pos(name):
            p = (tp[name]["tp_rank"] if name in tp else 0, ep[name]["ep_rank"] if name in ep else 0)
            self.metas.setdefault(name, {}).setdefault(p, (tp.get(name), ep.get(name)))
            return p

        model, engine = st["model"], st.get("engine") or {}
        if model.get("format") == "flat_shard":
            self._flats(model, ("param",), pos)
        else:
            for name, t in model.items():
                self.direct.setdefault((name, "param"), {}).setdefault(pos(name), t)
        if engine.get("format") == "flat_shard":
            self._flats(engine, ("exp_avg", "exp_avg_sq"), pos)
        elif engine.get("format") == "full":
            for name, s in engine["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    self.direct.setdefault((name, key), {}).setdefault(pos(name), s[key])
        elif engine:
            raise ValueError(f"unknown optimizer state format {engine.get('format')!r}")
        self.step = max(self.step, int(engine.get("step", 0)))  # (a ZeRO rank of padding only says 0)

    def _flats(self, sd: dict, keys, pos) -> None:
        for f in sd["flats"]:
            for name, shape, off in f["params"]:
                for key in keys:
                    pieces = self.flat.setdefault((name, key), {}).setdefault(pos(name), {})
                    pieces.setdefault(int(f["lo"]), (f[key], int(f["lo"]), int(f["hi"]), int(off), tuple(shape)))

    def has(self, name: str, key: str = "param") -> bool:
        return (name, key) in self.direct or (name, key) in self.flat

    def _piece(self, name: str, key: str, p: tuple) -> torch.Tensor:
        """The tensor of (tp rank, ep rank) p as that rank held it: a copy, or joined from flat [lo, hi) pieces."""
        if p in self.direct.get((name, key), {}):
            return self.direct[(name, key)][p].detach().clone()
        pieces = self.flat[(name, key)][p]
        shape = next(iter(pieces.values()))[4]
        numel = int(torch.Size(shape).numel())
        out, covered = torch.empty(numel), 0
        _, _, _, off, _ = next(iter(pieces.values()))
        for t, lo, hi, _, _ in pieces.values():
            a, b = max(off, lo), min(off + numel, hi)
            if a < b:
                out[a - off:b - off] = t[a - lo:b - lo]
                covered += b - a
        if covered != numel:
            raise CheckpointError(f"checkpoint {self.path}: the flat shards hold {covered} of {name}'s {numel} "
                                  f"elements ({key})")
        return out.view(shape)

    def full(self, name: str, key: str = "param") -> torch.Tensor | None:
        """Single-device `name` of `key` ("param", "exp_avg", "exp_avg_sq"), fp32, owning its memory; None if the
        checkpoint holds none (the tied lm_head.weight: the pipeline's last-stage copy, else wte)."""
        if name == "lm_head.weight" and not self.has(name, key):
            name = "transformer.wte.weight"
        if not self.has(name, key):
            return None
        at = sorted(set(self.direct.get((name, key), {})) | set(self.flat.get((name, key), {})))
        tp_m, ep_m = self.metas[name][at[0]]
        pieces = [self._piece(name, key, p) for p in at]
        if tp_m is not None:
            full = consolidate._place(name, pieces, [self.metas[name][p][0] for p in at], tp_m["tp"])
        elif ep_m is not None:
            full = consolidate._place(name, pieces, [{**self.metas[name][p][1], "tp": ep_m["ep"], "tp_rank": p[1]}
                                                     for p in at], ep_m["ep"])
        else:
            full = pieces[0]
        want = self.shapes.get(name)
        if want is not None and full.dim() == len(want) and full.shape[0] > want[0]:
            full = full[:want[0]].clone()  # rows only TP's vocab padding added
        if want is not None and tuple(full.shape) != want:
            raise CheckpointError(f"checkpoint {self.path}: {name} joins to shape {tuple(full.shape)}, the model "
                                  f"config gives {want}")
        return full.float()

    def buffer(self, name: str) -> torch.Tensor | None:
        """A persistent model buffer (MoE's expert_bias: the same on every rank holding its layer)."""
        for st in self.states:
            if name in (st.get("buffers") or {}):
                return st["buffers"][name].clone()
        return None


def full_state(path: str):
    """(name, {"param", "exp_avg", "exp_avg_sq": single-device tensor or None}) for every parameter of the model
    (the tied weight once), then (name, {"buffer": tensor}) for its buffers: streamed, one name at a time."""
    src = Source(path)
    with torch.device("meta"):
        model = GPT(src.cfg)
    params = [n for n, _ in model.named_parameters()]
    for name in params:
        yield name, {key: src.full(name, key) for key in KEYS}
    for name in model.state_dict():
        if name not in params and name != "lm_head.weight":
            yield name, {"buffer": src.buffer(name)}


# ----------------------------------------------------------------------------------------------------------------
# this rank's side: its part, in the form its engine writes

def _cut(full: torch.Tensor, tp_m: dict | None, ep_m: dict | None) -> torch.Tensor:
    """This rank's part of a single-device tensor: its tp slices (after TP's vocab padding rows), or its ep rows."""
    for m in (tp_m, ep_m):
        if m is None:
            continue
        shape = list(m["full_shape"])
        if full.shape[0] < shape[0] and list(full.shape[1:]) == shape[1:]:  # TP pads the vocabulary with zero rows
            full = torch.cat([full, full.new_zeros(shape[0] - full.shape[0], *shape[1:])])
        if list(full.shape) != shape:
            raise CheckpointError(f"a tensor of shape {tuple(full.shape)} cannot be cut as {shape}")
        full = torch.cat([full.narrow(m["dim"], lo, hi - lo) for lo, hi in m["slices"]], m["dim"])
    return full


def _local_state(src: Source, tgt: dict) -> dict:
    """The state this rank's Trainer would save (tgt: its state_dict now, for names, shapes and forms) with the
    checkpoint's values, built one tensor at a time."""
    tp, ep = tgt.get("tp_shards") or {}, tgt.get("ep_shards") or {}

    def part(name, key, shape):
        full = src.full(name, key)
        if full is None and key != "param":  # AdamW never stepped it (no gradient yet): no state, as saved
            return None
        if full is None:
            raise CheckpointError(f"checkpoint {src.path} holds no {name}")
        t = _cut(full, tp.get(name), ep.get(name)).contiguous()
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint {src.path}: {name} gives this rank a part of shape "
                                  f"{tuple(t.shape)}, its model holds {tuple(shape)}")
        return t

    def flats(sd, keys):
        out = []
        for f in sd["flats"]:
            new = {k: v for k, v in f.items() if k not in KEYS}
            lo, hi = int(f["lo"]), int(f["hi"])
            for key in keys:
                new[key] = torch.zeros(hi - lo)
            for name, shape, off in f["params"]:
                a, b = max(off, lo), min(off + int(torch.Size(shape).numel()), hi)
                for key in keys if a < b else ():  # only the parameters that meet this rank's [lo, hi)
                    t = part(name, key, shape)
                    if t is not None:  # (else AdamW's zeros)
                        new[key][a - lo:b - lo] = t.reshape(-1)[a - off:b - off]
            out.append(new)
        return {**{k: v for k, v in sd.items() if k != "flats"}, "flats": out}

    model, engine = tgt["model"], tgt["engine"]
    if model.get("format") == "flat_shard":
        new_model = flats(model, ("param",))
    else:
        new_model = {name: part(name, "param", t.shape) for name, t in model.items()}
    if engine.get("format") == "flat_shard":
        new_engine = {**flats(engine, ("exp_avg", "exp_avg_sq")), "step": src.step}
    else:  # engine.py's "full" form, for every parameter the model holds
        state = {name: {key: part(name, key, t.shape) for key in ("exp_avg", "exp_avg_sq")}
                 for name, t in model.items()}
        new_engine = {"format": "full", "step": src.step,
                      "state": {name: st for name, st in state.items() if all(v is not None for v in st.values())}}
    buffers = {}
    for name, t in (tgt.get("buffers") or {}).items():
        b = src.buffer(name)
        if b is None or b.shape != t.shape:
            raise CheckpointError(f"checkpoint {src.path} holds no buffer {name} of shape {tuple(t.shape)}")
        buffers[name] = b
    return {"model": new_model, "engine": new_engine, "buffers": buffers,
            "scaler": _fresh(src.states[0].get("scaler", tgt["scaler"]))}


def _form(sd: dict):
    """What must match for a shard to load as it is: names and shapes or flat layouts, slices, chunks."""
    def of(x, tensors):
        if x.get("format") == "flat_shard":
            keys = ("params", "numel", "padded", "lo", "hi", "expert")
            return "flat_shard", x.get("rank"), x.get("world"), [{k: f.get(k) for k in keys} for f in x["flats"]]
        return x.get("format"), sorted((n, tuple(t.shape)) for n, t in x.items()) if tensors else None
    return (of(sd["model"], True), of(sd["engine"], False), sd.get("tp_shards") or {}, sd.get("ep_shards") or {},
            sd.get("pp_chunks"))


# ----------------------------------------------------------------------------------------------------------------
# restore

def restore(path: str, mesh, trainer, loader) -> int:
    """Load the checkpoint at `path` into this rank's trainer, loader and RNGs under this run's layout; returns the
    step to continue from. Collective (every rank learns whether all can load their own shard as it is); raises
    CheckpointError, the same on every rank up to the first collective, else this rank's (restore_training agrees)."""
    err, own = None, False
    try:
        meta = checkpoint.verify(path, share=(mesh.rank, mesh.world))
        check_format(meta, None, path)
        tgt = trainer.state_dict()
        if meta["layout"] == checkpoint.layout(mesh):
            shard = consolidate._load_shard(path, mesh.rank, consolidate._layout(meta, path))
            own = _form(shard) == _form(tgt)
    except CheckpointError as e:
        err = str(e)
    except _ODD as e:
        err = f"checkpoint {path} is malformed: {type(e).__name__}: {e}"
    views = checkpoint._all_gather(mesh, (err, own))
    err = next((e for e, _ in views if e), None)
    if err:
        raise CheckpointError(err)
    try:
        if all(o for _, o in views):  # the same layout: each rank's own shard, bit-exact
            state, meta = checkpoint.load(path, mesh)
            check_format(meta, state, path)
            rng = state["rng"]
        else:
            src = Source(path, meta)
            state = {**_local_state(src, tgt), "loader": src.states[0]["loader"]}
            rng = src.states[mesh.rank % len(src.states)]["rng"]
            saved = [(st.get("fp8") or {}).get("amax") for st in src.states]
            if "fp8" in tgt and any(saved):
                state["fp8"] = {"amax": merge_amax(saved, tgt["fp8"]["amax"])}
                if mesh.is_main:
                    print(f"note: FP8 amax histories of {path} carried over to this layout: per linear the max over "
                          f"the saved ranks' (their whole tensors' amaxes)", flush=True)
        if "fp8" in tgt and "fp8" not in state and mesh.is_main:
            print(f"note: {path} holds no FP8 amax histories (saved without train.fp8_delayed): delayed scaling "
                  f"starts afresh", flush=True)
        bad = checkpoint.nonfinite(checkpoint._trained_state(state))
        if bad:
            raise CheckpointError(f"checkpoint {path} holds non-finite values ({', '.join(bad[:3])}): resume from an "
                                  f"earlier one (write its name into {os.path.dirname(path)}/latest)")
        try:
            trainer.load_state_dict(state)
            loader.load_state_dict(_fresh(state["loader"]))
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from None
        checkpoint.set_rng_state(_fresh(rng), mesh.device)
    except _ODD as e:
        raise CheckpointError(f"checkpoint {path} is malformed: {type(e).__name__}: {e}") from None
    return meta["step"]


def restore_training(path: str, mesh: Mesh, trainer, loader) -> int:
    """Load the checkpoint into the trainer, loader and RNGs under this run's layout, whatever layout wrote it
    (restore(); the same layout loads each rank's own shard, bit-exact); returns the step to continue from.
    Collective: a failure on any rank (corrupt shard, non-finite values, another model) is the same error on every
    rank."""
    err = step = None
    try:
        step = restore(path, mesh, trainer, loader)
    except CheckpointError as e:
        err = str(e)
    err = checkpoint._first_error(mesh, err)
    if err:
        raise checkpoint.AgreedError(err)
    return step


def full_optimizer_state(ckpt_path: str) -> dict:
    """AdamW's state of a checkpoint of any layout in engine.py's single-device "full" form ({"format": "full",
    "step", "state": {name: {"exp_avg", "exp_avg_sq"}}}), loadable by any engine's load_state_dict."""
    path, _ = consolidate.resolve(ckpt_path)
    src = Source(path, checkpoint.check_complete(path))
    with torch.device("meta"):
        names = [n for n, _ in GPT(src.cfg).named_parameters()]  # the tied weight once
    return {"format": "full", "step": src.step,
            "state": {n: {k: src.full(n, k) for k in ("exp_avg", "exp_avg_sq")} for n in names}}
