"""sample.py and nanopara/consolidate.py on checkpoints that train.py wrote, the way a user makes them.

Each layout (one process, tp=2 + sp, dp=2 x ZeRO-3, tp=2 x dp=2 x ZeRO-3, pp=2 x tp=2) trains a tiny model for 2
steps. While it saves, the test asks the running engine for its own full weights (engine.full_model_state_dict(),
then the tp pieces gathered over the tp group and joined by tp.unshard, then the pp stages' names merged): the
consolidated state dict must equal them exactly, and sample.py must print the same text from the checkpoint as a
single-device GPT holding those weights. `--model.vocab_multiple=1` makes the vocabulary 50257 rows, odd, so tp=2
pads it to 50258 and the TP padding row must be dropped. Errors a user can cause are one line on stderr and exit
code 2.
"""
import dataclasses
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sample
import train
from nanopara import checkpoint, tp
from nanopara.checkpoint import CheckpointError
from nanopara.consolidate import full_model_state
from nanopara.data import get_tokenizer, write_shard
from nanopara.model import GPT, to_hf_state_dict
from tests.distributed import spawn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {  # name: (processes, extra train.py keys)
    "single": (1, []),
    "tp2_sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "dp2_zero3": (2, ["--parallel.zero=3"]),
    "tp2_dp2_zero3": (4, ["--parallel.tp=2", "--parallel.zero=3"]),
    "pp2_tp2": (4, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--parallel.tp=2"]),  # stages merged
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample_shards")
    toks = np.random.default_rng(0).integers(0, 50257, 20000)  # any GPT-2 ids: prompts stay in the vocabulary
    write_shard(str(d / "s_train_000000.bin"), toks)
    write_shard(str(d / "s_val_000000.bin"), toks[:3000])
    return str(d / "s_*.bin")


def argv(shards, out_dir, *extra):
    return ["--preset=tiny", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64",
            "--model.vocab_multiple=1", "--train.seq_len=32", "--train.micro_batch=2", "--train.steps=2",
            "--train.val_every=0", "--train.sample_tokens=0", *extra]


# ----------------------------------------------------------------------------------------------------------------
# the oracle: the running engine's own gather, taken when the run saves its checkpoint

def _engine_of(mesh):
    """The data-parallel engine the run built (whatever train.py calls it): the object holding this mesh that can
    gather the full model."""
    found = [o for o in gc.get_objects() if hasattr(type(o), "full_model_state_dict")
             and getattr(o, "__dict__", {}).get("mesh") is mesh]
    assert len(found) == 1, f"expected one engine holding the run's mesh, found {len(found)}"
    return found[0]


def capture_engine_weights(ref_file):
    """Wrap checkpoint.save so that, at the run's save, rank 0 writes the engine's full weights to ref_file."""
    orig = checkpoint.save
    sig = inspect.signature(orig)

    def save(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        mesh, state = bound["mesh"], bound["state"]
        local = _engine_of(mesh).full_model_state_dict()  # full over dp (collective under ZeRO-3); tp pieces
        full = local
        if mesh.tp > 1:
            pieces = [None] * mesh.tp
            dist.all_gather_object(pieces, local, group=mesh.tp_group)
            full = {name: t if name not in state["tp_shards"] else
                    tp.unshard([p[name] for p in pieces], state["tp_shards"][name]["dim"],
                               state["tp_shards"][name]["parts"]) for name, t in local.items()}
        if mesh.pp > 1:  # each stage holds its own names; the last stage's copy of the tied wte is dropped
            stages = [None] * mesh.pp
            dist.all_gather_object(stages, full, group=mesh.pp_group)
            full = {k: v for st in stages for k, v in st.items() if k != "lm_head.weight"}
        if mesh.rank == 0:
            torch.save({k: v.detach().clone() for k, v in full.items()}, ref_file)
        return orig(*args, **kwargs)

    checkpoint.save = save
    return orig


def _worker(rank, world, args, ref_file):
    capture_engine_weights(ref_file)
    train.main(args)


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    """run(name) -> (run directory, the engine's full weights): trains each layout once per module."""
    done = {}

    def get(name):
        if name not in done:
            world, extra = LAYOUTS[name]
            d = tmp_path_factory.mktemp(name)
            out, ref_file = d / "run", str(d / "engine_weights.pt")
            if world == 1:
                orig = capture_engine_weights(ref_file)
                try:
                    train.main(argv(shards, out, *extra))
                finally:
                    checkpoint.save = orig
            else:
                spawn(_worker, world, argv(shards, out, *extra), ref_file)
            done[name] = out, torch.load(ref_file, weights_only=True)
        return done[name]
    return get


def sample_main(args, capsys):
    """(exit code, stdout, stderr lines) of sample.py run in this process."""
    capsys.readouterr()  # drop what came before (a training run's log)
    code = sample.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_one_line_error(code, out, err, *words):
    assert code == 2 and out == "" and len(err) == 1 and err[0].startswith("error: "), (code, out, err)
    for w in words:
        assert w in err[0], err[0]


# ----------------------------------------------------------------------------------------------------------------
# consolidation

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_consolidated_state_equals_the_engines_full_weights(run, name):
    out, ref = run(name)
    sd, cfg = full_model_state(out)
    assert cfg.n_layer == 2 and cfg.n_embd == 32 and cfg.vocab_size == cfg.padded_vocab == 50257
    model = GPT(cfg)
    assert set(sd) == set(model.state_dict())  # every key a single-device GPT has, nothing else
    model.load_state_dict(sd)  # strict
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    wte = ref["transformer.wte.weight"]
    if "--parallel.tp=2" in LAYOUTS[name][1]:
        assert wte.shape[0] == 50258 and not wte[50257:].any()  # the vocab-parallel padding row, zero
        ref = {**ref, "transformer.wte.weight": wte[:50257]}
    assert set(ref) == set(sd) - {"lm_head.weight"}
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k


def test_run_ckpt_and_step_directories_give_the_same_state(run):
    out, _ = run("single")
    step = checkpoint.latest(out)
    assert os.path.basename(step) == "step_000002"
    a, _ = full_model_state(out)
    for path in (out / "ckpt", step):
        b, _ = full_model_state(path)
        assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------------------
# sampling

SAMPLE_ARGS = ["--prompt=The quick brown fox", "--tokens=12", "--seed=7", "--temperature=1.0", "--top_k=50"]


@pytest.mark.parametrize("name", ["tp2_sp", "dp2_zero3", "tp2_dp2_zero3", "pp2_tp2"])
def test_sample_from_sharded_checkpoint_equals_single_device_model(run, name, capsys):
    out, ref = run(name)
    code, text, err = sample_main([f"--out_dir={out}", *SAMPLE_ARGS, "--num_samples=2"], capsys)
    assert code == 0 and err == [], err
    _, cfg = full_model_state(out)
    model = GPT(cfg)
    ref = {**ref, "transformer.wte.weight": ref["transformer.wte.weight"][:cfg.padded_vocab]}
    model.load_state_dict({**ref, "lm_head.weight": ref["transformer.wte.weight"]})
    expected = sample.complete(model.eval(), get_tokenizer(), sample.parse_args(
        ["--out_dir=unused", *SAMPLE_ARGS, "--num_samples=2"]))
    assert text == "\n---------------\n".join(expected) + "\n"
    assert all(t.startswith("The quick brown fox") and len(t) > len("The quick brown fox") for t in expected)


def test_same_seed_same_text_and_samples_do_not_depend_on_their_count(run, capsys):
    out, _ = run("single")
    _, one, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS], capsys)
    _, again, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS], capsys)
    _, two, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS, "--num_samples=2"], capsys)
    _, other, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS, "--seed=8"], capsys)
    assert one == again and two.startswith(one.rstrip("\n") + "\n---------------\n") and other != one
    _, greedy, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS, "--temperature=0", "--seed=1"], capsys)
    _, greedy2, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS, "--temperature=0", "--seed=2"], capsys)
    assert greedy == greedy2  # greedy decoding uses no randomness


