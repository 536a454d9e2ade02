"""Sample text from a nanopara checkpoint (any layout: one process, DDP, ZeRO-1/2/3, TP/SP) or GPT-2's weights.

    python sample.py --out_dir=runs/tiny --prompt="ROMEO:" --tokens=200          # the run's newest checkpoint
    python sample.py --ckpt=runs/tiny/ckpt/step_000100 --temperature=0 --tokens=50 # one step directory, greedy
    python sample.py --init_from=pytorch_model.bin --prompt="Hello, I'm a language model,"  # Hugging Face GPT-2

Keys (`--key=value`; a repeated key: the last one wins):
  --out_dir=RUN        a training run: samples from <RUN>/ckpt/latest
  --ckpt=PATH          a step directory (or a step name under <out_dir>/ckpt): takes precedence over ckpt/latest
  --init_from=FILE     a Hugging Face GPT2LMHeadModel state dict (.bin/.pt); --n_head=H if n_embd/64 is not it
  --prompt=TEXT        the text to continue (default: start from <|endoftext|>)
  --tokens=N           new tokens per sample (100); --num_samples=N (1), printed apart by a line of dashes
  --temperature=T      0 = greedy (0.8); --top_k=K: sample among the K likeliest tokens, 0 = all (200)
  --seed=S             the same seed, checkpoint and keys print the same text (1337); --device=auto|cpu|cuda
A prompt that leaves no room for N new tokens in the model's context keeps its last block_size - N tokens (a
warning on stderr). Every user error is one line on stderr and exit code 2; --help prints this text. Checkpoint
weights come from nanopara/consolidate.py.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from nanopara.checkpoint import CheckpointError
from nanopara.cli import parse_flags
from nanopara.config import ModelConfig
from nanopara.consolidate import full_model_state, resolve
from nanopara.data import get_tokenizer
from nanopara.model import GPT, from_hf_state_dict


class SampleError(ValueError):
    """A user mistake (bad key or value, unreadable weights): one line on stderr, exit code 2."""


@dataclasses.dataclass
class Args:
    out_dir: str = ""
    ckpt: str = ""
    init_from: str = ""
    n_head: int = 0
    prompt: str = ""
    tokens: int = 100
    num_samples: int = 1
    temperature: float = 0.8
    top_k: int = 200
    seed: int = 1337
    device: str = "auto"


def parse_args(argv: list[str]) -> Args:
    args = parse_flags(Args(), argv, SampleError)  # a repeated key: the last one wins
    for key, low in (("tokens", 1), ("num_samples", 1), ("top_k", 0), ("n_head", 0)):
        if getattr(args, key) < low:
            raise SampleError(f"--{key} must be >= {low}, got {getattr(args, key)}")
    if not 0 <= args.temperature < float("inf"):  # NaN fails too
        raise SampleError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if 0 < args.temperature < 1e-4:  # greedy in effect; far smaller T overflows logits / T to inf (NaN softmax)
        raise SampleError(f"--temperature={args.temperature} is too small to sample with; 0 means greedy")
    if not 0 <= args.seed < 2 ** 63:
        raise SampleError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise SampleError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.init_from and (args.out_dir or args.ckpt):
        raise SampleError("give --init_from=FILE or --out_dir/--ckpt, not both")
    if not (args.init_from or args.out_dir or args.ckpt):
        raise SampleError("nothing to sample from: give --out_dir=RUN, --ckpt=STEP_DIR or --init_from=FILE")
    if args.n_head and not args.init_from:
        raise SampleError("--n_head applies to --init_from only (a checkpoint records its own)")
    return args


# ----------------------------------------------------------------------------------------------------------------
# weights

def hf_model(path: str, n_head: int = 0) -> GPT:
    """A GPT with Hugging Face GPT-2 weights; the shape comes from the tensors (n_head: n_embd / 64, as in GPT-2)."""
    if not os.path.isfile(path):
        raise SampleError(f"--init_from: no file {path}")
    if path.endswith(".safetensors"):
        raise SampleError(f"--init_from: {path} is safetensors; pass the PyTorch state dict (pytorch_model.bin)")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, truncated, or pickled objects other than tensors
        why = (str(e).strip().splitlines() or [""])[0][:200]  # torch's messages run over several lines
        raise SampleError(f"--init_from: cannot read {path} as a state dict: {type(e).__name__}: {why}") from None
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise SampleError(f"--init_from: {path} is not a state dict of tensors")
    if "wte.weight" in sd:  # saved from GPT2Model (the Hub's gpt2 files): no "transformer." prefix
        sd = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in sd.items()}
    wte, wpe = sd.get("transformer.wte.weight"), sd.get("transformer.wpe.weight")
    if wte is None or wpe is None or wte.dim() != 2 or wpe.dim() != 2:
        raise SampleError(f"--init_from: {path} is not a GPT-2 state dict (no wte/wpe weights)")
    blocks = {int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.") and k.split(".")[2].isdigit()}
    if not blocks:
        raise SampleError(f"--init_from: {path} is not a GPT-2 state dict (no transformer blocks)")
    n_embd = wte.shape[1]
    n_head = n_head or (n_embd // 64 if n_embd % 64 == 0 else 0)
    if not n_head or n_embd % n_head:
        raise SampleError(f"--init_from: n_embd={n_embd} is not a GPT-2 size; give --n_head=H dividing it")
    cfg = ModelConfig(n_layer=max(blocks) + 1, n_head=n_head, n_embd=n_embd,
                      block_size=wpe.shape[0], vocab_size=wte.shape[0])
    model = GPT(cfg)
    try:
        from_hf_state_dict(model, sd)
    except ValueError as e:
        raise SampleError(f"--init_from: {path}: {e}") from None
    return model


def checkpoint_model(args: Args) -> GPT:
    path = args.ckpt or args.out_dir
    if args.ckpt and args.out_dir and not os.path.isdir(args.ckpt):
        path = os.path.join(args.out_dir, "ckpt", args.ckpt)  # a step name under the run
    path, note = resolve(path)
    if note:  # ckpt/latest missing or damaged: an older complete checkpoint is used
        print(f"warning: {note}", file=sys.stderr, flush=True)
    sd, cfg = full_model_state(path)
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


# ----------------------------------------------------------------------------------------------------------------
# sampling

def prompt_tokens(enc, text: str, model: GPT, tokens: int) -> tuple[list[int], bool]:
    """(token ids to start from, whether the first is a <|endoftext|> added because the prompt is empty)."""
    V, T = model.cfg.vocab_size, model.cfg.block_size
    if tokens >= T:
        raise SampleError(f"--tokens={tokens} leaves no room for a prompt in the model's context of {T} tokens "
                          f"(use --tokens<={T - 1})")
    if not text:
        return [enc.eot_token if enc.eot_token < V else 0], True  # tiny test vocabularies lack EOT
    ids = enc.encode(text, allowed_special="all")
    if max(ids) >= V:
        raise SampleError(f"the prompt has token id {max(ids)}, outside this model's vocabulary of {V}")
    if len(ids) + tokens > T:
        keep = T - tokens
        print(f"warning: the prompt's {len(ids)} tokens + --tokens={tokens} exceed the model's context of {T}; "
              f"keeping the prompt's last {keep} tokens", file=sys.stderr, flush=True)
        ids = ids[-keep:]
    return ids, False


@torch.no_grad()
def complete(model: GPT, enc, args: Args) -> list[str]:
    """num_samples texts (prompt + continuation), one after another from one generator seeded with args.seed."""
    device = next(model.parameters()).device
    ids, started_at_eot = prompt_tokens(enc, args.prompt, model, args.tokens)
    idx = torch.tensor([ids], device=device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    texts = []
    for _ in range(args.num_samples):
        out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k or None, generator=g)
        out = out[0, 1:] if started_at_eot else out[0]
        texts.append(enc.decode([t for t in out.tolist() if t < enc.n_vocab]))
    return texts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    try:
        args = parse_args(argv)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SampleError("--device=cuda but no CUDA GPU is visible")
        device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        try:
            enc = get_tokenizer()
        except RuntimeError as e:  # offline, no cached encoding
            raise SampleError(str(e)) from None
        model = hf_model(args.init_from, args.n_head) if args.init_from else checkpoint_model(args)
        model.to(device).eval()
        print("\n---------------\n".join(complete(model, enc, args)), flush=True)
        return 0
    except (SampleError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
