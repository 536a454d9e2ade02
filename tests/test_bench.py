"""The benchmarks' harness and scripts on CPU: a broken benchmark wastes a GPU machine's time (a phases line once
indexed past Phases.summary()), so what can run here runs here. Timings are never asserted, only their plumbing."""
import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from tests.distributed import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _torchrun(n: int, script: str, *args, timeout=240):
    """The real launcher, kept for one bench (test_bench_tp_baseline_and_tp_on_cpu) so that the scripts also run as
    the GPU machines run them; the others go through _bench, without its ~7 s of start-up on the 2-core machine (the
    agent and each worker import torch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           os.path.join(ROOT, "bench", script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _bench(tmp_path, n: int | None, script: str, *args) -> str:
    """`torchrun --nproc_per_node=n bench/SCRIPT ARGS` (n None: `python bench/SCRIPT ARGS`), one gloo process per
    rank forked from the fork server (tests/distributed.py); returns the ranks' stdout."""
    return run_script(os.path.join(ROOT, "bench", script), *args, logs=str(tmp_path / f"{script}-logs-{n or 1}"),
                      nproc=n, cwd=ROOT)


# ---- harness.py --------------------------------------------------------------------------------------------------

def test_timed_runs_warmup_then_steps_and_times_each():
    import harness as H
    calls = []

    def step():
        calls.append(time.perf_counter())
        time.sleep(0.01 if len(calls) != 5 else 0.05)  # the 5th call (3rd timed) is the slow one
        return len(calls)
    t = H.timed(step, steps=4, warmup=2, device="cpu", each=True)
    assert len(calls) == 6 and t["last"] == 6 and len(t["times"]) == 4
    assert t["min_s"] >= 0.01 and t["max_s"] >= 0.05 and t["median_s"] < t["max_s"]
    assert t["step_s"] >= t["min_s"] and t["peak_gb"] == 0.0  # (CPU: no device memory)
    t = H.timed(step, steps=3, device="cpu")  # not each: one host interval over all steps
    assert len(calls) == 9 and t["times"] == [t["step_s"]] == [t["median_s"]]


def test_clock_and_bench_ms_on_cpu():
    import harness as H
    clock = H.Clock("cpu")
    a = clock()
    time.sleep(0.02)
    assert clock.ms(a, clock()) >= 20
    n = []
    assert H.bench_ms(lambda: n.append(1), "cpu", reps=3) >= 0 and len(n) == 3


def test_exposed_comm_and_busy_share_of_a_synthetic_step():
    """Exposed communication: NCCL time during which no compute kernel runs; busy: the compute kernels' union."""
    import harness as H
    kernels = [("gemm", 0, 100), ("ncclDevKernel_AllGather", 50, 150), ("gemm", 120, 200),
               ("ncclDevKernel_ReduceScatter", 210, 260), ("ncclDevKernel_AllReduce", 240, 270)]  # us
    s = H.kernel_summary(kernels)
    assert s["comm_ms"] == pytest.approx(0.160)  # 50..150 and 210..270
    assert s["exposed_comm_ms"] == pytest.approx(0.080)  # 100..120 and 210..270: no compute kernel there
    assert s["busy_ms"] == pytest.approx(0.180) and s["span_ms"] == pytest.approx(0.270)
    assert s["gpu_busy_share"] == pytest.approx(180 / 270) and s["kernels"] == 5
    assert H.kernel_summary([])["exposed_comm_ms"] == 0.0


