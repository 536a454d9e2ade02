"""Supervised fine-tuning on one GPU: does the loss mask cost throughput, and does SFT teach a held-out task?

    python3 bench/bench_sft.py --out=DIR [--preset gpt2_124m] [--init RUN_DIR|gpt2.bin] [--steps 600] [--digits 3]
    python3 bench/bench_sft.py --out=/tmp/x --preset tiny --device cpu --examples 400 --micro_batch 4 \
        --steps 3 --tp_steps 2                                                        # the logic

1. Data: synthetic addition, "{a}+{b}=?" -> "{a+b}", a and b below 10**digits; the test pairs are disjoint from the
   train pairs. Written as JSONL and made into packed, loss-masked shards by `data/prepare.py sft`.
2. Throughput: train.py on those shards with data.loss_mask=auto and =off, same model/batch (tokens/s from the
   median step of metrics.jsonl, MFU beside it). Expect a ratio ~1.0: the mask only turns targets into -1.
3. Learning: train.py for --steps on the SFT shards (from --init if given, else from scratch), then greedy exact
   match on the held-out pairs with the KV-cache generator, before and after.
Results: one JSON line in DIR/sft.jsonl (numbers, ratio; stamped by bench/harness.py), the runs under DIR/runs.
~2-3 min on one H100.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import harness as H
from nanopara.consolidate import full_model_state
from nanopara.data import get_tokenizer
from nanopara.model import GPT
from nanopara.report import read_metrics
from nanopara.sft import EOT, init_from, prompt_ids

ROOT = H.ROOT


def load_prepare():
    spec = importlib.util.spec_from_file_location("prepare", os.path.join(ROOT, "data", "prepare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_task(out, n_train, n_test, digits, seed=0):
    """Train/test JSONL of additions; a pair (a, b) is in test iff it was drawn for test, never in train."""
    import random
    rng, top = random.Random(seed), 10 ** digits
    test = set()
    while len(test) < n_test:
        test.add((rng.randrange(top), rng.randrange(top)))
    train_rows = []
    while len(train_rows) < n_train:
        a, b = rng.randrange(top), rng.randrange(top)
        if (a, b) not in test:
            train_rows.append((a, b))
    paths = {}
    for name, rows in (("train", train_rows), ("test", sorted(test))):
        paths[name] = os.path.join(out, f"add{digits}_{name}.jsonl")
        with open(paths[name], "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": f"{a}+{b}=?", "response": str(a + b)}) + "\n")
    return paths, sorted(test)


@torch.no_grad()
def exact_match(model, enc, pairs, device, batch=256):
    """Greedy answers after prompt_ids (EOT + template), cut at the first EOT; prompts of one length per batch."""
    model.eval().to(device)
    by_len = {}
    for a, b in pairs:
        ids = prompt_ids(enc, f"{a}+{b}=?")
        by_len.setdefault(len(ids), []).append((ids, str(a + b)))
    right = 0
    for items in by_len.values():
        for i in range(0, len(items), batch):
            chunk = items[i:i + batch]
            x = torch.tensor([ids for ids, _ in chunk], device=device)
            out = model.generate(x, 8, temperature=0)[:, x.shape[1]:].tolist()
            for toks, (_, want) in zip(out, chunk):
                toks = toks[:toks.index(EOT)] if EOT in toks else toks
                right += enc.decode(toks).strip() == want
    return right / len(pairs)


def run(argv):
    """train.py on argv, as a user runs it; the step records of its metrics.jsonl."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], capture_output=True, text=True)
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith(("step", "loss mask", "init"))))
    if r.returncode:
        raise SystemExit(f"train.py failed ({r.returncode}): {r.stderr[-2000:]}")
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
    return read_metrics(os.path.join(out_dir, "metrics.jsonl"))[0]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="gpt2_124m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--init", default="", help="run directory or HF GPT-2 .bin to fine-tune (default: from scratch)")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--examples", type=int, default=100_000)
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--micro_batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=600, help="SFT optimizer steps")
    p.add_argument("--tp_steps", type=int, default=40, help="steps per throughput run")
    p.add_argument("--lr", type=float, default=0.0, help="default: 1e-4 with --init, 6e-4 from scratch")
    p.add_argument("--extra", default="", help="more train.py keys, space-separated")
    return p.parse_args()


