"""Graphed decoding: one generated token = one CUDA graph replay (issue #31).

At small batch, decoding is host-bound: one token is one Python forward that launches every kernel of the blocks
one by one. A CUDA graph records one step's launches once and replays them with a single call, so everything a
step touches keeps its shape and storage:
  StaticKVCache  per layer, (B, nh, T_max, hs) key/value buffers allocated once, written with `index_copy_` at a
                 slot held in a DEVICE tensor `pos`; `mask` gives a (B, 1, T, T_max) boolean mask per row. It speaks
                 model.KVCache's protocol (`update`, `mask`), so the model's attention runs unchanged.
  Decoder        static token (B, 1), slot (1,), left-padding counts (B, 1) and the caches; `step(tok) -> logits
                 (B, V)`, captured on the first step after eager warm-up steps on a side stream, replayed after.
                 `prefill(idx, pad)` runs the prompts (any length) eagerly into the same caches, so one graph
                 serves every prompt length and every mix of lengths (same B and T_max).
  generate       prefill, then per token: pick from the static logits outside the graph (argmax, or temperature /
                 top-k), replay; with `eot` (or a `finished` callback) one host sync every `check_every` tokens.

Left padding: row b of a batch padded to L has p_b = L - len_b padding slots; its token at slot s has position
s - p_b and sees keys p_b..s; a padding slot sees only itself (no all-masked row, no NaN). A padding-free row
computes exactly what the one-position decoder computed (bit for bit on CPU, fp32).
Contract of `generate`: on a (B, T) tensor (like GPT.generate), (B, T + n) tokens, n cut to the context; on a list
of token-id lists, the new tokens of each, cut after the first `eot` (kept), the longest prompt + max_new_tokens
within the context (ValueError). Rows stay in the batch to the end; callers cut after the first EOT.

Callers: rl.sample (its "graph"/"static" samplers), greedy.py (GSM8K). Tested by tests/test_decode.py (greedy equals
GPT.generate token for token on CPU). Limits (autocast baked in, MoE eager, weights by address): notes/post_training.md.
"""
from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

from nanopara.moe import moe_layers


class StaticKVCache:
    """One layer's keys/values in fixed (B, nh, T_max, hs) buffers, written at device slots (see the module
    docstring). `pos` (T,) int64 slots and `attn_mask` (B, 1, T, T_max) are set by the Decoder before each forward
    (`Decoder._bind`)."""

    def __init__(self, B, nh, T_max, hs, device, dtype):
        self.k = torch.zeros(B, nh, T_max, hs, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = self.attn_mask = None

    def update(self, k, v):  # k, v (B, nh, T, hs) -> the whole (B, nh, T_max, hs) buffers
        self.k.index_copy_(2, self.pos, k.to(self.k.dtype))
        self.v.index_copy_(2, self.pos, v.to(self.v.dtype))
        return self.k, self.v

    def mask(self, T):  # (B, 1, T, T_max): row b's query at slot s sees its keys at slots pad[b]..s
        return self.attn_mask


def graph_ok(model) -> bool:
    """Whether graph="auto" captures this model: CUDA parameters and no MoE layers."""
    return model.transformer.wpe.weight.is_cuda and not moe_layers(model)


def _amp_state(device):
    on = torch.is_autocast_enabled(device.type)
    return on, (torch.get_autocast_dtype(device.type) if on else None)


class Decoder:
    """Static caches + a one-token step for `batch` rows and up to `max_len` cache slots (prompt included).

    prefill(idx (B, T), pad=None) -> logits (B, V) of the last prompt slot; step(tok (B,) or (B, 1)) -> logits (B, V)
    of that token, which sits at the next slot. `pad` (B,) counts the left-padding slots of each row (None: none):
    row b's real tokens fill slots pad[b]..T-1 at positions 0..T-1-pad[b], and its keys before pad[b] are never
    attended to. Returned logits are float views of static buffers (graph=True): read them before the next call.
    V = the real vocabulary (padding columns dropped). Runs under torch.no_grad and in the model's current mode
    (call with the model in eval mode: generate does)."""

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
        self.keys = torch.arange(max_len, device=p.device)  # key slots, for the masks
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=p.device)  # static input of a step
        self.pos = torch.zeros(1, dtype=torch.long, device=p.device)  # static slot of that token (shared by the rows)
        self.pad = torch.zeros(batch, 1, dtype=torch.long, device=p.device)  # static left-padding slots per row
        self.n = 0  # the host's copy of pos: slots in the caches
        self.graph = self.logits = self.amp = None

    def _bind(self, slots):
        """Every cache writes at `slots` (T,) (the same for every row) and masks with the mask they imply, one for
        all layers: row b's query at slot s sees keys at slots lo..s, lo = pad[b] (its first real token), or s itself
        for a query on a padding slot (a row with no key at all would give NaN, and NaN in a padding slot's value
        poisons even a zero attention weight). Returns the rows' positions (B, T) = slot - pad[b] (0 on padding)."""
        s = slots[None, :, None]  # (1, T, 1)
        lo = torch.minimum(self.pad[:, :, None], s)  # (B, T, 1)
        k = self.keys[None, None, :]  # (1, 1, T_max)
        mask = ((k >= lo) & (k <= s))[:, None]  # (B, 1, T, T_max)
        for c in self.caches:
            c.pos, c.attn_mask = slots, mask
        return (slots[None, :] - self.pad).clamp_(min=0)  # (B, T)

    @torch.no_grad()
    def prefill(self, idx, pad=None):
        B, T = idx.shape
        if B != self.B or T > self.max_len:
            raise ValueError(f"Decoder.prefill: batch of {B} x {T} tokens for a decoder of {self.B} x {self.max_len}")
        if pad is None:
            self.pad.zero_()
        else:
            self.pad.copy_(torch.as_tensor(pad, dtype=torch.long).view(B, 1))
        slots = torch.arange(T, device=self.device)
        pos = self._bind(slots)
        # model.forward's stages, with the head on the last position only: the (B, T, V) logits of the whole prompt
        # (2 GB at 1,024 rows of 20 tokens in bf16) were computed and dropped
        model = self.model
        ops, x, m = model.ops_for(idx.device), model.embed(idx, 0, pos), None
        for block, cache in zip(model.transformer.h, self.caches):
            x, m = block(x, ops, cache, m)
        logits, _ = model.head(x[:, -1:].contiguous(), None if m is None else m[:, -1:].contiguous())
        self.pos.fill_(T)
        self.n = T
        return logits[:, -1, :self.V].float()

    def _body(self):
        """One step on the static token, slot and padding: the whole of what the graph records."""
        pos = self._bind(self.pos)
        logits, _ = self.model(self.tok, kv_caches=self.caches, pos=pos)
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


