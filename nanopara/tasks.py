"""Tasks with verifiable answers for SFT and RL: synthetic arithmetic, sorting, counting, and GSM8K.

    examples = make_examples("arith", n=1000, split="train", seed=0)   # [Example(prompt, response, answer)]
    reward = TASKS["arith"].check(" 405, I think", "405")                # 1.0
    python -m nanopara.tasks arith --n=50000 --split=train --seed=0 --out=arith_train.jsonl

An Example is a prompt (the user's text; sft.format_prompt wraps it), the correct response (the text SFT trains on,
starting with a space) and the answer its checker compares against.
  arith   "What is 348+57?" -> " 405": a+b or a-b, operands uniform in [0, 1000)
  digits  "What is 3 4 8 + 5 7?" -> " 4 0 5": arith one digit per token (GPT-2's BPE chunks numbers unevenly)
  sort    "Sort: 5 2 9 1" -> " 1 2 5 9": 3-8 digits, ascending
  count   "How many times does 3 appear in 3 1 3 7 3?" -> " 3": 5-12 digits
  gsm8k   GSM8K's question -> its worked solution ("<<...>>" calculator notes removed), answer = the final number
Splits: a synthetic example is held out (split "test") iff sha1 of its prompt is 0 mod 10 (train and test disjoint
for every seed and n; distinct prompts from random.Random(seed)); GSM8K's are its train/test.jsonl, sampled. Scores
use one held-out set, make_examples(task, n, "test", TEST_SEED), whatever the training seeds.
Checker rules (reward 1.0 or 0.0), applied to the completion cut at the first newline ("\\n"; GSM8K: at a blank
line or "Question:"/"User:", since its solutions span lines):
  arith, count  the first number of the text equals the answer (commas in groups of three and trailing decimal
                zeros allowed: "1,234.0" = 1234; leading/trailing whitespace and any text after the number ignored)
  digits        as arith, after single spaces between digits (and after a leading minus) are closed up: "- 1 1 8"
  sort          the integers of the text, in order, equal the answer's (separators free: "1, 2, 5, 9" counts)
  gsm8k         the last number of the text equals the answer (evals.extract_number: GSM8K's usual rule)
JSONL lines carry "text" = format_prompt(prompt) + response too. Callers: rl.py, bench/post_train_demo.py, tests.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import sys
from typing import Callable

from nanopara import evals
from nanopara.cli import parse_flags
from nanopara.config import ConfigError
from nanopara.data import default_mirror
from nanopara.sft import format_prompt

HELD_OUT = 10  # one synthetic prompt in 10 (by hash) is test-only
TEST_SEED = 1337  # the held-out set every score uses (rl.py, bench/post_train_demo.py): no training seed moves it


@dataclasses.dataclass
class Example:
    prompt: str
    response: str
    answer: str


# ----------------------------------------------------------------------------------------------------------------
# checkers

_INT = re.compile(r"-?\d+")


def first_line(completion: str) -> str:
    return completion.split("\n", 1)[0]


def first_number(text: str) -> str | None:
    """The first number of text, canonical as evals.extract_number writes it ("1,234.50" -> "1234.5")."""
    m = evals._NUMBER.search(text)  # the same number syntax as GSM8K's extraction
    return evals.extract_number(text[:m.end()]) if m else None


def check_number(completion: str, answer: str) -> float:
    got = first_number(first_line(completion))
    return float(got is not None and got == answer)


_SPACED = re.compile(r"(?<=[\d-]) (?=\d)")


def check_digits(completion: str, answer: str) -> float:
    return check_number(_SPACED.sub("", first_line(completion)), answer)


def check_sorted(completion: str, answer: str) -> float:
    return float(_INT.findall(first_line(completion)) == answer.split())


def check_gsm8k(completion: str, answer: str) -> float:
    text = evals.cut_at_stop(completion).split("User:")[0]
    got = evals.extract_number(text)
    return float(got is not None and got == answer)


# ----------------------------------------------------------------------------------------------------------------
# generators: one example from a random.Random

def gen_arith(rng: random.Random) -> Example:
    a, b, op = rng.randrange(1000), rng.randrange(1000), rng.choice("+-")
    c = a + b if op == "+" else a - b
    return Example(f"What is {a}{op}{b}?", f" {c}", str(c))


def spaced(n: int) -> str:
    return " ".join(str(n))  # -118 -> "- 1 1 8"


def gen_digits(rng: random.Random) -> Example:
    a, b, op = rng.randrange(1000), rng.randrange(1000), rng.choice("+-")
    c = a + b if op == "+" else a - b
    return Example(f"What is {spaced(a)} {op} {spaced(b)}?", " " + spaced(c), str(c))


def gen_sort(rng: random.Random) -> Example:
    xs = [rng.randrange(10) for _ in range(rng.randint(3, 8))]
    ys = " ".join(map(str, sorted(xs)))
    return Example("Sort: " + " ".join(map(str, xs)), " " + ys, ys)


def gen_count(rng: random.Random) -> Example:
    xs = [rng.randrange(10) for _ in range(rng.randint(5, 12))]
    d = rng.choice(xs) if rng.random() < 0.8 else rng.randrange(10)  # sometimes absent: the answer 0
    n = xs.count(d)
    return Example(f"How many times does {d} appear in {' '.join(map(str, xs))}?", f" {n}", str(n))


@dataclasses.dataclass
class Task:
    name: str
    check: Callable[[str, str], float]  # (completion, answer) -> 1.0 or 0.0
    gen: Callable[[random.Random], Example] | None  # None: read from files (GSM8K)


TASKS = {t.name: t for t in (Task("arith", check_number, gen_arith), Task("digits", check_digits, gen_digits),
                             Task("sort", check_sorted, gen_sort),
                             Task("count", check_number, gen_count), Task("gsm8k", check_gsm8k, None))}


def split_of(prompt: str) -> str:
    return "test" if int(hashlib.sha1(prompt.encode()).hexdigest(), 16) % HELD_OUT == 0 else "train"


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def make_examples(name: str, n: int, split: str = "train", seed: int = 0, gsm8k: str = "") -> list[Example]:
    """n distinct examples of task `name` from `split` (train|test), the same for the same arguments."""
    task = get_task(name)
    if split not in ("train", "test"):
        raise ConfigError(f"split must be train or test, got {split!r}")
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    rng = random.Random(f"{name}/{split}/{seed}")
    if task.gen is None:
        return _gsm8k_examples(n, split, rng, gsm8k)
    seen, out = set(), []
    for _ in range(50 * n + 1000):  # a guard: every task holds far more prompts than any n asked of it
        ex = task.gen(rng)
        if ex.prompt not in seen and split_of(ex.prompt) == split:
            seen.add(ex.prompt)
            out.append(ex)
            if len(out) == n:
                return out
    raise ConfigError(f"task {name} has fewer than {n} distinct {split} prompts (found {len(out)})")


def digest(examples: list[Example]) -> str:
    """A short fingerprint of a list of examples' prompts (sha1, 12 hex digits): which held-out set a score used."""
    return hashlib.sha1("\n".join(ex.prompt for ex in examples).encode()).hexdigest()[:12]


