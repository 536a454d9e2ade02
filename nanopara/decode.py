"""Graphed decoding: one generated token = one CUDA graph replay (issue #31).

Why: at small batch, decoding is host-bound. One token is one Python forward that launches every kernel of the
12 blocks (LayerNorms, matmuls, attention, KV-cache writes) one by one, and at batch 1 each of those kernels is
shorter than its launch: `model.generate` and `rl.sample` spend most of a step waiting for the CPU. A CUDA graph
records the launches of one step once and replays them with a single call.

A graph replays fixed kernels on fixed addresses, so everything a step touches must keep its shape and storage:
  StaticKVCache  per layer, (B, nh, T_max, hs) key/value buffers allocated once. The write position is a DEVICE
                 tensor `pos` (shared by all layers): `update` writes with `index_copy_` along the time axis at `pos`
                 and returns the whole T_max buffers; `mask` returns a (1, 1, T, T_max) boolean mask letting query
                 i see the keys at positions <= its own. The unwritten (or stale) tail is masked out, so nothing
                 ever needs clearing. It speaks model.KVCache's protocol (`update`, `mask`), so the model's attention
                 runs unchanged; the positional embedding reads the same `pos` (GPT.forward's `pos` argument).
  Decoder        static input token (B, 1) and position (1,) tensors, the caches, and `step(tok) -> logits (B, V)`.
                 The step's body: mask from pos, model forward on the static token at pos, pos += 1. With
                 graph=True (CUDA) the body is captured on the first step: a few eager warm-up steps on a side
                 stream first (Triton tuning and compilation, cuBLAS handles, the allocator: torch.cuda.graphs'
                 recipe), then one capture; later steps copy the token in and replay. `prefill(idx)` runs the prompt
                 (any length T) eagerly into the same caches and sets pos = T, so one captured graph serves every
                 prompt length and step. The host keeps its own copy of the position (no sync) for bounds checks.
  generate       prefill, then per token: pick from the static logits OUTSIDE the graph (argmax, or temperature /
                 top-k multinomial on (B, V): a handful of cheap launches, and any sampling rule works), write the
                 token into the output buffer and replay. No host sync per token: with `eot`, one sync every
                 `check_every` tokens asks whether every row has emitted it, and stops early if so.

Contract of `generate` (like GPT.generate): (B, T + n) tokens, n = max_new_tokens cut to the context
(block_size). Rows stay in the batch to the end: a fixed batch is what a graph replays, and cheaper than shrinking
it. Tokens after a row's first `eot` are unspecified (the model's continuation, or `eot` once every row finished
early): callers that stop at EOT truncate each row after its first EOT (rl.sample does).

Limits:
- One position for the whole batch: prompts of one length (as rl.sample batches them).
- Autocast: the graph bakes in the autocast state of its first step (checked on every later step). Captured with
  autocast's weight-cast cache off (a cast cached outside the graph would be freed under it), so under bf16
  autocast each replay casts the fp32 weights again: one read of the fp32 weights per token (likely the main cost
  left at batch 1; not measured). A bf16 model (no autocast) has no casts.
- MoE layers: graph="auto" runs them eagerly. moe.py's "sorted"/"loop" paths sync with the host (offsets.tolist(),
  nonzero), which capture forbids; the Triton routing path claims no host sync but is untested under capture
  (graph=True tries it).
- Weights are read by address: in-place updates (optimizer steps) are seen by later replays; replaced parameter
  tensors (`.to()`, load_state_dict(assign=True)) are not, so `decoder_for` keys its cache on the parameters'
  addresses.
- Attention reads all T_max cached keys every step (masked), not only the filled ones: fixed shapes.
Greedy decoding equals GPT.generate token for token on CPU (tests/test_decode.py); on GPU bf16 the masked
attention over T_max keys rounds differently from the sliced one, so rare near-ties may differ.
"""
from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

from nanopara.moe import moe_layers


