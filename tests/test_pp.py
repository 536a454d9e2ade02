"""Pipeline parallel (nanopara/pp.py): schedules simulated together, and pipelined steps against one process.

Schedules: every schedule for p = 2, 3, 4 and several m runs through `simulate` (no deadlock under the strictest
NCCL pairing, F before B before W, every (micro-batch, chunk) once) and hits its paper's bubble formula.

Distributed: gloo processes on the CPU (fp32, torch kernels, one thread each) train a tiny GPT with each schedule
and AdamW for STEPS steps; pytest compares with the single-process model on the same micro-batches, computed in
this process with one thread too (matmul results depend on the thread count). Per chunk the pipeline runs the
same ops in the same order, so the first step's loss and every untied gradient are bit-exact. The tied
wte/lm_head gradient is summed in another order (sum_i e_i + sum_i h_i against sum_i (e_i + h_i)): ~1 ulp of fp32,
which AdamW carries into later losses and weights (measured worst: see the tolerances). pp2 x dp2 averages two per-rank
means instead of one mean over both ranks' rows: the same rounding-level difference, same tolerance.

    .venv/bin/python -m pytest -q tests/test_pp.py
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import TorchDispatchMode

from nanopara import pp
from nanopara.cli import parse_args
from nanopara.config import ConfigError, ModelConfig
from nanopara.mesh import Mesh
from nanopara.parallel import check_layout
from nanopara.model import GPT
from tests.distributed import spawn

B, T, C, STEPS = 2, 16, 32, 3
# Measured worst differences (torch 2.13 CPU, 3 AdamW steps at lr 1e-2) and the bounds, ~5x above them; a missing
# or misplaced gradient moves a weight by ~lr per step and the loss by >1e-3:
LOSS_TOL = dict(rtol=1e-6, atol=0)    # 4.8e-7 on a loss of ~3.9 (2 ulp), pp2 x dp2
GRAD_TOL = dict(rtol=0, atol=1e-7)    # 2.2e-8 pp2 x dp2; 7.5e-9 the tied wte gradient at dp = 1
WEIGHT_TOL = dict(rtol=0, atol=1e-5)  # 1.8e-6 pp2 x dp2; 5.3e-7 at pp4


def _cfg(n_layer: int) -> ModelConfig:
    return ModelConfig(n_layer=n_layer, n_head=2, n_embd=C, block_size=T, vocab_size=50, vocab_multiple=64,
                       kernels="torch")


def _batches(step: int, m: int, rows: int):
    """m micro-batches of `rows` sequences: token ids and next-token targets, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, 50, (m, rows, T + 1), generator=g)
    return tok[:, :, :-1], tok[:, :, 1:]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ----------------------------------------------------------------------------------------------------------------
# schedules: simulated, no processes

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb", 1)]


def _ms(name: str, p: int) -> list[int]:
    if name == "interleaved":
        return [p, 2 * p, 3 * p]
    return ([1, 2] if name == "gpipe" else []) + [p, p + 1, 2 * p + 1]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name, v", SCHEDULES)
def test_schedules_simulate_without_deadlock_and_hit_their_bubble(name, v, p):
    for m in _ms(name, p):
        acts = pp.build_schedule(name, p, m, v)
        ran = pp.simulate(acts)  # raises on deadlock, mismatched messages, F/B/W order, missing or repeated work
        assert len(ran) == m * p * v * (3 if name == "zb" else 2)
        # memory: at most p micro-batches in flight (forward done, last backward not yet) on a rank, except GPipe
        if name in ("1f1b", "zb"):
            for r, rank_acts in enumerate(acts):
                live, peak = 0, 0
                for a in rank_acts:
                    live += 1 if a.op == "F" else -1 if a.op == ("W" if name == "zb" else "B") else 0
                    peak = max(peak, live)
                assert peak <= (p if name == "zb" else p - r)
        units = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb": 3 * m}[name]
        assert pp.bubble(acts) == pytest.approx((p - 1) / (units + p - 1), abs=1e-12), (name, p, m)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_forward_only_schedule_runs_any_m_without_deadlock(p):
    """Validation's schedule: interleaved 1F1B's forwards (GPipe's at v = 1), a partial last group of micro-batches."""
    for v in (1, 2, 3):
        for m in range(1, 2 * p + 2):
            acts = [pp.forward_only(p, m, r, v) for r in range(p)]
            ran = pp.simulate(acts)
            assert len(ran) == m * p * v and all(a.op == "F" for _, a in ran), (p, v, m)