def test_kernel_kinds_of_real_kernel_names():
    """KINDS sorts GEMMs (cuBLAS, nvjet, Triton FP8), attention, NCCL, AdamW, LayerNorm, FP8 casts, ...; ms summed
    per kind and per name, costliest first."""
    import harness as H
    kernels = [("sm90_xmma_gemm_bf16bf16", 0, 100), ("_attn_fwd_ws_kernel", 100, 130),
               ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 130, 150), ("ncclDevKernel_AllReduce_Sum", 100, 300),
               ("_adamw_kernel", 300, 340), ("_layernorm_fwd_kernel", 340, 345), ("_amax_kernel", 345, 347),
               ("_fp8_matmul_kernel", 347, 400), ("_cast_kernel", 400, 401), ("elementwise_kernel", 401, 411),
               ("triton_poi_fused_add_0", 411, 412), ("_ce_fwd_kernel", 412, 414), ("mystery", 414, 415)]
    s = H.kernel_summary(kernels, top=3)
    assert s["kernel_ms_by_kind"] == pytest.approx({
        "gemm": 0.120, "attention": 0.030, "comm": 0.200, "adamw": 0.040, "layernorm": 0.005, "fp8 cast": 0.003,
        "fp8 gemm": 0.053, "elementwise": 0.010, "inductor fused": 0.001, "cross entropy": 0.002, "other": 0.001})
    assert list(s["kernel_ms_by_kind"])[0] == "comm"  # costliest first
    assert [k[0] for k in s["top_kernels_ms"]] == ["ncclDevKernel_AllReduce_Sum", "sm90_xmma_gemm_bf16bf16",
                                                    "_fp8_matmul_kernel"]
    assert H.kernel_kind("c10d::allreduce_") == "comm" and H.kernel_kind("aten::addmm") == "gemm"


def test_profile_on_cpu_gives_operators_end_to_end():
    import torch
    import harness as H
    a = torch.randn(64, 64)
    kernels = H.profile(lambda: (a @ a).sum(), "cpu")
    names = [k[0] for k in kernels]
    assert "aten::mm" in names and all(s < e for _, s, e in kernels)
    assert H.kernel_summary(kernels)["kernel_ms_by_kind"]["gemm"] > 0
    assert H.profile(lambda: None, "cpu", on=False) == []


def test_table_aligns_formats_and_marks_missing_values():
    import harness as H
    rows = [{"mode": "torch", "tok": 12345.6, "mfu": 0.4567}, {"mode": "triton+compile", "tok": None}]
    text = H.table(rows, [("mode", "mode", ""), ("tok", "tok/s", ",.0f"), ("mfu", "MFU", ".1%")], title="t")
    lines = text.splitlines()
    assert lines[0] == "t" and lines[1].split() == ["mode", "tok/s", "MFU"]
    assert lines[2].split() == ["torch", "12,346", "45.7%"] and lines[3].split() == ["triton+compile", "-", "-"]
    assert len({len(line) for line in lines[1:3]}) == 1  # aligned


def test_jsonl_rows_carry_gpu_date_and_revision(tmp_path):
    import harness as H
    path = tmp_path / "sub" / "rows.jsonl"
    H.append_jsonl(str(path), {"mode": "a", "tokens_per_s": 1.0})
    H.append_jsonl(str(path), [{"mode": "b"}, {"mode": "c", "gpu": "given"}])
    H.append_jsonl("", {"mode": "nowhere"})  # no --out: nothing written
    rows = H.read_jsonl(str(path))
    assert [r["mode"] for r in rows] == ["a", "b", "c"]
    for r in rows:
        assert {"gpu", "date", "git", "torch"} <= set(r) and len(r["date"]) == 10
    assert rows[0]["gpu"] == "cpu" and rows[2]["gpu"] == "given"  # a row's own value wins
    assert rows[0]["git"] != "" and "git" in H.banner("x")


def test_make_cfg_checks_overrides_and_amp_follows_the_trainer():
    import torch
    import harness as H
    from nanopara.config import ConfigError
    cfg = H.make_cfg("tiny", {"train.micro_batch": 3, "parallel.sp": True, "parallel.tp": 2})
    assert cfg.train.micro_batch == 3 and cfg.parallel.sp is True and cfg.preset == "tiny"
    with pytest.raises(ConfigError, match="unknown config key"):
        H.make_cfg("tiny", {"train.micro_batchh": 3})
    with H.amp("cpu")():  # fp32 on CPU: no autocast
        assert not torch.is_autocast_enabled("cpu")
    with H.amp("cpu", "bf16")():
        assert torch.is_autocast_enabled("cpu")


