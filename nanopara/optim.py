"""AdamW parameter groups, the learning-rate schedule, gradient clipping and fp16 loss scaling.

- Weight decay applies to 2-D weights (matmuls, embeddings) only; biases and LayerNorm gains are not decayed.
- Schedule: linear warm-up over `warmup_steps`, then cosine decay to `lr * min_lr_frac` at `steps`.
- Clipping uses the global L2 norm (`clip_coef`); the engines (engine.py) compute it from what each rank holds.
- fp16 training multiplies the loss by a dynamic scale; a step whose gradients overflow is skipped and the scale
  halves; after `growth_interval` clean steps it doubles (the usual dynamic loss scaling of mixed precision).
"""
from __future__ import annotations

import math

import torch

from nanopara.config import TrainConfig


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay for 2-D weights (matmuls, embeddings, MoE expert weights), never for a parameter named *bias
    (MoE expert biases are (E, out)); the ZeRO flat buffers (buckets.Flat) use the same rule."""
    return p.dim() >= 2 and not name.endswith("bias")


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Split parameters into decayed (dim >= 2 weights) and non-decayed groups; tied parameters appear once. A
    parameter named *bias is never decayed: MoE expert biases are (E, out), 2-D (dense GPT-2's biases are 1-D, so
    its groups are the same as by dim alone)."""
    seen, decay, no_decay = set(), [], []
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(named_params, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    groups = param_groups(named_params, t.weight_decay)
    fused = device.type == "cuda"  # one kernel per step for all tensors; CPU keeps the exact for-loop path
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused,
                             foreach=False if not fused else None)


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if step >= t.steps:
        return t.lr * t.min_lr_frac
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * frac))  # 1 -> 0
    return t.lr * (t.min_lr_frac + (1.0 - t.min_lr_frac) * coeff)


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Multiplier for the gradients so that their global norm is at most max_norm (1 when already below)."""
    if max_norm <= 0:
        return torch.ones((), device=norm.device)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class LossScaler:
    """Dynamic loss scale for fp16 (a no-op at scale 1 for bf16/fp32)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good_steps = max(self.scale / 2.0, 1.0), 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])
