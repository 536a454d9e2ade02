"""GRPO (Shao et al. 2024, DeepSeekMath): the math and the loop pieces of RL with verifiable rewards.

One step (rl.py runs the loop): P prompts, G completions each, sampled with the KV cache; reward r in {0, 1} from
the task's checker; group-normalised advantage per completion
    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)          std over the G rewards (population: G=1 gives 0)
so a group whose completions all score the same gives A = 0 and no gradient. Loss per response token t
    ratio_t = exp(logp_t - old_logp_t)
    L_t     = -min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A)  +  kl_coef * k3_t
    k3_t    = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1      (Schulman's k3: unbiased, >= 0)
summed over every response token of the global batch and divided by their count (token-level mean, as DAPO/Dr.
GRPO). old_logp: the sampling policy, recomputed with one forward before the updates (the first update has ratio 1
exactly); ref_logp: the frozen starting model. Response tokens include the closing EOT, so the policy learns where
to stop. Log-probs are those of logits / temperature, the distribution that was sampled.

Prompts are sft.prompt_ids(enc, prompt) = EOT + "User: {prompt}\nAssistant:", what SFT trained on.
Sampling (`sample`): on CUDA, models without MoE layers, decode.py (one left-padded batch, a CUDA graph replay per
token, finished rows cut at EOT afterwards); otherwise (`sampler="dynamic"`) model.py's KV cache, rows batched by
prompt length, finished rows leaving the batch. Training forwards right-pad the sequences: causal attention never
lets a real token see the padding after it, and masks drop the rest.

The update is the Trainer's step (parallelize on `trainer_config`: AdamW, clipping, autocast, the dp engine) with
policy_loss as forward_backward's loss_fn. Each rank samples and scores its share of the prompts (groups never
straddle ranks: advantages need no communication); the loss is divided by the global token count, so a step on N
ranks equals one process's step on the same rollouts. Callers: rl.py; tests/test_rl.py; notes/post_training.md.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanopara import decode
from nanopara.config import Config, ParallelConfig, TrainConfig
from nanopara.model import keep_rows, kv_caches
from nanopara.sft import prompt_ids


# ----------------------------------------------------------------------------------------------------------------
# the math

def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(P, G) rewards -> (P, G) advantages (r - group mean) / (group std + eps); all-equal groups give exactly 0."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=0)
    return (rewards - mean) / (std + eps)


def policy_loss(logp, old_logp, adv, mask, clip_eps: float, ref_logp=None, kl_coef: float = 0.0,
                n_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (+ k3 KL) over response tokens. logp, old_logp, ref_logp, mask: (B, T); adv: (B,).
    Returns (sum of per-token losses / n_tokens (default: mask.sum()), sums for metrics: clipped tokens, kl)."""
    mask = mask.to(logp.dtype)
    n = mask.sum() if n_tokens is None else n_tokens
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None].to(logp.dtype)  # (B, 1): one advantage for every token of a completion
    per_tok = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    stats = {"clipped": (((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask).sum().detach()}
    if ref_logp is not None:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        stats["kl"] = (k3 * mask).sum().detach()
        if kl_coef:
            per_tok = per_tok + kl_coef * k3
    return (per_tok * mask).sum() / n, stats


# ----------------------------------------------------------------------------------------------------------------
# sampling with the KV cache

SAMPLERS = ("auto", "graph", "static", "dynamic")


SLOT_MULTIPLE = 64  # the static caches' slots are rounded up to this: calls of nearby lengths reuse one decoder


def _sample_static(model, prompts: list, max_new: int, temperature: float, eot: int, generator, amp,
                   graph: bool) -> list:
    """New token ids (EOT kept) of prompts of any lengths, in one left-padded batch on decode.py's static caches
    (graph: one replay per token); each row is cut after its first EOT. The longest prompt + max_new must fit the
    context. The caches get that many slots rounded up to SLOT_MULTIPLE (at most the context), so later calls
    whose prompts are a little longer or shorter reuse the kept decoder and its captured graph."""
    need = max(map(len, prompts)) + max_new
    slots = min(-(-need // SLOT_MULTIPLE) * SLOT_MULTIPLE, model.cfg.block_size)
    with amp():
        return decode.generate(model, prompts, max_new, temperature, None, generator, eot=eot, graph=graph,
                               max_len=slots)


def _static_batches(prompts: list, max_new: int, block: int, max_batch: int) -> list:
    """[(row indices, new tokens)]: the rows whose prompt + max_new fit the context in chunks of max_batch rows,
    longest prompts first; a row that does not fit gets block - len new tokens (what the dynamic path gives it), in
    a batch of its prompt length."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    fit = [i for i in order if len(prompts[i]) + max_new <= block]
    out = [(fit[s:s + max_batch], max_new) for s in range(0, len(fit), max_batch)]
    by_len = {}
    for i in order:
        if len(prompts[i]) + max_new > block:
            by_len.setdefault(len(prompts[i]), []).append(i)
    for L, rows in by_len.items():
        out += [(rows[s:s + max_batch], max(block - L, 0)) for s in range(0, len(rows), max_batch)]
    return out


@torch.no_grad()
def _sample_batch(model, prompts: list, max_new: int, temperature: float, eot: int, generator, amp,
                  sampler: str = "dynamic") -> list:
    """New token ids (EOT kept) for prompts of one token length. sampler "graph" / "static": decode.py's static
    caches with / without a CUDA graph (any lengths there); "dynamic": model.py's KV cache, finished rows leave the
    batch."""
    if sampler in ("graph", "static"):
        return _sample_static(model, prompts, max_new, temperature, eot, generator, amp, sampler == "graph")
    dev, V = model.transformer.wpe.weight.device, model.cfg.vocab_size
    B, L = len(prompts), len(prompts[0])
    total = min(L + max_new, model.cfg.block_size)
    with amp():
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else \
            model.transformer.wpe.weight.dtype
    caches = kv_caches(model, B, total, dtype)
    outs, alive = [[] for _ in range(B)], list(range(B))  # alive[j]: the prompt row that batch row j samples for
    with amp():
        logits, _ = model(torch.tensor(prompts, device=dev), kv_caches=caches)  # (B, L, Vp)
    for pos in range(L, total):
        z = logits[:, -1, :V].float()  # (b, V): never a padding id
        if temperature == 0:
            nxt = z.argmax(-1)
        else:
            nxt = torch.multinomial(F.softmax(z / temperature, dim=-1), 1, generator=generator)[:, 0]
        toks = nxt.tolist()  # the one host sync per token: the stop test needs the tokens
        for r, t in zip(alive, toks):
            outs[r].append(t)
        keep = [j for j, t in enumerate(toks) if t != eot]
        if pos == total - 1 or not keep:
            break
        if len(keep) < len(alive):  # drop finished rows from the batch and the caches
            sel = torch.tensor(keep, device=dev)
            keep_rows(caches, sel)
            nxt, alive = nxt[sel], [alive[j] for j in keep]
        with amp():
            logits, _ = model(nxt[:, None], kv_caches=caches, pos0=pos)  # (b, 1, Vp)
    return outs


def sample(model, prompts: list, max_new: int, temperature: float = 1.0, eot: int = 50256, generator=None,
           amp=contextlib.nullcontext, sampler: str = "auto", max_batch: int = 256) -> list:
    """New token ids of each prompt (a list of token-id lists), stopping at EOT (kept) or after max_new tokens (cut
    to the context); temperature 0 is greedy. sampler: "auto" ("graph" where decode.graph_ok: CUDA, no MoE layers;
    else "dynamic"), "graph", "static" or "dynamic". "graph" / "static" run every prompt of the call in one
    left-padded batch of decode.py's static caches (with / without a CUDA graph), in chunks of `max_batch` rows,
    longest prompts first (_static_batches); "dynamic" runs the prompts of one length as one batch, shortest first
    (_sample_batch). Greedy gives the same tokens whichever runs (up to rounding on GPU); sampling draws from the
    same distribution but not the same random numbers (the fixed batch draws for finished rows too)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sample: sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    if max_batch < 1:
        raise ValueError(f"sample: max_batch must be >= 1, got {max_batch}")
    if sampler == "auto":
        sampler = "graph" if decode.graph_ok(model) else "dynamic"
    outs = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        if sampler in ("graph", "static"):
            for rows, n in _static_batches(prompts, max_new, model.cfg.block_size, max_batch):
                for i, new in zip(rows, _sample_static(model, [prompts[i] for i in rows], n, temperature, eot,
                                                       generator, amp, sampler == "graph")):
                    outs[i] = new
            return outs
        by_len = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for L in sorted(by_len):
            rows = by_len[L]
            for i, new in zip(rows, _sample_batch(model, [prompts[i] for i in rows], max_new, temperature, eot,
                                                  generator, amp, sampler)):
                outs[i] = new
    finally:
        model.train(was_training)
    return outs


# ----------------------------------------------------------------------------------------------------------------
# rollouts and the update

@dataclasses.dataclass
class Rollout:
    """One rank's completions, right-padded: tokens (B, T); mask (B, T-1) marks the targets that are response
    tokens; old_logp / ref_logp (B, T-1) of those targets; adv (B,)."""
    tokens: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def make_rollout(prompts: list, completions: list, adv: torch.Tensor, device) -> Rollout:
    """prompts[i] + completions[i] right-padded with 0; completions must be non-empty."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    T = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        tokens[i, :len(s)] = torch.tensor(s)
        mask[i, len(p) - 1:len(s) - 1] = 1  # target j+1 is a response token
    return Rollout(tokens.to(device), mask.to(device), adv.to(device, torch.float32))


def token_logprobs(model, tokens: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                   amp=contextlib.nullcontext) -> torch.Tensor:
    """(B, T-1) log-prob of each next token under logits / temperature, computed only where mask is set (0 else)."""
    with amp():
        logits, _ = model(tokens)  # (B, T, Vp)
    sel = mask.bool()
    z = logits[:, :-1][sel][:, :model.cfg.vocab_size].float()  # (N, V): response positions only
    if temperature not in (0, 1):
        z = z / temperature
    lp = z.log_softmax(-1).gather(1, tokens[:, 1:][sel][:, None])[:, 0]  # (N,)
    out = torch.zeros(mask.shape, dtype=lp.dtype, device=lp.device)
    return out.masked_scatter(sel, lp)


def all_sum(t: torch.Tensor, group=None, world: int = 1) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, group=group)
    return t


def trainer_config(model_cfg, *, rows: int, micro: int, world: int, device: str, dtype: str = "auto",
                   weight_decay: float = 0.0, eps: float = 1e-8, grad_clip: float = 1.0) -> Config:
    """The Config of the policy's Trainer (parallel.parallelize): dp = world, AdamW betas 0.9 / 0.95, eager (a loss_fn
    runs outside CUDA graphs), one micro-step per `micro` rows of this rank's `rows` (0: all), so accum = ceil(rows /
    micro). A micro-step's sequences are at most the context long (train.seq_len: rollouts' lengths vary)."""
    micro = min(micro or rows, rows)
    accum, T = -(-rows // micro), model_cfg.block_size
    return Config(preset="rl", device=device, model=model_cfg, parallel=ParallelConfig(dp=world),
                  train=TrainConfig(micro_batch=micro, seq_len=T, tokens_per_step=accum * micro * T * world,
                                    weight_decay=weight_decay, beta1=0.9, beta2=0.95, eps=eps, grad_clip=grad_clip,
                                    dtype=dtype, val_every=0, sample_tokens=0, cuda_graph="false"))


def update(trainer, ro: Rollout, lr: float, *, clip_eps: float, kl_coef: float = 0.0,
           temperature: float = 1.0) -> dict:
    """One optimizer step on a rollout through the Trainer (every dp rank calls it with its own): the loss of each
    micro-batch (slices of train.micro_batch rows: trainer.accum of them) is summed over its response tokens and
    divided by the global count N, so that after the Trainer's 1/accum and 1/(dp*cp) the gradient is that of the
    global token mean (policy_loss's n_tokens = N / (accum * dp * cp); exactly N on one process, one micro-batch)."""
    group, n = trainer.mesh.groups.get("dp_cp"), trainer.engine.n
    n_tok = all_sum(ro.mask.sum().double(), group, n).float()
    B, micro = ro.tokens.shape[0], trainer.cfg.train.micro_batch  # (trainer_config)
    rows = [slice(s, s + micro) for s in range(0, B, micro)]
    share = n_tok / (len(rows) * n)
    stats = []

    def loss_fn(model, sl):
        logp = token_logprobs(model, ro.tokens[sl], ro.mask[sl], temperature)  # the Trainer's autocast is on
        ref = ro.ref_logp[sl] if ro.ref_logp is not None else None
        loss, st = policy_loss(logp, ro.old_logp[sl], ro.adv[sl], ro.mask[sl], clip_eps, ref, kl_coef, share)
        stats.append(torch.stack([st["clipped"], st.get("kl", torch.zeros((), device=loss.device))]).double())
        return loss

    loss = trainer.forward_backward(rows, loss_fn=loss_fn).item()
    norm = trainer.step(lr)
    trainer.engine.wait_params()  # ZeRO prefetch: sampling next may replay a decode.py graph, which runs no hooks
    tot = all_sum(torch.stack(stats).sum(0), group, n)
    N = max(n_tok.item(), 1.0)
    return {"loss": loss, "clip_frac": tot[0].item() / N, "kl": tot[1].item() / N, "grad_norm": norm,
            "response_tokens": int(n_tok.item()), "trained_tokens": int(all_sum(
                torch.tensor(float(ro.tokens.numel()), dtype=torch.float64, device=ro.tokens.device), group,
                n).item())}


# ----------------------------------------------------------------------------------------------------------------
# held-out exact match

@torch.no_grad()
def exact_match(model, enc, task, examples: list, max_new: int, *, eot: int = 50256,
                batch: int = 256, rank: int = 0, world: int = 1, group=None, amp=contextlib.nullcontext) -> float:
    """Mean checker reward of greedy completions (the held-out exact match); example i is scored on rank i % world,
    the counts all-reduced: every rank returns the same number."""
    dev = model.transformer.wpe.weight.device
    mine = list(range(rank, len(examples), world))
    correct = 0.0
    for s in range(0, len(mine), batch):
        idx = mine[s:s + batch]
        prompts = [prompt_ids(enc, examples[i].prompt) for i in idx]
        for i, new in zip(idx, sample(model, prompts, max_new, 0.0, eot, amp=amp)):
            correct += task.check(enc.decode([t for t in new if t != eot]), examples[i].answer)
    tot = all_sum(torch.tensor([correct, len(mine)], dtype=torch.float64, device=dev), group, world)
    return (tot[0] / tot[1].clamp(min=1)).item()
