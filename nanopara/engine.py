"""What every data-parallel engine shares: the Engine base (loss averaging, no_sync, the step, clipping).

An engine owns a model's optimizer and gradient synchronisation; the Trainer (trainer.py) drives it:

    engine = build_engine(model, mesh, cfg)       # parallel.py: SingleDevice, DDP (dp.py), ZeRO (zero.py, zero3.py)
    for micro in range(accum):
        with engine.no_sync(micro < accum - 1):   # no gradient communication on non-final micro-steps
            _, loss = engine.model(x, y)
            engine.backward(loss * scale / accum)
    grad_norm = engine.step(lr, grad_scale=scale) # clip + update + zero grads; inf/nan norm => step skipped

N = dp*cp ranks hold replicas; gradients of replicated parameters reduce over mesh.groups["dp_cp"]. Averaging is
done in exactly one place: `backward` scales the loss by 1/N, and every reduction is a SUM. Parameters are fp32
master weights, compute runs under autocast, gradients and AdamW's m, v are fp32 (bytes: `Engine.memory_bytes`).
Clipping uses the global norm: squares summed over dp x cp for shards (ZeRO), over tp for `p.tp_dim` parameters
(tp-replicated ones counted once), over ep for experts (`p.ep_dim`), and over pp (the last stage's copy of the tied
weight, `p.pp_tied_copy`, skipped); `p.sp_partial` grads are summed over tp first (tp.py). Pipelines run their
backwards under no_sync and call `sync_from_now` from each chunk's last backward (pp.Pipeline's on_last_backward).
Checkpoints: model_state_dict()/state_dict() return this rank's part; an unsharded optimizer's is {"format": "full",
"step", "state": {name: {"exp_avg", "exp_avg_sq"}}}. Every engine loads the full forms (resharding) and its own
layout (bit-exact resume). ZeRO-1/2's parameter all-gathers may still run after step() (zero.py's prefetch): read
or write parameters outside a forward only after `wait_params()`. Hooks hold the engine weakly (`weak_method`), so
`del engine` frees everything.
Buckets and flat buffers: buckets.py. Used by dp.py, zero.py and zero3.py; tested through them by tests/test_dp.py.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from nanopara.comm import NoWork  # noqa: F401  (dp.py, zero.py take it from here)
from nanopara.config import Config
from nanopara.mesh import Mesh
from nanopara.optim import clip_coef

REPLICATED, TP_SHARDED, SP_PARTIAL, PP_COPY, EXPERT, EXPERT_SP = 0, 1, 2, 3, 4, 5
PARTIAL_OVER_TP = (SP_PARTIAL, EXPERT_SP)


def param_kind(p: torch.Tensor) -> int:
    """How a parameter relates to tp (tp.py's contract): sharded (tp_dim), partial grads (sp_partial), replicated;
    PP_COPY: the last pipeline stage's copy of the tied weight (pp.py), left out of the norm (the first stage's
    copy has the same gradient); EXPERT: this ep rank's experts (ep.py's `ep_dim`), reduced over the edp group;
    EXPERT_SP: the same under sequence parallel, whose tp ranks routed different tokens: also summed over tp."""
    if getattr(p, "pp_tied_copy", False):
        return PP_COPY
    if hasattr(p, "ep_dim"):
        return EXPERT_SP if getattr(p, "sp_partial", False) else EXPERT
    if hasattr(p, "tp_dim"):
        return TP_SHARDED
    return SP_PARTIAL if getattr(p, "sp_partial", False) else REPLICATED


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The autocast dtype (trainer.autocast's choice): bf16 on GPU and fp32 on CPU for train.dtype=auto."""
    from nanopara.trainer import autocast  # (trainer.py builds on the engines: imported when first needed)
    return autocast(cfg, device)[1] or torch.float32


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    sizes = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            sizes[s.data_ptr()] = s.nbytes()
    return sum(sizes.values())


def sum_sq(grads, device) -> torch.Tensor:
    """Sum of squares of a list of tensors, fp32, 0-dim on `device`."""
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm([g.float() for g in grads])).pow(2).sum()


