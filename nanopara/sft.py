"""Supervised fine-tuning: the prompt template SFT, RL and evaluation share; examples -> packed, loss-masked rows;
the weights a fine-tuning run starts from (--ckpt.init_from).

Template. A chat is rendered turn by turn; only the assistant's words (and what closes them) are trained on:
    system     "System: {content}\\n"                       masked
    user       "User: {content}\\n"                         masked
    assistant  "Assistant:"  masked, then " {content}" + ("\\n" if more turns follow else <|endoftext|>) trained
A {prompt, response} line is the chat [user prompt, assistant response], i.e. format_prompt(prompt) + " response"
+ EOT: RL (rl.py) samples after prompt_ids(prompt) = EOT + format_prompt(prompt), so the policy sees exactly what
SFT taught it. A response that does not start with whitespace gets one space (GPT-2 words carry their space).

Packing (data/prepare.py sft). Each example is EOT + its turns; examples are laid in input order into rows of
row_len tokens (next-fit: a row takes examples until the next one does not fit), the rest of a row is EOT padding
with mask 0. The closing EOT of an example is the token after it: the next example's leading EOT, the first pad,
or the next row's first token, and it is the only one of those trained. So a target is trained only if it is a
response token or the EOT that ends it; the target after a closing EOT (the next prompt's first token) never is.
Examples in a row are not isolated: attention is causal over the whole row, so example k+1 sees example k's
tokens as context after an EOT, as in pre-training on packed documents. Its loss never has example k's tokens as
targets; only its conditioning can differ, which is the usual packing trade (no padding waste, no doc-masked
attention kernel needed); `--no_pack` puts one example per row for full isolation at the cost of padding.

Masks and loader: nanopara/data.py (a sibling .mask file per shard; y = -1 where masked). Tests: tests/test_sft.py.
"""
from __future__ import annotations

import json
import os

import numpy as np

EOT = 50256  # GPT-2 <|endoftext|> (data.EOT)
ROLES = ("system", "user", "assistant")


class SFTError(ValueError):
    """A malformed SFT input line or an init_from that does not fit the run: one line, naming file:line."""


def format_prompt(prompt: str) -> str:
    """The text a model sees before its response, e.g. 'User: 12+7=?\\nAssistant:'; responses start with a space."""
    return f"User: {prompt.strip()}\nAssistant:"


def prompt_ids(enc, prompt: str) -> list[int]:
    """Token ids an SFT-trained model answers after: EOT + format_prompt(prompt) (generation continues from here)."""
    return [EOT] + enc.encode_ordinary(format_prompt(prompt))

# ----------------------------------------------------------------------------------------------------------------
# examples