def test_hugging_face_round_trip(shards, tmp_path, capsys):
    # the default vocab_multiple (128), as Hugging Face files are read: both models then have the same shapes
    out = tmp_path / "run"
    train.main([a for a in argv(shards, out) if a != "--model.vocab_multiple=1"])
    sd, cfg = full_model_state(out)
    model = GPT(cfg)
    model.load_state_dict(sd)
    hf = to_hf_state_dict(model)
    assert hf["transformer.wte.weight"].shape == (50257, 32)  # unpadded, and Conv1D weights stored (in, out):
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    torch.save(hf, tmp_path / "gpt2.bin")
    # the Hub's gpt2 file is GPT2Model's: no "transformer." prefix
    torch.save({k.removeprefix("transformer."): v for k, v in hf.items()}, tmp_path / "gpt2_noprefix.bin")
    _, from_ckpt, _ = sample_main([f"--out_dir={out}", *SAMPLE_ARGS], capsys)
    for f in ("gpt2.bin", "gpt2_noprefix.bin"):
        code, from_hf, err = sample_main([f"--init_from={tmp_path / f}", "--n_head=2", *SAMPLE_ARGS], capsys)
        assert code == 0 and err == [] and from_hf == from_ckpt
    # n_embd=32 is no GPT-2 size: the head count cannot be inferred
    code, o, err = sample_main([f"--init_from={tmp_path / 'gpt2.bin'}", *SAMPLE_ARGS], capsys)
    assert_one_line_error(code, o, err, "--n_head")


