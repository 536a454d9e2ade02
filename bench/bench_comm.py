"""Hand-written ring all-reduce (nanopara.comm) against NCCL's all_reduce: time and bus bandwidth on N GPUs.

    torchrun --nproc_per_node=N bench/bench_comm.py [--quick] [--out F.jsonl] [--device cpu]

For each size (32 MiB .. 1 GiB) and dtype (bf16, fp32), both implementations all-reduce (SUM) the same buffer in
place on the default group. Time per call = CUDA-event time of a batch of calls / calls, the slowest rank's.
Bus bandwidth (nccl-tests' definition for all-reduce) = 2(N-1)/N * bytes / time: the bytes each rank must send
and receive in any bandwidth-optimal algorithm, so the number is comparable across N and with the link speed.
Both use the same NCCL communicator underneath (the ring through ncclSend/ncclRecv in group calls), so the ratio
measures the algorithm: NCCL pipelines slices of each chunk over many channels, our ring moves whole chunks one
step at a time and adds on the compute stream in between. A correctness check (integer-valued data, exact in
any order) runs once per dtype before timing. Finishes in well under a minute on 4 H100s.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import harness as H
from nanopara.comm import ring_all_reduce
from nanopara.mesh import Mesh

MiB = 2 ** 20


def timed(fn, x, calls: int, mesh) -> float:
    """Seconds per call, the slowest rank's: stamps on the stream (CUDA events; the host clock on CPU, where this
    is a gloo smoke test of the script, not a measurement) around `calls` back-to-back calls, after two warm-ups
    (the first p2p call also sets up NCCL's p2p connections)."""
    fn(x)
    fn(x)
    H.sync(x.device)
    dist.barrier()
    clock = H.Clock(x.device)
    a = clock()
    for _ in range(calls):
        fn(x)
    b = clock()
    H.sync(x.device)
    return H.max_over_ranks([clock.ms(a, b) / 1e3 / calls], mesh)[0]


def check(group, dtype, device):
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randint(-8, 8, (3 * MiB + 7,), device=device).to(dtype)  # odd size: uneven chunks
    x += r
    ref = x.clone()
    dist.all_reduce(ref)
    got = ring_all_reduce(x.clone(), group)
    if not torch.equal(got, ref):
        raise SystemExit(f"ring_all_reduce differs from NCCL for {dtype} on {n} ranks")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 sizes, fewer calls")
    ap.add_argument("--out", default="", help="append the rows as JSON lines here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo smoke test, 1-4 MiB")
    args = ap.parse_args()
    mesh = Mesh.build(dp=-1, device=args.device)
    n, group, device = mesh.world, dist.group.WORLD, mesh.device
    sizes = [32, 256, 1024] if args.quick else [32, 64, 128, 256, 512, 1024]  # MiB
    if device.type == "cpu":
        sizes = [1, 4]
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        check(group, dtype, device)
        for mib in sizes:
            numel = mib * MiB // torch.tensor([], dtype=dtype).element_size()
            x = torch.zeros(numel, dtype=dtype, device=device)  # values do not change the speed; 0 stays finite
            calls = max(3, min(20, (2048 if not args.quick else 512) // mib))
            t_nccl = timed(lambda t: dist.all_reduce(t), x, calls, mesh)
            t_ring = timed(lambda t: ring_all_reduce(t, group), x, calls, mesh)
            factor = 2 * (n - 1) / n * mib * MiB / 1e9  # GB moved per rank
            rows.append({"dtype": str(dtype).replace("torch.", ""), "MiB": mib, "nccl_ms": t_nccl * 1e3,
                         "ring_ms": t_ring * 1e3, "nccl_busbw_GBs": factor / t_nccl,
                         "ring_busbw_GBs": factor / t_ring, "ring_over_nccl": t_nccl / t_ring})
            del x
            H.free()
    if mesh.is_main:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
        print(H.banner(f"all-reduce (SUM, in place), NCCL {nccl}", mesh))
        print(H.table(rows, [("dtype", "dtype", ""), ("MiB", "MiB", "d"), ("nccl_ms", "NCCL ms", ".2f"),
                             ("nccl_busbw_GBs", "busbw GB/s", ".1f"), ("ring_ms", "ring ms", ".2f"),
                             ("ring_busbw_GBs", "busbw GB/s", ".1f"), ("ring_over_nccl", "ring/NCCL busbw", ".2f")]))
        H.append_jsonl(args.out, [dict(r, bench="comm", gpus=n, nccl=nccl) for r in rows])
    mesh.destroy()


if __name__ == "__main__":
    main()
