"""Config: presets, typed overrides, and one clear message for every user mistake."""
import pytest

from nanopara.config import PRESETS, ConfigError, config_from_dict, parse_args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name):
    cfg = parse_args([f"--preset={name}"])
    assert cfg.preset == name
    assert cfg.model.n_embd % cfg.model.n_head == 0
    assert cfg.model.padded_vocab % 128 == 0 and cfg.model.padded_vocab >= cfg.model.vocab_size


def test_gpt2_shapes():
    assert parse_args(["--preset=gpt2_124m"]).model.padded_vocab == 50304
    big = parse_args(["--preset=gpt_1b"]).model
    assert big.head_dim == 128 and big.n_embd == 2048


def test_overrides_are_typed():
    cfg = parse_args(["--preset=tiny", "--train.steps=7", "--train.lr=1e-3", "--parallel.sp=false",
                      "--seed=3", "--resume=true", "--data.dataset=books", "--train.tokens_per_step=2e3"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 1e-3 and cfg.seed == 3 and cfg.resume is True and cfg.data.dataset == "books"
    assert cfg.train.tokens_per_step == 2000
    assert parse_args(["--parallel.zero=3", "--parallel.zero3_unit_blocks=2"]).parallel.zero3_unit_blocks == 2


def test_round_trip_through_dict():
    cfg = parse_args(["--preset=tiny", "--model.n_layer=3"])
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("argv, message", [
    (["--train.stepz=3"], "did you mean --train.steps"),
    (["--modle.n_layer=3"], "did you mean --model.n_layer"),
    (["--train.steps=abc"], "expects int"),
    (["--parallel.sp=maybe"], "expects true/false"),
    (["--preset=gpt3"], "unknown preset"),
    (["--train.seq_len=2048"], "exceeds the model's context"),
    (["--parallel.sp=true"], "needs parallel.tp > 1"),
    (["--parallel.tp=5"], "not divisible by parallel.tp=5"),
    (["--parallel.zero=4"], "parallel.zero must be"),
    (["--parallel.reduce_dtype=fp16"], "reduce_dtype must be fp32 or bf16"),
    (["--parallel.grad_dests=yes"], "grad_dests must be auto, on or off"),
    (["--parallel.grad_dests=on", "--parallel.zero=3"], "DDP and ZeRO-2"),
    (["--parallel.reduce_dtype=bf16", "--parallel.zero=2"], "DDP .parallel.zero=0. only"),
    (["--parallel.zero=3", "--parallel.zero3_unit_blocks=-1"], r"zero3_unit_blocks must be >= 1 \(or 0: auto\)"),
    (["--parallel.zero3_unit_blocks=2"], "applies to ZeRO-3 .parallel.zero=3. only"),
    (["--train.dtype=fp8"], "train.dtype"),
    (["--model.n_head=7"], "not divisible by model.n_head=7"),
    (["--parallel.tp=2", "--parallel.sp=true", "--train.seq_len=1023"], "not divisible by parallel.tp=2"),
    (["steps=3"], "--key=value"),
])
def test_bad_config_is_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)