def test_trainer_step_on_a_solo_mesh():
    """build_trainer + synthetic_batches + train_step: train.py's step, timed on a world-of-one mesh."""
    import torch
    import harness as H
    cfg = H.make_cfg("tiny", {"train.micro_batch": 2, "train.seq_len": 16, "train.tokens_per_step": 64,
                              "model.n_layer": 1})
    mesh = H.solo_mesh(torch.device("cpu"))
    trainer, n_params = H.build_trainer(cfg, mesh)
    batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)
    assert trainer.accum == 2 and len(batches) == 2 and batches[0][0].shape == (2, 16)
    assert torch.equal(batches[0][1][:, :-1], batches[0][0][:, 1:])  # targets: the next token
    t = H.timed(lambda: H.train_step(trainer, batches), steps=2, warmup=1, mesh=mesh)
    assert t["last"].item() > 0 and n_params > 0 and H.mfu(cfg, n_params, 1e3, 1, mesh.device) == 0.0


# ---- the benches ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [["--parallel.pp=2", "--parallel.pp_schedule=1f1b"], ["--parallel.tp=2"],
                                    ["--parallel.dp=2"],
                                    ["--parallel.tp=2", "--parallel.tp_streams=2", "--train.micro_batch=2"]])
def test_bench_layout_runs_train_layouts_on_cpu(tmp_path, layout):
    """bench_layout.py through the Trainer on 2 gloo processes: a pipeline, tp, and dp with accumulation each give
    one row whose tokens/s counts every micro-step of train.tokens_per_step, with its profile's fields; dp also
    against a one-process baseline row in the same file; tp with parallel.tp_streams=2 (the flag passes through)."""
    flags = ["--preset=tiny", "--train.micro_batch=1", "--train.seq_len=32", "--train.tokens_per_step=128", *layout]
    out = tmp_path / "layouts.jsonl"
    args = ["--steps", "1", "--warmup", "1", "--out", str(out)]
    dp = 2 if "--parallel.dp=2" in layout else 1
    if dp == 2:  # the one-process run as train.py without torchrun: the baseline row
        _bench(tmp_path, None, "bench_layout.py", *args, "--label", "one", "--", *flags[:-1])
    stdout = _bench(tmp_path, 2, "bench_layout.py", *args, "--label", "x", "--baseline", "one", "--", *flags)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rec = rows[-1]
    mb = 2 if "--train.micro_batch=2" in layout else 1  # (the last repeated key wins)
    assert rec["label"] == "x" and rec["micro_steps"] == 128 // (32 * dp * mb) and rec["n_gpu"] == 2
    assert rec["flags"][-len(layout):] == layout
    assert rec["tokens_per_s"] == pytest.approx(128 / (rec["step_ms"] / 1e3))
    assert rec["layout"]["dp"] == dp and {"gpu", "date", "git"} <= set(rec)
    assert rec["kernel_ms_by_kind"] and rec["profiled_step_span_ms"] > 0 and 0 < rec["gpu_busy_share"] <= 1
    if dp == 2:
        one = rows[0]
        assert one["n_gpu"] == 1 and one["micro_steps"] == 4 and rec["baseline"] == "one"
        assert rec["per_gpu_vs_baseline"] == pytest.approx(rec["tokens_per_s"] / 2 / one["tokens_per_s"])
    assert "tok/s" in stdout and "x" in stdout


class _FakeEvent:
    """Stands in for a CUDA event: time t ms."""

    def __init__(self, t):
        self.t = t

    def elapsed_time(self, other):
        return other.t - self.t