def sum_over(tensors, group) -> None:
    """In-place SUM over `group` of a list of fp32 tensors in one collective."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # (Σ numel,): a few small tensors per layer
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def weak_method(obj, name: str):
    """A callable that calls obj.<name> (looked up at call time, so a patched method is honoured) without keeping
    `obj` alive (a no-op once it is gone).

    Hooks on parameters and autograd nodes are held by C++ structures that Python's gc cannot traverse: a hook
    holding the engine strongly (a bound method, a lambda over self) would make engine -> params -> hook -> engine
    an uncollectable cycle, and the engine, its model and every buffer they own would outlive `del engine`.
    """
    ref = weakref.ref(obj)

    def call(*args, **kwargs):
        o = ref()
        return None if o is None else getattr(o, name)(*args, **kwargs)
    return call


def check_fp32(params) -> None:
    bad = [tuple(p.shape) for p in params if p.dtype != torch.float32]
    if bad:
        raise ValueError(f"data-parallel engines keep fp32 master weights; got {len(bad)} non-fp32 parameters "
                         f"(e.g. shape {bad[0]}): build the model in fp32 and train under autocast")


def named_optim_state(opt: torch.optim.Optimizer, names: dict) -> dict:
    """An unsharded optimizer's state in the "full" format, keyed by parameter name (names: id(p) -> name)."""
    state, step = {}, 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                state[names[id(p)]] = {k: v for k, v in st.items() if k != "step"}
                step = int(st["step"])
    return {"format": "full", "step": step, "state": state}


def load_named_optim_state(opt: torch.optim.Optimizer, names: dict, sd: dict) -> None:
    """Inverse of `named_optim_state`."""
    if sd.get("format") != "full":
        raise ValueError(f"optimizer state of format {sd.get('format')!r} does not fit this engine: "
                         f"load zero.unshard_optimizer(<every rank's shard>) instead")
    state, groups, i = {}, [], 0
    for group in opt.param_groups:
        ids = []
        for p in group["params"]:
            if names[id(p)] in sd["state"]:
                state[i] = {"step": torch.tensor(float(sd["step"])), **sd["state"][names[id(p)]]}
            ids.append(i)
            i += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    opt.load_state_dict({"state": state, "param_groups": groups})  # casts/moves m, v to each parameter


# ----------------------------------------------------------------------------------------------------------------
# the engine base: loss averaging, no_sync, clip-and-step, accounting, checkpoints of replicated engines