def throughput(a, common: list, res: dict) -> None:
    """2. tokens/s with and without the loss mask (same shards, same model and batch)."""
    for mask in ("auto", "off"):
        recs = run(common + [f"--out_dir={os.path.join(a.out, 'runs', 'tp_' + mask)}",
                             f"--train.steps={a.tp_steps}", "--train.val_every=0", "--ckpt.final=false",
                             f"--data.loss_mask={mask}", "--train.warmup_steps=5", "--train.log_every=1"])
        steady = recs[len(recs) // 2:] or recs  # past the first steps' compilation and warm-up
        res[f"tokens_per_s_mask_{mask}"] = statistics.median(r["tokens_per_s"] for r in steady)
        res[f"mfu_mask_{mask}"] = statistics.median(r["mfu"] for r in steady)
    res["throughput_ratio_mask_vs_off"] = res["tokens_per_s_mask_auto"] / res["tokens_per_s_mask_off"]
    print(f"tokens/s with the loss mask {res['tokens_per_s_mask_auto']:,.0f}, without "
          f"{res['tokens_per_s_mask_off']:,.0f} (ratio {res['throughput_ratio_mask_vs_off']:.3f}); "
          f"MFU {res['mfu_mask_auto']:.1%}")


def learning(a, common: list, res: dict, enc, test_pairs) -> None:
    """3. exact match on the held-out additions before and after SFT."""
    device = torch.device(a.device if a.device != "auto" else "cuda")
    run_dir, lr, t0 = os.path.join(a.out, "runs", "sft"), a.lr or (1e-4 if a.init else 6e-4), time.time()
    recs = run(common + [f"--out_dir={run_dir}", f"--train.steps={a.steps}", f"--train.lr={lr}",
                         f"--train.warmup_steps={max(1, a.steps // 20)}", "--train.val_every=100",
                         "--train.val_steps=4", f"--train.log_every={max(1, a.steps // 20)}"])
    res.update(sft_seconds=time.time() - t0, sft_steps=a.steps, lr=lr, loss_first=recs[0]["loss"],
               loss_last=recs[-1]["loss"])
    if a.init:  # the starting model, loaded as train.py loads it
        base = GPT(H.parse_args(common + [f"--out_dir={run_dir}"]).model)
        init_from(base, a.init)
        res["exact_match_before"] = exact_match(base, enc, test_pairs, device)
    sd, mcfg = full_model_state(run_dir)
    model = GPT(mcfg)
    model.load_state_dict(sd)
    res["exact_match_after"] = exact_match(model, enc, test_pairs, device)
    print(f"SFT {a.steps} steps in {res['sft_seconds']:.0f} s: loss {res['loss_first']:.3f} -> {res['loss_last']:.3f}; "
          f"held-out exact match {res.get('exact_match_before', float('nan')):.1%} -> {res['exact_match_after']:.1%}")


def main():
    a = parse()
    os.makedirs(a.out, exist_ok=True)
    t_start, enc = time.time(), get_tokenizer()
    print(H.banner(f"bench_sft {a.preset} add{a.digits} from {a.init or 'scratch'}"), flush=True)
    paths, test_pairs = make_task(a.out, a.examples, a.test, a.digits)
    load_prepare().main(["sft", paths["train"], "--val_jsonl", paths["test"], "--out", os.path.join(a.out, "shards"),
                         "--seq_len", str(a.seq_len), "--name", "add", "--force"])
    common = [f"--preset={a.preset}", f"--device={a.device}", "--data.dataset=add",
              f"--data.data_dir={os.path.join(a.out, 'shards')}", f"--train.seq_len={a.seq_len}",
              f"--train.micro_batch={a.micro_batch}", "--train.sample_tokens=0", "--overwrite=true",
              *([f"--ckpt.init_from={a.init}"] if a.init else []), *a.extra.split()]
    res = {"preset": a.preset, "init": a.init or "scratch", "digits": a.digits, "train_examples": a.examples,
           "test_examples": len(test_pairs), "seq_len": a.seq_len, "micro_batch": a.micro_batch}
    throughput(a, common, res)
    learning(a, common, res, enc, test_pairs)
    res["total_seconds"] = time.time() - t_start
    H.append_jsonl(os.path.join(a.out, "sft.jsonl"), res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