def test_phases_summary_and_line_agree_with_their_keys():
    from bench_dp import PHASE_KEYS, Phases, phase_line
    ph = Phases()
    for i, step in enumerate([60.0, 62.0, 70.0, 61.0]):  # start, fwd, bwd, grads, end at fixed offsets in a step
        t = 100.0 * i
        ph.steps.append({k: _FakeEvent(t + o) for k, o in
                         zip(("start", "fwd", "bwd", "grads", "end"), (0, 20, 58, 58.5, step - 0.2))})
    ph.gc_ms, ph.gc_n = 3.0, [2, 1, 0]
    v = ph.summary()
    assert len(v) == len(PHASE_KEYS)
    got = dict(zip(PHASE_KEYS, v))
    assert got["fwd"] == 20 and got["bwd"] == 38 and got["tail"] == 0.5  # medians of identical phases
    assert got["median"] == 100.0 and got["mean"] == 100.0  # start to start, three steps that have a next one
    assert (got["gc0"], got["gc1"], got["gc2"]) == (2, 1, 0) and got["gc_ms"] == 1.0  # per step
    line = phase_line("ddp", 0, v)
    assert "median 100.00" in line and line.endswith("gc runs 2/1/0"), line


def test_bench_dp_runs_every_engine_on_cpu(tmp_path):
    """bench_dp.py end to end on 2 gloo processes: every engine (through the Trainer, with accumulation) and torch
    DDP produce a row with a throughput; a second run against the first as --baseline gets its scaling."""
    out = tmp_path / "dp.jsonl"
    modes = ["torch_ddp", "ddp", "zero2", "zero3:u2", "ddp:nocomm", "ddp:single"]
    args = ["--device", "cpu", "--large", "", "--steps", "1", "--warmup", "1", "--micro_batch", "1", "--seq_len",
            "16", "--accum", "2"]
    _bench(tmp_path, 2, "bench_dp.py", *args, "--modes", ",".join(modes), "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["mode"] for row in rows] == modes
    assert all(row["tok_s"] > 0 and row["accum"] == 2 and row["gpus"] == 2 for row in rows)
    assert rows[1]["vs_torch_ddp"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"])
    again = tmp_path / "again.jsonl"  # one process against the 2-process rows: scaling = tok/s / (1 x theirs)
    _bench(tmp_path, None, "bench_dp.py", *args, "--modes", "ddp", "--baseline", str(out), "--out", str(again))
    (row,) = [json.loads(line) for line in again.read_text().splitlines()]
    assert row["gpus"] == 1 and row["scaling"] == pytest.approx(row["tok_s"] / rows[1]["tok_s"])


def test_step_times_summarises_metrics(tmp_path, capsys):
    import step_times
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, "loss": 1.0, "step_time_s": t, "tokens_per_s": 1000 / t}
            for i, t in enumerate([9.0, 0.05, 0.06, 0.04, 0.05, 0.07])]
    recs.insert(3, {"step": 2, "val_loss": 1.0})  # validation lines carry no step time
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    sys.argv = ["step_times.py", "--skip", "1", str(run)]
    step_times.main()
    out = capsys.readouterr().out
    assert "5 steps, step ms median 50.00 mean 54.00 min 40.00 last 70.00" in out, out
    assert "at the median 20,000" in out, out