def test_simulator_detects_deadlock_and_mismatched_messages():
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation, which rank 1 needs
    # first (it runs both forwards before any backward): a cycle
    acts = pp.build_schedule("gpipe", 2, 2)
    acts[0] = [acts[0][i] for i in (0, 2, 1, 3)]  # F0 B0 F1 B1
    with pytest.raises(ValueError, match="deadlocks"):
        pp.simulate(acts)
    swapped = pp.build_schedule("gpipe", 2, 2)
    swapped[1] = [swapped[1][i] for i in (1, 0, 2, 3)]  # rank 1 consumes micro-batch 1's activation first
    with pytest.raises(ValueError, match="do not pair up"):
        pp.simulate(swapped)
    late = pp.build_schedule("1f1b", 2, 2)
    late[1] = [late[1][i] for i in (1, 0, 2, 3)]  # last rank: B0 before its F0
    with pytest.raises(ValueError, match="before its F"):
        pp.simulate(late)
    short = pp.build_schedule("zb", 2, 2)
    short[0] = [a for a in short[0] if not (a.op == "W" and a.mb == 1)]
    with pytest.raises(ValueError, match="never runs"):
        pp.simulate(short)


def test_simulator_pairs_messages_as_strictly_as_nccl():
    """Interleaved 1F1B posts each steady F/B pair's messages as one batch (`joint`). Posted one action at a time
    instead, the data dependencies still close (bubble() runs it), but two neighbours each wait on a batch queued
    behind a message the other has not posted yet: a hang on one NCCL stream per rank, which simulate reports."""
    acts = [[dataclasses.replace(a, joint=False) for a in rank_acts] for rank_acts in
            pp.build_schedule("interleaved", 2, 4, 2)]
    assert pp.bubble(acts) > 0
    with pytest.raises(ValueError, match="deadlocks"):
        pp.simulate(acts)


def test_bad_settings_are_one_clear_error():
    with pytest.raises(ValueError, match=r"model.n_layer=6 is not divisible by parallel.pp\*parallel.pp_virtual"):
        pp.split_layers(6, 2, 2)
    with pytest.raises(ValueError, match="sums to 5, but model.n_layer=6"):
        pp.split_layers(6, 2, layers=[2, 3])
    with pytest.raises(ValueError, match="every chunk needs at least one block"):
        pp.split_layers(6, 3, layers=[3, 3, 0])
    with pytest.raises(ValueError, match="needs one per chunk"):
        pp.split_layers(6, 2, layers=[1, 2, 3])
    with pytest.raises(ValueError, match="pp_virtual=2 needs parallel.pp > 1"):
        pp.split_layers(6, 1, 2)
    assert [list(r) for r in pp.split_layers(6, 3, layers=[1, 3, 2])] == [[0], [1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="'1f1b' needs at least parallel.pp=3 micro-batches per step, got 2"):
        pp.build_schedule("1f1b", 3, 2)
    with pytest.raises(ValueError, match="'zb' needs at least parallel.pp=4"):
        pp.build_schedule("zb", 4, 3)
    with pytest.raises(ValueError, match="groups of parallel.pp=2: 3 micro-batches per step is not a multiple"):
        pp.build_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="'interleaved' needs pp_virtual >= 2"):
        pp.build_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="pp_schedule='bogus'"):
        pp.build_schedule("bogus", 2, 4)
    assert len(pp.build_schedule("gpipe", 3, 2)[0]) == 4  # GPipe runs m < p: only the bubble grows


