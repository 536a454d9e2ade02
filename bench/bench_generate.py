"""Batched generation against Hugging Face transformers' `generate`, on the same GPT-2 weights (issue #31).

    python3 bench/bench_generate.py [--preset gpt2_124m] [--init_from RUN_OR_BIN] [--batches 1,16,64,256]
                                    [--prompt 32] [--new 128] [--mixed] [--out DIR]

A benchmark-only comparison: transformers is imported here and nowhere else (the GPU machines have it; on CPU,
`pip install transformers` into any path on PYTHONPATH). One model, two runtimes:
  ours  GPT (random init of --preset, or --init_from: a run of this trainer or a GPT-2 .bin) and nanopara's
        samplers: `model.generate` (one batch, KV cache, eager), `rl.sample` with sampler="dynamic" (RL's
        eager sampler, rows leave at EOT; here EOT = -1, so no row leaves early) and with its default (on CUDA:
        "graph", decode.py), and `decode.generate(graph=True)` (ours_graph: static KV cache, one CUDA graph replay
        per token; its first call captures the graph: ours_graph_first_call_s, the timed call replays);
  HF    GPT2LMHeadModel built from `to_hf_state_dict(model)`, `generate(do_sample=False, use_cache=True,
        min_new_tokens=max_new_tokens)`: the same number of tokens for every row.
1. Parity (fp32): greedy continuations of a few prompts agree token for token (a wrong weight mapping would show),
   and of prompts of 9, 2 and 5 tokens left-padded into one batch (ours: decode.py's per-row positions and key
   mask; HF: an attention mask).
2. Speed (bf16 autocast for ours, the HF model cast to bf16, CUDA): per batch size, B random prompts of --prompt
   tokens, --new greedy tokens each; tokens/s = B * new / wall time after one warm-up call; ratio ours / HF.
   Goal (issue #31): at least 2x. Results as JSON (GPU, date, versions, rows) in DIR/generate.json; per row
   ours_over_hf (the best of ours) and ours_graph_over_hf. --mixed: prompt lengths drawn from [prompt/4, prompt]
   per row; ours left-padded into one batch (decode.generate on a list, rl.sample's default) and rl.sample's
   dynamic sampler (one batch per prompt length) against HF left-padded.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanopara import decode, rl  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402
from nanopara.model import GPT, to_hf_state_dict  # noqa: E402


def hf_model(model: GPT):
    """GPT2LMHeadModel holding `model`'s weights (transformers imported here only)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.cfg
    cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                     n_head=c.n_head, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1,
                     pad_token_id=c.vocab_size - 1)
    hf = GPT2LMHeadModel(cfg)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    bad = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]  # causal-mask buffers
    if bad or unexpected:
        raise SystemExit(f"weight mapping: missing {bad[:3]}, unexpected {list(unexpected)[:3]}")
    return hf.eval()


def hf_generate(hf, idx: torch.Tensor, new: int) -> torch.Tensor:
    out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, use_cache=True, pad_token_id=hf.config.pad_token_id)
    return out[:, idx.shape[1]:]


def hf_generate_padded(hf, prompts: list, new: int, device) -> list:
    """Hugging Face on prompts of different lengths: left-padded with an attention mask (its positions follow the
    mask), the new tokens of each row."""
    pad, L = hf.config.pad_token_id, max(map(len, prompts))
    idx = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
    out = hf.generate(idx.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, use_cache=True, pad_token_id=pad)
    return out[:, L:].tolist()


def mixed_prompts(B: int, longest: int, vocab: int, seed: int) -> list:
    """B random prompts of lengths drawn from [longest / 4, longest] (the longest always present)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, longest // 4), longest + 1, (B,), generator=g).tolist()
    lens[0] = longest
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lens]


def parity_mixed(model: GPT, hf, device, new=8) -> int:
    """Rows whose greedy continuation (fp32) differs between our left-padded batch (decode.generate on a list) and
    Hugging Face's left-padded batch with an attention mask, prompts of 2, 5 and 9 tokens (0 = parity)."""
    prompts = [p[:n] for p, n in zip(mixed_prompts(3, 9, model.cfg.vocab_size, 1), (9, 2, 5))]
    with torch.no_grad():
        ours = decode.generate(model, prompts, new, temperature=0, graph=False)
        theirs = hf_generate_padded(hf, prompts, new, device)
    return sum(a != b for a, b in zip(ours, theirs))


