"""Batched generation against Hugging Face transformers' `generate`, on the same GPT-2 weights (issue #31).

    python3 bench/bench_generate.py [--preset gpt2_124m] [--init_from RUN_OR_BIN] [--batches 1,16,64,256]
                                    [--prompt 32] [--new 128] [--mixed] [--out F.jsonl]

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
   Goal (issue #31): at least 2x. One JSON line per batch size (and one of parity) to --out; per row
   ours_over_hf (the best of ours) and ours_graph_over_hf. --mixed: prompt lengths drawn from [prompt/4, prompt]
   per row; ours left-padded into one batch (decode.generate on a list, rl.sample's default) and rl.sample's
   dynamic sampler (one batch per prompt length) against HF left-padded.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

import harness as H
from nanopara import decode, rl
from nanopara.model import GPT, to_hf_state_dict


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
    t = H.timed(fn, 2, device=device, each=True)["times"]
    if first is not None:
        first["s"] = t[0]
    return t[1]


def runs_of(args, model, hf, B, device, amp):
    """(name, fn) of each sampler on B prompts of --prompt tokens (--mixed: of lengths in [prompt/4, prompt])."""
    new, graph = min(args.new, model.cfg.block_size - args.prompt), device.type == "cuda"  # (CPU: eager)
    if args.mixed:
        xs = mixed_prompts(B, args.prompt, model.cfg.vocab_size, B)
        return (("ours_rl_sample", lambda: rl.sample(model, xs, new, 0.0, -1, None, amp, sampler="dynamic")),
                ("ours_rl_sample_graph", lambda: rl.sample(model, xs, new, 0.0, -1, None, amp)),
                ("ours_graph", lambda: decode.generate(model, xs, new, temperature=0, graph=graph)),
                ("hf_generate", lambda: hf_generate_padded(hf, xs, new, device)))
    x = torch.randint(0, model.cfg.vocab_size - 1, (B, args.prompt), generator=torch.Generator().manual_seed(B))
    xd = x.to(device)
    return (("ours_generate", lambda: model.generate(xd, new, temperature=0)),
            ("ours_rl_sample", lambda: rl.sample(model, x.tolist(), new, 0.0, -1, None, amp, sampler="dynamic")),
            ("ours_rl_sample_graph", lambda: rl.sample(model, x.tolist(), new, 0.0, -1, None, amp)),
            ("ours_graph", lambda: decode.generate(model, xd, new, temperature=0, graph=graph)),
            ("hf_generate", lambda: hf_generate(hf, xd, new)))


def speed_row(args, model, hf, B, device, amp) -> dict:
    new = min(args.new, model.cfg.block_size - args.prompt)
    res = {"batch": B, "prompt_tokens": f"{max(1, args.prompt // 4)}-{args.prompt}" if args.mixed else args.prompt,
           "new_tokens": new, "mixed": args.mixed}
    runs = runs_of(args, model, hf, B, device, amp)
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
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=sorted(H.PRESETS))
    ap.add_argument("--init_from", default="", help="a run of this trainer or a GPT-2 .bin (default: random init)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mixed", action="store_true", help="prompt lengths drawn from [prompt/4, prompt] per row: "
                    "ours left-padded in one batch (and rl.sample's old per-length batches) vs HF left-padded")
    ap.add_argument("--out", default="", help="append JSON lines here")
    args = ap.parse_args()
    import transformers
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(H.PRESETS[args.preset]().model)
    if args.init_from:
        from nanopara.sft import init_from
        init_from(model, args.init_from)
    model = model.to(device).eval()
    hf = hf_model(model).to(device)
    print(H.banner(f"bench_generate {args.preset}, transformers {transformers.__version__}"), flush=True)
    head = {"section": "parity", "preset": args.preset, "init_from": args.init_from, "mixed": args.mixed,
            "transformers": transformers.__version__, "rows_differing": parity(model, hf, device),
            "mixed_rows_differing": parity_mixed(model, hf, device)}
    print(f"parity (fp32, greedy): {head['rows_differing']} of 3 rows differ; left-padded prompts of 9, 2 and 5 "
          f"tokens: {head['mixed_rows_differing']} of 3", flush=True)
    amp = H.amp(device)
    if device.type == "cuda":
        hf = hf.to(torch.bfloat16)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        rows.append(speed_row(args, model, hf, B, device, amp))
        print(", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()),
              flush=True)
    H.append_jsonl(args.out, [head] + [dict(r, section="speed", preset=args.preset,
                                            transformers=transformers.__version__) for r in rows])


if __name__ == "__main__":
    main()