class StaticKVCache:
    """One layer's keys/values in fixed (B, nh, T_max, hs) buffers, written at device positions (see the module
    docstring). `pos` (T,) int64 and `attn_mask` are set by the Decoder before each forward (`Decoder._bind`)."""

    def __init__(self, B, nh, T_max, hs, device, dtype):
        self.k = torch.zeros(B, nh, T_max, hs, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = self.attn_mask = None

    def update(self, k, v):  # k, v (B, nh, T, hs) -> the whole (B, nh, T_max, hs) buffers
        self.k.index_copy_(2, self.pos, k.to(self.k.dtype))
        self.v.index_copy_(2, self.pos, v.to(self.v.dtype))
        return self.k, self.v

    def mask(self, T):  # (1, 1, T, T_max): query i (absolute pos[i]) sees keys 0..pos[i]
        return self.attn_mask


def graph_ok(model) -> bool:
    """Whether graph="auto" captures this model: CUDA parameters and no MoE layers."""
    return model.transformer.wpe.weight.is_cuda and not moe_layers(model)


def _amp_state(device):
    on = torch.is_autocast_enabled(device.type)
    return on, (torch.get_autocast_dtype(device.type) if on else None)


class Decoder:
    """Static caches + a one-token step for `batch` rows and up to `max_len` positions (prompt included).

    prefill(idx (B, T)) -> logits (B, V) of the last prompt position; step(tok (B,) or (B, 1)) -> logits (B, V) of
    that token, which sits at the next position. Returned logits are float views of static buffers (graph=True):
    read them before the next call. V = the real vocabulary (padding columns dropped). Runs under torch.no_grad
    and in the model's current mode (call with the model in eval mode: generate does)."""

    def __init__(self, model, batch: int, max_len: int, dtype, graph: bool = True, warmup: int = 2):
        p = model.transformer.wpe.weight
        if max_len > model.cfg.block_size:
            raise ValueError(f"Decoder: max_len {max_len} exceeds the model's context of {model.cfg.block_size}")
        if graph and not p.is_cuda:
            raise ValueError("Decoder: graph=True needs the model on a CUDA device")
        self.model, self.B, self.max_len, self.dtype, self.graph_on = model, batch, max_len, dtype, graph
        self.device, self.warmup = p.device, warmup
        self.V = model.cfg.vocab_size
        self.caches = [StaticKVCache(batch, blk.attn.n_head, max_len, blk.attn.head_dim, p.device, dtype)
                       for blk in model.transformer.h]
        self.keys = torch.arange(max_len, device=p.device)  # key positions, for the masks
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=p.device)  # static input of a step
        self.pos = torch.zeros(1, dtype=torch.long, device=p.device)  # static position of that token
        self.n = 0  # the host's copy of pos: tokens in the caches
        self.graph = self.logits = self.amp = None

    def _bind(self, pos):
        """Every cache writes at positions `pos` (T,) and masks with the mask they imply (one mask for all layers)."""
        mask = (self.keys[None, :] <= pos[:, None])[None, None]  # (1, 1, T, T_max)
        for c in self.caches:
            c.pos, c.attn_mask = pos, mask

    @torch.no_grad()
    def prefill(self, idx):
        B, T = idx.shape
        if B != self.B or T > self.max_len:
            raise ValueError(f"Decoder.prefill: batch of {B} x {T} tokens for a decoder of {self.B} x {self.max_len}")
        pos = torch.arange(T, device=self.device)
        self._bind(pos)
        logits, _ = self.model(idx, kv_caches=self.caches, pos=pos)
        self.pos.fill_(T)
        self.n = T
        return logits[:, -1, :self.V].float()

    def _body(self):
        """One step on the static token and position: the whole of what the graph records."""
        self._bind(self.pos)
        logits, _ = self.model(self.tok, kv_caches=self.caches, pos=self.pos)
        self.pos.add_(1)
        return logits[:, -1, :self.V].float()  # (B, V)

    def _capture(self):
        on, dt = self.amp
        # autocast as the caller has it, cast cache off: casts are recorded, not read from tensors freed later
        amp = lambda: torch.autocast(self.device.type, dtype=dt, enabled=on, cache_enabled=False)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), amp():  # warm-up: writes the current token at the current position each time
            for _ in range(self.warmup):
                self._body()
                self.pos.sub_(1)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), amp():
            self.logits = self._body()  # recorded, not run: the first replay runs it

    @torch.no_grad()
    def step(self, tok):
        if self.n == 0:
            raise ValueError("Decoder.step before prefill")
        if self.n >= self.max_len:
            raise ValueError(f"Decoder.step: all {self.max_len} positions are used")
        self.tok.copy_(tok.view(self.B, 1))
        self.n += 1
        if not self.graph_on:
            return self._body()
        amp = _amp_state(self.device)
        if self.graph is None:
            self.amp = amp
            self._capture()
        elif amp != self.amp:
            raise ValueError(f"Decoder.step: captured under autocast {self.amp}, called under {amp}")
        self.graph.replay()
        return self.logits


