"""Hand-written ring all-reduce (nanopara.comm) against NCCL's all_reduce: time and bus bandwidth on N GPUs.

    torchrun --nproc_per_node=N bench/bench_comm.py [--quick] [--out FILE]

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
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanopara.comm import ring_all_reduce  # noqa: E402

MiB = 2 ** 20


def timed(fn, x, calls: int) -> float:
    """Seconds per call on this rank (CUDA events around `calls` back-to-back calls), max over ranks."""
    fn(x)  # warm-up (the first p2p call also sets up NCCL's p2p connections)
    fn(x)
    if x.device.type != "cuda":  # --device=cpu: a smoke test of this script with gloo, not a measurement
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        t = torch.tensor((time.perf_counter() - t0) / calls)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor(start.elapsed_time(end) / 1e3 / calls, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo smoke test, 1-4 MiB")
    args = ap.parse_args()

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
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
            t_nccl = timed(lambda t: dist.all_reduce(t), x, calls)
            t_ring = timed(lambda t: ring_all_reduce(t, group), x, calls)
            factor = 2 * (n - 1) / n * mib * MiB / 1e9  # GB moved per rank
            rows.append({"dtype": str(dtype).replace("torch.", ""), "MiB": mib, "nccl_ms": t_nccl * 1e3,
                         "ring_ms": t_ring * 1e3, "nccl_busbw_GBs": factor / t_nccl,
                         "ring_busbw_GBs": factor / t_ring, "ring_over_nccl": t_nccl / t_ring})
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo smoke test)"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
        print(f"all-reduce (SUM, in place) on {n} x {name}, NCCL {nccl}, torch {torch.__version__}, "
              f"{datetime.date.today()}")
        print(f"{'dtype':>8} {'size':>9} | {'NCCL ms':>8} {'busbw GB/s':>10} | {'ring ms':>8} {'busbw GB/s':>10} "
              f"| ring/NCCL busbw")
        for r in rows:
            print(f"{r['dtype']:>8} {r['MiB']:>5} MiB | {r['nccl_ms']:8.2f} {r['nccl_busbw_GBs']:10.1f} | "
                  f"{r['ring_ms']:8.2f} {r['ring_busbw_GBs']:10.1f} | {r['ring_over_nccl']:.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"bench": "comm", "gpus": n, "device": name, "torch": torch.__version__,
                           "date": str(datetime.date.today()), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