class Engine:
    sharded_grads = False  # True: the grads this rank holds are 1/N shards (their squares sum over dp x cp)
    label = "engine"       # for messages
    keep_grad_buffers = False  # zero .grad in place after a step instead of freeing (CUDA graphs: fixed addresses)
    grads_overwritten = False  # graph.GraphedMicroStep(overwrite): each replay writes every .grad whole: leave them
    reduced_in_graph = False   # graph.GraphedPipelineStep reduced the gradients inside its graph: step() does not

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        self.model, self.mesh, self.cfg, self.device = model, mesh, cfg, mesh.device
        self.group = mesh.groups.get("dp_cp")
        self.n = mesh.dp * mesh.cp
        self.r = mesh.ranks["dp_cp"].index(mesh.rank) if "dp_cp" in mesh.ranks else 0
        self.tp_group = mesh.groups.get("tp") if mesh.tp > 1 else None
        self.pp_group = mesh.groups.get("pp") if mesh.pp > 1 else None
        # expert parallel (ep.py): experts' grads reduce over edp (their replicas), their norms sum over ep
        self.ep_group, self.edp_group = mesh.groups.get("ep"), mesh.groups.get("edp")
        self._live = set()  # ids of parameters whose next gradient is the step's last (sync_from_now)
        self.async_step = self.device.type == "cuda"  # step(): needs the fused AdamW that engines build on GPU
        self._sync = True
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied weight once
        self.names = {id(p): name for name, p in named}
        self.params = [p for _, p in named]
        self.optimizer = None
        self._handles = []  # hook handles, removed by close()
        self._dest_params, self._given = [], set()  # parameters with a gradient destination; ids given one this round
        self.copied = 0  # gradient elements copied into communication buffers (what the destinations avoid)

    def close(self) -> None:
        """Wait for the gradient communication in flight (starts none) and remove this engine's hooks from the
        model (idempotent). Not needed to free memory (hooks hold the engine weakly, so `del engine` frees it);
        call it before handing the model to another engine, so the old hooks stop running."""
        self.wait_params()
        self._wait_inflight()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._set_grad_dests([])

    def _set_grad_dests(self, params) -> None:
        """Give `params` gradient destinations. Those that model.matmul_weight reads (the Linear weights) ask for
        one in backward: each weight's fp32 gradient is then written by its bf16 -> fp32 cast straight into
        `self._grad_dest(p)`, a view of the engine's buffer that autograd keeps as p.grad, instead of into a new
        tensor the engine would copy there. Not for a parameter the model holds under two names (the tied
        wte/lm_head): autograd sums its two gradients into a new tensor anyway. `_grad_dest` gives a parameter
        at most one destination per round (`_given`), so a weight used twice in one forward gets its second
        gradient in a new tensor, which autograd adds to the first (into a new tensor, which is then copied
        like any other gradient)."""
        for p in self._dest_params:  # the previous ones go (close(): all)
            if hasattr(p, "grad_into"):
                del p.grad_into
        uses = {}
        for _, p in self.model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        dest = weak_method(self, "_grad_dest")
        self._dest_params = [p for p in params if uses.get(id(p)) == 1]
        for p in self._dest_params:
            p.grad_into = dest

    @contextlib.contextmanager
    def no_sync(self, skip: bool = True):
        prev, self._sync = self._sync, not skip
        try:
            yield
        finally:
            self._sync = prev

    def sync_from_now(self, params) -> None:
        """pp.Pipeline's on_last_backward: the gradients `params` get from now on are the step's last, so their
        buckets may reduce as soon as they are complete, overlapping the backwards still to run; the rest of the
        step stays under no_sync. Never the tied weight: its halves are summed across stages first."""
        self._live.update(id(p) for p in params if not getattr(p, "pp_tied", False))

    def backward(self, loss: torch.Tensor) -> None:
        self._before_backward()
        (loss / self.n if self.n > 1 else loss).backward()  # THE place where gradients are averaged over dp x cp
        self._after_backward()

    def step(self, lr: float, grad_scale: float = 1.0, sync: bool = True):
        """Clip by the global norm, undo grad_scale, update, zero the grads; returns the norm (of the unscaled
        grads). A non-finite norm skips the update (and ZeRO's parameter all-gather has nothing new to send).
        sync=False: on GPU the norm comes back as a 0-dim device tensor, unread, so nothing waits for the GPU
        (train.py reads it one step later); a float otherwise.

        GPU (`async_step`): nothing waits for the norm before the update is issued. The fused AdamW kernel takes
        the unscale-and-clip divisor and the skip flag as device tensors (the `grad_scale` / `found_inf` it has
        for AMP), so the step's one host sync, reading the norm, comes after the update and ZeRO's all-gather are
        queued, as torch's clip_grad_norm_ + step + norm.item() does; reading the norm first left the GPU idle
        while the host issued the clip and the update (124M's clip + update: 2.4-2.6 ms of GPU time that way,
        2.1 ms now; 2 x H100, B=16). CPU: the norm is read first and the for-loop AdamW runs as before."""
        self.wait_params()  # (ZeRO prefetch: a gather still in flight sends the shard this update writes)
        if not self.reduced_in_graph:
            self._finish_grads()
        self._live = set()
        pieces = self._grad_pieces()  # [(grad, kind)]: every gradient (or shard) this rank holds
        sum_over([g for g, k in pieces if k in PARTIAL_OVER_TP], self.tp_group)
        sq = self._global_sq(pieces)
        if self.async_step:
            norm = sq.sqrt() / grad_scale
            if self.optimizer is not None:
                self.optimizer.grad_scale = grad_scale / clip_coef(norm, self.cfg.train.grad_clip)  # the kernel
                self.optimizer.found_inf = (~torch.isfinite(norm)).float()                          # divides
                self._update(lr)
            self._after_step()
            self._zero_grads()  # stream-ordered after the update; the host work is done before the one sync
            return norm.item() if sync else norm
        norm = math.sqrt(sq.item()) / grad_scale
        if math.isfinite(norm):
            coef = clip_coef(torch.tensor(norm), self.cfg.train.grad_clip).item() / grad_scale
            if coef != 1.0:
                torch._foreach_mul_([g for g, _ in pieces], coef)
            if self.optimizer is not None:
                self._update(lr)
            self._after_step()
        self._zero_grads()
        return norm

    def _update(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def _global_sq(self, pieces) -> torch.Tensor:
        """The squared global norm of the gradients: fp32, 0-dim, on the device (no host sync)."""
        sq = torch.stack([sum_sq([g for g, k in pieces if k in (REPLICATED, SP_PARTIAL)], self.device),  # tp-repl.
                          sum_sq([g for g, k in pieces if k == TP_SHARDED], self.device),  # tp-sharded
                          sum_sq([g for g, k in pieces if k in (EXPERT, EXPERT_SP)], self.device)])  # ep's; (3,)
        if self.sharded_grads and self.group is not None:  # ZeRO: expert shards too (edp x ep = dp x cp)
            dist.all_reduce(sq, group=self.group)
        elif self.ep_group is not None:  # replicated engines: the ep ranks hold different experts
            ep_part = sq[2:].clone()
            dist.all_reduce(ep_part, group=self.ep_group)
            sq = torch.cat([sq[:2], ep_part])
        if self.tp_group is not None:
            tp_part = sq[1:2].clone()
            dist.all_reduce(tp_part, group=self.tp_group)
            sq = torch.cat([sq[:1], tp_part, sq[2:]])
        sq = sq.sum()
        if self.pp_group is not None:  # every stage holds other parameters (PP_COPY left out above)
            dist.all_reduce(sq, group=self.pp_group)
        return sq

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state (m and v; not AdamW's 0-dim step counters) this rank
        holds, asserted by tests/test_dp.py. For Ψ parameters (the tied wte/lm_head counted once), 4-byte
        params/grads and K = 8 (fp32 m, v), ZeRO paper Fig. 1; Ψ' = Σ over flat buffers of their size rounded up
        to a multiple of N (Ψ' - Ψ < N per buffer):

            engine    params   grads    optim    paper (Ψ' = Ψ)
            DDP       4Ψ       4Ψ       8Ψ       16Ψ
            ZeRO-1    4Ψ'      4Ψ'      8Ψ'/N    8Ψ + 8Ψ/N
            ZeRO-2    4Ψ'      4Ψ'/N    8Ψ'/N    4Ψ + 12Ψ/N
            ZeRO-3    4Ψ'/N    4Ψ'/N    8Ψ'/N    16Ψ/N

        Transients of a step come on top (activations; autocast's bf16 weight copies, none under ZeRO-3; one
        bucket or unit of gradients in flight per engine: see each engine's docstring)."""
        params = list(self.model.parameters())
        return {"params": storage_bytes(params + self._extra_params()),
                "grads": storage_bytes([p.grad for p in params] + self._extra_grads()),
                "optim": storage_bytes(self._optim_state())}

    def _optim_state(self):
        return [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]

    def model_state_dict(self) -> dict:
        self.wait_params()
        return {name: p.detach() for name, p in self.model.named_parameters()}  # the tied lm_head.weight once

    def load_model_state_dict(self, sd: dict) -> None:
        if "format" in sd:
            raise ValueError(f"a '{sd['format']}' model state does not fit {self.label}: "
                             f"load zero.unshard_model(<every rank's shard>) instead")
        missing = [name for name in self.names.values() if name not in sd]
        unexpected = [k for k in sd if k not in dict(self.model.named_parameters(remove_duplicate=False))]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.wait_params()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(sd[name])

    def full_model_state_dict(self) -> dict:
        """{name: full tensor} on every rank (collective for ZeRO-3); tp shards stay this tp rank's."""
        return {name: t.clone() for name, t in self.model_state_dict().items()}

    def state_dict(self) -> dict:
        return named_optim_state(self.optimizer, self.names)

    def load_state_dict(self, sd: dict) -> None:
        load_named_optim_state(self.optimizer, self.names, sd)

    def _grad_dest(self, p):
        """p's slot (`self._slot[id(p)]`, p-shaped, in an engine's flat gradient buffer) as a new view, so autograd
        keeps it as p.grad without a copy, for p's first gradient after a step; None later (the next micro-steps
        accumulate into p.grad, the slot, in place). Engines without slots define their own (zero.py)."""
        if p.grad is not None or id(p) in self._given:
            return None
        self._given.add(id(p))
        return self._slot[id(p)].view_as(p)

    def _into_slot(self, p) -> None:
        """A post-accumulate-grad hook's part: p's first gradient since the step, made elsewhere than in its slot
        (no destination: not a Linear weight), is copied into the slot, which becomes p.grad."""
        slot = self._slot[id(p)]
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            self.copied += p.numel()
            p.grad = slot

    def drop_grads(self) -> None:
        """.grad = None everywhere and every gradient destination free again (graph.py, before an overwrite
        capture: its backward then writes each gradient whole where the engine's destinations say)."""
        self.wait_params()
        for p in self.params:
            p.grad = None
        self._given.clear()

    # hooks for the subclasses
    def zero_grad_buffers(self) -> None:
        """Zero the gradients in place, keeping their tensors (graph.py: a captured backward writes into them)."""
        self.wait_params()
        self._zero_grads()

    def wait_params(self) -> None:
        """Make the current stream wait for every parameter all-gather still in flight (ZeRO-1/2's prefetch,
        zero.py; no host sync on GPU): whatever reads or writes parameters outside a hooked forward calls it."""

    def _before_backward(self): pass
    def _after_backward(self): pass
    def _finish_grads(self): pass
    def _wait_inflight(self): pass
    def _after_step(self): pass
    def _extra_params(self): return []
    def _extra_grads(self): return []
