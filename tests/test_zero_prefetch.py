"""ZeRO-1/2 parameter prefetch (parallel.zero_prefetch, zero.py): the all-gathers after a step overlap the next forward.

dp2 on gloo (CPU, fp32), a tiny GPT cut into many flats (bucket_mb tiny), gradient accumulation 2, built by
parallel.parallelize as train.py builds it:
  - prefetch on equals prefetch off bit for bit (losses, evaluate() and state_dict() between steps, final parameters)
    for ZeRO-1 and ZeRO-2;
  - ordering: the gathers are made to complete late (each runs at issue into a side buffer, the flat's other ranks'
    range is poisoned with NaN, and only the handle's wait() writes the gathered values), so a reader that did not
    wait sees NaN. Every forward reads only waited flats, the waits interleave with the forward (not all before it),
    state_dict()/evaluate() right after a step see the gathered values, and with the hooks switched off the same
    run goes NaN (the check can fail).
  - the flag: bad values and impossible combinations are one ConfigError line; auto's choice.
"""
import math

import pytest
import torch
import torch.distributed as dist

from nanopara.config import Config, ConfigError, ModelConfig
from tests.distributed import spawn

STEPS, MICRO, SEQ, VOCAB = 4, 2, 16, 64


def make_cfg(zero: int, prefetch: str) -> Config:
    cfg = Config(device="cpu", seed=0)
    cfg.model = ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB, vocab_multiple=1,
                            kernels="torch")
    cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.zero_prefetch = 2, zero, prefetch
    cfg.parallel.bucket_mb = 2000 * 4 / 2 ** 20  # ~2000 floats: many flats, several per block
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = MICRO, SEQ, MICRO * SEQ * 2 * 2  # accum 2
    cfg.train.lr, cfg.train.grad_clip, cfg.train.sample_tokens = 1e-2, 0.5, 8
    return cfg


def _batches(mesh, n):
    gen = torch.Generator().manual_seed(100 + mesh.dp_rank)
    return [[tuple(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen) for _ in range(2)) for _ in range(2)]
            for _ in range(n)]


class LateGathers:
    """dist.all_gather_into_tensor made to complete late: the real gather runs at issue into a side buffer, the
    destination outside this rank's own slice is poisoned (NaN), and wait() writes the gathered values."""

    def __init__(self, log):
        self.real, self.log = dist.all_gather_into_tensor, log

    def __call__(self, out, inp, group=None, async_op=False):
        full = torch.empty_like(out)
        self.real(full, inp.clone(), group=group)
        mine = inp.clone()
        out.fill_(float("nan"))
        inp.copy_(mine)  # (inp is out's own slice)
        log, key = self.log, out.data_ptr()

        class Work:
            def wait(self):
                out.copy_(full)
                log.append(("wait", key))
        work = Work()
        if not async_op:
            work.wait()
        return work


def _train(mesh, zero, prefetch, data, late=None, unhook=False):
    from nanopara.model import GPT
    from nanopara.parallel import parallelize
    cfg = make_cfg(zero, prefetch)
    torch.manual_seed(0)
    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    engine = trainer.engine
    assert engine.prefetch == (prefetch == "true"), (prefetch, engine.prefetch)  # auto: CUDA only
    log = late.log if late is not None else []
    if unhook:
        engine._wait_before = lambda module, args: None  # the control: forwards no longer wait
    flat_of = {p.data_ptr(): f.param.data_ptr() for f in engine.flats for p in f.params}
    for i, block in enumerate(trainer.model.transformer.h):  # after the engine's hooks: sees what they left
        def check(module, args, i=i):
            log.append(("fwd", i))
            pending = {engine.flats[k].param.data_ptr() for k in engine._pending}
            waiting = {flat_of[p.data_ptr()] for p in module.parameters()} & pending
            log.append(("unwaited", i, len(waiting)))
        block.register_forward_pre_hook(check)
    losses, evals, sds = [], [], []
    for s, batches in enumerate(data):
        losses.append(trainer.forward_backward(batches).item())
        trainer.step(cfg.train.lr)
        log.append(("step", s))
        if s == 1:  # between steps, right after one: what a checkpoint and a validation pass read
            sd = trainer.state_dict()
            sds.append({k: v.clone() for k, v in sd["model"].items()})
            evals.append(trainer.evaluate(data[0]))
    trainer.engine.wait_params()  # reading parameters outside a forward: wait first (without: gloo's gathers race)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.engine.close()
    return losses, evals, sds, params