# ------------------------------------------------------------------------------------------------------------------
# a few decoders kept for reuse: a capture costs a few eager steps, and samplers call with the same shapes again

_DECODERS: collections.OrderedDict = collections.OrderedDict()
KEEP = 4  # decoders kept (each holds its caches and its graph's memory pool)


def decoder_for(model, batch: int, max_len: int, dtype, graph: bool) -> Decoder:
    """A Decoder for these shapes, reused while the model's parameters stay where they were (in-place updates are
    fine: a replay reads the current values) and the autocast state matches; the KEEP most recent are kept."""
    dev = model.transformer.wpe.weight.device
    key = (id(model), batch, max_len, dtype, graph, str(dev), _amp_state(dev),
           tuple(p.data_ptr() for p in model.parameters()))
    dec = _DECODERS.get(key)
    if dec is None or dec.model is not model:
        dec = _DECODERS[key] = Decoder(model, batch, max_len, dtype, graph)
        while len(_DECODERS) > KEEP:
            _DECODERS.popitem(last=False)
    _DECODERS.move_to_end(key)
    return dec


def clear_decoders() -> None:
    """Free the kept decoders (their caches and graphs)."""
    _DECODERS.clear()


def pick(logits, temperature: float = 0.0, top_k: int | None = None, generator=None):
    """Next tokens (B,) from logits (B, V): argmax for temperature 0, else a sample of softmax(logits / temperature)
    restricted to the top_k largest (GPT.generate's rule)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None:
        kth = torch.topk(z, min(top_k, z.shape[-1])).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.multinomial(F.softmax(z, dim=-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             generator: torch.Generator | None = None, eot: int | None = None, graph="auto",
             check_every: int = 16):
    """Continuations of idx (B, T) -> (B, T + n), n = max_new_tokens cut to the context, as GPT.generate returns.
    graph: True (CUDA graph), False (the same static caches, eager) or "auto" (True where `graph_ok`). With `eot`,
    every `check_every` tokens one host sync asks whether all rows have emitted it; if so the rest is `eot`. Tokens
    after a row's first `eot` are unspecified: truncate there. The caches take the autocast dtype when autocast is
    on (call inside it), else the parameters' dtype."""
    B, T = idx.shape
    dev = model.transformer.wpe.weight.device
    total = min(T + max_new_tokens, model.cfg.block_size)
    n = total - T
    if n <= 0:
        return idx
    on, dt = _amp_state(dev)
    use_graph = graph_ok(model) if graph == "auto" else bool(graph)
    dec = decoder_for(model, B, total, dt if on else model.transformer.wpe.weight.dtype, use_graph)
    was_training = model.training
    model.eval()
    try:
        out = torch.full((B, n), -1 if eot is None else eot, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        logits = dec.prefill(idx.to(dev))
        for i in range(n):
            tok = pick(logits, temperature, top_k, generator)
            out[:, i] = tok
            if i == n - 1:
                break
            if eot is not None:
                done |= tok == eot
                if i % check_every == check_every - 1 and bool(done.all()):  # the only host sync
                    break
            logits = dec.step(tok)
    finally:
        model.train(was_training)
    return torch.cat([idx.to(dev), out], dim=1)
