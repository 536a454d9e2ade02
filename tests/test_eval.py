"""nanopara/evals.py and eval.py: HellaSwag scoring, loss, GSM8K extraction and generation, the CLI, two ranks.

Scoring is checked against an explicit per-ending loop over single unpadded forwards on a tiny random model with a
byte-level tokenizer (vocab 256), so padding, truncation and batching cannot hide an off-by-one. The loss task is
checked against the val_loss train.py's evaluate() logged on the same checkpoint and tokens; a 2-process gloo run
of eval.py against a 1-process run. Run: .venv/bin/python -m pytest -q tests/test_eval.py (~40 s on 2 cores).
"""
import bz2
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval as eval_cli
import train
from nanopara import evals
from nanopara.config import ModelConfig
from nanopara.data import write_shard
from nanopara.evals import EvalError, HellaSwagItem
from nanopara.model import GPT, to_hf_state_dict
from tests.distributed import free_ports, spawn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ByteTok:
    """A byte-level stand-in for tiktoken's encoding (vocab 256, no EOT)."""
    n_vocab, eot_token = 256, None

    def encode_ordinary(self, s):
        return list(s.encode())

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")

    def decode_single_token_bytes(self, t):
        return bytes([t])


def tiny(vocab=256, block=64, seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block, vocab_size=vocab)).eval()


def explicit_logprob(model, ctx, cont):
    """sum_j log p(cont[j] | ctx + cont[:j]) from one unpadded forward, position by position."""
    seq = (ctx + cont)[-(model.cfg.block_size + 1):]
    n_ctx = len(seq) - len(cont)
    with torch.no_grad():
        logits, _ = model(torch.tensor([seq[:-1]]))
    total = 0.0
    for j, tok in enumerate(cont):
        total += torch.log_softmax(logits[0, n_ctx - 1 + j, :model.cfg.vocab_size].double(), -1)[tok].item()
    return total


ITEMS = [HellaSwagItem("Cooking: She cracks two eggs into a bowl and", 2,
                       ["flies away.", "sings a song about the moon", "whisks them.", "x"]),
         HellaSwagItem("Sport: The runner crosses the line", 0,
                       ["and raises his arms.", "then eats a very long sandwich slowly", "no.", "upside"])]


# ----------------------------------------------------------------------------------------------------------------
# HellaSwag

