"""Context parallel (nanopara/cp.py) against single-device attention and the single-process training run.

Ring and Ulysses attention: cp gloo processes each hold their zigzag (or contiguous) chunks of the same q, k, v;
their output, LSE and q/k/v gradients must equal the rows of one attention_ref over the whole sequence. fp32 on
both sides, the merge reorders the softmax sums: measured max error 2.1e-6 (cp=4) on O(1) values, so 1e-5 (a wrong
mask or a missing block moves values by > 1e-2). The Triton block kernels run in the interpreter (conftest sets
TRITON_INTERPRET=1). Training: train.py at cp2 (with full recompute), cp4, cp2 x tp2 + sp, cp2 x dp2 (ZeRO-1),
cp2 x pp2 and cp2 Ulysses against the single-process run of tests/test_parallel_train.py's model and data over
6 steps (bound and reasons there). Kept K/V (parallel.cp_keep_kv): bit for bit the old backward, no K/V message.
"""
import numpy as np
import pytest
import torch

import train
from kernels.attention import attention_ref, split_qkv
from nanopara.cli import parse_args
from nanopara.config import ConfigError
from nanopara.cp import ulysses_attention
from nanopara.ring_attention import Ring, ring_attention, ring_fwd, zigzag_positions
from nanopara.mesh import Mesh
from tests.distributed import spawn
from tests.test_parallel_train import ATOL, argv, run_parallel, shards  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(4)]  # q, k, v, dout


def _local_rows(layout, T, cp, r):
    if layout == "zigzag":
        return zigzag_positions(T, cp, r)
    return torch.arange(r * T // cp, (r + 1) * T // cp)


def _check_ring(mesh, ring, q, k, v, do, rows, causal):
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*ref_in, causal=causal)
    ref_out.backward(do)
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out, lse = ring_fwd(*[t.detach() for t in mine], ring)
    torch.testing.assert_close(out, ref_out.detach()[:, :, rows], **TOL)
    torch.testing.assert_close(lse, ref_lse.detach()[:, :, rows], **TOL)
    ring_attention(*mine, ring).backward(do[:, :, rows])
    for got, ref in zip(mine, ref_in):
        torch.testing.assert_close(got.grad, ref.grad[:, :, rows], **TOL)


def _packed_equals_views(mesh, prev, nxt, world, triton=False):
    """ring_attention_qkv (the model's path: one packed gradient) gives ring_attention's output and, packed, its
    q, k, v gradients, bit for bit (triton: on the Triton block kernels, interpreter, as on a GPU)."""
    from nanopara.ring_attention import ring_attention_qkv
    ring = Ring(mesh.cp_group, mesh.cp_rank, world, prev, nxt, triton=triton)
    g = torch.Generator().manual_seed(7)
    B, T, nh, hs = (1, 16 * world, 2, 16) if triton else (2, 6 * world, 3, 8)
    qkv = torch.randn(B, T, 3 * nh * hs, generator=g)
    do = torch.randn(B, nh, T, hs, generator=g)
    a = qkv.clone().requires_grad_()
    out_a = ring_attention_qkv(a, nh, ring)
    out_a.backward(do)
    b = qkv.clone().requires_grad_()
    out_b = ring_attention(*split_qkv(b, nh), ring)
    out_b.backward(do)
    assert torch.equal(out_a, out_b) and torch.equal(a.grad, b.grad)


def _ring_worker(rank, world):
    mesh = Mesh.build(dp=1, cp=world, device="cpu")
    prev, nxt = mesh.neighbours("cp")
    T = 12 * world  # 2*cp divides T
    q, k, v, do = _inputs(2, 3, T, 8)
    for causal in (True, False):
        for layout in ("zigzag", "contiguous"):
            ring = Ring(mesh.cp_group, rank, world, prev, nxt, causal=causal, layout=layout)
            _check_ring(mesh, ring, q, k, v, do, _local_rows(layout, T, world, rank), causal)
    q, k, v, do = _inputs(2, 2 * world, T, 8, seed=2)  # Ulysses: heads split over the ranks
    ring = Ring(mesh.cp_group, rank, world, prev, nxt)
    rows = zigzag_positions(T, world, rank)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*ref_in, causal=True)[0].backward(do)
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*mine, ring)
    out.backward(do[:, :, rows])
    torch.testing.assert_close(out, attention_ref(q, k, v)[0][:, :, rows], **TOL)
    for got, ref in zip(mine, ref_in):
        torch.testing.assert_close(got.grad, ref.grad[:, :, rows], **TOL)
    _packed_equals_views(mesh, prev, nxt, world)
    if world == 2:  # the Triton block kernels (interpreter): head dim 16, local blocks of 8 and 16 rows
        q, k, v, do = _inputs(1, 2, 32, 16, seed=1)
        ring = Ring(mesh.cp_group, rank, world, prev, nxt, causal=True, triton=True)
        _check_ring(mesh, ring, q, k, v, do, zigzag_positions(32, 2, rank), True)
        _packed_equals_views(mesh, prev, nxt, world, triton=True)
    mesh.destroy()


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_matches_single_device(cp):
    spawn(_ring_worker, cp)