def test_bench_pp_runs_every_schedule_on_cpu(tmp_path):
    """bench_pp.py end to end on 2 gloo processes through the Trainer: a row per schedule with its bubble and the
    tied-gradient time, the dp comparison, and one clear skip for a split the model cannot take."""
    out = tmp_path / "pp.jsonl"
    stdout = _bench(tmp_path, 2, "bench_pp.py", "--device", "cpu", "--preset", "tiny", "--micro_batch", "1",
                    "--seq_len", "32", "--n_micro", "2", "--schedules", "gpipe,interleaved:2,interleaved:3,zb",
                    "--compare", "dp", "--steps", "1", "--warmup", "1", "--out", str(out))
    assert "interleaved:3  m=2   skipped: model.n_layer=4 is fewer blocks than" in stdout, stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["schedule"] for row in rows] == ["interleaved:2", "zb", "dp", "gpipe"]
    assert all(row["tok_s"] > 0 and row["gpu"] == "cpu" for row in rows)
    formula = {"gpipe": 1 / 3, "interleaved:2": 1 / 5, "zb": 1 / 7}  # (p-1)/(units+p-1), p = m = 2
    for row in rows:
        if row["layout"] == "pp":
            assert row["formula"] == pytest.approx(formula[row["schedule"]])
            assert all(0 <= b < 1 for b in row["bubble"]) and row["p2p_ms"] > 0 and row["F_ms"] > 0
            assert (row["W_ms"] > 0) == (row["schedule"] == "zb") and all(t > 0 for t in row["tied_ms"])


def test_bench_ep_runs_single_dp_and_ep_on_cpu(tmp_path):
    """bench_ep.py on 2 gloo processes through the Trainer: the one-process baseline, dp2 and ep2 each give a row;
    ep2 holds fewer parameters per GPU; the ratios row compares it with both."""
    out = tmp_path / "ep.jsonl"
    _bench(tmp_path, 2, "bench_ep.py", "--device=cpu", "--preset=tiny_moe", "--micro_batch=2", "--seq_len=32",
           "--steps=1", "--warmup=1", f"--out={out}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {r.get("layout", r.get("section")): r for r in rows}
    assert list(by) == ["single", "dp2", "ep2", "ratios"] and by["single"]["gpus"] == 1
    assert by["ep2"]["params_per_gpu"] < by["dp2"]["params_per_gpu"] == by["single"]["params_per_gpu"]
    assert by["ratios"]["ep2_over_dp2_per_gpu"] == pytest.approx(
        by["ep2"]["tokens_per_s_per_gpu"] / by["dp2"]["tokens_per_s_per_gpu"])


def test_bench_cp_runs_every_section_on_cpu(tmp_path):
    """bench_cp.py on 2 gloo processes (reference blocks): 1 GPU against cp2 through the Trainer, the no-comm
    control, Ulysses, the zigzag and contiguous balance, each a stamped row."""
    out = tmp_path / "cp.jsonl"
    _bench(tmp_path, 2, "bench_cp.py", "--device=cpu", "--n_layer=2", "--n_embd=64", "--n_head=2", "--seq_len=64",
           "--steps=1", f"--out={out}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["section"] for r in rows] == ["step", "exposed", "ulysses", "balance", "balance"]
    step = rows[0]
    assert step["cp_efficiency"] == pytest.approx(step["one_gpu"]["step_s"] / (2 * step["cp2"]["step_s"]))
    assert step["cp2"]["tok_s"] > 0 and rows[2]["impl"] == "ulysses" and rows[3]["layout"] == "zigzag"
    assert all(r["gpu"] == "cpu" and r["model"]["seq_len"] == 64 for r in rows)


def test_bench_tp_baseline_and_tp_on_cpu(tmp_path):
    """bench_tp.py sections 1-2 on 2 gloo processes: each rank's one-process baseline, then tp2 with SP, through
    the Trainer (sections 3-4 need CUDA events and memory). Under torchrun itself, as the GPU machines run it."""
    out = tmp_path / "tp.jsonl"
    _torchrun(2, "bench_tp.py", "--device", "cpu", "--preset", "tiny", "--micro_batch", "2", "--seq_len", "32",
              "--sp", "--quick", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["section"] for r in rows] == ["baseline", "tp"] and rows[1]["sp"] is True
    assert all(r["tokens_per_s"] > 0 and r["n_gpu"] == 2 for r in rows)


def test_bench_generate_same_weights_same_greedy_tokens():
    """bench/bench_generate.py's Hugging Face model holds our weights: greedy continuations agree (skipped where
    transformers is not installed: it is a benchmark-only dependency, present on the GPU machines)."""
    pytest.importorskip("transformers")
    import torch
    from bench_generate import hf_model, parity
    from nanopara.presets import PRESETS
    from nanopara.model import GPT
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]().model).eval()
    assert parity(model, hf_model(model), torch.device("cpu")) == 0
    other = GPT(PRESETS["tiny"]().model).eval()  # other random weights: the check can fail
    assert parity(model, hf_model(other), torch.device("cpu")) > 0


