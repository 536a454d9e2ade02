"""Evaluation tasks on a single-device GPT: HellaSwag, held-out loss and perplexity, GSM8K exact match.

HellaSwag (Zellers et al. 2019), completion scoring as lm-eval-harness and llm.c do it: each of an item's 4 endings
is scored by the sum of its tokens' log-probabilities given the context; the ending is encoded as " " + ending,
apart from the context. acc takes the largest sum; acc_norm divides each sum by the ending's length in characters
(lm-eval-harness's acc_norm: a unit every tokenizer shares); acc_norm_tok by its length in tokens (llm.c's
acc_norm). Ties go to the lowest index. Input: llama.cpp's 6-lines-per-task text (klosax/hellaswag_text_data); a
context that does not fit the model keeps its last tokens.
Loss: mean next-token cross-entropy over windows of T+1 tokens taken with stride T from each token stream (a shard,
or a text file tokenized with an EOT in front): data.py's windows, every token a target once; ppl = exp(loss);
loss_batches cuts them, eval.py scores them with the Trainer's evaluate (the same loss as train.py's val_loss).
GSM8K (Cobbe et al. 2021): "Question: q\\nAnswer:" after `shots` worked examples ("<<...>>" calculator notes
removed), greedy decoding with stops (greedy.py); exact match compares extract_number() of the completion and of
the reference's "#### N".

Batches and ranks: requests are sorted by length, longest first (an out-of-memory batch fails at once), cut into
batches, and batch k goes to data-parallel rank k % world. Scoring tasks run the same number of forwards on every
rank (a throwaway one where a rank has no batch left), so engines that gather weights in forward hooks stay in
step; generation does not. Per-item results go into a zero vector that is all-reduced (sum) over `group`: the
numbers equal one process's with the same batch size, exactly. Every task sets model.eval() and restores the mode.

Callers: eval.py (command line), train.py (hellaswag between steps), tasks.py; tested by tests/test_eval.py.
"""
from __future__ import annotations

import bz2
import contextlib
import dataclasses
import json
import os
import re
from decimal import Decimal

import numpy as np
import torch
import torch.distributed as dist

from nanopara.greedy import STOPS, device_of, eval_mode, greedy_complete_padded
from nanopara.greedy import greedy_complete, stop_length  # noqa: F401  (tests/test_eval.py calls them as evals.*)

HELLASWAG_URL = "https://raw.githubusercontent.com/klosax/hellaswag_text_data/main/hellaswag_val_full.txt"
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
PAD_MULTIPLE = 32  # sequence lengths rounded up: fewer distinct shapes for the kernels' autotuners


class EvalError(ValueError):
    """A user mistake (a missing or malformed eval file, a model that cannot run a task): one line."""


# ----------------------------------------------------------------------------------------------------------------
# data files

@dataclasses.dataclass
class HellaSwagItem:
    ctx: str
    label: int
    endings: list