def _gsm8k_examples(n: int, split: str, rng: random.Random, path: str) -> list[Example]:
    file = evals.find_eval_file(path, default_mirror(), "gsm8k", (f"{split}.jsonl",), f"GSM8K {split}",
                                "pass --gsm8k=PATH")
    rows = evals.read_gsm8k(file)
    rows = rng.sample(rows, min(n, len(rows)))
    out = []
    for r in rows:
        solution = re.sub(r"<<[^>]*>>", "", r["answer"]).strip()
        out.append(Example(r["question"].strip(), " " + solution, evals.gsm8k_reference(r["answer"])))
    return out


# ----------------------------------------------------------------------------------------------------------------
# command line: JSONL for SFT (data/prepare.py sft reads prompt/response; text is for data/prepare.py text)

@dataclasses.dataclass
class Args:
    n: int = 1000
    split: str = "train"
    seed: int = 0
    out: str = ""
    gsm8k: str = ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        task, args = argv[0], parse_flags(Args(), argv[1:])
        if not args.out:
            raise ConfigError("--out=FILE.jsonl is required")
        examples = make_examples(task, args.n, args.split, args.seed, args.gsm8k)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            for ex in examples:
                f.write(json.dumps({**dataclasses.asdict(ex), "text": format_prompt(ex.prompt) + ex.response}) + "\n")
        os.replace(args.out + ".tmp", args.out)
        print(f"wrote {len(examples)} {task} {args.split} examples to {args.out}")
        return 0
    except (ConfigError, evals.EvalError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