def test_bench_generate_left_padded_batches_match_hugging_face():
    """Prompts of different lengths in one batch: ours left-padded (decode.py: per-row positions and key mask) and
    Hugging Face's left-padded batch with an attention mask give the same greedy tokens (skipped without
    transformers)."""
    pytest.importorskip("transformers")
    import torch
    from bench_generate import hf_model, parity_mixed
    from nanopara.presets import PRESETS
    from nanopara.model import GPT
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]().model).eval()
    with torch.no_grad():  # larger weights than GPT-2's init: greedy decoding that is not one repeated token
        for p in model.parameters():
            p.normal_(0, 0.1)
    assert parity_mixed(model, hf_model(model), torch.device("cpu")) == 0


def test_bench_generate_speed_rows_on_cpu(monkeypatch):
    """bench_generate.py's timing rows on the tiny model, Hugging Face stood in for by our own generate (the real
    comparison needs transformers): every sampler timed, both prompt layouts, the ratio to the stand-in."""
    import argparse
    import torch
    import bench_generate as G
    import harness as H
    from nanopara.model import GPT
    torch.manual_seed(0)
    model = GPT(H.PRESETS["tiny"]().model).eval()
    monkeypatch.setattr(G, "hf_generate", lambda hf, idx, new: model.generate(idx, new, temperature=0))
    monkeypatch.setattr(G, "hf_generate_padded", lambda hf, xs, new, device: G.decode.generate(model, xs, new, 0))
    for mixed in (False, True):
        args = argparse.Namespace(prompt=8, new=4, mixed=mixed)
        row = G.speed_row(args, model, None, 2, torch.device("cpu"), H.amp("cpu"))
        names = [n for n, _ in G.runs_of(args, model, None, 2, torch.device("cpu"), H.amp("cpu"))]
        assert all(row[f"{n}_tokens_per_s"] > 0 for n in names), row
        assert row["ours_over_hf"] > 0 and row["new_tokens"] == 4 and row["ours_graph_first_call_s"] > 0