def read_hellaswag(path: str, limit: int = 0) -> list[HellaSwagItem]:
    """Items of llama.cpp's format (6 lines each: context, gold label 0-3, 4 endings), .txt or .txt.bz2."""
    try:
        with (bz2.open if path.endswith(".bz2") else open)(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise EvalError(f"cannot read HellaSwag file {path}: {type(e).__name__}: {e}") from None
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    if not lines or len(lines) % 6:
        raise EvalError(f"{path}: {len(lines)} lines, not a positive multiple of 6 (llama.cpp's HellaSwag format: "
                        f"context, label 0-3, 4 endings per task)")
    items = []
    for i in range(0, len(lines), 6):
        ctx, label, *endings = lines[i:i + 6]
        if label.strip() not in ("0", "1", "2", "3"):
            raise EvalError(f"{path}:{i + 2}: the gold label must be 0-3, got {label[:40]!r}")
        if not ctx.strip():
            raise EvalError(f"{path}:{i + 1}: empty context")
        for j, text in enumerate(endings):
            if not text.strip():
                raise EvalError(f"{path}:{i + 3 + j}: empty ending")
        items.append(HellaSwagItem(ctx, int(label), endings))
        if len(items) == limit:
            break
    return items


def read_gsm8k(path: str, limit: int = 0) -> list[dict]:
    """{"question", "answer"} rows of GSM8K's JSONL; the answer ends with "#### N"."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                        and isinstance(row.get("answer"), str)):
                    raise EvalError(f"{path}:{n}: a GSM8K row needs string fields \"question\" and \"answer\"")
                if "####" not in row["answer"] or extract_number(row["answer"].split("####")[-1]) is None:
                    raise EvalError(f"{path}:{n}: the answer has no \"#### N\" final number")
                rows.append(row)
                if len(rows) == limit:
                    break
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"cannot read GSM8K file {path}: {type(e).__name__}: {e}") from None
    if not rows:
        raise EvalError(f"{path}: no GSM8K rows")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# shared machinery: rank slices, the all-reduce, the progress callback

def _my_batches(n_batches: int, rank: int, world: int) -> list:
    """Batch indices of this rank (k % world == rank), padded with None to the longest rank's count (lockstep)."""
    slots = -(-n_batches // world)
    return [k if k < n_batches else None for k in range(rank, slots * world, world)]


def _all_sum(t: torch.Tensor, world: int, group, device) -> torch.Tensor:
    """Sum of a CPU tensor over the ranks (each filled its own entries, zeros elsewhere: the sum is exact)."""
    if world > 1:
        d = t.to(device)
        dist.all_reduce(d, group=group)
        t = d.cpu()
    return t


# ----------------------------------------------------------------------------------------------------------------
# completion scoring (HellaSwag; any multiple-choice task)

@torch.no_grad()
def completion_logprobs(model, requests: list, batch_rows: int, *, rank=0, world=1, group=None,
                        amp=contextlib.nullcontext, progress=None) -> torch.Tensor:
    """(R,) float64: sum of log p(cont | ctx) over each (ctx tokens, cont tokens) pair, the same on every rank.
    A pair longer than the context + 1 keeps its last block_size + 1 tokens (the continuation must fit)."""
    dev, T, V = device_of(model), model.cfg.block_size, model.cfg.vocab_size
    for ctx, cont in requests:
        if not 1 <= len(cont) <= T:
            raise EvalError(f"a continuation of {len(cont)} tokens cannot be scored in a context of {T}")
        if len(ctx) < 1:
            raise EvalError("a request needs at least one context token")
    order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i])))  # stable: ties keep file order
    batches = [order[i:i + batch_rows] for i in range(0, len(order), batch_rows)]
    out = torch.zeros(len(requests), dtype=torch.float64)
    mine = _my_batches(len(batches), rank, world)
    done, total = 0, sum(len(batches[k]) for k in mine if k is not None)
    with eval_mode(model):
        for k in mine:
            if k is None:  # lockstep: a throwaway forward
                with amp():
                    model(torch.zeros(1, 1, dtype=torch.long, device=dev))
                continue
            rows = [(requests[i][0] + requests[i][1])[-(T + 1):] for i in batches[k]]
            L = max(len(r) for r in rows) - 1
            L = min(-(-L // PAD_MULTIPLE) * PAD_MULTIPLE, T)
            x = torch.zeros(len(rows), L, dtype=torch.long)  # right padding: causal, so earlier positions ignore it
            y = torch.full((len(rows), L), -1, dtype=torch.long)  # targets; -1 = not scored
            for r, (seq, i) in enumerate(zip(rows, batches[k])):
                n, c = len(seq) - 1, len(requests[i][1])
                x[r, :n] = torch.tensor(seq[:-1])
                y[r, n - c:n] = torch.tensor(seq[-c:])  # position t predicts token t + 1
            y = y.to(dev)
            with amp():
                logits, _ = model(x.to(dev))  # (B, L, Vp)
            mask = y >= 0
            lp = torch.log_softmax(logits[mask][:, :V].float(), dim=-1)  # (M, V): scored positions only
            tok = torch.zeros(mask.shape, dtype=torch.float64, device=dev)
            tok[mask] = lp.gather(1, y[mask][:, None]).squeeze(1).double()
            out[batches[k]] = tok.sum(1).cpu()  # a row's sum in position order: deterministic
            done += len(rows)
            if progress:
                progress(done, total)
    return _all_sum(out, world, group, dev)


def hellaswag_scores(model, enc, items: list, batch: int = 16, **dist_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """((N, 4) summed log-probabilities of the endings, (N, 4) their lengths in tokens); batch = items per forward."""
    reqs = []
    for it in items:
        ctx = enc.encode_ordinary(it.ctx)
        reqs += [(ctx, enc.encode_ordinary(" " + e)) for e in it.endings]
    if dist_kw.get("progress"):  # counted in items, not rows (an item's 4 rows may sit in different batches)
        bar = dist_kw["progress"]
        dist_kw["progress"] = lambda done, total: bar(done // 4, total // 4)
    sums = completion_logprobs(model, reqs, 4 * batch, **dist_kw).view(len(items), 4)
    ntok = torch.tensor([len(c) for _, c in reqs], dtype=torch.float64).view(len(items), 4)
    return sums, ntok


def hellaswag_metrics(items: list, sums: torch.Tensor, ntok: torch.Tensor) -> dict:
    """acc (sum), acc_norm (per character of the ending), acc_norm_tok (per token): argmax, lowest index on ties."""
    nchar = torch.tensor([[len(e) for e in it.endings] for it in items], dtype=torch.float64)
    gold = torch.tensor([it.label for it in items])
    out = {}
    for name, score in (("acc", sums), ("acc_norm", sums / nchar), ("acc_norm_tok", sums / ntok)):
        out[f"hellaswag_{name}"] = (score.argmax(1) == gold).double().mean().item()  # argmax: first maximum
    out["hellaswag_n"] = len(items)
    return out


def hellaswag(model, enc, items: list, batch: int = 16, **dist_kw) -> dict:
    """{"hellaswag_acc", "hellaswag_acc_norm", "hellaswag_acc_norm_tok", "hellaswag_n"}; dist_kw: rank, world,
    group (data-parallel), amp (a context factory), progress (callback(done, total) of this rank's rows)."""
    return hellaswag_metrics(items, *hellaswag_scores(model, enc, items, batch, **dist_kw))


# ----------------------------------------------------------------------------------------------------------------
# loss and perplexity

@torch.no_grad()
def loss_batches(streams: list, seq_len: int, batch: int, limit: int, vocab_size: int, block_size: int) -> list:
    """The loss task's windows of seq_len + 1 tokens (stride seq_len, every token a target once) of each 1-D token
    array (a shard memmap, an encoded text), the first `limit` (0: all), in batches [[(stream, start)]] of `batch`
    windows; eval.py scores them with the Trainer's evaluate. Token ids must be < vocab_size (EvalError)."""
    if not 1 <= seq_len <= block_size:
        raise EvalError(f"seq_len={seq_len} must be in [1, the model's context {block_size}]")
    windows = [(s, w * seq_len) for s, toks in enumerate(streams) for w in range(max(len(toks) - 1, 0) // seq_len)]
    windows = windows[:limit] if limit else windows
    if not windows:
        raise EvalError(f"no window of seq_len+1={seq_len + 1} tokens in {sum(map(len, streams))} tokens")
    top = max(int(np.max(t)) for t in streams if len(t))  # checked on every rank before any batch: no rank waits
    if top >= vocab_size:                                  # in a collective for one that failed
        raise EvalError(f"token id {top} >= the model's vocab_size {vocab_size} (data of another tokenizer?)")
    return [windows[i:i + batch] for i in range(0, len(windows), batch)]


def window_batch(streams: list, windows: list, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (B, seq_len) on the host: the windows' tokens and their next tokens."""
    xy = torch.from_numpy(np.stack([np.asarray(streams[s][a:a + seq_len + 1], dtype=np.int64) for s, a in windows]))
    return xy[:, :-1], xy[:, 1:]


# ----------------------------------------------------------------------------------------------------------------
# GSM8K: answer extraction, prompts, batches over ranks

# thousands in groups of three ("1,234,567"; "3,4" and "1,2345" are two numbers each), an optional decimal part,
# ".5" too (not after a digit: "1.2.3" is 1.2 and 3)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?(?<!\d)\.\d+")


def extract_number(text: str) -> str | None:
    """The last number in text, canonical: commas dropped, "$" and units ignored, a minus kept unless it follows a
    letter, digit or closing bracket (then it is a subtraction or a hyphen: "16-3" is 16 and 3), trailing decimal
    zeros dropped ("3.50" -> "3.5", "18.00" -> "18"); None if there is none. A Unicode minus counts as "-"."""
    text = text.replace("\u2212", "-")
    found = list(_NUMBER.finditer(text))
    if not found:
        return None
    m = found[-1]
    num = m.group()
    if num.startswith("-") and m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] in ")]"):
        num = num[1:]
    d = Decimal(num.replace(",", ""))
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def gsm8k_reference(answer: str) -> str | None:
    """The number after the reference solution's last "####"."""
    return extract_number(answer.split("####")[-1])


def gsm8k_correct(completion: str, answer: str) -> bool:
    pred = extract_number(completion)
    return pred is not None and pred == gsm8k_reference(answer)



def cut_at_stop(text: str) -> str:
    cut = min([text.find(s) for s in STOPS if s in text], default=len(text))
    return text[:cut]


def shot_text(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer: {re.sub(r'<<[^>]*>>', '', row['answer']).strip()}\n\n"


def gsm8k_prompt(enc, question: str, shots: list, budget: int) -> tuple[list, int]:
    """(prompt tokens, shots kept): the most of `shots` (kept from the first) that fit in `budget` tokens; with
    none fitting, the question alone keeps its last `budget` tokens."""
    tail = f"Question: {question}\nAnswer:"
    for j in range(len(shots), -1, -1):
        ids = enc.encode_ordinary("".join(shot_text(s) for s in shots[:j]) + tail)  # one encoding: BPE merges
        if len(ids) <= budget:                                                       # across the joins stay right
            return ids, j
    return ids[-budget:], 0


def gsm8k_batches(prompts: list, batch: int) -> list:
    """Batches of prompt indices: longest prompts first (stable), `batch` rows each, lengths mixed (left padding)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def gsm8k_completions(model, prompts: list, batch: int, max_new: int, token_bytes, eot: int | None = None,
                      stops=STOPS, *, rank=0, world=1, amp=contextlib.nullcontext, progress=None) -> dict:
    """{prompt index: new token ids} of this rank's batches (gsm8k_batches; batch k on rank k % world), greedy with
    greedy_complete_padded; the caches have one slot count for every batch (the longest prompt + max_new), so one
    decoder serves all batches of `batch` rows."""
    batches = gsm8k_batches(prompts, batch)
    slots = max(map(len, prompts)) + max_new
    mine = [k for k in _my_batches(len(batches), rank, world) if k is not None]
    done, total = 0, sum(len(batches[k]) for k in mine)
    out = {}
    for k in mine:
        outs = greedy_complete_padded(model, [prompts[i] for i in batches[k]], max_new, token_bytes, eot, stops,
                                      amp=amp, max_len=slots)
        out.update(zip(batches[k], outs))
        done += len(batches[k])
        if progress:
            progress(done, total)
    return out


def gsm8k(model, enc, rows: list, shots: list = (), batch: int = 16, max_new: int = 256, *, rank=0, world=1,
          group=None, amp=contextlib.nullcontext, progress=None) -> dict:
    """{"gsm8k_exact_match", "gsm8k_n", "gsm8k_shots_dropped"} (items whose prompt fit fewer than all shots);
    prompts sorted longest first and left-padded into batches of `batch` rows, batch k on rank k % world."""
    T = model.cfg.block_size
    if not 1 <= max_new < T:
        raise EvalError(f"max_new={max_new} must be in [1, the model's context {T}) to leave room for a question")
    prompts = [gsm8k_prompt(enc, r["question"], list(shots), T - max_new) for r in rows]
    if max(max(ids) for ids, _ in prompts) >= model.cfg.vocab_size:
        raise EvalError(f"the prompts hold token ids >= the model's vocab_size {model.cfg.vocab_size}")
    correct = torch.zeros(len(rows), dtype=torch.float64)
    eot = getattr(enc, "eot_token", None)
    outs = gsm8k_completions(model, [ids for ids, _ in prompts], batch, max_new, enc.decode_single_token_bytes, eot,
                             rank=rank, world=world, amp=amp, progress=progress)
    for i, new in outs.items():
        text = cut_at_stop(enc.decode([t for t in new if t != eot]))
        correct[i] = float(gsm8k_correct(text, rows[i]["answer"]))
    correct = _all_sum(correct, world, group, device_of(model))
    return {"gsm8k_exact_match": correct.mean().item(), "gsm8k_n": len(rows),
            "gsm8k_shots_dropped": sum(j < len(shots) for _, j in prompts)}


# ----------------------------------------------------------------------------------------------------------------
# where the files are

def find_eval_file(given: str, mirror: str | None, sub: str, names: tuple, what: str, how: str) -> str:
    """`given` (a file, or a folder holding one of `names`), else <mirror>/eval/<sub>/<name>."""
    if given:
        if os.path.isdir(given):
            for n in names:
                if os.path.isfile(os.path.join(given, n)):
                    return os.path.join(given, n)
            raise EvalError(f"{given} holds none of {', '.join(names)}")
        if not os.path.isfile(given):
            raise EvalError(f"no {what} file {given}")
        return given
    for n in names:
        if mirror and os.path.isfile(os.path.join(mirror, "eval", sub, n)):
            return os.path.join(mirror, "eval", sub, n)
    raise EvalError(f"no {what} file: set NANOPARA_MIRROR to a mirror holding eval/{sub}/{names[0]}, or {how}")