def _equal_runs(a, b):
    (la, ea, sa, pa), (lb, eb, sb, pb) = a, b
    assert la == lb and ea == eb, (la, lb, ea, eb)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert all(torch.equal(x[k], y[k]) for x, y in zip(sa, sb) for k in x)


def _worker(rank, world):
    import nanopara.zero as zero_mod
    from nanopara.mesh import Mesh
    torch.set_num_threads(1)
    mesh = Mesh.build(dp=2, device="cpu")
    data = _batches(mesh, STEPS)
    for zero in (1, 2):
        off = _train(mesh, zero, "false", data)
        assert all(math.isfinite(x) for x in off[0])
        _equal_runs(off, _train(mesh, zero, "true", data))  # 1. the numerics are prefetch off's
        log = []
        late = LateGathers(log)
        zero_mod.dist.all_gather_into_tensor = late  # (this worker process only)
        try:
            _equal_runs(off, _train(mesh, zero, "true", data, late=late))  # 2. late gathers: nothing read early
            events = list(log)
            log.clear()
            bad = _train(mesh, zero, "true", data, late=late, unhook=True)  # the control: no waits before forwards
        finally:
            zero_mod.dist.all_gather_into_tensor = late.real
        assert not all(math.isfinite(x) for x in bad[0]), bad[0]  # read before its gather: NaN
        assert all(e[2] == 0 for e in events if e[0] == "unwaited"), events  # every block's flats were waited
        after_step = events[events.index(("step", 0)) + 1:]
        steps = [i for i, e in enumerate(after_step) if e[0] == "step"]
        first = after_step[:steps[0]]  # step 1: its forward after step 0's gathers were issued
        fwd0 = first.index(("fwd", 0))
        assert any(e[0] == "wait" for e in first[:fwd0]) and any(e[0] == "wait" for e in first[fwd0:]), first
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout_s(180)
def test_prefetch_equals_no_prefetch_and_waits_before_every_read():
    spawn(_worker, 2)


def test_zero_prefetch_flag():
    from nanopara.parallel import check_layout
    from nanopara.zero import zero_prefetch
    cfg = make_cfg(1, "maybe")
    with pytest.raises(ConfigError, match=r"parallel.zero_prefetch must be auto\|true\|false, got 'maybe'"):
        cfg.check()
    for zero, want in ((0, False), (1, True), (2, True), (3, False)):
        cfg = make_cfg(zero, "auto")
        cfg.check()
        assert zero_prefetch(cfg) == (want, "")
        assert zero_prefetch(cfg, "cpu") == (False, "")  # auto: CUDA only (gloo has nothing to overlap on)
        cfg.parallel.zero_prefetch = "false"
        assert zero_prefetch(cfg) == (False, "")
    for zero in (0, 3):
        cfg = make_cfg(zero, "true")
        cfg.check()
        with pytest.raises(ConfigError, match="zero_prefetch=true applies to ZeRO-1/2"):
            check_layout(cfg, 2, "cpu")
    cfg = make_cfg(1, "auto")
    cfg.train.compile = True
    on, why = zero_prefetch(cfg)
    assert not on and "train.compile" in why
    cfg.parallel.zero_prefetch = "true"
    with pytest.raises(ConfigError, match="train.compile"):
        check_layout(cfg, 2, "cpu")
    cfg = make_cfg(2, "true")
    assert check_layout(cfg, 2, "cpu") == 2 and zero_prefetch(cfg) == (True, "")