def _gpu_worker(rank, world):
    """bf16 ring attention on the Triton kernels (NCCL): its error against fp32 attention over the whole sequence is
    at most 2x the single-device Triton kernel's (+ a floor of 1e-3 of the largest value, as test_attention.py)."""
    from kernels.attention import attention_triton
    mesh = Mesh.build(dp=1, cp=world, device="cuda")
    prev, nxt = mesh.neighbours("cp")
    B, H, T, D = 1, 8, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    rows = zigzag_positions(T, world, rank, "cuda")

    def grads(fn, *xs):
        xs = [t.detach().requires_grad_() for t in xs]
        out = fn(*xs)
        out.backward(do[:, :, rows] if out.shape[2] != T else do.to(out.dtype))
        return [out.detach().float()] + [t.grad.float() for t in xs]

    ref = [t[:, :, rows] for t in grads(lambda *x: attention_ref(*x, causal=True)[0], q.float(), k.float(),
                                        v.float())]
    single = [t[:, :, rows] for t in grads(lambda *x: attention_triton(*x, causal=True), q, k, v)]
    ring = Ring(mesh.cp_group, rank, world, prev, nxt, triton=True)
    ours = grads(lambda *x: ring_attention(*x, ring), *(t[:, :, rows] for t in (q, k, v)))
    for name, o, s, r in zip(("out", "dq", "dk", "dv"), ours, single, ref):
        err, err_single = (o - r).abs().max().item(), (s - r).abs().max().item()
        assert err <= 2 * err_single + 1e-3 * r.abs().max().item(), (name, err, err_single)
    mesh.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_ring_attention_bf16_within_2x_single_device_error():
    spawn(_gpu_worker, 2)


def _model_worker(rank, world):
    """apply_cp on a tiny GPT: the cp ranks' mean loss and averaged gradients equal one process's, with -1 targets
    spread unevenly (count-weighted mean) and one rank with no valid target at all."""
    from nanopara.config import ModelConfig
    from nanopara.cp import apply_cp
    from nanopara.model import GPT
    import torch.distributed as dist
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=64, vocab_multiple=8,
                      kernels="torch")
    mesh = Mesh.build(dp=1, cp=world, device="cpu")
    torch.manual_seed(0)
    ref = GPT(cfg)
    cpm = apply_cp(GPT(cfg).requires_grad_(True), mesh)
    cpm.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (2, 16), generator=g)
    y = torch.randint(0, 64, (2, 16), generator=g)
    y[0, :5] = -1  # uneven: rank 0 holds positions 0-3 and 12-15
    y[1, zigzag_positions(16, world, 1)] = -1  # row 1: rank 1's chunks all ignored
    for targets in (y, torch.where(torch.arange(16) < 8, y, -1)):  # the second: rank 1 has no valid target
        ref.zero_grad()
        cpm.zero_grad()
        _, loss_ref = ref(x, targets)
        loss_ref.backward()
        _, loss = cpm(x, targets)
        (loss / world).backward()  # the engines' 1/(dp*cp)
        total = loss.detach() / world
        dist.all_reduce(total)
        torch.testing.assert_close(total, loss_ref.detach(), **TOL)
        for (name, p), p_ref in zip(cpm.named_parameters(), ref.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, p_ref.grad, atol=1e-6, rtol=1e-5, msg=name)
    logits, _ = cpm(x)  # logits of this rank's tokens only
    assert logits.shape[1] == 16 // world
    torch.testing.assert_close(logits, ref(x)[0][:, zigzag_positions(16, world, rank)], **TOL)
    mesh.destroy()


def test_model_loss_and_grads_match_single_process():
    spawn(_model_worker, 2)


def test_seq_len_not_divisible_by_2cp_is_rejected():
    with pytest.raises(ConfigError, match="not divisible by 2\\*parallel.cp = 8"):
        parse_args(["--preset=tiny", "--parallel.cp=4", "--train.seq_len=100"])
    with pytest.raises(ValueError, match="does not split into 2\\*cp = 6 equal chunks"):
        zigzag_positions(20, 3, 0)
    with pytest.raises(ConfigError, match="train.compile=true with parallel.cp"):
        parse_args(["--preset=tiny", "--parallel.cp=2", "--train.compile=true"])
    with pytest.raises(ConfigError, match="parallel.cp > 1"):
        parse_args(["--preset=tiny", "--parallel.cp=2", "--train.eval_every=10"])
    with pytest.raises(ConfigError, match="n_head/parallel.tp = 4 heads over parallel.cp=8"):
        parse_args(["--preset=tiny", "--parallel.cp=8", "--parallel.cp_impl=ulysses"])