def test_bench_fp8_e2e_runs_on_cpu(tmp_path):
    """bench/bench_fp8_e2e.py's throughput and profile sections on the tiny preset (fp32, the FP8 references), through
    the Trainer: a row per mode with a throughput, the FP8 weights re-cast once per step, a profile row."""
    import bench_fp8_e2e
    out = tmp_path / "fp8.jsonl"
    bench_fp8_e2e.main(["--device", "cpu", "--presets", "tiny", "--modes", "bf16,tensor", "--steps", "1", "--seq",
                        "64", "--warmup", "1", "--profile", "--profile_mode", "bf16", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tp = [r for r in rows if r["section"] == "throughput"]
    assert [r["mode"] for r in tp] == ["bf16", "tensor"], rows
    assert all(r["tokens_per_s"] > 0 and r["loss_last"] == r["loss_last"] and r["gpu"] == "cpu" for r in tp), rows
    assert tp[0]["fp8_linears"] == 0 and tp[1]["fp8_linears"] == 16  # 4 blocks x 4 Linears, lm_head stays
    assert tp[1]["weight_casts"] == 2 * 16 and tp[1]["vs_bf16"] > 0  # 2 steps, one cast per Linear per step
    assert "error" not in tp[1], tp[1]  # its loss within LOSS_GAP of bf16's
    assert tp[0]["fp8_ws"] is None and tp[1]["fp8_ws"] is False  # eager: the Triton GEMMs (graphs take the Gluon)
    assert bench_fp8_e2e.loss_flag(5.391, 5.021) == "loss 5.391 is +7.4% off bf16's 5.021"  # 2026-12-07's three ops
    assert bench_fp8_e2e.loss_flag(5.070, 5.021) is None and bench_fp8_e2e.loss_flag(float("nan"), 5.0)
    prof = [r for r in rows if r["section"] == "profile"]
    assert len(prof) == 1 and prof[0]["mode"] == "bf16" and prof[0]["kernel_ms_by_kind"]["gemm"] > 0, rows


def test_bench_fp8_e2e_compiled_peer_is_pytorch_ops_under_compile(monkeypatch):
    """The +compile rows (issue #43's fair peer): PyTorch ops, train.compile on, torchao's recipe applied before
    parallelize (so before torch.compile); nanopara's own modes keep the Triton kernels and no compile."""
    import bench_fp8_e2e
    seen = {}

    def fake_build_trainer(cfg, mesh, prepare=None):
        seen.update(kernels=cfg.model.kernels, compile=cfg.train.compile, fp8=cfg.train.fp8, prepare=prepare)
        return None, 0
    monkeypatch.setattr(bench_fp8_e2e.H, "build_trainer", fake_build_trainer)
    args = argparse.Namespace(batch_map={}, seq=64, fp8_filter="auto")
    bench_fp8_e2e.build("tiny", "ao_rowwise+compile", args, None)
    assert seen["kernels"] == "torch" and seen["compile"] is True and seen["fp8"] == "none" and seen["prepare"]
    bench_fp8_e2e.build("tiny", "bf16+compile", args, None)
    assert seen["kernels"] == "torch" and seen["compile"] is True and seen["prepare"] is None
    bench_fp8_e2e.build("tiny", "tensor", args, None)
    assert seen["kernels"] == "auto" and seen["compile"] is False and seen["fp8"] == "tensor"
    import torch
    cpu = argparse.Namespace(device=torch.device("cpu"))  # a mesh's device
    out = bench_fp8_e2e.throughput(argparse.Namespace(presets="tiny", modes="bf16+compile"), cpu, print)
    assert out == []  # skipped off CUDA, never timed as an eager row


def test_bench_fp8_e2e_compare(tmp_path):
    """--compare: final train loss over the last steps both runs logged, last validation loss, relative gaps."""
    import bench_fp8_e2e
    for name, off in (("a", 0.0), ("b", 0.02)):
        run = tmp_path / name
        run.mkdir()
        recs = [{"step": s, "loss": 4.0 - 0.001 * s + off, "tokens_per_s": 1000.0 * (2 if name == "b" else 1)}
                for s in range(100)]
        recs += [{"step": s, "val_loss": 3.9 - 0.001 * s + off / 2} for s in (49, 99)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = bench_fp8_e2e.compare_runs(str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), tail=10)
    ta = 4.0 - 0.001 * 94.5  # mean over steps 90..99
    assert r["tail_steps"] == 10 and r["last_step"] == 99
    assert r["train_a"] == pytest.approx(ta) and r["train_gap"] == pytest.approx(0.02 / ta)
    assert r["val_step"] == 99 and r["val_gap"] == pytest.approx(0.01 / (3.9 - 0.099))
    assert r["val_gap_max"] == pytest.approx(0.01 / (3.9 - 0.099))  # the later step: the smaller loss
    assert r["tokens_per_s_b"] == 2 * r["tokens_per_s_a"] == 2000.0
    assert r["within_1pct"] is True  # train gap ~0.52 %, val gap ~0.26 %
    far = tmp_path / "far.jsonl"  # 0.05 above a: a train gap of ~1.3 %
    far.write_text("".join(json.dumps({"step": s, "loss": 4.05 - 0.001 * s}) + "\n" for s in range(100)))
    r = bench_fp8_e2e.compare_runs(str(tmp_path / "a"), str(far), tail=10)
    assert r["within_1pct"] is False and "val_gap" not in r and r["tokens_per_s_b"] is None


def test_host_zb_times_each_phase_of_both_paths():
    """bench/host_zb.py: the one-pass backward has no W; ZB's split has all three phases."""
    import host_zb
    one, split = host_zb.time_phases(2, False, 2), host_zb.time_phases(2, True, 2)
    assert one["W"] == 0 and one["F"] > 0 and one["B"] > 0
    assert all(split[k] > 0 for k in ("F", "B", "W"))


def test_compare_runs_lines_up_two_runs(tmp_path):
    """bench/compare_runs.py (bench/ab_train.sh's table): per-step loss difference, median tok/s of steps >= 3."""
    import compare_runs
    for side, toks, shift in (("old", 100.0, 0.0), ("new", 110.0, 0.5)):
        os.makedirs(tmp_path / f"{side}_r")
        with open(tmp_path / f"{side}_r" / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 0, "resumed_from": "x"}) + "\n")  # not a step line: skipped
            for i in range(6):
                f.write(json.dumps({"step": i, "loss": 5.0 - i + (shift if i == 4 else 0.0), "tokens_per_s":
                                    toks if i >= 3 else 1.0, "peak_mem_gb": 1.0 + i}) + "\n")
    r = compare_runs.compare(compare_runs.rows(str(tmp_path / "old_r")), compare_runs.rows(str(tmp_path / "new_r")))
    assert r["steps"] == 6 and r["max_abs_loss_diff"] == 0.5 and r["ratio"] == 1.1 and r["peak_mem_gb_new"] == 6.0


