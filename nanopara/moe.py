"""Mixture-of-Experts MLP: a router and E GPT-2 MLPs in place of a block's MLP (Switch, GShard, DeepSeek-V3).

Math, per token x (C,), E experts, top-k (Shazeer et al. 2017; Fedus et al. 2021):
    z = W_r x in fp32 (E,),   s = softmax(z) | sigmoid(z)
    experts e_1..e_k = top-k of s + b      b: the aux-loss-free balancing bias (a buffer; selects, never weighs)
    gates g_j = s_{e_j} / sum_i s_{e_i}     (moe_renorm=False keeps s_{e_j}: with k = 1 a renormalised gate is 1)
    y = sum_j g_j MLP_{e_j}(x) [+ MLP_shared(x)],  MLP(x) = c_proj(gelu_tanh(c_fc(x))) (shared: moe_shared > 0)
  Capacity (moe_capacity = cf > 0): each expert keeps at most ceil(cf * N * k / E) of the N*k assignments, first
  choices before second choices, each in token order (GShard); a token whose k assignments all drop passes through
  on the residual stream (and the shared experts). cf = 0: dropless.
Aux losses over the N tokens of a forward (Switch eq. 4-6; ST-MoE eq. 5): balance L_b = E * sum_e f_e P_e (f_e:
  the share of assignments routed to e, P_e = mean_t p_e, p = s / sum(s)); z-loss L_z = mean_t logsumexp(z_t)^2;
  aux = moe_aux_coef * L_b + moe_z_coef * L_z. Its gradient enters in the backward of the layer's output
  (`_AuxLossGrad`, Megatron-Core's auto-scaler): `aux_grad_scale` must equal the factor the trainer puts on its loss.
Aux-loss-free balancing (DeepSeek-V3), moe_bias_rate = u > 0: after the optimizer step `update_expert_bias(model)`
  sets b_e += u * sign(mean(load) - load_e) from the loads counted by the training forwards (all-reduced first).
Paths (`impl`, the same numbers up to summation order): loop (the spec, `moe_loop_ref`), sorted (kernels/moe_route's
PyTorch references; host syncs), grouped_mm (torch._grouped_mm; CUDA, 16-bit), triton (kernels/moe_route.py and
kernels/grouped_gemm.py: no host sync, fixed shapes: a CUDA graph can hold it), auto (triton on CUDA, sorted elsewhere).
`aux_loss` after a forward; `stats` (views of the `stat` buffer: aux, z, drop, load_min, load_max) after a training
one: what a step changes is written in place into buffers (stat, load, aux_scale), so a graph replay repeats it.
Parameters: router.weight (E, C); experts.c_fc / c_proj (E, H, C) / (E, C, H), H = moe_hidden or 4C, biases (E, H)
/ (E, C); shared.c_fc / c_proj (S*H, C) / (C, S*H). Expert parallel: ep.py. Callers: model.py (Block), trainer.py
(aux scale, bias update, stats). Tests: tests/test_moe.py, test_moe_fine.py, test_capture_safety.py; notes/moe.md.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

IMPLS = ("auto", "loop", "sorted", "grouped_mm", "triton")
STATS = ("aux", "z", "drop", "load_min", "load_max")  # MoEMLP.stats, in the order of its `stat` buffer


@dataclass
class MoEConfig:
    """The fields MoEMLP reads. ModelConfig gets the moe_* ones under the same names when the model integrates MoE."""
    n_embd: int = 768            # residual width C; experts are GPT-2 MLPs C -> 4C -> C
    n_layer: int = 12            # for the c_proj init, N(0, 0.02 / sqrt(2 n_layer))
    bias: bool = True            # biases in the expert Linears (the router has none)
    dropout: float = 0.0         # on the layer's output, as the dense MLP
    moe_experts: int = 8         # E
    moe_top_k: int = 2           # experts per token
    moe_score: str = "softmax"   # softmax | sigmoid (DeepSeek-V3)
    moe_renorm: bool = True      # gates renormalised over the chosen k (False: Switch's k = 1 gate s_e)
    moe_capacity: float = 0.0    # capacity factor cf: each expert keeps ceil(cf * N * k / E) assignments; 0 = dropless
    moe_aux_coef: float = 0.01   # load-balancing loss weight (Switch: 0.01); 0 = off
    moe_z_coef: float = 0.001    # router z-loss weight (ST-MoE: 0.001); 0 = off
    moe_bias_rate: float = 0.0   # aux-loss-free bias step u (DeepSeek-V3: 0.001); 0 = off
    moe_impl: str = "auto"       # auto | triton | grouped_mm | sorted | loop
    moe_hidden: int = 0          # each expert's hidden width H; 0 = 4 * n_embd (GPT-2's MLP)
    moe_shared: int = 0          # shared experts S (always on, width H each: one dense MLP of S*H); 0 = none

    def __post_init__(self):
        check_moe_config(self)


def check_moe_config(cfg) -> None:
    """Every check MoE needs without a process group: MoEConfig.__post_init__, MoEMLP and Config.check call it."""
    if cfg.moe_experts < 1 or not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise ValueError(f"moe: need 1 <= moe_top_k <= moe_experts, got top_k={cfg.moe_top_k}, "
                         f"experts={cfg.moe_experts}")
    if cfg.moe_score not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_score must be softmax or sigmoid, got {cfg.moe_score!r}")
    for name in ("moe_capacity", "moe_aux_coef", "moe_z_coef", "moe_bias_rate", "moe_hidden", "moe_shared"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.moe_impl not in IMPLS:
        raise ValueError(f"moe_impl must be one of {', '.join(IMPLS)}, got {cfg.moe_impl!r}")


# ----------------------------------------------------------------------------------------------------------------
# routing math shared by every path


def gate_weights(logits, idx, score="softmax", renorm=True):
    """Gates (N, k) fp32 of the chosen experts, differentiable in the logits (the selection itself is not)."""
    s = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()  # (N, E)
    g = s.gather(1, idx)
    return g / g.sum(-1, keepdim=True) if renorm else g


def load_balance_loss(logits, counts, k, score="softmax"):
    """Switch/GShard L_b = E * sum_e f_e P_e: f from the routed counts (no gradient), P the mean probabilities."""
    N, E = logits.shape
    s = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    p = s if score == "softmax" else s / s.sum(-1, keepdim=True)
    f = counts.float() / (N * k)
    return E * (f * p.mean(0)).sum()


def z_loss(logits):
    """ST-MoE router z-loss: mean over tokens of logsumexp(z)^2."""
    return torch.logsumexp(logits.float(), -1).pow(2).mean()


def capacity_of(N, k, E, factor):
    """Assignments each expert keeps: ceil(factor * N * k / E); None (dropless) for factor 0."""
    return None if factor <= 0 else math.ceil(factor * N * k / E)


def _kernels():
    """(kernels.moe_route, kernels.grouped_gemm), imported on first use: they import Triton, which a model without
    MoE layers never needs (model.py's TritonOps does the same). The routing references live there too (DESIGN §5)."""
    from kernels import grouped_gemm, moe_route
    return moe_route, grouped_gemm


def compute_dtype(x):
    """The dtype the expert matmuls run in: autocast's when it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


# ----------------------------------------------------------------------------------------------------------------
# modules


class ExpertLinear(nn.Module):
    """E Linears stacked: weight (E, n_out, n_in), bias (E, n_out); slice e is an nn.Linear's parameters."""

    def __init__(self, n_experts, n_in, n_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_experts, n_out)) if bias else None


