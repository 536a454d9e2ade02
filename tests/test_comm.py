"""Ring collectives against torch.distributed, and ZeRO-3's autograd gather, on gloo (CPU) with 2, 3 and 4 ranks.

Exactness: inputs are small integers stored as floats, so every sum is exact in any order and the ring must match
torch.distributed bit for bit (SUM, MAX, AVG = SUM / N); a random-float case checks the same within fp32 rounding
(the two implementations add the N contributions in different orders: |error| <= N ulp of the sum's magnitude).
Sizes 1, 7 and 1001 do not divide by 2, 3 or 4 (uneven chunks, and empty chunks when size < N).
"""
import os
import socket
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from nanopara.comm import all_gather_flat, ring_all_gather, ring_all_reduce, ring_reduce_scatter, zero_gathered
from tests.distributed import processes, spawn

SIZES = (1, 7, 1001)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, n, port, fn):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames *_into_tensor; 2.11 has no new name
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        fn(rank, n)
    finally:
        dist.destroy_process_group()
    # success: skip interpreter teardown, where a gloo thread still alive occasionally aborted a finished worker
    # (SIGABRT, "terminate called without an active exception"; tests/distributed.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ints(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _worker(rank, world):
    """2-, 3- and 4-rank groups inside one spawned world of 4 (a spawn costs seconds); the groups are not prefixes
    of the world, so group ranks differ from global ranks (the ring must map neighbours to global ranks)."""
    for members in ([1, 3], [0, 2, 3], [0, 1, 2, 3]):
        group = dist.new_group(members)  # every rank creates every group
        if rank in members:
            _check(dist.get_rank(group), len(members), group)


def _check(rank, n, group):
    for dtype in (torch.float32, torch.bfloat16):
        for size in SIZES:
            x = _ints((size,), 100 * rank + size, dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                ref = x.clone()
                dist.all_reduce(ref, op=op, group=group)
                got = ring_all_reduce(x.clone(), group, op=op)
                assert torch.equal(got, ref), (n, dtype, size, op)
            got = ring_all_reduce(x.clone(), group, op=dist.ReduceOp.AVG)  # gloo has no AVG: SUM, then / N
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            assert torch.equal(got, ref / n), (n, dtype, size, "avg")

            # reduce-scatter / all-gather: `size` elements per rank
            big = _ints((n * size,), 7 * rank + size, dtype)
            ref = torch.empty(size, dtype=dtype)
            dist.reduce_scatter_tensor(ref, big, group=group)
            keep = big.clone()
            got = ring_reduce_scatter(torch.empty(size, dtype=dtype), big, group)
            assert torch.equal(got, ref) and torch.equal(big, keep), (n, dtype, size, "reduce-scatter")
            mine = _ints((size,), rank + size, dtype)
            ref = torch.empty(n * size, dtype=dtype)
            dist.all_gather_into_tensor(ref, mine, group=group)
            assert torch.equal(ring_all_gather(torch.empty(n * size, dtype=dtype), mine, group), ref)

    # random floats, an awkward 2-D shape: equal within the reordering of an n-term fp32 sum
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    # |sum| < 16, where one ulp is 2^-19; n terms reordered: at most ~n ulp apart
    torch.testing.assert_close(ring_all_reduce(x.clone(), group), ref, rtol=0, atol=n * 2 ** -19)
    with pytest.raises(ValueError, match="expected"):
        ring_reduce_scatter(torch.empty(3), torch.empty(3 * n + 1), group)

    # ZeRO-3's boundary: fwd returns views of the gathered buffer (shapes laid end to end, padding after), bwd
    # reduce-scatters the whole gradient (SUM over ranks; zeros for the padding and for a view the loss ignores)
    shard = _ints((5,), rank, torch.float32)
    full, work, _ = all_gather_flat(shard, group, torch.float32)
    work.wait()
    anchor = torch.zeros(0, requires_grad=True)
    got = []
    shapes = [(2, 3), (1,), (2,)]  # 9 of the 5n >= 10 elements; the rest is padding
    a, b, c = zero_gathered(anchor, full, group, lambda w, out, sent: got.append((w, out)), shapes)
    weights = _ints((5 * n,), 50 + rank, torch.float32)  # a different loss on every rank
    ((a * weights[:6].view(2, 3)).sum() + (c * weights[7:9]).sum()).backward()  # b is unused
    (w, out), = got
    w.wait()
    total = torch.cat([weights[:6], torch.zeros(1), weights[7:9], torch.zeros(5 * n - 9)])
    dist.all_reduce(total, group=group)
    assert torch.equal(out, total[rank * 5:(rank + 1) * 5]) and anchor.grad is None
    ref = torch.empty(5 * n)
    dist.all_gather_into_tensor(ref, shard, group=group)
    assert torch.equal(torch.cat([a.detach().reshape(-1), b.detach(), c.detach()]), ref[:9])
    assert a.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # views, not copies


def test_ring_collectives_match_torch():
    processes(_entry, 4, 4, _free_port(), _worker)


def test_group_none_is_a_no_op():
    x = torch.arange(5.0)
    assert ring_all_reduce(x, None) is x and torch.equal(x, torch.arange(5.0))
    out = torch.empty(5)
    assert torch.equal(ring_all_gather(out, x, None), x) and torch.equal(ring_reduce_scatter(out, x, None), x)


def _stuck_worker(rank, world, out):
    from nanopara.mesh import Mesh
    mesh = Mesh.build(pp=2, device="cpu", timeout_s=3)
    if rank == 0:  # rank 1 never joins: the pp group's collective must fail within the run's timeout
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.zeros(1), group=mesh.groups["pp"])
        with open(out, "w") as f:
            f.write(f"{time.monotonic() - t0:.1f}")
    else:
        while not os.path.exists(out):
            time.sleep(0.05)
    mesh.destroy()


def test_mesh_groups_take_the_runs_timeout(tmp_path):
    """parallel.timeout_s reaches every group of the mesh, not only the world's: new_group's own default is 30
    minutes, which turned a hang in a pp group into half an hour of nothing (seen in CI)."""
    out = str(tmp_path / "waited")
    spawn(_stuck_worker, 2, out)
    assert float(open(out).read()) < 30