def test_long_prompt_is_cropped_to_the_context_with_one_warning(run, capsys):
    out, _ = run("single")
    enc = get_tokenizer()
    prompt = "to be or not to be, " * 20
    ids = enc.encode(prompt)
    assert len(ids) > 64
    code, text, err = sample_main([f"--out_dir={out}", f"--prompt={prompt}", "--tokens=10", "--seed=3"], capsys)
    assert code == 0 and len(err) == 1 and err[0].startswith("warning: ") and "last 54 tokens" in err[0]
    kept = enc.decode(ids[-54:])
    assert enc.encode(kept) == ids[-54:]
    code, same, err = sample_main([f"--out_dir={out}", f"--prompt={kept}", "--tokens=10", "--seed=3"], capsys)
    assert code == 0 and err == [] and same == text and text.startswith(kept)
    # a prompt that fits with room for the new tokens is never cropped
    code, _, err = sample_main([f"--out_dir={out}", f"--prompt={enc.decode(ids[:54])}", "--tokens=10"], capsys)
    assert code == 0 and err == [], err


def test_repeated_key_last_wins():
    a = sample.parse_args(["--out_dir=x", "--tokens=3", "--tokens=5", "--prompt=a", "--prompt=b=c"])
    assert a.tokens == 5 and a.prompt == "b=c"


def test_help_lists_every_key(capsys):
    assert sample.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{f.name}=" in out for f in dataclasses.fields(sample.Args))


# ----------------------------------------------------------------------------------------------------------------
# user errors: one line, exit code 2

