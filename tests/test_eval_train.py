"""train.py's --train.eval_every: HellaSwag logged at the right steps, equal to evals.hellaswag on the checkpointed
weights (one process and a 2-rank gloo run), and a missing file or an unbuilt layout stops the run before any step."""
import json

import pytest
import torch

import train
from nanopara import evals
from nanopara.cli import parse_args
from nanopara.config import ConfigError
from nanopara.consolidate import full_model_state
from nanopara.data import get_tokenizer
from nanopara.evals import HellaSwagItem
from nanopara.model import GPT
from tests.distributed import spawn
from tests.test_train import argv, shards  # noqa: F401  (the module-scoped shards fixture)

ITEMS = [HellaSwagItem("Cooking: She cracks two eggs into a bowl and", 2,
                       ["flies away.", "sings a song about the moon", "whisks them.", "x"]),
         HellaSwagItem("Sport: The runner crosses the line", 0,
                       ["and raises his arms.", "then eats a very long sandwich slowly", "no.", "upside"]),
         HellaSwagItem("Home: A man climbs a ladder onto the roof", 1,
                       ["and swims.", "and removes the old shingles.", "then", "and bakes bread in the oven"])]


@pytest.fixture
def hs_file(tmp_path):
    path = tmp_path / "hs.txt"
    path.write_text("".join("\n".join([it.ctx, str(it.label), *it.endings]) + "\n" for it in ITEMS))
    return path


def eval_argv(shards, out, hs, *extra):  # noqa: F811
    # GPT-2's vocabulary (HellaSwag is tokenized with tiktoken); micro_batch 4 -> one item per forward
    return argv(shards, out, "--model.vocab_size=50257", "--train.eval_every=2", f"--train.eval_hellaswag={hs}",
                "--ckpt.every=4", "--ckpt.keep=10", *extra)


def records(out):
    return [json.loads(ln) for ln in open(out / "metrics.jsonl") if "hellaswag_acc" in ln]


def expected(ckpt):
    sd, mcfg = full_model_state(str(ckpt))
    model = GPT(mcfg)
    model.load_state_dict(sd)
    return evals.hellaswag(model, get_tokenizer(), ITEMS, batch=1)


def check_run(out):
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 3, 5, 7]  # every 2 steps; 7 is also the last
    for r, ckpt in ((recs[1], out / "ckpt" / "step_000004"), (recs[3], out / "ckpt" / "step_000008")):
        want = expected(ckpt)
        assert {k: r[k] for k in want} == want  # exactly: the same weights, batches and order
        assert r["hellaswag_n"] == 3 and r["eval_time_s"] >= 0


def test_eval_every_logs_hellaswag_equal_to_the_checkpoints(shards, hs_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    train.main(eval_argv(shards, out, hs_file))
    check_run(out)
    assert any(ln.startswith("step     7 | hellaswag_acc ") for ln in capsys.readouterr().out.splitlines())


def _rank(rank, world, args):
    train.main(args)


def test_two_gloo_ranks_log_what_one_process_computes(shards, hs_file, tmp_path):  # noqa: F811
    out = tmp_path / "dp2"
    spawn(_rank, 2, eval_argv(shards, out, hs_file, "--parallel.dp=2"))  # 3 batches: rank 1 runs a throwaway one
    check_run(out)


def test_missing_file_is_one_line_before_any_step(shards, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NANOPARA_MIRROR", str(tmp_path / "mirror"))
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train.main(eval_argv(shards, out, ""))
    msg = str(e.value)
    assert "\n" not in msg and "HellaSwag" in msg and str(tmp_path / "mirror") in msg
    assert evals.HELLASWAG_URL in msg and "--train.eval_hellaswag" in msg
    assert not (out / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="no HellaSwag file"):
        train.main(eval_argv(shards, out, tmp_path / "nope.txt"))


@pytest.mark.parametrize("extra, fragment", [
    (["--parallel.pp=2"], "pp > 1"), (["--parallel.tp=2"], "tp > 1"), (["--parallel.zero=3"], "zero=3"),
    (["--model.vocab_size=256"], "vocab_size=256"), (["--train.eval_tasks=hellaswag,mmlu"], "eval_tasks"),
    (["--train.eval_every=-1"], "eval_every=-1"), (["--train.eval_limit=-2"], "eval_limit=-2")])
def test_unbuilt_layouts_and_bad_keys_are_refused(extra, fragment):
    base = ["--preset=tiny", "--model.vocab_size=50257", "--train.eval_every=10"]
    with pytest.raises(ConfigError, match=fragment.replace("+", r"\+")):
        parse_args(base + extra)
    parse_args(["--preset=tiny", "--parallel.tp=2", "--train.eval_tasks=hellaswag"])  # eval_every=0: no refusal
