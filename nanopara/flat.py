"""One replica on flat buffers (`train.optimizer=flat`): parameters, gradients and AdamW's m, v end to end, one
AdamW launch a step (kernels/adamw.py), and the bf16 copy of the weights that the matmuls read written by it.

Why (issue #44's profile of gpt2_moe's graphed step on one H100, notes/moe.md): torch's fused AdamW, a multi-tensor
kernel over every parameter tensor, ran at 83 % of copy bandwidth (4.4 ms) where one launch over a flat buffer runs
at 98 % (results/bench_adamw.txt); and autocast cast each fp32 weight to bf16 in every forward (1.09 ms: 4 bytes
read and 2 written an element), which the update can write for 2 bytes from the value it already holds.

Layout: the decayed parameters (optim.decays: 2-D and more) first, then the rest, each run in registration order, so
decay is a range (no mask) and the shadow covers [0, n_decay); each starts at a multiple of 64 elements (zeros in
between, which stay zero). Each parameter's .data becomes its view of the buffer
(the same Parameter objects: modules, names and attributes unchanged). Gradients land in their slots of one flat
buffer: the Linear weights' bf16 -> fp32 casts write there (the engine's gradient destinations,
model.matmul_weight), the rest are copied in by a post-accumulate-grad hook (as dp.DDP's buckets), and later
micro-steps accumulate in place. Shadow: `p.shadow` (bf16, p's shape) is what model.matmul_weight hands the matmul
while `p.shadow_version == p._version`: the kernel's writes bump no version; a torch in-place write to p does, and
then the matmul casts as before until the shadow is written again (every step; a model load rewrites it at once).
The step count, the unscale-and-clip divisor and the skip flag are device tensors (no host sync; a skipped step
does not count), as in torch's fused AdamW. Checkpoints: every engine's "full" optimizer format.
Limits: one replica (dp = cp = 1) and no pipeline (config.py says so); CPU runs adamw_ref's torch ops, the same
maths. Tested by tests/test_flat.py against SingleDevice with torch.optim.AdamW.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nanopara.config import Config, TrainConfig
from nanopara.engine import Engine, check_fp32, compute_dtype, param_kind, weak_method
from nanopara.mesh import Mesh
from nanopara.optim import decays


ALIGN = 64  # elements


class FlatAdamW:
    """torch.optim.AdamW as the engines use it (param_groups' lr, step(), state, load_state_dict, grad_scale /
    found_inf set before step) over flat buffers. `shadow`: the dtype of the weight copy, or None."""

    def __init__(self, named_params, t: TrainConfig, device: torch.device, shadow: torch.dtype | None = None):
        seen, decay, rest = set(), [], []
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                (decay if decays(name, p) else rest).append(p)
        self.params = decay + rest
        sizes = [p.numel() for p in self.params]
        ends = [0]  # each parameter at a multiple of ALIGN elements: its fp32, bf16 and gradient views 256 / 128
        for k in sizes:  # bytes aligned, as TMA, cuBLAS and the vectorised kernels want (zero padding between)
            ends.append(ends[-1] + -(-k // ALIGN) * ALIGN)
        self.offsets = ends[:-1]
        self.n, self.n_decay = ends[-1], ends[len(decay)]
        self.p = torch.zeros(self.n, device=device)
        self.g, self.m, self.v = (torch.zeros(self.n, device=device) for _ in range(3))
        self.p16 = torch.empty(self.n_decay, device=device, dtype=shadow) if shadow is not None else None
        self.step_t = torch.zeros((), device=device)  # steps taken (float: the kernel reads it as fp32)
        self.grad_scale = self.found_inf = None
        self.hp = dict(beta1=t.beta1, beta2=t.beta2, eps=t.eps, weight_decay=t.weight_decay)
        self.param_groups = [{"params": decay, "lr": t.lr, "weight_decay": t.weight_decay},
                             {"params": rest, "lr": t.lr, "weight_decay": 0.0}]
        self.state, self.grad_slots = {}, []
        with torch.no_grad():
            for p, o, k in zip(self.params, self.offsets, sizes):
                self.p[o:o + k].copy_(p.detach().reshape(-1))
                p.data = self.p[o:o + k].view_as(p)
                self.grad_slots.append(self.g[o:o + k].view_as(p))
                self.state[p] = {"step": self.step_t, "exp_avg": self.m[o:o + k].view_as(p),
                                 "exp_avg_sq": self.v[o:o + k].view_as(p)}
                if o < self.n_decay and self.p16 is not None:
                    p.shadow = self.p16[o:o + k].view_as(p)
        self.refresh_shadow()

    def refresh_shadow(self) -> None:
        """Write the shadow from the weights (after a load) and mark it current."""
        if self.p16 is not None:
            with torch.no_grad():
                self.p16.copy_(self.p[:self.n_decay])
            self._mark_shadow()

    def _mark_shadow(self) -> None:
        for p in self.params[:len(self.param_groups[0]["params"])] if self.p16 is not None else ():
            p.shadow_version = p._version

    def close(self) -> None:
        """Drop the shadows (matmul_weight casts again); the parameters stay views of the flat buffer."""
        for p in self.params:
            for a in ("shadow", "shadow_version"):
                if hasattr(p, a):
                    delattr(p, a)

    @torch.no_grad()
    def step(self) -> None:
        from kernels.adamw import adamw_step_  # (Triton is imported on first use, as the op tables do)
        if self.found_inf is not None:
            self.step_t.add_(1.0 - self.found_inf)
        else:
            self.step_t.add_(1.0)
        adamw_step_(self.p, self.g, self.m, self.v, self.param_groups[0]["lr"], step=self.step_t,
                    n_decay=self.n_decay, p16=self.p16, grad_scale=self.grad_scale, found_inf=self.found_inf,
                    **self.hp)
        self.grad_scale = self.found_inf = None
        self._mark_shadow()

    def load_state_dict(self, sd: dict) -> None:
        """engine.load_named_optim_state's form: {"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, ...}, the
        index counting parameters over param_groups in order."""
        order = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            for i, st in sd["state"].items():
                mine = self.state[order[i]]
                mine["exp_avg"].copy_(st["exp_avg"])
                mine["exp_avg_sq"].copy_(st["exp_avg_sq"])
                self.step_t.fill_(float(st["step"]))


class FlatSingle(Engine):
    """One replica (dp = cp = 1, any tp) on FlatAdamW's buffers; clipping, the norm and checkpoints as Engine's."""

    label = "SingleDevice(flat)"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        super().__init__(model, mesh, cfg)
        check_fp32(self.params)
        dt = compute_dtype(cfg, mesh.device)
        self.optimizer = FlatAdamW(model.named_parameters(), cfg.train, mesh.device,
                                   shadow=dt if dt == torch.bfloat16 else None)  # (fp16 runs: autocast's casts)
        self._slot = {id(p): s for p, s in zip(self.optimizer.params, self.optimizer.grad_slots)}
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(weak_method(self, "_on_grad")))
        self._set_grad_dests(self.params)
        self._zero_grads()

    def close(self) -> None:
        super().close()
        self.optimizer.close()

    def _on_grad(self, p):
        self._into_slot(p)  # (the Linear weights' gradients are made in their slots: Engine._grad_dest)

    def _finish_grads(self):
        for p in self.params:  # no gradient this step (an unused parameter): its slot holds the last step's
            if p.grad is None:
                p.grad = self._slot[id(p)].zero_()

    def _grad_pieces(self):
        return [(p.grad, param_kind(p)) for p in self.params if p.grad is not None]

    def _zero_grads(self):
        if self.grads_overwritten:  # a graph writes every slot whole each replay
            return
        if self.keep_grad_buffers:  # a graph accumulates into the slots: zero them in place
            self.optimizer.g.zero_()
            for p in self.params:
                p.grad = self._slot[id(p)]
        else:
            for p in self.params:  # the next backward hands its gradients to the slots
                p.grad = None
        self._given.clear()

    def load_model_state_dict(self, sd: dict) -> None:
        super().load_model_state_dict(sd)
        self.optimizer.refresh_shadow()

    def _extra_params(self):
        return [self.optimizer.p16] if self.optimizer.p16 is not None else []

    def _extra_grads(self):
        return [self.optimizer.g]
