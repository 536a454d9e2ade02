"""Host cost of ZB-H1's split backward (nanopara/zb.py) against the one-pass backward of 1F1B, on CPU.

    python bench/host_zb.py [--repeats 40] [--n_layer 12]

A pipeline chunk of gpt_1b's structure (n_layer blocks of 4 Linears, the first stage: embedding + blocks) at toy
widths (n_embd 64, T 16, B 1), so every op is nearly all Python / dispatcher / autograd overhead, under bf16
autocast as the trainer runs it. Rows: the forward, the backward of 1F1B (one `autograd.backward`), and ZB's B
(the backward with the Linears' weight gradients stored) and W (`DeferredWeightGrads.run`), each timed as the
pipeline runs it (pp.Pipeline._run). Medians over the repeats, ms. On a GPU these costs hide behind the kernels
unless the stage is host-bound (notes/pp.md: at micro-batch 2, gpt_1b's stages idle 41-43 %).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import harness as H
from nanopara.config import ModelConfig
from nanopara.model import GPT
from nanopara.pp import split_model
from nanopara.zb import DeferredWeightGrads


def chunk_of(n_layer: int, split: bool):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2 * n_layer, n_head=4, n_embd=64, block_size=16, vocab_size=64, vocab_multiple=1,
                      kernels="torch")
    ch = split_model(GPT(cfg), 2, 0)[0]  # the first stage's chunk: embedding + n_layer blocks
    return ch, (DeferredWeightGrads(ch) if split else None)


def time_phases(n_layer: int, split: bool, repeats: int) -> dict:
    ch, d = chunk_of(n_layer, split)
    x = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    dy = torch.randn(1, 16, 64)
    times, amp = {"F": [], "B": [], "W": []}, H.amp("cpu", "bf16")
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        with amp():
            y = ch(x, None)
        t1 = time.perf_counter()
        if d is None:
            torch.autograd.backward(y, dy)
            t2 = t3 = time.perf_counter()
        else:
            with d.recording(0):
                torch.autograd.backward(y, dy, inputs=d.eager_params)
            t2 = time.perf_counter()
            d.run(0)
            t3 = time.perf_counter()
        for p in ch.parameters():
            p.grad = None
        if d is not None:
            d.new_step()  # as pp.Pipeline.step: the weights changed, the cached casts go
        if i >= 5:  # warm-up: allocator, first-call caches
            times["F"].append(t1 - t0)
            times["B"].append(t2 - t1)
            times["W"].append(t3 - t2)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--n_layer", type=int, default=12, help="blocks in the chunk (gpt_1b at pp = 2: 12)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'path':6} {'F ms':>7} {'B ms':>7} {'W ms':>7} {'B+W ms':>7}")
    for name in ("1f1b", "zb", "1f1b", "zb"):  # twice: the second pass shows the spread
        r = time_phases(args.n_layer, name == "zb", args.repeats)
        print(f"{name:6} {r['F']:7.2f} {r['B']:7.2f} {r['W']:7.2f} {r['B'] + r['W']:7.2f}")


if __name__ == "__main__":
    main()