def test_zigzag_positions_cover_the_sequence_once():
    cp, T = 3, 24
    rows = [zigzag_positions(T, cp, r).tolist() for r in range(cp)]
    assert rows[0] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert sorted(sum(rows, [])) == list(range(T))


# --------------------------------------------------------------------------------------------------------------
# train.py end to end: the losses of the single-process run (test_parallel_train's model and data, fewer steps)

STEPS = ["--train.steps=6"]


@pytest.fixture(scope="module")
def cp_reference(shards, tmp_path_factory):  # noqa: F811
    return train.main(argv(shards, tmp_path_factory.mktemp("cpref") / "run", 8, *STEPS))["losses"]


@pytest.mark.parametrize("name, world, micro_batch, extra", [
    ("cp2full", 2, 8, ["--parallel.cp=2", "--train.activation_checkpointing=full"]),
    ("cp4", 4, 8, ["--parallel.cp=4"]),
    ("cp2tp2sp", 4, 8, ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true"]),
    ("cp2dp2z1", 4, 4, ["--parallel.cp=2", "--parallel.zero=1"]),
    ("cp2pp2", 4, 8, ["--parallel.cp=2", "--parallel.pp=2"]),
    ("cp2ulysses", 2, 8, ["--parallel.cp=2", "--parallel.cp_impl=ulysses"]),
])
def test_cp_train_matches_single_process(shards, cp_reference, tmp_path, name, world, micro_batch, extra):  # noqa: F811
    losses = run_parallel(tmp_path, name, world, argv(shards, tmp_path / "run", micro_batch, *extra, *STEPS))
    assert len(losses) == 6
    np.testing.assert_allclose(losses, cp_reference, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# kept K/V (parallel.cp_keep_kv): the forward keeps the remote K/V blocks; backward sends no K/V, runs the remote
# blocks first and the diagonal while their parts travel, and adds in the old order: bit for bit the old results

def _grads_of(ring, q, k, v, do, rows, packed=False):
    """ring attention's output and q, k, v gradients (three views, or the packed qkv path's packed gradient)."""
    from nanopara.ring_attention import ring_attention_qkv
    if packed:
        B, nh, _, hs = q.shape
        qkv = torch.cat([t[:, :, rows].transpose(1, 2).reshape(B, len(rows), nh * hs) for t in (q, k, v)], -1)
        qkv.requires_grad_()
        out = ring_attention_qkv(qkv, nh, ring)
        out.backward(do[:, :, rows])
        return [out.detach(), qkv.grad]
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, ring)
    out.backward(do[:, :, rows])
    return [out.detach()] + [t.grad for t in mine]


def _keep_kv_worker(rank, world):
    mesh = Mesh.build(dp=1, cp=world, device="cpu")
    prev, nxt = mesh.neighbours("cp")
    T = 12 * world
    small, tri = _inputs(2, 3, T, 8, seed=4), _inputs(1, 2, 16 * world, 16, seed=5)
    cases = [(c, lay, False, p, small) for c in (True, False) for lay in ("zigzag", "contiguous") for p in (0, 1)]
    if world == 2:  # the Triton block kernels (interpreter), both paths
        cases += [(True, "zigzag", True, p, tri) for p in (0, 1)]
    for causal, layout, triton, packed, (q, k, v, do) in cases:
        rows = _local_rows(layout, q.shape[2], world, rank)
        got = [_grads_of(Ring(mesh.cp_group, rank, world, prev, nxt, causal=causal, layout=layout, triton=triton,
                              keep_kv=keep), q, k, v, do, rows, packed) for keep in (False, True)]
        assert all(torch.equal(a, b) for a, b in zip(*got)), (causal, layout, triton, packed)
    mesh.destroy()


@pytest.mark.parametrize("cp", [2, 4])
def test_keep_kv_equals_ring_bwd_bit_for_bit(cp):
    spawn(_keep_kv_worker, cp)


def _backward_messages(ring, q, k, v, do, rows):
    """(K/V messages sent, dK/dV parts sent) by one ring attention backward, counted at ring_attention._post."""
    import torch.distributed as dist
    import nanopara.ring_attention as ra
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, ring)
    B, nh, T, hs = mine[0].shape
    sends, post = [], ra._post
    ra._post = lambda ops: (sends.extend(tuple(o.tensor.shape) for o in ops if o.op is dist.isend), post(ops))[1]
    try:
        out.backward(do[:, :, rows])
    finally:
        ra._post = post
    kv = sum(shape == (2, B, nh, T, hs) for shape in sends)  # a K/V block; a part is (2, B, keys, nh, hs)
    return kv, len(sends) - kv


