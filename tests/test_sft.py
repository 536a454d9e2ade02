"""Supervised fine-tuning: template, packing, loss masks through the loader, prepare.py sft, train.py on SFT shards
(single process = gloo layouts), and --ckpt.init_from from a trainer checkpoint or Hugging Face weights.

Run: .venv/bin/python -m pytest tests/test_sft.py -q   (~1-2 min on 2 cores; the tokenizer from ../shared/data)
Synthetic shards use a 250-token vocabulary so the tiny models stay small; prepare's round trip uses GPT-2 BPE.
"""
import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from nanopara import sft
from nanopara.cli import parse_args
from nanopara.config import ModelConfig
from nanopara.consolidate import full_model_state
from nanopara.data import EOT, TokenLoader, find_shards, get_tokenizer, mask_path, write_mask, write_shard
from nanopara.model import GPT, TritonOps, to_hf_state_dict
from tests.distributed import spawn
from test_data import prepare  # data/prepare.py loaded as a module

V = 250  # synthetic vocabulary; token 249 plays EOT in the hand-made shards
ROW = 16


# ----------------------------------------------------------------------------------------------------------------
# template and packing

def test_single_turn_renders_as_prompt_ids_plus_response():
    enc = get_tokenizer()
    for prompt, response in [("12+7=?", "19"), ("  What is\n 3*4? ", " 12"), ("sort: b a", "a b\n"), ("", "")]:
        toks, mask = sft.encode(enc, sft.parse_line({"prompt": prompt, "response": response}, "x:1"))
        head = sft.prompt_ids(enc, prompt)  # what RL and evaluation condition on
        assert toks[:len(head)].tolist() == head and not mask[:len(head)].any()
        body = enc.encode_ordinary(response if response[:1].isspace() else " " + response)
        assert toks[len(head):].tolist() == body and mask[len(head):].all()  # closing EOT: added by pack


def test_chat_trains_only_assistant_turns():
    enc = get_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    toks, mask = sft.encode(enc, msgs)
    assert enc.decode(toks.tolist()) == "<|endoftext|>System: Be brief.\nUser: hi\nAssistant: hello\nUser: 2+2?\n" \
                                        "Assistant: 4"
    assert enc.decode(toks[mask == 1].tolist()) == " hello\n 4"


def _examples(rng, n, lo=2, hi=9):
    """(tokens, mask) examples in the synthetic vocab: EOT, a prompt (ids < 100), a response (ids >= 100)."""
    out = []
    for _ in range(n):
        p, r = rng.integers(0, 100, rng.integers(lo, hi)), rng.integers(100, 249, rng.integers(0, 5))
        out.append((np.concatenate([[249], p, r]).astype(np.uint16),
                    np.concatenate([[0], np.zeros(len(p)), np.ones(len(r))]).astype(np.uint8)))
    return out