def parse_line(obj, where: str) -> list[dict]:
    """One JSONL record -> chat messages [{role, content}]; `where` = 'file:line' for the error."""
    if not isinstance(obj, dict):
        raise SFTError(f"{where}: expected a JSON object with 'prompt' and 'response' or 'messages', got "
                       f"{type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise SFTError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise SFTError(f"{where}: messages[{i}] must be {{\"role\": {'|'.join(ROLES)}, \"content\": "
                               f"string}}, got {json.dumps(m)[:80]}")
        if msgs[-1]["role"] != "assistant":
            raise SFTError(f"{where}: the last message must be the assistant's (it is what is trained on)")
        return msgs
    missing = [k for k in ("prompt", "response") if not isinstance(obj.get(k), str)]
    if missing:
        raise SFTError(f"{where}: needs string fields 'prompt' and 'response' (or 'messages'); "
                       f"{' and '.join(repr(k) for k in missing)} missing or not a string")
    return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]


def read_jsonl(path: str):
    """Yield ('file:line', messages) of every non-blank line; a malformed line is an SFTError naming file:line."""
    if not os.path.isfile(path):
        raise SFTError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield where, parse_line(obj, where)


def render(msgs: list[dict]) -> list[tuple[str, bool]]:
    """(text, trained) segments of a chat; the closing EOT is implied (see the module docstring)."""
    out = []
    for i, m in enumerate(msgs):
        c = m["content"]
        if m["role"] == "assistant":
            out.append(("Assistant:", False))
            out.append((c if c[:1].isspace() else " " + c, True))
            if i < len(msgs) - 1:
                out.append(("\n", True))  # end of this turn: more turns follow
        else:
            out.append((f"{m['role'].capitalize()}: {c.strip()}\n", False))
    return out


def encode(enc, msgs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of one example: EOT + its segments, each tokenized on its own so the mask boundary is exact."""
    toks, mask = [EOT], [0]
    for text, trained in render(msgs):
        ids = enc.encode_ordinary(text)
        toks += ids
        mask += [int(trained)] * len(ids)
    return np.array(toks, dtype=np.uint16), np.array(mask, dtype=np.uint8)


def pack(examples, row_len: int, one_per_row: bool = False) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Lay (tokens, mask) examples into rows of row_len (next-fit, input order) -> (tokens (R*row_len + 1,),
    mask (same), indices of examples longer than a row, skipped). The last token is one more EOT: the closing EOT
    of the last row (the loader's windows take row_len*k + 1 tokens). Mask of a closing EOT = 1 (module doc)."""
    rows, skipped, row, used = [], [], [], 0
    for i, (toks, _) in enumerate(examples):
        if len(toks) > row_len:
            skipped.append(i)
            continue
        if row and (one_per_row or used + len(toks) > row_len):
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += len(toks)
    if row:
        rows.append(row)
    tokens = np.full(len(rows) * row_len + 1, EOT, dtype=np.uint16)  # EOT padding everywhere not written
    mask = np.zeros(len(rows) * row_len + 1, dtype=np.uint8)
    closing = []
    for r, members in enumerate(rows):
        at = r * row_len
        for i in members:
            toks, m = examples[i]
            tokens[at:at + len(toks)], mask[at:at + len(toks)] = toks, m
            at += len(toks)
            closing.append(at)  # the next example's leading EOT, a pad, or the next row's first token
    mask[closing] = 1  # after every example is written: a leading EOT's own mask is 0
    return tokens, mask, skipped

# ----------------------------------------------------------------------------------------------------------------
# the weights a fine-tuning run starts from


# the ModelConfig keys that decide the parameters' shapes (and so must match the checkpoint); dropout, kernels and
# the MoE training knobs may differ in a fine-tuning run
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "moe_experts", "moe_every")


def init_from(model, path: str) -> str:
    """Load `path` into the single-device `model`: a run, ckpt/ or step directory of this trainer (any layout,
    nanopara/consolidate.py), or a Hugging Face GPT2LMHeadModel state dict (.bin/.pt). Raises SFTError when the
    shapes do not match model.cfg. Returns what was loaded, for the log."""
    import torch
    from nanopara.model import from_hf_state_dict
    if os.path.isdir(path):
        from nanopara import checkpoint
        from nanopara.consolidate import full_model_state, model_config, resolve
        step_dir, _ = resolve(path)
        saved = model_config(checkpoint.check_complete(step_dir), step_dir)
        diff = [f"model.{k}={getattr(saved, k)} (this run: {getattr(model.cfg, k)})" for k in SHAPE_KEYS
                if getattr(saved, k) != getattr(model.cfg, k)]
        if diff:
            raise SFTError(f"--ckpt.init_from={path}: the checkpoint's model differs from this run's: "
                           f"{', '.join(diff)}; set those keys (or the preset it was trained with)")
        sd, _ = full_model_state(step_dir)
        V = model.cfg.vocab_size
        with torch.no_grad():  # wte's padding rows depend on vocab_multiple: copy the real vocabulary only
            own = model.state_dict()
            for k, t in sd.items():
                if k in ("transformer.wte.weight", "lm_head.weight"):
                    own[k][:V].copy_(t[:V])
                    own[k][V:].zero_()
                elif k in own:
                    own[k].copy_(t)
        return f"trainer checkpoint {step_dir}"
    if not os.path.isfile(path):
        from nanopara.checkpoint import CheckpointError
        raise CheckpointError(f"--ckpt.init_from: no file or checkpoint directory {path}")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, truncated, safetensors
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise SFTError(f"--ckpt.init_from={path}: cannot read it as a PyTorch state dict ({type(e).__name__}: "
                       f"{why}); pass a run directory or a GPT2LMHeadModel pytorch_model.bin") from None
    if not isinstance(sd, dict) or "transformer.wte.weight" not in sd or "transformer.wpe.weight" not in sd:
        raise SFTError(f"--ckpt.init_from={path}: not a GPT-2 state dict (no transformer.wte/wpe weights)")
    c = model.cfg
    layers = 1 + max((int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.")), default=-1)
    (vocab, n_embd), block = sd["transformer.wte.weight"].shape, sd["transformer.wpe.weight"].shape[0]
    have = {"n_layer": layers, "n_embd": n_embd, "vocab_size": vocab, "block_size": block}
    diff = [f"model.{k}={v} (this run: {getattr(c, k)})" for k, v in have.items() if v != getattr(c, k)]
    if diff:
        raise SFTError(f"--ckpt.init_from={path}: the Hugging Face weights' shape differs from this run's: "
                       f"{', '.join(diff)}; set those keys (GPT-2 124M: --preset=gpt2_124m)")
    try:
        from_hf_state_dict(model, sd)
    except ValueError as e:
        raise SFTError(f"--ckpt.init_from={path}: {e}") from None
    return f"Hugging Face GPT-2 weights {path}"