class Experts(nn.Module):
    """E GPT-2 MLPs: c_fc C -> H, GELU (tanh), c_proj H -> C; H = 4C unless given (moe_hidden)."""
    takes_fp8 = True  # fp8.apply_fp8 marks them (`fp8_state`): their MLP then runs kernels/grouped_gemm_fp8.py

    def __init__(self, n_experts, n_embd, bias=True, hidden=0):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = ExpertLinear(n_experts, n_embd, hidden, bias)
        self.c_proj = ExpertLinear(n_experts, hidden, n_embd, bias)

    def params(self):
        """(w_fc, b_fc, w_proj, b_proj), biases None without bias."""
        return self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias

    def mlp(self, e, x):
        """Expert e on rows x (n, C) -> (n, C); the PyTorch paths (autocast applies as in the dense MLP)."""
        b_fc = None if self.c_fc.bias is None else self.c_fc.bias[e]
        b_proj = None if self.c_proj.bias is None else self.c_proj.bias[e]
        h = F.gelu(F.linear(x, self.c_fc.weight[e], b_fc), approximate="tanh")
        return F.linear(h, self.c_proj.weight[e], b_proj)


class _AuxLossGrad(torch.autograd.Function):
    """fwd: y unchanged; bwd: y's gradient, and `scale` (a 0-dim device tensor) as the gradient of the aux loss
    (Megatron-Core's MoEAuxLossAutoScaler): the aux loss trains the router without being added to the trainer's
    loss."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.save_for_backward(scale)
        ctx.aux_dtype = aux.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (scale,) = ctx.saved_tensors
        return dy, scale.to(ctx.aux_dtype), None


def moe_loop_ref(x, logits, experts, k, score="softmax", renorm=True, bias=None, capacity=None):
    """The spec, one expert at a time: top-k of the (biased) scores; expert e takes its assignments in slot-major
    order (all first choices by token, then second choices, ...), keeps the first `capacity`, runs its MLP on those
    tokens and adds gate * output into their rows. Returns (y (N, C), counts (E,) before dropping, kept total)."""
    N, E = logits.shape
    mr, _ = _kernels()
    idx = mr.topk_ref(mr.select_key(logits.detach(), score, bias), k)  # (N, k)
    gates = gate_weights(logits, idx, score, renorm)
    y = torch.zeros(N, x.shape[1], device=x.device, dtype=torch.float32)
    kept = 0
    for e in range(E):
        slot, tok = (idx.t() == e).nonzero(as_tuple=True)  # row-major over (k, N): slot-major, token order
        if capacity is not None:
            slot, tok = slot[:capacity], tok[:capacity]
        kept += tok.numel()
        out = experts.mlp(e, x[tok])  # (n_e, C)
        y = y.index_add(0, tok, out.float() * gates[tok, slot, None])
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    return y.to(compute_dtype(x)), counts, torch.tensor(kept, device=x.device)


def experts_sorted(xs, offsets, experts, grouped_mm=False):
    """Expert MLPs on an expert-sorted buffer xs (R, C) with PyTorch ops: torch._grouped_mm over all groups (no host
    sync; CUDA, 16-bit), or one matmul per group slice (one host sync). Rows past offsets[E] come back zero (slices)
    or unspecified (grouped_mm); nothing reads them."""
    if grouped_mm:
        dt = compute_dtype(xs)
        w_fc, b_fc, w_proj, b_proj = experts.params()
        ends = offsets[1:]
        # each row's expert, on the device; rows past the last group (unspecified values, in capacity mode) get
        # no bias and so send no gradient into it
        rows = torch.arange(xs.shape[0], device=xs.device)
        row_expert = torch.bucketize(rows, ends, right=True).clamp(max=w_fc.shape[0] - 1)
        used = (rows < offsets[-1])[:, None]
        add_bias = lambda t, b: t if b is None else t + torch.where(used, b.to(dt)[row_expert], 0)  # noqa: E731
        h = add_bias(torch._grouped_mm(xs.to(dt), w_fc.to(dt).transpose(-2, -1), offs=ends), b_fc)  # (R, 4C)
        y = torch._grouped_mm(F.gelu(h, approximate="tanh"), w_proj.to(dt).transpose(-2, -1), offs=ends)
        return add_bias(y, b_proj)
    bounds = offsets.tolist()
    outs = [experts.mlp(e, xs[lo:hi]) for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    if xs.shape[0] > bounds[-1]:
        outs.append(outs[0].new_zeros(xs.shape[0] - bounds[-1], xs.shape[1]))
    return torch.cat(outs)


class MoEMLP(nn.Module):
    """Drop-in for model.MLP: forward(x, ops) -> (..., C). Reads `aux_loss` / `stats` after a forward (see the
    module docstring); cfg: any object with MoEConfig's fields (MoEConfig, or the model's ModelConfig). linear: the
    shared experts' Linear class (model.py passes model.Linear: its direct fp32 gradient writes)."""

    def __init__(self, cfg, impl=None, linear=nn.Linear):
        super().__init__()
        check_moe_config(cfg)
        E, C = cfg.moe_experts, cfg.n_embd
        self.n_experts, self.top_k, self.score, self.renorm = E, cfg.moe_top_k, cfg.moe_score, cfg.moe_renorm
        self.capacity_factor, self.aux_coef, self.z_coef = cfg.moe_capacity, cfg.moe_aux_coef, cfg.moe_z_coef
        self.bias_rate, self.dropout = cfg.moe_bias_rate, cfg.dropout
        self.impl = impl or cfg.moe_impl
        if self.impl not in IMPLS:
            raise ValueError(f"MoEMLP: impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        self.router = nn.Linear(C, E, bias=False)
        H, S = getattr(cfg, "moe_hidden", 0) or 4 * C, getattr(cfg, "moe_shared", 0)
        self.experts = Experts(E, C, cfg.bias, H)
        if S:  # outside tp's plan: replicated like the experts
            self.shared = nn.Module()
            self.shared.c_fc, self.shared.c_proj = linear(C, S * H, bias=cfg.bias), linear(S * H, C, bias=cfg.bias)
        else:
            self.shared = None
        self.register_buffer("expert_bias", torch.zeros(E))  # aux-loss-free balancing (checkpointed)
        self.register_buffer("load", torch.zeros(E), persistent=False)  # assignments since the last bias update
        self.register_buffer("stat", torch.zeros(len(STATS)), persistent=False)  # the last training forward's stats
        self.register_buffer("aux_scale", torch.ones(()), persistent=False)  # aux_grad_scale on the device
        self.aux_grad_scale = 1.0  # the trainer's factor on its loss (1 / micro-steps), see the module docstring
        self.aux_shards = 1  # sequence parallel (tp.apply_tp): the tp ranks' shards of one micro-batch, whose aux
        #                      losses are averaged (their router gradients are summed over tp like every SP grad)
        self.ep = None  # ep.EPGroup once ep.apply_ep shards the experts: this rank then holds E / ep of them
        self.aux_loss = None
        self._has_stats = False  # a training forward has written `stat`
        self.reset_parameters(cfg.n_layer)

    @property
    def aux_grad_scale(self) -> float:
        return self._aux_grad_scale

    @aux_grad_scale.setter
    def aux_grad_scale(self, value: float):
        """Kept in the `aux_scale` buffer too, which each forward copies for its backward: a CUDA graph's replay
        reads the value set before it, and pp.py's per micro-batch settings each reach their own backward."""
        self._aux_grad_scale = float(value)
        self.aux_scale.fill_(value)

    @property
    def stats(self) -> dict:
        """{aux, z, drop, load_min, load_max}: 0-dim views of `stat`, the last training forward's; {} before one."""
        return {k: self.stat[i] for i, k in enumerate(STATS)} if self._has_stats else {}

    def reset_parameters(self, n_layer=12):
        """GPT-2's init (GPT.reset_parameters does the same by parameter name): N(0, 0.02), c_proj N(0, 0.02 /
        sqrt(2 n_layer)), zero biases."""
        nn.init.normal_(self.router.weight, std=0.02)
        lins = [self.experts.c_fc, self.experts.c_proj] + ([] if self.shared is None else [*self.shared.children()])
        for lin, std in zip(lins, [0.02, 0.02 / math.sqrt(2 * n_layer)] * 2):
            nn.init.normal_(lin.weight, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def capacity(self, n_tokens):
        return capacity_of(n_tokens, self.top_k, self.n_experts, self.capacity_factor)

    def pick_impl(self, x, ops=None):
        if self.impl != "auto":
            return self.impl
        return getattr(ops, "moe_impl", None) or ("triton" if x.is_cuda else "sorted")

    def router_logits(self, x):
        """(N, E) fp32: routing decisions are sensitive, so never in 16 bits (Switch §2.4)."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.router.weight.float())

    def forward(self, x, ops=None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, C)
        N, k = x2.shape[0], self.top_k
        impl = self.pick_impl(x2, ops)
        logits = self.router_logits(x2)  # (N, E)
        bias = self.expert_bias if self.bias_rate > 0 else None
        cap = self.capacity(N)
        if impl == "loop" and self.ep is None:
            y, counts, kept = moe_loop_ref(x2, logits, self.experts, k, self.score, self.renorm, bias, cap)
        else:
            impl = "sorted" if impl == "loop" else impl  # expert parallel: the loop's spec is the sorted path's
            mr, _ = _kernels()
            r = (mr.route_triton if impl == "triton" else mr.route_ref)(logits.detach(), k, self.score, bias, cap)
            gates = gate_weights(logits, r.idx, self.score, self.renorm)  # (N, k)
            dest, rows = r.dest, r.rows
            if self.ep is not None and cap is not None:  # ep.py's fixed-size exchange: E x cap rows, padded
                dest, rows, cap = self.ep.padded(r, cap)
            if impl == "triton":
                xs = mr.permute_triton(x2.to(compute_dtype(x2)), dest, rows)  # (R, C) expert-sorted
            else:
                xs = mr.permute_ref(x2, dest, rows)
            if self.ep is None:
                ys = self._run_experts(impl, xs, r.offsets)
            else:  # expert parallel (nanopara/ep.py): rows to the ranks holding their experts and back
                ys = self.ep.experts(xs, r.offsets, lambda rows, offsets: self._run_experts(impl, rows, offsets),
                                     cap, impl == "triton")
            y = (mr.unpermute_triton if impl == "triton" else mr.unpermute_ref)(ys, dest, gates)
            counts, kept = r.counts, r.offsets[-1]
        y = self._losses(y, logits, counts, kept, N)
        if self.shared is not None:  # the op table's MLP (FP8's fused one, selective recompute's windows) where given
            sh = self.shared
            y = y + (ops.mlp(x2, sh.c_fc, sh.c_proj) if ops is not None else
                     sh.c_proj(F.gelu(sh.c_fc(x2), approximate="tanh"))).to(y.dtype)
        return F.dropout(y.view(*shape[:-1], y.shape[-1]), self.dropout, self.training)

    def _run_experts(self, impl, xs, offsets):
        """This rank's experts on the expert-sorted rows xs, group bounds offsets (E_local + 1,)."""
        if getattr(self.experts, "fp8_state", None) is not None:  # train.fp8: kernels/grouped_gemm_fp8.py
            from kernels.grouped_gemm_fp8 import grouped_mlp_fp8
            return grouped_mlp_fp8(xs, *self.experts.params(), offsets, triton=impl == "triton" or xs.is_cuda)
        if impl == "triton":
            return _kernels()[1].grouped_mlp_triton(xs, *self.experts.params(), offsets)
        return experts_sorted(xs, offsets, self.experts, impl == "grouped_mm")

    def _losses(self, y, logits, counts, kept, N):
        """Sets aux_loss; a training forward also writes `stat` and adds to `load` (in place: a CUDA graph's replay
        repeats both); routes the aux loss's gradient through y's backward."""
        if N == 0:
            self.aux_loss = None
            return y
        lb = load_balance_loss(logits, counts, self.top_k, self.score)
        zl = z_loss(logits)
        self.aux_loss = self.aux_coef * lb + self.z_coef * zl
        if self.training:
            with torch.no_grad():
                if self.bias_rate > 0:
                    self.load += counts.float()
                c = counts.float()
                self.stat.copy_(torch.stack([lb, zl, 1 - kept.float() / (N * self.top_k), c.min() / c.mean(),
                                             c.max() / c.mean()]))
            self._has_stats = True
        if torch.is_grad_enabled() and self.aux_loss.requires_grad and (self.aux_coef > 0 or self.z_coef > 0):
            scale = self.aux_scale.clone() if self.aux_shards == 1 else self.aux_scale / self.aux_shards
            y = _AuxLossGrad.apply(y, self.aux_loss, scale)
        return y

    @torch.no_grad()
    def update_bias(self):
        """DeepSeek-V3's step: b_e += u * sign(mean load - load_e) (no loads: sign(0) = 0, no change); clears the
        load. Device ops only."""
        if self.bias_rate > 0:
            self.expert_bias += self.bias_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


# ----------------------------------------------------------------------------------------------------------------
# what a trainer calls


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def set_aux_grad_scale(model, scale):
    """The factor the trainer applies to its loss before backward (1 / micro-steps, times an fp16 loss scale)."""
    for m in moe_layers(model):
        m.aux_grad_scale = scale


@contextlib.contextmanager
def loads_counted_once(model, runs: int):
    """Around a call that runs the same training forwards `runs` times where eager mode runs them once: a CUDA
    graph's first call (graph.py: `warmup` eager runs on the captured batches, then one replay). The expert loads
    it adds are divided by `runs` (sums of integer counts: exact), so the bias update is eager mode's."""
    layers = [m for m in moe_layers(model) if m.bias_rate > 0]
    before = [m.load.clone() for m in layers]
    yield
    with torch.no_grad():
        for m, b in zip(layers, before):
            m.load.copy_(b + (m.load - b) / runs)


@torch.no_grad()
def update_expert_bias(model, all_reduce=None):
    """After the optimizer step: every MoE layer's aux-loss-free bias update. `all_reduce` (a function summing a
    tensor in place over the data-parallel group) makes the loads, hence the biases, agree on every replica: one
    collective for all layers."""
    layers = [m for m in moe_layers(model) if m.bias_rate > 0]
    if not layers:
        return
    if all_reduce is not None:
        flat = torch.cat([m.load for m in layers])
        all_reduce(flat)
        for m, part in zip(layers, flat.split([m.load.numel() for m in layers])):
            m.load.copy_(part)
    for m in layers:
        m.update_bias()


def collect_stats(model) -> dict:
    """The log line's MoE fields over all layers (one host sync): moe_aux / moe_z / moe_drop averaged,
    moe_load_min the lowest and moe_load_max the highest; {} without MoE layers or before a forward."""
    stats = [m.stats for m in moe_layers(model) if m.stats]
    if not stats:
        return {}
    v = torch.stack([torch.stack([s["aux"], s["z"], s["drop"], s["load_min"], s["load_max"]]) for s in stats]).cpu()
    return dict(moe_aux=v[:, 0].mean().item(), moe_z=v[:, 1].mean().item(), moe_drop=v[:, 2].mean().item(),
                moe_load_min=v[:, 3].min().item(), moe_load_max=v[:, 4].max().item())


def active_params(model) -> int:
    """Parameters one token passes through (for MFU): all, less (E - k) / E of every MoE layer's experts."""
    n = sum(p.numel() for p in model.parameters())
    for m in moe_layers(model):
        n -= sum(p.numel() for p in m.experts.parameters()) * (m.n_experts - m.top_k) // m.n_experts
    return n


def step_stats(model) -> dict:
    """collect_stats' fields as 0-dim device tensors, no host sync (the step reporter reads them with the loss)."""
    stats = [m.stats for m in moe_layers(model) if m.stats]
    if not stats:
        return {}
    v = torch.stack([torch.stack([s[k].float() for k in ("aux", "z", "drop", "load_min", "load_max")]) for s in stats])
    return dict(moe_aux=v[:, 0].mean(), moe_z=v[:, 1].mean(), moe_drop=v[:, 2].mean(), moe_load_min=v[:, 3].min(),
                moe_load_max=v[:, 4].max())