def test_moe_books_runs_arms_and_seeds_and_judges_the_goal(tmp_path):
    """bench/moe_books.py end to end on CPU (tiny models, two steps, one seed of each arm at once), then its verdict:
    the MoE mean below dense's by more than the pooled standard deviation, failed runs left out."""
    import moe_books
    from tests.shards import tiny_shards
    data = tiny_shards(tmp_path, "t")
    tiny = ("--device=cpu --train.cuda_graph=false --model.n_layer=2 --model.n_embd=32 --model.n_head=2 "
            "--model.moe_hidden=32 --train.seq_len=32 --train.micro_batch=2 --train.tokens_per_step=64 "
            "--train.val_every=1 --train.warmup_steps=1")
    rows = moe_books.main(["--out", str(tmp_path / "mb"), "--data", data, "--seeds", "1", "--jobs", "2",
                           "--steps", "2", "--limit", "2", "--timeout", "200", "--extra", tiny])
    runs = [r for r in rows if "summary" not in r]
    assert sorted((r["arm"], r["seed"]) for r in runs) == [("dense", 1), ("fine", 1)]
    assert all("error" not in r and 0 < r["val_loss"] < 20 and r["tok_s"] > 0 and r["curve"] for r in runs), runs
    assert rows[-1]["summary"] and rows[-1]["dense_n"] == rows[-1]["fine_n"] == 1 and "met" not in rows[-1]
    assert os.path.isfile(tmp_path / "mb" / "moe_books.jsonl")
    fake = [{"arm": "dense", "val_loss": v} for v in (3.30, 3.33, 3.36)]
    better = moe_books.summary(fake + [{"arm": "fine", "val_loss": v} for v in (3.20, 3.22, 3.24)], "fine")
    assert better["met"] and better["diff"] == pytest.approx(-0.11) and better["pooled_std"] == pytest.approx(
        ((0.03 ** 2 + 0.02 ** 2) / 2) ** 0.5)
    level = moe_books.summary(fake + [{"arm": "fine", "val_loss": v} for v in (3.28, 3.31, 3.34)] +
                              [{"arm": "fine", "error": "train.py exited 1"}], "fine")
    assert not level["met"] and level["fine_n"] == 3