def write_items(path, items, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for it in items:
            f.write("\n".join([it.ctx, str(it.label), *it.endings]) + "\n")


def test_read_hellaswag_txt_and_bz2(tmp_path):
    for name, opener in (("h.txt", open), ("h.txt.bz2", bz2.open)):
        write_items(tmp_path / name, ITEMS, opener)
        got = evals.read_hellaswag(str(tmp_path / name))
        assert got == ITEMS
        assert evals.read_hellaswag(str(tmp_path / name), limit=1) == ITEMS[:1]


@pytest.mark.parametrize("lines, fragment", [
    (["ctx", "1", "a", "b", "c"], "not a positive multiple of 6"),
    (["ctx", "4", "a", "b", "c", "d"], ":2: the gold label must be 0-3"),
    (["ctx", "1", "a", "b", "", "d"], ":5: empty ending"),
    ([" ", "1", "a", "b", "c", "d"], ":1: empty context"),
])
def test_read_hellaswag_errors(tmp_path, lines, fragment):
    (tmp_path / "h.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(EvalError, match=fragment):
        evals.read_hellaswag(str(tmp_path / "h.txt"))


@pytest.mark.parametrize("batch", [1, 2])
def test_hellaswag_scores_equal_explicit_loop(batch):
    model, enc = tiny(), ByteTok()
    sums, ntok = evals.hellaswag_scores(model, enc, ITEMS, batch)
    want = torch.tensor([[explicit_logprob(model, enc.encode_ordinary(it.ctx), enc.encode_ordinary(" " + e))
                          for e in it.endings] for it in ITEMS], dtype=torch.float64)
    # one unpadded forward per ending vs padded batches: float32 logits differ in the last bits
    torch.testing.assert_close(sums, want, rtol=0, atol=1e-4)
    assert ntok.tolist() == [[len(e) + 1 for e in it.endings] for it in ITEMS]  # bytes, with the leading space
    nchar = torch.tensor([[len(e) for e in it.endings] for it in ITEMS], dtype=torch.float64)
    gold = [it.label for it in ITEMS]
    hand = {"hellaswag_acc": want, "hellaswag_acc_norm": want / nchar, "hellaswag_acc_norm_tok": want / ntok}
    got = evals.hellaswag_metrics(ITEMS, sums, ntok)
    for key, score in hand.items():
        preds = [max(range(4), key=lambda j: (score[i, j].item(), -j)) for i in range(len(ITEMS))]
        assert got[key] == sum(p == g for p, g in zip(preds, gold)) / len(ITEMS), key
    assert got["hellaswag_n"] == 2


def test_hellaswag_metrics_hand_numbers():
    # endings of 1, 10, 4, 4 characters and 1, 2, 8, 4 tokens: the sums pick ending 0, per character 1, per token 2
    endings = ["a", "b" * 10, "cccc", "dddd"]
    items = [HellaSwagItem("c", g, endings) for g in (0, 1, 1)]
    sums = torch.tensor([[-2.0, -5.0, -6.0, -4.5]] * 3, dtype=torch.float64)
    ntok = torch.tensor([[1.0, 2.0, 8.0, 4.0]] * 3, dtype=torch.float64)
    got = evals.hellaswag_metrics(items, sums, ntok)
    assert got["hellaswag_acc"] == pytest.approx(1 / 3)
    assert got["hellaswag_acc_norm"] == pytest.approx(2 / 3)
    assert got["hellaswag_acc_norm_tok"] == 0.0
    tie = evals.hellaswag_metrics(items[:1], torch.full((1, 4), -1.0, dtype=torch.float64), ntok[:1])
    assert tie["hellaswag_acc"] == 1.0  # a tie goes to the lowest index


def test_context_longer_than_the_model_keeps_its_last_tokens():
    model, enc = tiny(block=32), ByteTok()
    ctx, cont = enc.encode_ordinary("a long context " * 5), enc.encode_ordinary(" end.")
    got = evals.completion_logprobs(model, [(ctx, cont), (ctx[:5], cont)], batch_rows=2)
    torch.testing.assert_close(got[0].item(), explicit_logprob(model, ctx[-(33 - len(cont)):], cont),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1].item(), explicit_logprob(model, ctx[:5], cont), rtol=0, atol=1e-4)


def test_random_model_scores_near_chance():
    """Gold labels are drawn independently of everything the model sees, so the number right is Binomial(n, 1/4)
    whatever the model prefers: with n = 300, sd = sqrt(300 * 1/4 * 3/4) / 300 = 2.5 points, and 5 sd (12.5
    points) is crossed with probability < 1e-6. A scorer that peeks at the label lands far outside."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghij klmnopqrstuvwxyz"))

    def text(lo, hi):
        return "".join(rng.choice(letters, rng.integers(lo, hi))).strip() or "z"

    items = [HellaSwagItem(text(10, 30), int(rng.integers(4)), [text(3, 15) for _ in range(4)]) for _ in range(300)]
    got = evals.hellaswag(tiny(seed=1), ByteTok(), items, batch=32)
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_acc_norm_tok"):
        assert abs(got[key] - 0.25) < 0.125, (key, got[key])


# ----------------------------------------------------------------------------------------------------------------
# GSM8K

@pytest.mark.parametrize("text, want", [
    ("The answer is 18.", "18"), ("#### 1,234", "1234"), ("It costs $3.50 each", "3.5"), ("3.50", "3.5"),
    ("18.00 dollars", "18"), ("-7 degrees", "-7"), ("16-3-4=9", "9"), ("So 5-3", "3"), ("x = -5", "-5"),
    ("a total of 1,000,000.", "1000000"), ("3,4", "4"), ("1,2345", "2345"), (".5 cups", "0.5"),
    ("2 \u2212 5 = \u22123", "-3"), ("(2)-3", "3"), ("total: -12.50 kg", "-12.5"), ("10% more", "10"),
    ("12:30 pm", "30"), ("no number here", None), ("", None), ("version 1.2.3", "3"), ("0.25", "0.25"),
])
def test_extract_number(text, want):
    assert evals.extract_number(text) == want


def test_gsm8k_correct_and_stops():
    answer = "He sells 9 * 2 = $<<9*2=18>>18.\n#### 1,800"
    assert evals.gsm8k_reference(answer) == "1800"
    assert evals.gsm8k_correct(" He makes $1,800.00 a day.", answer)
    assert not evals.gsm8k_correct(" He makes 18 dollars.", answer)
    assert not evals.gsm8k_correct(" no idea", answer)
    assert evals.cut_at_stop(" 5 + 3 = 8\n#### 8\n\nQuestion: what is 9?") == " 5 + 3 = 8\n#### 8"
    assert evals.cut_at_stop(" 8 Question: 9") == " 8 "
    assert evals.shot_text({"question": "q?", "answer": "2+2=<<2+2=4>>4\n#### 4"}) == \
        "Question: q?\nAnswer: 2+2=4\n#### 4\n\n"


def test_gsm8k_prompt_keeps_the_shots_that_fit():
    enc = ByteTok()
    shots = [{"question": "a" * 20, "answer": "#### 1"}, {"question": "b" * 20, "answer": "#### 2"}]
    full, kept = evals.gsm8k_prompt(enc, "q?", shots, budget=1000)
    assert kept == 2 and enc.decode(full).startswith("Question: aaaa") and enc.decode(full).endswith(
        "Question: q?\nAnswer:")
    one_len = len(evals.shot_text(shots[0]) + "Question: q?\nAnswer:")
    ids, kept = evals.gsm8k_prompt(enc, "q?", shots, budget=one_len)
    assert kept == 1 and len(ids) == one_len and "bbbb" not in enc.decode(ids)
    ids, kept = evals.gsm8k_prompt(enc, "q" * 100, shots, budget=30)
    assert kept == 0 and len(ids) == 30 and enc.decode(ids).endswith("\nAnswer:")


def test_greedy_complete_equals_generate_with_stops():
    """Batched greedy decoding with rows leaving the batch equals model.generate(temperature=0) per prompt,
    cut at the first stop. The stop is a byte one row generates early, so rows finish at different steps."""
    model, max_new = tiny(), 12
    prompts = [list(b"abcdefgh"), list(b"hgfedcba"), list(b"zzzzzzzz")]
    ref = [model.generate(torch.tensor([p]), max_new, temperature=0)[0, len(p):].tolist() for p in prompts]
    stop = ref[0][2]
    got = evals.greedy_complete(model, prompts, max_new, lambda t: bytes([t]), stops=[bytes([stop])])
    want = [r[:r.index(stop) + 1] if stop in r else r for r in ref]
    assert got == want
    assert len({len(w) for w in want}) > 1  # rows did leave the batch at different steps


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is much faster than two fighting over a loaded machine's cores (as test_rl.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def spread(model, std=0.1):
    """Weights redrawn N(0, std): at GPT-2's init a random model mostly repeats one byte, so every comparison of two
    decoders would hold trivially (as tests/test_decode.py does)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name and p.dim() > 1:
                p.normal_(0.0, std)
    return model


def old_gsm8k_completions(model, prompts, batch, max_new, token_bytes, eot, stops):
    """evals.gsm8k's generation before left padding: equal-length groups, longest first, greedy_complete."""
    by_len, out = {}, {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for n in sorted(by_len, reverse=True):
        g = by_len[n]
        for s in range(0, len(g), batch):
            rows = g[s:s + batch]
            out.update(zip(rows, evals.greedy_complete(model, [prompts[i] for i in rows], max_new, token_bytes, eot,
                                                       stops)))
    return out


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("use_eot", [False, True])
def test_gsm8k_left_padded_batches_equal_the_length_groups(use_eot):
    """GSM8K's generation in left-padded batches of mixed lengths (longest first) = the old equal-length batches,
    token for token per prompt (fp32, CPU), with rows stopping at a stop string (and at EOT) at different steps;
    the rank split covers every prompt once."""
    model, tb, max_new = spread(tiny()), ByteTok().decode_single_token_bytes, 16
    texts = ["abc", "Tom has 3 apples.", "Tom has 9 apples.", "x", "How many?", "Question: 12 + 30 =", "qq", "abc"]
    prompts = [list(t.encode()) for t in texts]
    alone = [model.generate(torch.tensor([p]), max_new, temperature=0)[0, len(p):].tolist() for p in prompts]
    assert len({tuple(a) for a in alone}) == len(set(texts))  # distinct, not degenerate
    stop = alone[1][3]  # a byte prompt 1 emits early: rows stop at different steps, some never
    eot = alone[4][5] if use_eot else None
    stops = [bytes([stop]) + b"\x00", bytes([stop])]  # (the first never occurs: more than one stop)
    old = old_gsm8k_completions(model, prompts, 3, max_new, tb, eot, stops)
    new = evals.gsm8k_completions(model, prompts, 3, max_new, tb, eot, stops)
    assert new == old
    lens = [len(old[i]) for i in range(len(prompts))]
    assert min(lens) < max_new and max(lens) == max_new, lens
    for i, a in enumerate(alone):  # and each equals its prompt decoded alone, cut by the stop rule
        n = evals.stop_length(a, tb, eot, stops)
        assert new[i] == a[:n], i
    assert evals.gsm8k_batches(prompts, 3) == [[5, 1, 2], [4, 0, 7], [6, 3]]  # longest first, mixed lengths
    halves = [evals.gsm8k_completions(model, prompts, 3, max_new, tb, eot, stops, rank=r, world=2) for r in (0, 1)]
    assert sorted(halves[0]) == [1, 2, 3, 5, 6] and {**halves[0], **halves[1]} == new


@pytest.mark.usefixtures("one_thread")
def test_gsm8k_exact_match_unchanged_by_left_padding():
    """gsm8k() end to end: the answers are set from the OLD path's completions (right where they hold a number),
    so the exact match the new path reports must be the fraction of those."""
    model, enc = spread(tiny(block=128, seed=3)), ByteTok()
    with torch.no_grad():  # the final LayerNorm's bias along the digits' embeddings: completions hold numbers
        model.transformer.ln_f.bias += model.transformer.wte.weight[list(b"0123456789\n")].sum(0)
    qs = ["1+1?", "Tom has 3 apples and 4 pears.", "What is 7 * 8, in total?", "9", "How many legs has a cat?"]
    prompts = [evals.gsm8k_prompt(enc, q, [], 128 - 24)[0] for q in qs]
    old = old_gsm8k_completions(model, prompts, 2, 24, enc.decode_single_token_bytes, None, evals.STOPS)
    nums = [evals.extract_number(evals.cut_at_stop(enc.decode(old[i]))) for i in range(len(qs))]
    rows = [{"question": q, "answer": f"#### {n if n is not None else 123456789}"} for q, n in zip(qs, nums)]
    got = evals.gsm8k(model, enc, rows, [], batch=2, max_new=24)
    assert sum(n is not None for n in nums) == 4  # (not a trivial 0 / 5)
    assert got["gsm8k_exact_match"] == pytest.approx(4 / 5)
    assert got["gsm8k_n"] == 5


# ----------------------------------------------------------------------------------------------------------------
# the command line: weights, files, one run, two ranks

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    torch.save(to_hf_state_dict(GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=256))), d / "gpt.bin")
    torch.save(to_hf_state_dict(tiny()), d / "small_vocab.bin")
    write_items(d / "hs.txt", SIX)
    (d / "gsm8k").mkdir()
    rows = [{"question": f"Tom has {a} apples and buys {b}. How many now?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a, b in ((3, 4), (10, 25), (7, 1), (120, 5), (2, 2))]
    for name, part in (("test.jsonl", rows[:4]), ("train.jsonl", rows[4:])):
        (d / "gsm8k" / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    write_shard(str(d / "t_val_000000.bin"), np.random.default_rng(0).integers(0, 50257, 20 * 32 + 1))
    return d


def cli_argv(d, *extra):
    return [f"--init_from={d / 'gpt.bin'}", "--n_head=2", "--tasks=hellaswag,loss,gsm8k", f"--hellaswag={d / 'hs.txt'}",
            f"--data={d / 't_val_000000.bin'}", "--seq_len=32", f"--gsm8k={d / 'gsm8k'}", "--shots=1",
            "--max_new=6", "--batch=3", "--device=cpu", *extra]


def _numbers(record):
    return {k: v for k, v in record.items() if not k.endswith("_time_s") and k != "world"}


def _eval_rank(rank, world, argv, scores_file, port):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the library on its own first, then the script
    got = evals.hellaswag_scores(tiny(), ByteTok(), SIX, batch=1, rank=rank, world=world)
    if rank == 0:
        torch.save(got, scores_file)
    dist.destroy_process_group()
    # a fresh store for the script's process group: on the same port a rank could reach the old store, still closing
    # ("Failed to recv, got 0 bytes", seen in CI)
    os.environ["MASTER_PORT"] = str(port)
    assert eval_cli.main(argv) == 0


SIX = [HellaSwagItem(f"{it.ctx} {k}", (it.label + k) % 4, it.endings) for k in range(3) for it in ITEMS]


def test_two_gloo_ranks_equal_one_process(files, tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert eval_cli.main(cli_argv(files, f"--out={one}")) == 0
    first, second = free_ports(2)
    spawn(_eval_rank, 2, cli_argv(files, f"--out={two}"), str(tmp_path / "scores.pt"), second, port=first)
    sums, ntok = torch.load(tmp_path / "scores.pt")  # 6 batches of one item: 3 on each rank
    want = evals.hellaswag_scores(tiny(), ByteTok(), SIX, batch=1)
    assert torch.equal(sums, want[0]) and torch.equal(ntok, want[1])
    a, b = (json.loads(p.read_text()) for p in (one, two))
    assert (a["world"], b["world"]) == (1, 2)
    # exactly: the same batches, each item's result written by one rank; the loss to fp32 rounding (the Trainer's
    # evaluate averages each round's fp32 batch means over the ranks)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
    assert {k: v for k, v in _numbers(a).items() if k not in ("loss", "ppl")} == \
        {k: v for k, v in _numbers(b).items() if k not in ("loss", "ppl")}
    assert a["hellaswag_n"] == 6 and a["gsm8k_n"] == 4 and a["loss_tokens"] == 20 * 32
    assert a["gsm8k_shots"] == 1 and 0 <= a["hellaswag_acc"] <= 1
    assert b["ppl"] == pytest.approx(math.exp(b["loss"]))
    assert abs(b["loss"] - math.log(50257)) < 0.5  # a random model: about uniform over the vocabulary


def test_loss_equals_train_evaluate(tmp_path):
    """The loss of eval.py on a run's checkpoint (its own val shards by default) equals the val_loss that
    train.py's evaluate() logged for the same weights and windows (every val window in whole batches)."""
    d = tmp_path
    toks = np.random.default_rng(0).integers(0, 50257, 4000)
    write_shard(str(d / "s_train_000000.bin"), toks)
    write_shard(str(d / "s_val_000000.bin"), toks[:10 * 2 * 32 + 1])  # 20 windows of 33 = 10 batches of 2
    run = d / "run"
    train.main(["--preset=tiny", "--device=cpu", f"--out_dir={run}", f"--data.dataset={d / 's_*.bin'}",
                "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64",
                "--train.seq_len=32", "--train.micro_batch=2", "--train.steps=2", "--train.val_every=2",
                "--train.val_steps=10", "--train.sample_tokens=0"])
    val = [json.loads(line)["val_loss"] for line in open(run / "metrics.jsonl") if "val_loss" in line][-1]
    out = d / "e.jsonl"
    assert eval_cli.main([f"--out_dir={run}", "--tasks=loss", "--seq_len=32", "--batch=5", f"--out={out}"]) == 0
    rec = json.loads(out.read_text())
    assert rec["step"] == 2 and rec["loss_tokens"] == 20 * 32
    # per-token losses summed in float64 here, float32 batch means averaged there: measured 8e-8 apart (relative)
    assert rec["loss"] == pytest.approx(val, rel=1e-6)


def _small_cases(d):
    hs_bad = d / "bad.txt"
    hs_bad.write_text("ctx\n1\na\nb\nc\n")
    gs_bad = d / "gsbad"
    gs_bad.mkdir(exist_ok=True)
    (gs_bad / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    gs_noshots = d / "gsnoshots"
    gs_noshots.mkdir(exist_ok=True)
    (gs_noshots / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    big = d / "big_val.bin"
    write_shard(str(big), np.full(100, 60000))
    src = [f"--init_from={d / 'gpt.bin'}", "--n_head=2", "--device=cpu", f"--hellaswag={d / 'hs.txt'}"]  # the
    # bad key comes last (the last one wins), and a case that is not rejected runs on 6 items, not 10,042
    return [
        (["positional"], "look like --key=value"),
        ([*src, "--foo=1"], "unknown key --foo"),
        ([*src, "--batchh=2"], "did you mean --batch?"),
        ([*src, "--batch=x"], "--batch expects an integer"),
        ([*src, "--batch=0"], "--batch must be >= 1"),
        ([*src, "--limit=-1"], "--limit must be >= 0"),
        ([*src, "--tasks=hellaswag,hellaswg"], "did you mean hellaswag?"),
        ([*src, "--device=tpu"], "--device must be"),
        ([*src, "--dtype=fp8"], "--dtype must be"),
        ([], "nothing to evaluate"),
        ([*src, "--out_dir=x"], "not both"),
        (["--out_dir=/nonexistent/run"], "no such run"),
        (["--init_from=/nonexistent.bin"], "no file /nonexistent.bin"),
        (["--ckpt=x", "--n_head=2"], "--n_head applies to --init_from only"),
        ([*src, "--hellaswag=/nonexistent.txt"], "no HellaSwag file /nonexistent.txt"),
        ([*src, f"--hellaswag={hs_bad}"], "not a positive multiple of 6"),
        ([*src, f"--hellaswag={d}"], "holds none of hellaswag_val_full"),
        ([*src, "--tasks=gsm8k", f"--gsm8k={gs_bad}"], ":2: not JSON"),
        ([*src, "--tasks=gsm8k", f"--gsm8k={gs_noshots}"], "--shots=5 takes worked examples from"),
        ([*src, "--tasks=gsm8k", f"--gsm8k={d / 'gsm8k'}", "--max_new=256"], "--max_new=256 leaves no room"),
        ([*src, "--tasks=loss"], "--tasks=loss needs --data"),
        ([*src, "--tasks=loss", "--data=/nonexistent/*.bin"], "--data: no files match"),
        ([*src, "--tasks=loss", f"--data={big}", "--seq_len=32"], "token id 60000 >= the model's vocab_size"),
        ([*src, "--tasks=loss", f"--data={big}", "--seq_len=1000"], "--seq_len=1000 exceeds"),
        ([f"--init_from={d / 'small_vocab.bin'}", "--n_head=2", f"--hellaswag={d / 'hs.txt'}"],
         "this model has vocab_size 256"),
    ] + ([] if torch.cuda.is_available() else [([*src, "--device=cuda"], "no CUDA GPU")])


def test_every_user_error_is_one_line_and_exit_2(files, capsys):
    for argv, fragment in _small_cases(files):
        assert eval_cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert fragment in err, (argv, err)


def test_script_exit_code_and_help(files):
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "eval.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)  # both at once: each imports torch (~3 s)
             for args in (["--tasks=mmlu", f"--init_from={files / 'gpt.bin'}"], ["--help"])]
    try:
        (out, err), (help_out, _) = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 2 and out == "" and err.count("\n") == 1 and "unknown task" in err
    assert procs[1].returncode == 0 and "--tasks=LIST" in help_out