# ----------------------------------------------------------------------------------------------------------------
# split, in one process

def test_split_keeps_names_layers_and_a_tied_copy():
    torch.manual_seed(0)
    model = GPT(_cfg(6))
    full = dict(model.named_parameters())
    first, = pp.split_model(model, 3, 0, layers=[1, 3, 2])
    mid, = pp.split_model(model, 3, 1, layers=[1, 3, 2])
    last, = pp.split_model(model, 3, 2, layers=[1, 3, 2])
    assert (list(first.layers), list(mid.layers), list(last.layers)) == ([0], [1, 2, 3], [4, 5])
    names = [set(dict(ch.named_parameters())) for ch in (first, mid, last)]
    assert names[0] | names[1] | names[2] == set(full) | {"lm_head.weight"}
    assert names[1] == {n for n in full if n.split(".")[2:3] in (["1"], ["2"], ["3"])}
    assert first.tied is full["transformer.wte.weight"] and mid.tied is None
    assert last.tied is not first.tied and torch.equal(last.tied, first.tied) and last.tied.pp_tied_copy
    # pp = 1: one chunk, the single-device model; the tied weight stays one parameter
    only, = pp.split_model(model, 1, 0)
    assert only.lm_head.weight is only.transformer["wte"].weight
    assert dict(only.named_parameters()).keys() == full.keys()


def test_stage_holds_its_chunks_under_single_device_names():
    """pp.Stage is what the engines and checkpoints see: the chunks' parameters once each, by their GPT names."""
    torch.manual_seed(0)
    model = GPT(_cfg(4))
    full = dict(model.named_parameters())
    stages = [pp.Stage(pp.split_model(model, 2, r, virtual=2)) for r in range(2)]  # chunks {0, 2} and {1, 3}
    names = [dict(st.named_parameters()) for st in stages]
    assert names[0].keys() == {n for n in full if not n.startswith(("transformer.h.1.", "transformer.h.3.",
                                                                    "transformer.ln_f"))}
    assert names[1].keys() == {n for n in full if n.startswith(("transformer.h.1.", "transformer.h.3.",
                                                                "transformer.ln_f"))} | {"lm_head.weight"}
    assert all(names[0][n] is full[n] for n in names[0])  # the modules themselves, not copies
    assert (stages[0].layers, stages[1].layers) == ({0: [0], 2: [2]}, {1: [1], 3: [3]})
    assert names[0]["transformer.wte.weight"].pp_tied and names[1]["lm_head.weight"].pp_tied_copy
    stages[0].eval()
    assert not stages[0].chunks[0].training and not stages[0].transformer["h"]["2"].training
    with pytest.raises(RuntimeError, match="runs through its Pipeline"):
        stages[0](torch.zeros(1, T, dtype=torch.long))