def _decode(dec, idx, pad, n: int, temperature, top_k, generator, eot, check_every, finished):
    """Prefill idx (with `pad`) and pick n tokens -> (out (B, n), m): m = the columns picked before an early stop
    (the rest hold `eot`, or -1 without one)."""
    B, dev = idx.shape[0], idx.device
    out = torch.full((B, n), -1 if eot is None else eot, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    logits = dec.prefill(idx, pad)
    for i in range(n):
        tok = pick(logits, temperature, top_k, generator)
        out[:, i] = tok
        if i == n - 1:
            break
        if eot is not None:
            done |= tok == eot
        if (eot is not None or finished is not None) and i % check_every == check_every - 1:
            stop = done
            if finished is not None:  # the host reads the tokens so far: the same single sync
                stop = done | torch.as_tensor(finished(out[:, :i + 1].cpu()), dtype=torch.bool, device=dev)
            if bool(stop.all()):  # the only host sync
                return out, i + 1
        logits = dec.step(tok)
    return out, n


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             generator: torch.Generator | None = None, eot: int | None = None, graph="auto",
             check_every: int = 16, max_len: int | None = None, finished=None, pad_id: int = 0):
    """Continuations of `idx`, either a (B, T) tensor or a list of B token-id lists of any lengths.

    Tensor: -> (B, T + n), n = max_new_tokens cut to the context, as GPT.generate returns. Tokens after a row's
    first `eot` are unspecified: truncate there.
    List: the prompts are left-padded (with `pad_id`, never attended to) to the longest, L tokens, and decoded as one
    batch (per-row positions and key masks, see Decoder) -> a list of B lists of new tokens, max_new_tokens each,
    cut after the first `eot` (kept) when eot is given, and shorter where everything stopped early (below). The
    longest prompt + max_new_tokens must fit the context (ValueError otherwise; no silent cut).
    graph: True (CUDA graph), False (the same static caches, eager) or "auto" (True where `graph_ok`). With `eot`
    (or `finished`), every `check_every` tokens one host sync asks whether all rows are done; if so decoding stops
    (the tensor's rest is `eot`). finished(tokens (B, i) CPU tensor of the new tokens so far) -> (B,) bools: rows
    the caller needs no more tokens of (evals: a stop string). max_len: the caches' slots (default: the prompt +
    n); a larger fixed value lets calls with other prompt lengths reuse one decoder and its graph (decoder_for).
    The caches take the autocast dtype when autocast is on (call inside it), else the parameters' dtype."""
    dev = model.transformer.wpe.weight.device
    block = model.cfg.block_size
    as_list = not isinstance(idx, torch.Tensor)
    if as_list:
        prompts = [list(p) for p in idx]
        if not prompts:
            return []
        if min(map(len, prompts)) == 0:
            raise ValueError("decode.generate: every prompt needs at least one token")
        T = max(map(len, prompts))
        if T + max(max_new_tokens, 0) > block:
            raise ValueError(f"decode.generate: a prompt of {T} tokens + {max_new_tokens} new tokens exceeds the "
                             f"model's context of {block}")
        pad = [T - len(p) for p in prompts]
        idx = torch.tensor([[pad_id] * k + p for k, p in zip(pad, prompts)], dtype=torch.long)
        pad = torch.tensor(pad, dtype=torch.long)
    else:
        pad = None
    B, T = idx.shape
    total = min(T + max_new_tokens, block)
    n = total - T
    if n <= 0:
        return [[] for _ in range(B)] if as_list else idx
    slots = total if max_len is None else max_len
    if slots < total:
        raise ValueError(f"decode.generate: max_len {max_len} < the {total} slots this call needs")
    on, dt = _amp_state(dev)
    use_graph = graph_ok(model) if graph == "auto" else bool(graph)
    dec = decoder_for(model, B, slots, dt if on else model.transformer.wpe.weight.dtype, use_graph)
    was_training = model.training
    model.eval()
    try:
        out, m = _decode(dec, idx.to(dev), None if pad is None else pad.to(dev), n, temperature, top_k, generator,
                         eot, check_every, finished)
    finally:
        model.train(was_training)
    if not as_list:
        return torch.cat([idx.to(dev), out], dim=1)
    rows = out[:, :m].tolist()
    return [r[:r.index(eot) + 1] if eot is not None and eot in r else r for r in rows]
