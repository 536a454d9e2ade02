"""Tasks with checkers (nanopara/tasks.py): splits, generated answers, checker edge cases, the JSONL command line."""
import json
import os

import pytest

from nanopara import tasks
from nanopara.config import ConfigError
from nanopara.data import default_mirror
from nanopara.sft import format_prompt

SYNTHETIC = ("arith", "digits", "sort", "count")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_splits_are_disjoint_distinct_and_seeded(name):
    train = tasks.make_examples(name, 2000, "train", seed=0)
    test = tasks.make_examples(name, 300, "test", seed=0)
    other_seed = tasks.make_examples(name, 300, "test", seed=1)
    assert len({e.prompt for e in train}) == 2000 and len({e.prompt for e in test}) == 300
    assert not {e.prompt for e in train} & ({e.prompt for e in test} | {e.prompt for e in other_seed})
    assert tasks.make_examples(name, 300, "test", seed=0) == test  # the same arguments give the same examples
    assert other_seed != test
    assert all(tasks.split_of(e.prompt) == "test" for e in test)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_responses_are_right_and_pass_their_checker(name):
    for e in tasks.make_examples(name, 200, "train", seed=3):
        assert e.response.startswith(" ") and tasks.TASKS[name].check(e.response, e.answer) == 1.0
        prompt = "is " + e.prompt.split("is ", 1)[1].replace(" ", "") if name == "digits" else e.prompt
        nums = [int(x) for x in prompt.replace("?", " ").replace("+", " + ").replace("-", " - ").split()
                if x.lstrip("-").isdigit()]
        if name in ("arith", "digits"):
            a, b = nums
            assert int(e.answer) == (a + b if "+" in e.prompt else a - b)
        elif name == "sort":
            assert [int(x) for x in e.answer.split()] == sorted(nums)
        else:
            d, *xs = nums
            assert int(e.answer) == xs.count(d)


@pytest.mark.parametrize("completion, answer, want", [
    (" 405", "405", 1), ("405", "405", 1), ("  405  \n", "405", 1), (" 405, I think.", "405", 1),
    (" 405\n406", "405", 1),           # only the first line counts
    (" 1,234", "1234", 1), (" 1234.0", "1234", 1), (" 1,234.50", "1234.5", 1),
    (" -12", "-12", 1), (" 12", "-12", 0), (" -12", "12", 0),
    (" 406", "405", 0), (" 4050", "405", 0), (" 40 5", "405", 0), ("", "405", 0), (" none", "405", 0),
    (" The answer is 405", "405", 1),  # the first number, wherever it stands on the line
    (" 404 or 405", "405", 0),         # ... and only the first: listing guesses earns nothing
    ("\n405", "405", 0),               # an empty first line holds no number
    (" 3,4", "3", 1),                  # "3,4" is not a thousands group: the numbers 3 and 4
])
def test_number_checker(completion, answer, want):
    assert tasks.check_number(completion, answer) == want


@pytest.mark.parametrize("completion, answer, want", [
    (" 4 0 5", "405", 1), ("405", "405", 1), (" 4 0 5\n9", "405", 1), (" 4 0 5 is it", "405", 1),
    (" - 1 1 8", "-118", 1), (" -1 1 8", "-118", 1), (" 1 1 8", "-118", 0), (" - 1 1 8", "118", 0),
    (" 4 0 6", "405", 0), (" 4 0 5 0", "405", 0), (" 4  0 5", "405", 0),  # two spaces: the numbers 4 and 5
    (" 4 0", "405", 0), ("", "405", 0), (" 0", "0", 1), (" 1 0 3 4", "1034", 1),
])
def test_digits_checker(completion, answer, want):
    assert tasks.check_digits(completion, answer) == want
    assert tasks.TASKS["digits"].check(completion, answer) == want


def test_one_held_out_set_and_its_digest():
    """Scores use make_examples(task, n, "test", TEST_SEED): the same prompts in every run, whose digest names them
    (rl.py logs it beside each score); another seed draws another set."""
    a, b = (tasks.make_examples("digits", 50, "test", tasks.TEST_SEED) for _ in range(2))
    other = tasks.make_examples("digits", 50, "test", tasks.TEST_SEED + 1)
    assert a == b and tasks.digest(a) == tasks.digest(b) and len(tasks.digest(a)) == 12
    assert tasks.digest(other) != tasks.digest(a) and tasks.digest(a[:49]) != tasks.digest(a)


def test_digits_prompts_are_one_token_per_digit():
    from nanopara.data import get_tokenizer
    enc = get_tokenizer()
    for e in tasks.make_examples("digits", 50, "train", seed=4):
        for text in (e.prompt.split("is ", 1)[1], e.response):
            assert all(len(enc.decode([t]).strip()) <= 1 for t in enc.encode(text)), text


@pytest.mark.parametrize("completion, want", [
    (" 1 2 5 9", 1), ("1 2 5 9", 1), (" 1, 2, 5, 9.", 1), (" [1,2,5,9]", 1), (" 1 2 5 9\n0", 1),
    (" 1 2 9 5", 0), (" 1 2 5", 0), (" 1 2 5 9 9", 0), ("", 0), (" 12 5 9", 0),
])
def test_sort_checker(completion, want):
    assert tasks.check_sorted(completion, "1 2 5 9") == want


def test_gsm8k_checker_takes_the_last_number_before_a_stop():
    assert tasks.check_gsm8k(" 3 + 4 = 7\n#### 7", "7") == 1
    assert tasks.check_gsm8k(" It costs $1,800.00 in all.", "1800") == 1
    assert tasks.check_gsm8k(" 7\n\nQuestion: what is 8?", "7") == 1
    assert tasks.check_gsm8k(" 7\nUser: 8", "7") == 1
    assert tasks.check_gsm8k(" 7 then 8", "7") == 0
    assert tasks.check_gsm8k(" no idea", "7") == 0


@pytest.mark.skipif(not (default_mirror() and os.path.isfile(os.path.join(default_mirror(), "eval", "gsm8k",
                                                                            "test.jsonl"))),
                    reason="no GSM8K in the offline mirror")
def test_gsm8k_examples_from_the_mirror():
    test = tasks.make_examples("gsm8k", 20, "test", seed=0)
    assert len(test) == 20 and test == tasks.make_examples("gsm8k", 20, "test", seed=0)
    assert all(tasks.check_gsm8k(e.response, e.answer) == 1 and "<<" not in e.response for e in test)


def test_errors():
    with pytest.raises(ConfigError, match="unknown task"):
        tasks.make_examples("arithmetic", 3)
    with pytest.raises(ConfigError, match="split must be"):
        tasks.make_examples("arith", 3, split="val")
    with pytest.raises(ConfigError, match="n must be"):
        tasks.make_examples("sort", 0)


def test_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "d" / "count.jsonl"
    assert tasks.main(["count", "--n=5", "--split=test", "--seed=2", f"--out={out}"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = tasks.make_examples("count", 5, "test", 2)
    assert [(r["prompt"], r["response"], r["answer"]) for r in rows] == [(e.prompt, e.response, e.answer) for e in want]
    assert rows[0]["text"] == format_prompt(rows[0]["prompt"]) + rows[0]["response"]
    for argv in (["count", "--n=5"], ["nope", f"--out={out}"], ["count", "--m=1", f"--out={out}"]):
        assert tasks.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