@pytest.mark.parametrize("argv, message", [
    (["--parallel.pp=2", "--model.n_layer=7", "--parallel.pp_layers=even"],
     r'n_layer=7 is not divisible by parallel.pp\*parallel.pp_virtual = 2\*1 = 2: set parallel.pp_layers .* e.g. "4,3"'),
    (["--parallel.pp=2", "--parallel.pp_layers=7,6"], r"pp_layers='7,6' must give the blocks of each of the "
                                                      r"pp\*pp_virtual = 2 chunks, summing to model.n_layer=12"),
    (["--parallel.pp=2", "--parallel.pp_layers=4,4,4"], "must give the blocks of each of the pp.pp_virtual = 2"),
    (["--parallel.pp=2", "--parallel.pp_layers=6,x"], "expected positive block counts separated by commas"),
    (["--parallel.pp=2", "--parallel.pp_layers=12,0"], "expected positive block counts"),
    (["--parallel.pp=2", "--parallel.pp_schedule=interleaved"], "interleaved needs parallel.pp_virtual >= 2"),
    (["--parallel.pp=2", "--parallel.pp_virtual=2"], "pp_virtual=2 needs parallel.pp_schedule=interleaved"),
    (["--parallel.pp=2", "--parallel.pp_virtual=0"], r"pp_virtual=0 is out of range: it must be >= 1"),
    (["--parallel.pp=2", "--parallel.pp_schedule=zbv"], "pp_schedule must be gpipe.1f1b.interleaved.zb"),
    (["--parallel.pp=4", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2", "--parallel.pp_layers="],
     r"n_layer=12 is not divisible by parallel.pp\*parallel.pp_virtual = 4\*2 = 8"),
    (["--preset=tiny", "--parallel.pp=4", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"],
     r"n_layer=4 is fewer blocks than the parallel.pp\*parallel.pp_virtual = 4\*2 = 8 chunks"),
    (["--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved"], "applies to pipeline parallel only"),
    (["--parallel.pp_layers=6,6"], "pp_layers='6,6' applies to pipeline parallel only"),
    (["--parallel.pp=2", "--parallel.zero=2"], "ZeRO-2/3 reduce-scatter .* use parallel.zero=1"),
    (["--parallel.pp=2", "--parallel.zero=3"], "parallel.zero=3 with parallel.pp > 1"),
    (["--parallel.pp=2", "--train.compile=true"], "compile=true with parallel.pp > 1 is not supported"),
    (["--parallel.pp=2", "--parallel.cp=3"], r"seq_len=1024 is not divisible by 2\*parallel.cp = 6"),
    (["--train.activation_checkpointing=some"], "activation_checkpointing must be none.full.selective"),
])
def test_bad_pipeline_config_is_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_auto_split_counts_the_head():
    """parallel.pp_layers=auto (the default): the last chunk holds lm_head + loss, worth 2V/(24C+4T) blocks, so it
    gets fewer blocks; gpt_1b's hand-tuned 10,8 (pp2) and 5,5,5,3 (pp2 interleaved) come out; any n_layer splits."""
    from nanopara.config import balanced_layers, stage_layers
    cfg = parse_args(["--preset=gpt_1b", "--parallel.pp=2"])
    assert cfg.parallel.pp_layers == "auto" and stage_layers(cfg) == [10, 8]
    cfg = parse_args(["--preset=gpt_1b", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
                      "--parallel.pp_virtual=2"])
    assert stage_layers(cfg) == [5, 5, 5, 3]
    assert stage_layers(parse_args(["--preset=gpt2_124m", "--parallel.pp=2", "--model.n_layer=7"])) == [6, 1]
    assert stage_layers(parse_args(["--parallel.pp=2", "--parallel.pp_layers=even"])) is None
    assert stage_layers(parse_args(["--parallel.pp=2", "--parallel.pp_layers=7,5"])) == [7, 5]
    assert balanced_layers(12, 3, 0.0) == [4, 4, 4] and balanced_layers(12, 2, 100.0) == [11, 1]
    for n, c, h in ((18, 2, 2.4), (24, 4, 4.5), (9, 3, 1.0)):  # no other split has a less busy busiest chunk
        got = balanced_layers(n, c, h)
        cost = max(got[:-1] + [got[-1] + h])
        assert sum(got) == n and min(got) >= 1
        assert cost <= min(max(k + h, -(-(n - k) // (c - 1))) for k in range(1, n - c + 2)) + 1e-9


def test_check_layout_counts_the_pipelines_micro_batches():
    """m = tokens_per_step / (micro_batch * seq_len * dp), before any process group: 1F1B-type schedules need
    m >= pp, interleaved m % pp == 0; GPipe runs any m."""
    base = ["--preset=tiny", "--train.micro_batch=4", "--train.seq_len=64", "--train.tokens_per_step=2048"]
    assert check_layout(parse_args(base + ["--parallel.pp=2"]), 4, "cpu") == 4  # dp 2: 2048 / (4 * 64 * 2)
    assert check_layout(parse_args(base + ["--parallel.pp=4", "--parallel.pp_schedule=gpipe"]), 8, "cpu") == 4
    assert check_layout(parse_args(base + ["--parallel.pp=4", "--parallel.pp_schedule=gpipe"]), 16, "cpu") == 2
    with pytest.raises(ConfigError, match=r"'1f1b' needs at least parallel.pp=4 micro-batches per step, got 2: .*"
                                          r"= 2048 / 1024\)"):
        check_layout(parse_args(base + ["--parallel.pp=4"]), 16, "cpu")
    with pytest.raises(ConfigError, match="groups of parallel.pp=4: 6 micro-batches per step is not a multiple"):
        check_layout(parse_args(base[:-1] + ["--train.tokens_per_step=1536", "--parallel.pp=4", "--model.n_layer=12",
                                             "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=3"]),
                     4, "cpu")
    with pytest.raises(ConfigError, match="'zb' needs at least parallel.pp=2 micro-batches per step, got 1"):
        check_layout(parse_args(["--preset=tiny", "--parallel.pp=2", "--parallel.pp_schedule=zb"]), 2, "cpu")


def test_pp1_pipeline_is_the_single_process_step():
    """pp = 1 (no process group): the executor's loss and grads equal plain gradient accumulation, bit for bit."""
    torch.manual_seed(0)
    ref = GPT(_cfg(2))
    torch.manual_seed(0)
    chunks = pp.split_model(GPT(_cfg(2)), 1, 0)
    mesh = Mesh.build(dp=1, pp=1, device="cpu")
    xs, ys = _batches(0, 3, B)
    loss = pp.Pipeline(chunks, mesh, "1f1b", 3, (B, T, C)).step(xs, ys)
    ref_losses = [ref(x, y)[1] for x, y in zip(xs, ys)]
    for lo in ref_losses:
        (lo / 3).backward()
    assert torch.equal(loss, torch.stack([lo.detach() for lo in ref_losses]).mean())
    for (name, p), (_, q) in zip(chunks[0].named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("amp", [False, True])
def test_zb_split_backward_walks_the_graph_once(monkeypatch, amp):
    """zb.py: B accumulates everything but the Linears' weights in one walk of the graph, skips their dW GEMMs and
    stores their inputs (each Linear's backward runs once per micro-batch); W adds exactly the unsplit backward's
    weight gradients (bit for bit, also under bf16 autocast) with one GEMM per Linear and no second walk, a node
    per W_GROUP Linears whose gradients are added before the next node runs; B's biases are final before W."""
    from nanopara import zb
    torch.manual_seed(0)
    ref = GPT(_cfg(2))
    torch.manual_seed(0)
    (chunk,) = pp.split_model(GPT(_cfg(2)), 1, 0)
    d = zb.DeferredWeightGrads(chunk)
    n = len(d.linears)
    assert n == 2 * 4 and all(w.dim() == 2 for w in d.weights)  # 4 per block; lm_head is wte here
    calls = []
    orig = zb._Linear.backward
    monkeypatch.setattr(zb._Linear, "backward", staticmethod(lambda ctx, dy: calls.append(1) or orig(ctx, dy)))
    amp_ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if amp else contextlib.nullcontext
    xs, ys = _batches(0, 2, B)
    for mb, (x, y) in enumerate(zip(xs, ys)):
        with amp_ctx():
            loss = chunk(x, y) / 2
        with d.recording(mb), _CountGemms() as split:
            torch.autograd.backward(loss, inputs=d.eager_params)
        assert all(w.grad is None for w in d.weights) if mb == 0 else True
        with amp_ctx():
            ref_loss = ref(x, y)[1] / 2
        with _CountGemms() as whole:
            ref_loss.backward()
        assert split.n == whole.n - n  # the deferred weights' GEMMs are skipped, nothing else
    assert len(calls) == 2 * n  # once per Linear per micro-batch
    bias = chunk.transformer["h"]["0"].mlp.c_fc.bias
    assert torch.equal(bias.grad, ref.transformer.h[0].mlp.c_fc.bias.grad)  # B's parameters are done
    nodes, added = [0], []  # W's memory: a node's gradients are added before the next node makes its own
    orig_w = zb._WeightGrads.backward
    monkeypatch.setattr(zb._WeightGrads, "backward", staticmethod(lambda ctx, g: nodes.__setitem__(0, nodes[0] + 1)
                                                                  or orig_w(ctx, g)))
    hooks = [w.register_post_accumulate_grad_hook(lambda p: added.append(nodes[0])) for w in d.weights]
    for mb in range(2):
        nodes[0], added[:] = 0, []
        with _CountGemms() as w:
            d.run(mb)
        assert w.n == n  # W: one GEMM per Linear, no second walk
        assert added == [1 + i // zb.W_GROUP for i in range(n)]
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * n and not d.stored  # W ran no Linear backward, kept nothing
    for (name, p), (_, q) in zip(chunk.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


# ----------------------------------------------------------------------------------------------------------------
# distributed: pipelined training against one process

def _runs(p: int) -> dict:
    """name -> (schedule, m, v, n_layer, layers): each schedule, m not a multiple of p where allowed."""
    n = 2 * p
    runs = {"gpipe": ("gpipe", p + 1, 1, n, None), "1f1b": ("1f1b", 2 * p + 1, 1, n, None),
            "interleaved": ("interleaved", 2 * p, 2, n, None), "zb": ("zb", p + 1, 1, n, None)}
    if p == 3:
        runs["1f1b_uneven"] = ("1f1b", p, 1, 6, [1, 3, 2])
    if p == 2:
        runs["gpipe_m1"] = ("gpipe", 1, 1, 4, None)
    return runs


def _worker(rank, world, p, runs, out_file):
    torch.set_num_threads(1)
    mesh = Mesh.build(dp=world // p, pp=p, device="cpu")
    tied = pp.embedding_group(mesh)
    results = {}
    for name, (schedule, m, v, n_layer, layers) in runs.items():
        torch.manual_seed(0)
        chunks = pp.split_model(GPT(_cfg(n_layer)), p, mesh.pp_rank, v, layers)  # the GPT itself is dropped
        for ch in chunks:  # a stale last-stage copy (say, loaded from elsewhere) is restored from the first stage
            if ch.tied is not None and not ch.first:
                with torch.no_grad():
                    ch.tied.add_(1.0)
        pp.sync_tied_weights(chunks, tied, mesh)
        hook_calls = []
        probe = {}  # chunk -> a weight's grad when the hook fires (the last backward has not run yet)

        def hook(ch, params):  # ZB-H1 calls it twice per chunk: the c_fc weight's gradient comes in W (zb.py)
            w = next(iter(ch.transformer["h"].values())).mlp.c_fc.weight
            if any(q is w for q in params):
                hook_calls.append(ch.index)
                probe[ch.index] = None if w.grad is None else w.grad.clone()

        pipe = pp.Pipeline(chunks, mesh, schedule, m, (B, T, C), on_last_backward=hook)
        params = [q for ch in chunks for q in ch.parameters()]
        opt = _optimizer(params)
        losses, grads0, partial = [], {}, True
        for step in range(STEPS):
            xs, ys = _batches(step, m, B * mesh.dp)
            rows = slice(mesh.dp_rank * B, (mesh.dp_rank + 1) * B)
            loss = pipe.step(list(xs[:, rows]), list(ys[:, rows]))
            pp.sync_tied_grads(chunks, tied)
            if mesh.dp > 1:  # what a DP engine does after the pipeline: average over the replicas
                for q in params:
                    dist.all_reduce(q.grad, group=mesh.dp_group)
                    q.grad /= mesh.dp
                dist.all_reduce(loss, group=mesh.dp_group)
                loss /= mesh.dp
            for ch in chunks:
                w = next(iter(ch.transformer["h"].values())).mlp.c_fc.weight
                partial &= m == 1 or probe[ch.index] is not None and not torch.equal(probe[ch.index], w.grad)
            if step == 0:
                grads0 = {n: q.grad.clone() for ch in chunks for n, q in ch.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[name] = dict(losses=losses, grads0=grads0, hook_calls=hook_calls, partial=partial,
                             weights={n: q.detach().clone() for ch in chunks for n, q in ch.named_parameters()},
                             layers={ch.index: list(ch.layers) for ch in chunks})
    torch.save(results, f"{out_file}.{rank}")


def _reference(schedule, m, n_layer, rows):
    """The single-process run: same seed, same micro-batches, gradient accumulation, AdamW; one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = GPT(_cfg(n_layer))
        opt = _optimizer(model.parameters())
        losses, grads0 = [], {}
        for step in range(STEPS):
            xs, ys = _batches(step, m, rows)
            step_losses = [model(x, y)[1] for x, y in zip(xs, ys)]
            for lo in step_losses:
                (lo / m).backward()
            losses.append(torch.stack([lo.detach() for lo in step_losses]).mean().item())
            if step == 0:
                grads0 = {n: q.grad.clone() for n, q in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, grads0, {n: q.detach().clone() for n, q in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _check(tmp_path, p, dp, runs):
    out = tmp_path / "res"
    spawn(_worker, p * dp, p, runs, str(out))
    per_rank = [torch.load(f"{out}.{r}", weights_only=True) for r in range(p * dp)]
    for name, (schedule, m, v, n_layer, layers) in runs.items():
        ref_losses, ref_grads, ref_weights = _reference(schedule, m, n_layer, B * dp)
        res = [rk[name] for rk in per_rank]
        stage = res[::dp]  # dp rank 0 of each stage (ranks are laid out [pp, dp])
        first = stage[0]
        exact = dp == 1
        assert all(r["losses"] == res[0]["losses"] for r in res), name  # every rank logs the same loss
        if exact:
            assert first["losses"][0] == ref_losses[0], name
        torch.testing.assert_close(first["losses"], ref_losses, **LOSS_TOL, msg=name)
        # each stage holds its chunks' blocks only; together they hold the whole model, tied weight twice
        ranges = pp.split_layers(n_layer, p, v, layers)
        for r in range(p):
            assert stage[r]["layers"] == {c: list(ranges[c]) for c in range(r, p * v, p)}, name
        grads = {n: g for st in stage for n, g in st["grads0"].items()}
        weights = {n: w for st in stage for n, w in st["weights"].items()}
        assert grads.keys() == ref_grads.keys() | {"lm_head.weight"}, name
        tied = "transformer.wte.weight"
        assert torch.equal(grads[tied], grads["lm_head.weight"]), name  # summed halves, the same on both ranks
        for n, g in ref_grads.items():
            if exact and n != tied:
                assert torch.equal(grads[n], g), (name, n)
            else:
                torch.testing.assert_close(grads[n], g, **GRAD_TOL, msg=f"{name} {n}")
        for n, w in ref_weights.items():
            got = weights[n]
            if n.endswith("attn.c_attn.bias"):
                # the key bias has an exactly-zero true gradient (softmax is shift invariant per query row): both
                # runs feed rounding noise to AdamW, which turns it into +-lr steps; compare q and v biases only
                got, w = torch.cat([got[:C], got[2 * C:]]), torch.cat([w[:C], w[2 * C:]])
            torch.testing.assert_close(got, w, **WEIGHT_TOL, msg=f"{name} {n}")
        for r in range(p * dp):  # the tied copies never drift: identical on every first and last stage
            own = res[r]["weights"].get(tied, res[r]["weights"].get("lm_head.weight"))
            assert own is None or torch.equal(own, first["weights"][tied]), (name, r)
        # the DP hook: once per local chunk and step, before the chunk's last gradient arrives
        for r, st in enumerate(stage):
            assert sorted(st["hook_calls"]) == sorted(list(range(r, p * v, p)) * STEPS), name
            assert st["partial"], name


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_matches_single_process(tmp_path, p):
    _check(tmp_path, p, 1, _runs(p))


def test_pp2_dp2_matches_single_process(tmp_path):
    _check(tmp_path, 2, 2, {"1f1b": ("1f1b", 3, 1, 4, None), "zb": ("zb", 2, 1, 4, None)})


def _graphed_worker(rank, world, out_file, runs=(("1f1b", 0), ("zb", 0), ("interleaved", 0))):
    """pp2 (x dp world/2) through parallelize + Trainer on CUDA, eager and with train.cuda_graph
    (graph.GraphedPipelineStep; with dp > 1 the DDP / ZeRO-1 reduction inside the graph)."""
    from nanopara.config import Config
    from nanopara.parallel import parallelize
    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = Mesh.build(pp=2, dp=world // 2, device="cuda")
    results = {}
    for schedule, zero in runs:
        for graphed in (False, True):
            cfg = Config(device="cuda", seed=0)
            cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256, kernels="triton")
            cfg.parallel.pp, cfg.parallel.pp_schedule = 2, schedule
            cfg.parallel.pp_virtual = 2 if schedule == "interleaved" else 1
            cfg.parallel.dp, cfg.parallel.zero = mesh.dp, zero
            cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = 4, 32, 4 * 4 * 32 * mesh.dp
            cfg.train.cuda_graph = "true" if graphed else "false"
            torch.manual_seed(0)
            trainer = parallelize(GPT(cfg.model), mesh, cfg)
            gen = torch.Generator().manual_seed(1)
            batches = [tuple(torch.randint(0, 256, (4, 32), generator=gen) for _ in range(2)) for _ in range(4)]
            losses = []
            for _ in range(5):  # the same batches every step: the loss must fall
                losses.append(trainer.forward_backward(batches).item())
                trainer.step(1e-2)
            trainer.engine.wait_params()  # ZeRO-1's prefetched all-gathers (zero.py): before reading parameters
            results[(schedule, zero, graphed)] = dict(losses=losses, weights={
                n: q.detach().cpu() for n, q in trainer.model.named_parameters()})
            trainer.close()
            trainer.engine.close()
    torch.save(results, f"{out_file}.{rank}")


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
def test_pp2_graphed_step_trains_like_eager(tmp_path):
    """The whole pipeline step replayed from one CUDA graph per rank (send/recv recorded in it) trains like eager
    mode on 2 GPUs, for 1F1B, ZB-H1 and interleaved: the replay runs the same kernels in the same order."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_graphed_worker, 2, str(tmp_path / "res"))
    for rank in range(2):
        res = torch.load(f"{tmp_path / 'res'}.{rank}", weights_only=False)
        for schedule in ("1f1b", "zb", "interleaved"):
            eager, graph = res[(schedule, 0, False)], res[(schedule, 0, True)]
            assert graph["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-5), (schedule, graph, eager)
            assert graph["losses"][-1] < graph["losses"][0] - 0.1, schedule
            for n, w in eager["weights"].items():
                torch.testing.assert_close(graph["weights"][n], w, atol=1e-5, rtol=1e-5, msg=f"{schedule} {n}")


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
def test_pp2_dp2_graphed_step_trains_like_eager(tmp_path):
    """pp2 x dp2 under one CUDA graph per rank, DDP's and ZeRO-1's bucket reductions captured inside it: the same
    losses and weights as the eager pipeline step (4 GPUs)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    runs = (("1f1b", 0), ("1f1b", 1))
    spawn(_graphed_worker, 4, str(tmp_path / "res"), runs)
    for rank in range(4):
        res = torch.load(f"{tmp_path / 'res'}.{rank}", weights_only=False)
        for schedule, zero in runs:
            eager, graph = res[(schedule, zero, False)], res[(schedule, zero, True)]
            assert graph["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-5), (zero, graph, eager)
            for n, w in eager["weights"].items():
                torch.testing.assert_close(graph["weights"][n], w, atol=1e-5, rtol=1e-5, msg=f"zero={zero} {n}")