@pytest.mark.parametrize("args, words", [
    (["--out_dir=R", "--temprature=1"], ["--temprature", "did you mean --temperature"]),
    (["--out_dir=R", "--tokens=abc"], ["--tokens", "'abc'"]),
    (["--out_dir=R", "--tokens=0"], ["--tokens must be >= 1"]),
    (["--out_dir=R", "--top_k=-1"], ["--top_k"]),
    (["--out_dir=R", "--temperature=-0.5"], ["--temperature"]),
    (["--out_dir=R", "--temperature=nan"], ["--temperature"]),
    (["--out_dir=R", "--temperature=1e-9"], ["--temperature", "greedy"]),
    (["--out_dir=R", "--seed=-1"], ["--seed"]),
    (["--out_dir=R", "--num_samples=0"], ["--num_samples"]),
    (["--out_dir=R", "--device=tpu"], ["--device"]),
    (["--out_dir=R", "prompt"], ["--key=value"]),
    (["--out_dir"], ["--key=value"]),
    ([], ["--out_dir", "--init_from"]),
    (["--out_dir=R", "--init_from=F"], ["not both"]),
    (["--out_dir=R", "--n_head=2"], ["--n_head"]),
])
def test_bad_arguments(args, words, capsys):
    assert_one_line_error(*sample_main(args, capsys), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when there is no GPU")
def test_cuda_without_a_gpu(capsys):
    assert_one_line_error(*sample_main(["--out_dir=R", "--device=cuda"], capsys), "no CUDA GPU")


def test_bad_sources(run, tmp_path, capsys):
    out, _ = run("single")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty_run" / "ckpt").mkdir(parents=True)
    (tmp_path / "garbage.bin").write_bytes(b"not a torch file")
    torch.save({"transformer.wte.weight": torch.zeros(3, 4)}, tmp_path / "partial.bin")
    torch.save({"wte.weight": torch.zeros(3, 4), "wpe.weight": torch.zeros(8, 4)}, tmp_path / "no_blocks.bin")
    torch.save({"wte.weight": torch.zeros(3, 64), "wpe.weight": torch.zeros(8, 64),
                "h.0.ln_1.weight": torch.ones(64)}, tmp_path / "missing_keys.bin")
    cases = [
        ([f"--out_dir={tmp_path / 'nope'}"], ["no such run", "nope"]),
        ([f"--out_dir={tmp_path / 'afile'}"], ["is a file"]),
        ([f"--out_dir={tmp_path}"], ["holds no checkpoint"]),
        ([f"--out_dir={tmp_path / 'empty_run'}"], ["no complete checkpoint"]),
        ([f"--out_dir={out}", "--ckpt=step_000099"], ["no such run or checkpoint directory", "step_000099"]),
        ([f"--out_dir={out}", "--tokens=64"], ["--tokens=64", "context of 64"]),
        ([f"--init_from={tmp_path / 'missing.bin'}"], ["no file"]),
        ([f"--init_from={tmp_path / 'garbage.bin'}"], ["cannot read"]),
        ([f"--init_from={tmp_path / 'partial.bin'}"], ["not a GPT-2 state dict"]),
        ([f"--init_from={tmp_path / 'no_blocks.bin'}"], ["no transformer blocks"]),
        ([f"--init_from={tmp_path / 'missing_keys.bin'}"], ["missing"]),
        ([f"--init_from={tmp_path}"], ["no file"]),
    ]
    for args, words in cases:
        assert_one_line_error(*sample_main(["--tokens=4", *args], capsys), *words)


def _copy_ckpt(run_dir, tmp_path):
    """A copy of a run's newest checkpoint to damage: (its run directory, its step directory)."""
    src = checkpoint.latest(run_dir)
    dst = tmp_path / "run" / "ckpt" / os.path.basename(src)
    shutil.copytree(src, dst)
    (dst.parent / "latest").write_text(dst.name + "\n")
    return tmp_path / "run", dst


def _edit_meta(step, fn):
    meta = json.loads((step / "meta.json").read_text())
    fn(meta)
    (step / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, words", [
    ("truncate", ["rank_00001.pt"]),
    ("remove", ["rank_00001.pt"]),
    ("no_meta", ["meta.json"]),
    ("layout_pp", ["no shard for rank 2"]),  # a layout of more ranks than the shards written
    ("layout_garbage", ["unknown layout"]),
    ("format", ["unknown model state format", "'zigzag'"]),
])
def test_damaged_checkpoint_is_one_line(run, tmp_path, capsys, damage, words):
    run_dir, step = _copy_ckpt(run("tp2_sp")[0], tmp_path)
    shard = step / "rank_00001.pt"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "remove":
        shard.unlink()
    elif damage == "no_meta":
        (step / "meta.json").unlink()
    elif damage == "layout_pp":
        _edit_meta(step, lambda m: m["layout"].update(pp=2, world=4))
    elif damage == "layout_garbage":
        _edit_meta(step, lambda m: m.update(layout="2x2"))
    elif damage == "format":
        state = torch.load(shard, weights_only=True)
        state["model"] = {"format": "zigzag"}
        torch.save(state, shard)
        _edit_meta(step, lambda m: m.pop("shard_bytes", None))  # sizes changed on purpose
    with pytest.raises(CheckpointError) as e:
        full_model_state(step)
    assert "\n" not in str(e.value)
    # the step directory itself: a run directory would fall back to an older complete checkpoint (none here)
    assert_one_line_error(*sample_main([f"--ckpt={step}", "--tokens=4"], capsys), *words)


def test_command_line_error_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), f"--out_dir={tmp_path / 'none'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)  # run from outside the repo
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