def _count_worker(rank, world):
    mesh = Mesh.build(dp=1, cp=world, device="cpu")
    prev, nxt = mesh.neighbours("cp")
    q, k, v, do = _inputs(2, 3, 12 * world, 8, seed=6)
    rows = zigzag_positions(12 * world, world, rank)
    for keep in (True, False):
        kv, parts = _backward_messages(Ring(mesh.cp_group, rank, world, prev, nxt, keep_kv=keep), q, k, v, do, rows)
        assert parts == world - 1  # zigzag: every remote block is seen, its part goes home
        # on: no K/V message in backward; off (the check's control: `kv == 0` fails there): cp-1 of them
        assert kv == (0 if keep else world - 1), (keep, kv)
    mesh.destroy()


@pytest.mark.parametrize("cp", [2, 4])
def test_keep_kv_backward_sends_no_kv(cp):
    spawn(_count_worker, cp)


def test_keep_kv_flag():
    from nanopara.cp import keep_kv
    with pytest.raises(ConfigError, match=r"parallel.cp_keep_kv must be auto\|true\|false, got 'maybe'"):
        parse_args(["--preset=tiny", "--parallel.cp=2", "--parallel.cp_keep_kv=maybe"])
    with pytest.raises(ConfigError, match="parallel.cp_keep_kv=true applies to parallel.cp_impl=ring"):
        parse_args(["--preset=tiny", "--parallel.cp=2", "--parallel.cp_impl=ulysses", "--parallel.cp_keep_kv=true"])
    for flags, want in ((["--parallel.cp=2"], True), (["--parallel.cp=4"], False),
                        (["--parallel.cp=2", "--parallel.cp_impl=ulysses"], False), ([], False),
                        (["--parallel.cp=4", "--parallel.cp_keep_kv=true"], True),
                        (["--parallel.cp=2", "--parallel.cp_keep_kv=false"], False)):
        assert keep_kv(parse_args(["--preset=tiny", *flags]).parallel) is want, flags


def _train_worker(rank, world, args, out_file):
    import nanopara.ring_attention as ra
    calls, kept_bwd = [0], ra._ring_bwd_kept

    def counted(*a):
        calls[0] += 1
        return kept_bwd(*a)
    ra._ring_bwd_kept = counted  # ring_bwd looks it up at each call
    s = train.main(args)
    if rank == 0:
        torch.save((s["losses"], calls[0]), out_file)


@pytest.mark.parametrize("name, world, extra, calls", [  # calls: kept-K/V backwards on rank 0, steps x micro x layers
    ("cp2", 2, ["--parallel.cp=2"], 6 * 2 * 2),  # (2 micro-steps: 256 tokens a step / 8 x 16)
    ("cp2full", 2, ["--parallel.cp=2", "--train.activation_checkpointing=full"], 6 * 2 * 2),
    ("cp2sel", 2, ["--parallel.cp=2", "--train.activation_checkpointing=selective"], 6 * 2 * 2),
    ("cp4", 4, ["--parallel.cp=4"], 6 * 2 * 2),
    ("cp2pp2zb", 4, ["--parallel.cp=2", "--parallel.pp=2", "--parallel.pp_schedule=zb"], 6 * 2),  # a layer a stage
])
def test_keep_kv_train_equals_without(shards, tmp_path, name, world, extra, calls):  # noqa: F811
    from nanopara import checkpoint
    got = []
    for keep in ("true", "false"):
        run = tmp_path / f"{name}_{keep}"
        spawn(_train_worker, world, argv(shards, run, 8, *extra, *STEPS, "--ckpt.final=true",
                                         f"--parallel.cp_keep_kv={keep}"), str(tmp_path / f"{keep}.pt"))
        weights = torch.load(f"{checkpoint.latest(run)}/rank_00000.pt", weights_only=True)["model"]
        got.append((torch.load(tmp_path / f"{keep}.pt"), weights))
    ((losses_on, kept_on), w_on), ((losses_off, kept_off), w_off) = got
    assert kept_on == calls and kept_off == 0  # the kept path ran in every layer's backward, or in none
    assert len(losses_on) == 6 and losses_on == losses_off
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[n], w_off[n]) for n in w_on)