@pytest.mark.parametrize("one_per_row", [False, True])
def test_packing_keeps_examples_whole_and_targets_inside_their_example(one_per_row):
    rng = np.random.default_rng(0)
    examples = _examples(rng, 60) + [(np.full(ROW + 1, 5, np.uint16), np.zeros(ROW + 1, np.uint8))]  # too long
    tokens, mask, skipped = sft.pack([(t.copy(), m) for t, m in examples], ROW, one_per_row)
    # pack() fills EOT padding with data.EOT; the synthetic examples use 249 as their EOT: compare structure only
    assert skipped == [60] and (len(tokens) - 1) % ROW == 0
    rows = (len(tokens) - 1) // ROW
    at, placed = 0, []
    for i, (t, m) in enumerate(examples[:60]):  # next-fit in input order: find each example where it must be
        if (at % ROW) + len(t) > ROW or (one_per_row and at % ROW):
            assert (tokens[at:(at // ROW + 1) * ROW] == EOT).all()  # the rest of the row is padding
            at = (at // ROW + 1) * ROW
        assert tokens[at:at + len(t)].tolist() == t.tolist(), i  # whole, never cut over two rows
        placed.append((at, len(t), m))
        at += len(t)
    assert at // ROW + (at % ROW > 0) == rows
    want = np.zeros_like(mask)
    for start, n, m in placed:
        want[start:start + n] = np.maximum(want[start:start + n], m)
        want[start + n] = 1  # the closing EOT (next example's EOT, a pad or the next row's first token) is trained
    for start, n, m in placed:  # ...and the token after a closing EOT, the next prompt's first token, is not
        assert start + n + 1 >= len(mask) or tokens[start + n] != 249 or mask[start + n + 1] == 0
    assert mask.tolist() == want.tolist()
    if one_per_row:
        assert rows == 60
    else:
        assert rows < 50  # several examples per row (60 examples of ~8 tokens in rows of 16)


# ----------------------------------------------------------------------------------------------------------------
# loss masks through the loader

def _sft_shards(d, n_examples=400, seed=0, row=ROW):
    """Hand-made SFT train/val shards + masks (synthetic vocab) packed by sft.pack; returns the glob."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_examples), ("val", 60)):
        tokens, mask, _ = sft.pack(_examples(rng, n), row)
        tokens[tokens == EOT] = 249  # padding in the synthetic vocab
        path = os.path.join(d, f"s_{split}_000000.bin")
        write_shard(path, tokens)
        write_mask(mask_path(path), mask, row)
    return os.path.join(d, "s_*.bin")


def test_loader_yields_minus_one_exactly_where_masked(tmp_path):
    files = find_shards(_sft_shards(tmp_path), "train")
    tokens = np.fromfile(files[0], np.uint16, offset=1024).astype(np.int64)
    mask = np.fromfile(mask_path(files[0]), np.uint8, offset=1024)
    for T in (ROW, 2 * ROW):
        loader = TokenLoader(files, 3, T, shuffle=False, vocab_size=V)
        plain = TokenLoader(files, 3, T, shuffle=False, vocab_size=V, loss_mask="off")
        assert loader.masks is not None and plain.masks is None
        for b in range(4):
            (x, y), (x2, y2) = next(loader), next(plain)
            assert torch.equal(x, x2)
            for i in range(3):
                w = b * 3 + i  # window index: tokens w*T .. w*T + T
                assert x[i].tolist() == tokens[w * T: w * T + T].tolist()
                want = np.where(mask[w * T + 1: w * T + T + 1] == 1, tokens[w * T + 1: w * T + T + 1], -1)
                assert y[i].tolist() == want.tolist() and (y2[i] >= 0).all()
                assert (y[i] >= 0).any()  # every window holds at least one trained target (no 0/0 loss)


def test_loader_mask_errors(tmp_path):
    files = find_shards(_sft_shards(tmp_path), "train")
    with pytest.raises(ValueError, match=r"rows of 16 tokens; train.seq_len=24 would cut them"):
        TokenLoader(files, 2, 24, vocab_size=V)
    plain = str(tmp_path / "p_train_000001.bin")
    write_shard(plain, np.arange(200) % V)
    with pytest.raises(ValueError, match="has no loss mask .* mixing SFT and plain shards"):
        TokenLoader(files + [plain], 2, ROW, vocab_size=V)
    with pytest.raises(ValueError, match="has no loss mask .*data.loss_mask=on"):
        TokenLoader([plain], 2, ROW, vocab_size=V, loss_mask="on")
    write_mask(mask_path(plain), np.ones(199), ROW)
    with pytest.raises(ValueError, match="holds 199 tokens .* its shard has 200"):
        TokenLoader([plain], 2, ROW, vocab_size=V)


# ----------------------------------------------------------------------------------------------------------------
# masked positions contribute nothing

def _tiny_model(kernels="torch"):
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=V, kernels=kernels))


def _grads(model, x, y):
    model.zero_grad()
    model(x, y)[1].backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_masked_targets_contribute_nothing(ops):
    model = _tiny_model()
    if ops == "triton":  # the fused cross-entropy kernel (and attention, layernorm) in Triton's interpreter
        model._ops["cpu"] = TritonOps(interpret=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 16), generator=g)
    full = torch.randint(0, V, (2, 16), generator=g)  # every position's real next token
    keep = torch.rand(2, 16, generator=g) < 0.4  # trained targets
    masked = full.masked_fill(~keep, -1)
    base = _grads(model, x, masked)
    # 1. the gradients of a loss over the kept rows alone, which never sees a masked row's target token
    model.zero_grad()
    F.cross_entropy(model(x)[0][..., :V][keep].float(), full[keep]).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, base[k], atol=2e-6, rtol=1e-4)  # fp32, the same sums in another order
    # 2. the logits of masked rows get exactly zero gradient, whatever their target token was
    logits = model(x)[0].detach().float().requires_grad_()
    model.loss_fn(logits, masked).backward()
    assert (logits.grad[~keep] == 0).all() and (logits.grad[keep] != 0).any()
    # 3. the check can fail: one masked target made live moves the gradients
    live = masked.clone()
    live[0, int((~keep[0]).nonzero()[0])] = 3
    moved = _grads(model, x, live)
    assert max((moved[k] - base[k]).abs().max().item() for k in base) > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# prepare.py sft: JSONL -> shards -> loader

def test_prepare_round_trip(tmp_path):
    rows = [{"prompt": f"{a}+{b}=?", "response": str(a + b)} for a, b in [(12, 7), (300, 45), (9, 9), (1, 2)]]
    rows.insert(2, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello"}]})
    src = tmp_path / "ex.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "2+2=?", "response": "4"}) + "\n")
    prepare.main(["sft", str(src), "--val_jsonl", str(val), "--out", str(tmp_path / "shards"), "--seq_len", "32",
                  "--name", "arith"])
    enc = get_tokenizer()
    files = find_shards(str(tmp_path / "shards" / "arith"), "train")
    loader = TokenLoader(files, 1, 32, shuffle=False)
    got, trained = "", []
    for _ in range(len(loader)):
        x, y = next(loader)
        got += enc.decode(x[0].tolist())
        trained.append(enc.decode(y[0][y[0] >= 0].tolist()))
    texts = [f"User: {r['prompt']}\nAssistant: {r['response']}" for r in rows if "prompt" in r]
    texts.insert(2, "User: hi\nAssistant: hello")
    assert got.replace("<|endoftext|>", "|").strip("|").split("|") == texts  # in order, padding between rows
    responses = [" " + r["response"] if "prompt" in r else " hello" for r in rows]
    assert "".join(trained) == "".join(r + "<|endoftext|>" for r in responses)
    _, yv = next(TokenLoader(find_shards(str(tmp_path / "shards" / "arith"), "val"), 1, 32, shuffle=False))
    assert enc.decode(yv[0][yv[0] >= 0].tolist()) == " 4<|endoftext|>"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"}', "ex.jsonl:2: needs string fields 'prompt' and 'response'"),
    ('{"prompt": "a", "response": 3}', "ex.jsonl:2: .*'response' missing or not a string"),
    ("not json", "ex.jsonl:2: not valid JSON"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"ex.jsonl:2: messages\[0\] must be"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "ex.jsonl:2: the last message must be the assistant's"),
    ("[1, 2]", "ex.jsonl:2: expected a JSON object"),
])
def test_prepare_names_the_bad_line(tmp_path, capsys, line, message):
    src = tmp_path / "ex.jsonl"
    src.write_text('{"prompt": "1+1=?", "response": "2"}\n' + line + "\n")
    with pytest.raises(SystemExit):
        prepare.main(["sft", str(src), "--out", str(tmp_path / "shards")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prepare.py: error: ")
    assert re.search(message, err[0]), err[0]
    assert not os.path.exists(tmp_path / "shards" / "ex" / "manifest.json")  # nothing written


# ----------------------------------------------------------------------------------------------------------------
# train.py on SFT shards: the step-0 loss by hand, and gloo layouts = the single-process run

STEPS = 4


def argv(shards, out_dir, *extra):
    return ["--preset=tiny", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            f"--model.vocab_size={V}", "--model.kernels=torch", "--train.micro_batch=2", f"--train.seq_len={ROW}",
            f"--train.steps={STEPS}", "--train.warmup_steps=1", "--train.val_every=0", "--train.sample_tokens=0",
            "--train.lr=1e-2", f"--train.tokens_per_step={8 * ROW}", "--ckpt.final=false", *extra]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _sft_shards(str(tmp_path_factory.mktemp("sft")))


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """The single-process run (with its final checkpoint: init_from's source)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    return dict(train.main(argv(shards, run, "--ckpt.final=true")), dir=str(run))


def _first_loss(model, files, cfg, accum=4, loss_mask="auto"):
    """model's loss over train.py's first step (its loader, rank 0 of 1): the mean over every trained target of
    the step's micro-batches, i.e. their mean losses weighted by their trained-target counts (train.token_weights)."""
    loader = TokenLoader(files, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.seed, vocab_size=V,
                         loss_mask=loss_mask)
    with torch.no_grad():
        batches = [next(loader) for _ in range(accum)]
        losses = np.array([model(x, y)[1].item() for x, y in batches])
    counts = np.array([float((y != -1).sum()) for _, y in batches])
    if loss_mask != "off":
        assert counts.min() < counts.max()  # unequal micro-batches: the weighting is exercised
    return float((losses * counts).sum() / counts.sum())


def test_sft_step0_loss_is_the_masked_loss(shards, reference, tmp_path):
    cfg = parse_args(argv(shards, tmp_path / "x"))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)  # build_model's initial weights
    files = find_shards(shards, "train")
    assert reference["losses"][0] == pytest.approx(_first_loss(model, files, cfg), abs=1e-5)
    off = train.main(argv(shards, tmp_path / "off", "--train.steps=1", "--data.loss_mask=off"))["losses"][0]
    assert off == pytest.approx(_first_loss(model, files, cfg, loss_mask="off"), abs=1e-5)
    assert abs(off - reference["losses"][0]) > 1e-3  # the mask changes what is trained


def _worker(rank, world, args, out_file):
    s = train.main(args)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(s["losses"], f)


@pytest.mark.parametrize("layout", [["--parallel.dp=2", "--parallel.zero=1"], ["--parallel.pp=2"]])
def test_sft_gloo_layouts_equal_single_process(shards, reference, tmp_path, layout):
    # same micro-batch (2 rows) everywhere: dp2's micro-step j on rank r is the single run's micro-batch 2j + r,
    # so the per-micro-batch means over trained tokens are the same numbers; only fp32 sum order differs. pp reads
    # the targets on its last stage (parallel.stage_data); tp/sp change no data path (vocab-parallel CE ignores
    # -1 like the kernels: tests/test_tp.py) and cp2 rescales by the valid-target count (cp.py; it passed here too,
    # but takes ~75 s on the shared 2 cores), so they are left out to keep this file fast.
    out = tmp_path / "losses.json"
    spawn(_worker, 2, argv(shards, tmp_path / "run", *layout), str(out))
    np.testing.assert_allclose(json.loads(out.read_text()), reference["losses"], atol=1e-4, rtol=0)


def test_sft_loss_is_the_mean_over_the_steps_trained_tokens(shards, reference, tmp_path):
    """One micro-batch of 8 rows and four of 2 rows (the same rows) train alike: every trained target of the step
    weighs the same, however the step is cut into micro-batches (a mean of per-micro-batch means would not)."""
    whole = train.main(argv(shards, tmp_path / "whole", "--train.micro_batch=8"))["losses"]
    np.testing.assert_allclose(whole, reference["losses"], atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# --ckpt.init_from

def test_init_from_trainer_checkpoint_and_hf_weights(shards, reference, tmp_path):
    src = reference["dir"]
    sd, mcfg = full_model_state(src)
    model = GPT(mcfg)
    model.load_state_dict(sd)
    cfg = parse_args(argv(shards, tmp_path / "x"))
    want = _first_loss(model, find_shards(shards, "train"), cfg)
    got = train.main(argv(shards, tmp_path / "ft", "--train.steps=1", f"--ckpt.init_from={src}"))["losses"][0]
    assert got == pytest.approx(want, abs=1e-5)
    torch.save(to_hf_state_dict(model), tmp_path / "hf.bin")
    got = train.main(argv(shards, tmp_path / "ft_hf", "--train.steps=1",
                          f"--ckpt.init_from={tmp_path / 'hf.bin'}"))["losses"][0]
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(sft.SFTError, match=r"the checkpoint's model differs .*model.n_layer=2 \(this run: 3\)"):
        train.main(argv(shards, tmp_path / "bad", "--model.n_layer=3", f"--ckpt.init_from={src}"))
    with pytest.raises(sft.SFTError, match=r"Hugging Face weights' shape differs .*model.n_embd=32 \(this run: 64\)"):
        train.main(argv(shards, tmp_path / "bad2", "--model.n_embd=64", f"--ckpt.init_from={tmp_path / 'hf.bin'}"))
    (tmp_path / "junk.bin").write_bytes(b"not a torch file")
    with pytest.raises(sft.SFTError, match="cannot read it as a PyTorch state dict"):
        train.main(argv(shards, tmp_path / "bad3", f"--ckpt.init_from={tmp_path / 'junk.bin'}"))

