"""Presets: plain functions that return a Config, so a reader sees every number of a run in one place.

`python train.py --preset=NAME` starts from PRESETS[NAME]() (cli.parse_args), then applies the overrides.
tiny and tiny_moe are the CPU runs; the gpt2_* sizes are GPT-2's; gpt_1b and gpt_3b are wide (head dim 128) for FP8
and TP; the *_16k / *_32k variants are the long-context runs of context parallel (cp.py). Tested by
tests/test_config.py.
"""
from __future__ import annotations

from nanopara.config import Config



def gpt2_124m() -> Config:
    return Config(preset="gpt2_124m")


def _gpt2(name, n_layer, n_head, n_embd, lr) -> Config:
    c = Config(preset=name)
    c.model.n_layer, c.model.n_head, c.model.n_embd = n_layer, n_head, n_embd
    c.train.lr = lr
    return c


def gpt2_350m() -> Config:
    return _gpt2("gpt2_350m", 24, 16, 1024, 3e-4)


def gpt2_774m() -> Config:
    return _gpt2("gpt2_774m", 36, 20, 1280, 2.5e-4)


def gpt2_1558m() -> Config:
    return _gpt2("gpt2_1558m", 48, 25, 1600, 2e-4)


def gpt_1b() -> Config:
    """~1.0B parameters, wide (n_embd 2048) with head dim 128: large matmuls where FP8 and TP pay off."""
    c = _gpt2("gpt_1b", 18, 16, 2048, 3e-4)
    c.train.micro_batch = 8
    return c


def gpt_3b() -> Config:
    """~3.1B parameters (26 x 3072, head dim 128): the dense size where FP8 should pay most on one 80 GB GPU (issue
    #43). Micro-batch 8 keeps M = 8192 tokens a micro-step, the shape fp8.py's auto rule was measured at (there it
    puts every block Linear in FP8 tensor mode, attn.c_proj at the rule's threshold: 104 of 105 Linears, 95 % of the
    FLOPs; 1.350x the best bf16 on one H100, results/fp8_ws_e2e_h100.txt). Selective activation
    checkpointing: plan.py on one H100 predicts 64.8 GB (bf16) / 64.1 GB (FP8) of 85, room for the planner's 10 %;
    without it 73.2 GB, too close; full checkpointing 53.2 GB but 24 % slower. lr: GPT-3 2.7B's 1.6e-4."""
    c = _gpt2("gpt_3b", 26, 24, 3072, 1.6e-4)
    c.train.micro_batch, c.train.activation_checkpointing = 8, "selective"
    return c


def _long(c: Config, name: str, T: int) -> Config:
    """Long-context variant: learned positions up to T, one sequence of T per micro-step, 2**19 tokens a step
    (GPT-2's ~0.5M: 2**19 / T micro-steps, shared by the dp ranks)."""
    c.preset, c.model.block_size, c.train.seq_len, c.train.micro_batch = name, T, T, 1
    c.train.tokens_per_step = 2 ** 19
    return c


def gpt2_124m_16k() -> Config:
    """GPT-2 124M at 16k tokens of context; one GPU, or context parallel: --parallel.cp=2 (cp.py)."""
    return _long(gpt2_124m(), "gpt2_124m_16k", 16384)


def gpt_1b_32k() -> Config:
    """gpt_1b at 32k tokens of context: two GPUs with --parallel.cp=2 (each holds 16k tokens of a sequence)."""
    return _long(gpt_1b(), "gpt_1b_32k", 32768)


def tiny() -> Config:
    """CPU-sized: learns tinyshakespeare visibly in a few minutes on two cores."""
    c = Config(preset="tiny", out_dir="runs/tiny")
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 4, 4, 128, 256
    c.train.micro_batch, c.train.seq_len, c.train.steps = 8, 128, 200
    c.train.lr, c.train.warmup_steps, c.train.val_every, c.train.val_steps = 3e-3, 20, 100, 8
    c.train.log_every = 10
    return c


def gpt2_moe() -> Config:
    """GPT-2 124M width with 8 experts, top-2, in every other block (aux 0.01, z-loss 0.001): 124M + 6 x 7 x 4.7M
    = ~322M parameters, ~153M active per token (moe.active_params: 2 of 8 experts)."""
    c = Config(preset="gpt2_moe")
    c.model.moe_experts, c.model.moe_top_k, c.model.moe_every = 8, 2, 2
    return c


def gpt2_moe_fine() -> Config:
    """Fine-grained MoE at the 124M width (DeepSeekMoE's segmentation, issue #44 item 5): in every other block 32
    routed experts of hidden 768 (= C, a quarter of GPT-2's 4C: gpt2_moe's 8 x 4C cut in four), top-3, plus 1 shared
    expert of hidden 768 on every token. Active MLP FLOPs per token: (3 + 1) x 2 x 768 x 768 = 2 x 768 x 3072, the
    dense gpt2_124m MLP's exactly; only the router (32 x 768) and 4 x 768 - 3072 more bias terms per MoE layer are
    extra (+0.1 % of the FLOPs a token; tests/test_moe_fine.py asserts < 1 %). Parameters: 330M, 124M active."""
    c = Config(preset="gpt2_moe_fine")
    m = c.model
    m.moe_experts, m.moe_top_k, m.moe_every, m.moe_hidden, m.moe_shared = 32, 3, 2, 768, 1
    return c


def tiny_moe() -> Config:
    """tiny with 4 experts, top-2, every other block: the CPU MoE run."""
    c = tiny()
    c.preset, c.out_dir = "tiny_moe", "runs/tiny_moe"
    c.model.moe_experts, c.model.moe_top_k, c.model.moe_every = 4, 2, 2
    return c


PRESETS = {f.__name__: f for f in (tiny, gpt2_124m, gpt2_350m, gpt2_774m, gpt2_1558m, gpt_1b, gpt_3b, gpt2_moe,
                                   gpt2_moe_fine, tiny_moe, gpt2_124m_16k, gpt_1b_32k)}

