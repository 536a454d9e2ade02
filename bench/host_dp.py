"""Host cost of the data-parallel engines' forward and backward machinery (hooks, gradient destinations), on CPU.

    torchrun --nproc_per_node=2 bench/host_dp.py [--repeats 60]

GPT-2 124M's structure (12 blocks, 148 parameter tensors, 48 Linear weights with gradient destinations) at toy
widths (n_embd 48, T 8, B 1), so a backward is nearly all per-op and per-hook Python/C++ overhead. Each engine is
built by parallel.parallelize; its communication is switched off (`_launch` returns a finished stand-in), so the
rows compare what the engine's own host work adds to a forward and a backward: SingleDevice (no hooks), DDP and
ZeRO-2 with and without gradient destinations (`ddp:dest`, `zero2:nodest`). Medians of the timed forwards and
backwards, rank 0. On a GPU these costs hide behind the kernels unless the step is host-bound (small micro-
batches); see bench_dp.py's `host ms` for the GPU-side measure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import harness as H
from nanopara.mesh import Mesh


class _Done:
    def wait(self):
        pass


def _no_comm(engine):
    """Replace the engine's gradient collectives with finished stand-ins (same return shapes as `_launch`)."""
    if hasattr(engine, "flats"):  # ZeRO-2: (flat, work, reduced shard, sent)
        engine._launch = lambda i: (engine.flats[i], _Done(), torch.zeros(engine.flats[i].shard), None)
    else:
        engine._launch = lambda i: _Done()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mesh = Mesh.build(dp=int(os.environ.get("WORLD_SIZE", 1)), device="cpu")
    model = {"model.n_layer": 12, "model.n_head": 12, "model.n_embd": 48, "model.block_size": 16,
             "model.vocab_size": 64, "model.vocab_multiple": 1, "model.kernels": "torch", "train.seq_len": 8,
             "train.micro_batch": 1, "train.tokens_per_step": 0}
    x = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    modes = ["single", "ddp", "ddp:dest", "zero2", "zero2:nodest"] if mesh.dp > 1 else ["single"]
    for mode in modes + modes:  # twice: the second pass shows the spread
        base, _, variant = mode.partition(":")
        cfg = H.make_cfg("tiny", {**model, "parallel.zero": 2 if base == "zero2" else 0})
        trainer, _ = H.build_trainer(cfg, H.solo_mesh(mesh.device) if base == "single" else mesh)
        engine = trainer.engine
        if base != "single":
            _no_comm(engine)
        if variant in ("nodest", "dest"):  # DDP's are off by default (parallel.grad_dests=auto)
            engine._set_grad_dests([] if variant == "nodest" else engine.params)
        fwd, bwd = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            _, loss = engine.model(x[:, :-1], x[:, 1:])
            t1 = time.perf_counter()
            engine.backward(loss)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
            trainer.step(0.0)  # zero the grads / reset the buckets as a training step would
        if mesh.rank == 0:
            print(f"{mode:>13}: forward {1e3 * statistics.median(fwd[10:]):.2f} ms, backward "
                  f"{1e3 * statistics.median(bwd[10:]):.2f} ms host (medians of {len(fwd) - 10})", flush=True)
        engine.close()
    mesh.destroy()


if __name__ == "__main__":
    main()