def parity(model: GPT, hf, device, prompts=3, length=8, new=8) -> int:
    """Rows whose greedy continuation (fp32) differs between the two runtimes (0 = parity)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.cfg.vocab_size - 1, (prompts, length), generator=g).to(device)
    with torch.no_grad():
        ours = model.generate(idx, new, temperature=0)[:, length:]
        theirs = hf_generate(hf, idx, new)
    return int((ours != theirs).any(1).sum())


def timed(fn, device, first: dict | None = None) -> float:
    """Seconds of fn's second call; the first (warm-up: kernels, allocator, autotuning, graph capture) goes into
    first["s"] when given."""
    def run():
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    t = run()
    if first is not None:
        first["s"] = t
    return run()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=sorted(PRESETS))
    ap.add_argument("--init_from", default="", help="a run of this trainer or a GPT-2 .bin (default: random init)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mixed", action="store_true", help="prompt lengths drawn from [prompt/4, prompt] per row: "
                    "ours left-padded in one batch (and rl.sample's old per-length batches) vs HF left-padded")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import transformers
    device = torch.device(args.device)
    cfg = PRESETS[args.preset]().model
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.init_from:
        from nanopara.sft import init_from
        init_from(model, args.init_from)
    model = model.to(device).eval()
    hf = hf_model(model).to(device)
    mismatched = parity(model, hf, device)
    print(f"parity (fp32, greedy): {mismatched} of 3 rows differ", flush=True)
    mismatched_mixed = parity_mixed(model, hf, device)
    print(f"parity, left-padded prompts of 9, 2 and 5 tokens (fp32, greedy): {mismatched_mixed} of 3 rows differ",
          flush=True)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    if device.type == "cuda":
        hf = hf.to(torch.bfloat16)
    new = min(args.new, cfg.block_size - args.prompt)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        x = torch.randint(0, cfg.vocab_size - 1, (B, args.prompt), generator=torch.Generator().manual_seed(B))
        xd = x.to(device)
        res = {"batch": B, "prompt_tokens": args.prompt, "new_tokens": new}
        graph = device.type == "cuda"  # CUDA graphs need CUDA: on CPU the same static-cache path runs eagerly
        if args.mixed:
            res["prompt_tokens"] = f"{max(1, args.prompt // 4)}-{args.prompt}"
            xs = mixed_prompts(B, args.prompt, cfg.vocab_size, B)
            runs = (("ours_rl_sample", lambda: rl.sample(model, xs, new, 0.0, -1, None, amp, sampler="dynamic")),
                    ("ours_rl_sample_graph", lambda: rl.sample(model, xs, new, 0.0, -1, None, amp)),
                    ("ours_graph", lambda: decode.generate(model, xs, new, temperature=0, graph=graph)),
                    ("hf_generate", lambda: hf_generate_padded(hf, xs, new, device)))
        else:
            runs = (("ours_generate", lambda: model.generate(xd, new, temperature=0)),
                    ("ours_rl_sample", lambda: rl.sample(model, x.tolist(), new, 0.0, -1, None, amp,
                                                         sampler="dynamic")),
                    ("ours_rl_sample_graph", lambda: rl.sample(model, x.tolist(), new, 0.0, -1, None, amp)),
                    ("ours_graph", lambda: decode.generate(model, xd, new, temperature=0, graph=graph)),
                    ("hf_generate", lambda: hf_generate(hf, xd, new)))
        with torch.no_grad():
            for name, fn in runs:
                first = {}
                try:
                    with (amp() if name in ("ours_generate", "ours_graph") else contextlib.nullcontext()):
                        res[f"{name}_tokens_per_s"] = B * new / timed(fn, device, first)
                except RuntimeError as e:  # out of memory at a large batch must not lose the other numbers
                    res[f"{name}_error"] = str(e).splitlines()[0][:200]
                if name == "ours_graph" and "s" in first:
                    res["ours_graph_first_call_s"] = first["s"]
        decode.clear_decoders()  # this batch's caches and graphs
        ours = [res.get(f"{n}_tokens_per_s", 0) for n, _ in runs if n.startswith("ours")]
        if max(ours) and res.get("hf_generate_tokens_per_s"):
            res["ours_over_hf"] = max(ours) / res["hf_generate_tokens_per_s"]
            if res.get("ours_graph_tokens_per_s"):
                res["ours_graph_over_hf"] = res["ours_graph_tokens_per_s"] / res["hf_generate_tokens_per_s"]
        rows.append(res)
        print(f"batch {B:4d}: " + " | ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in res.items() if k != "batch"), flush=True)
    out = {"bench": "generate", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "preset": args.preset, "init_from": args.init_from,
           "parity_rows_differing": mismatched, "parity_mixed_rows_differing": mismatched_mixed, "mixed": args.mixed,
           "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generate.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
