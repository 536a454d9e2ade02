"""Data parallelism: the training engine interface, single-device engine.

An engine owns the optimizer and the gradient synchronisation of a model; train.py talks only to it:

    engine = build_engine(model, mesh, cfg)
    for micro in range(accum):
        with engine.no_sync(micro < accum - 1):   # no gradient communication on non-final micro-steps
            _, loss = engine.model(x, y)
            engine.backward(loss * scale / accum)
    grad_norm = engine.step(lr, grad_scale=scale) # clip + update + zero grads; inf/nan norm => step skipped

`state_dict()` / `load_state_dict()` carry this rank's optimizer (shard), `model_state_dict()` /
`load_model_state_dict()` this rank's parameters, each with the metadata checkpoint.py needs.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from nanopara.config import Config
from nanopara.mesh import Mesh
from nanopara.optim import build_adamw, clip_coef, grad_norm_sq


class SingleDevice:
    """One replica, no communication: plain AdamW with global-norm clipping."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        self.model, self.mesh, self.cfg = model, mesh, cfg
        self.optimizer = build_adamw(model.named_parameters(), cfg.train, mesh.device)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def no_sync(self, skip: bool = True):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float, grad_scale: float = 1.0) -> float:
        norm = math.sqrt(grad_norm_sq([p.grad for p in self.params]).item()) / grad_scale
        if math.isfinite(norm):
            coef = clip_coef(torch.tensor(norm), self.cfg.train.grad_clip).item() / grad_scale
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            if coef != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])

    def model_state_dict(self) -> dict:
        return {k: v for k, v in self.model.state_dict().items() if k != "lm_head.weight"}  # tied to wte

    def load_model_state_dict(self, sd: dict) -> None:
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def build_engine(model: nn.Module, mesh: Mesh, cfg: Config):
    if mesh.dp * mesh.cp == 1:
        return SingleDevice(model, mesh, cfg)
    raise NotImplementedError("data parallel engines (DDP, ZeRO) are not built yet")
