"""Run configuration: one dataclass per section, and every check that needs no process group.

A run is `Config` = top-level keys (preset, device, seed, out_dir, resume, overwrite) + one dataclass per section
(model, parallel, train, data, ckpt); the comment beside each field is what `python train.py --help` prints.
`Config.check()` runs before any work (no process group, no data, no model yet): ranges of numeric keys, choices,
then combinations; the checks against the world size are parallel.check_layout.

Presets live in presets.py, the command line (`--section.key=value`, typed by these fields) in cli.py; neither is
imported here. Tested by tests/test_config.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user mistake in the configuration: printed as one line, before any work."""


# ----------------------------------------------------------------------------------------------------------------
# sections

@dataclass
class ModelConfig:
    n_layer: int = 12            # transformer blocks
    n_head: int = 12             # attention heads (head dim = n_embd // n_head)
    n_embd: int = 768            # residual width
    block_size: int = 1024       # context length (learned positions)
    vocab_size: int = 50257      # GPT-2 BPE; the embedding is padded up to a multiple of `vocab_multiple`
    vocab_multiple: int = 128    # 50257 -> 50304: aligned matmul tiles; padding logits never reach the loss
    dropout: float = 0.0         # residual/embedding dropout (GPT-2 pre-training uses none at this scale)
    bias: bool = True            # GPT-2 has biases in Linear and LayerNorm
    kernels: str = "auto"        # auto: Triton kernels on CUDA, PyTorch elsewhere | triton | torch (SDPA, F.*)
    # Mixture of Experts (nanopara/moe.py, notes/moe.md); moe_experts = 0: dense GPT-2
    moe_experts: int = 0         # E experts (GPT-2 MLPs) per MoE layer; 0 = dense (no MoE layer)
    moe_every: int = 2           # block i gets the MoE MLP when i % moe_every == moe_every - 1 (2: every other one)
    moe_top_k: int = 2           # experts per token
    moe_score: str = "softmax"   # router scores: softmax | sigmoid (DeepSeek-V3 with renorm; Llama 4's top-1 without)
    moe_renorm: bool = True      # gates renormalised over the chosen k (False: Switch's k = 1 gate)
    moe_capacity: float = 0.0    # capacity factor: an expert keeps ceil(cf * tokens * k / E) assignments, 0 = dropless
    moe_aux_coef: float = 0.01   # Switch/GShard load-balancing loss weight; 0 = off
    moe_z_coef: float = 0.001    # router z-loss weight (ST-MoE); 0 = off
    moe_bias_rate: float = 0.0   # aux-loss-free balancing bias step (DeepSeek-V3: 0.001); 0 = off
    moe_impl: str = "auto"       # auto (triton on CUDA, sorted on CPU) | triton | grouped_mm | sorted | loop
    moe_hidden: int = 0          # each routed expert's MLP width; 0 = 4 * n_embd (fine-grained: smaller, more experts)
    moe_shared: int = 0          # always-on shared experts of width moe_hidden per MoE layer (DeepSeekMoE); 0 = none

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass
class ParallelConfig:
    dp: int = -1                 # data parallel degree; -1 = whatever is left of the world size
    tp: int = 1                  # tensor parallel degree (Megatron column/row)
    pp: int = 1                  # pipeline stages (pp.py); the step's micro-batches (tokens_per_step) run through them
    cp: int = 1                  # context parallel (cp.py): ring attention, each rank holds 2 of 2*cp seq chunks
    cp_impl: str = "ring"        # ring (K/V passed around, zigzag-balanced) | ulysses (all-to-all heads <-> seq)
    cp_keep_kv: str = "auto"     # ring: the received K/V kept for backward: auto (at cp = 2: cp.keep_kv) | true | false
    ep: int = 1                  # expert parallel (ep.py): each of ep ranks of dp x cp holds moe_experts/ep experts
    ep_chunks: int = 1           # ep with a capacity: the all-to-alls in this many pieces, pipelined with the experts
    ep_fp8: bool = False         # ep: the rows go out to the experts in e4m3 with a scale per row (C + 4 bytes, not 2C)
    zero: int = 0                # 0 = DDP, 1/2/3 = ZeRO stage
    sp: bool = False             # sequence parallel (needs tp > 1)
    tp_overlap: int = 0          # TP: row blocks per GEMM, each block's collective under the next one's GEMM
                                 # (tp_linear.py); 0 = off (4 blocks: 27-29% slower eager, notes/tp.md)
    tp_streams: int = 1          # TP: 2 = each micro-batch as two halves on two CUDA streams (tp_streams.py)
    sp_keep_gathered: bool = False  # SP: column layers keep their gathered (B, T, C) input for dW: one all-gather a
                                 # layer fewer in backward, 2 x B*T*C bytes a block more held (default: regather)
    pp_schedule: str = "1f1b"    # gpipe | 1f1b | interleaved (needs pp_virtual >= 2) | zb (ZB-H1, zero bubble)
    pp_virtual: int = 1          # model chunks per pp rank (interleaved 1F1B's v): bubble (p-1)/(v*m), v x the p2p
    pp_layers: str = "auto"      # blocks per chunk in model order ("7,6,6,5"); auto: balanced, the head counted; even
    bucket_mb: float = 25.0      # DDP gradient bucket size
    reduce_dtype: str = "fp32"   # DDP gradient all-reduce in fp32 | bf16 (half the bytes; grads stay fp32)
    grad_dests: str = "auto"     # Linear weight grads written straight into DDP/ZeRO-2 buffers (dp._set_grad_dests):
                                 # auto = ZeRO-2 only (it would copy every micro-step) | on (DDP too) | off
    zero3_unit_blocks: int = 0   # ZeRO-3 gathers this many consecutive blocks as one unit: fewer hooks and
                                 # collectives per step, as many times the gathered bytes (> n_layer: one unit);
                                 # 0 = auto: the fewest blocks that hold >= zero3.UNIT_MIN_PARAMS parameters
    zero_prefetch: str = "auto"  # ZeRO-1/2: parameter all-gathers waited per block in the next forward (zero.py)
                                 # auto (on for ZeRO-1/2 where safe: zero.zero_prefetch) | true | false
    timeout_s: int = 600         # collective timeout: a rank mismatch errors instead of hanging forever


@dataclass
class TrainConfig:
    steps: int = 5000            # optimizer steps
    micro_batch: int = 32        # sequences per rank per micro-step
    seq_len: int = 1024          # tokens per sequence
    tokens_per_step: int = 0     # global tokens per optimizer step (0 = one micro-step on every dp rank)
    lr: float = 6e-4             # peak learning rate
    min_lr_frac: float = 0.1     # cosine decays to lr * min_lr_frac
    warmup_steps: int = 700      # linear warm-up steps
    weight_decay: float = 0.1    # AdamW decay on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0       # max global grad norm (0 = off)
    optimizer: str = "torch"     # torch (torch.optim.AdamW, fused on CUDA) | flat (flat.py: one replica, one launch)
    dtype: str = "auto"          # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 (dynamic loss scaling) | fp32
    compile: bool = False        # torch.compile the model (the PyTorch baseline uses it)
    cuda_graph: str = "auto"     # auto (on for tp or pp > 1 with dp = cp = 1 on CUDA, where it is safe) | true | false
    val_every: int = 250         # steps between validation passes (0 = never)
    val_steps: int = 20          # micro-batches per validation pass
    log_every: int = 1           # steps between log lines
    sample_every: int = 0        # steps between text samples (0 = only at the end)
    sample_tokens: int = 64      # tokens generated per sample
    max_bad_steps: int = 5       # consecutive non-finite losses before the run stops
    activation_checkpointing: str = "none"  # none | full (recompute each block in backward) | selective
    fp8: str = "none"            # none | tensor | row | block: Linears' GEMMs in FP8 (nanopara/fp8.py; lm_head stays)
    fp8_filter: str = "auto"     # auto (fp8.py's measured per-shape rule) | all (every Linear but lm_head) | globs
    fp8_delayed: bool = False    # tensor mode: X and dY scales from a 16-step amax history (one pass per cast)
    fp8_grad: str = "e5m2"       # dY's FP8 format: e5m2 (range) | e4m3 (precision, with its own scale)
    eval_every: int = 0          # steps between downstream evals (nanopara/evals.py) and at the last step; 0 = never
    eval_tasks: str = "hellaswag"  # comma-separated tasks run every eval_every steps: hellaswag
    eval_limit: int = 0          # the first N items of each task (0 = all; HellaSwag val has 10042)
    eval_hellaswag: str = ""     # llama.cpp's HellaSwag file (.txt/.txt.bz2) or its folder; "" = the mirror's


@dataclass
class DataConfig:
    dataset: str = "shakespeare" # shakespeare | books | fineweb10B | fineweb-edu10B | path/glob of .bin shards
    data_dir: str = "data/shards"
    loss_mask: str = "auto"      # auto: the shards' .mask files when they have them (SFT: loss on responses) | on | off


@dataclass
class CheckpointConfig:
    every: int = 0               # steps between checkpoints (0 = only at the end)
    keep: int = 2                # complete checkpoints kept on disk
    final: bool = True           # save one at the end of the run
    init_from: str = ""          # start from a run/step dir of this trainer or HF GPT-2 weights (.bin/.pt)
    async_: str = "auto"         # auto (on GPU runs, off on CPU) | true | false: training goes on while a background
                                 # thread writes the checkpoint (nanopara/async_save.py; the final one is waited for)


@dataclass
class Config:
    preset: str = "gpt2_124m"
    device: str = "auto"         # auto | cuda | cpu
    seed: int = 1337
    out_dir: str = "runs/default"
    resume: bool = False         # continue from <out_dir>/ckpt/latest (or the newest complete checkpoint)
    overwrite: bool = False      # start afresh in an out_dir that holds another run (its checkpoints and logs go)
    plan: bool = False           # print the planner's memory and step-time prediction for this run and exit
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Every check that needs no process group: ranges of numeric keys first (nothing divides by zero below),
        then choices, then combinations. The checks against the world size are parallel.check_layout."""
        for key, rule, ok in _RULES:
            section, _, name = key.rpartition(".")
            value = getattr(getattr(self, section) if section else self, name)
            if not ok(value):
                raise ConfigError(f"--{key}={value} is out of range: it must be {rule}")
        m, p, t = self.model, self.parallel, self.train
        for key, value, choices in (("device", self.device, ("auto", "cuda", "cpu")),
                                    ("model.kernels", m.kernels, ("auto", "triton", "torch")),
                                    ("train.dtype", t.dtype, ("auto", "bf16", "fp16", "fp32")),
                                    ("train.optimizer", t.optimizer, ("torch", "flat")),
                                    ("parallel.reduce_dtype", p.reduce_dtype, ("fp32", "bf16")),
                                    ("parallel.grad_dests", p.grad_dests, ("auto", "on", "off")),
                                    ("parallel.zero_prefetch", p.zero_prefetch, ("auto", "true", "false")),
                                    ("parallel.pp_schedule", p.pp_schedule, ("gpipe", "1f1b", "interleaved", "zb")),
                                    ("parallel.cp_impl", p.cp_impl, ("ring", "ulysses")),
                                    ("parallel.cp_keep_kv", p.cp_keep_kv, ("auto", "true", "false")),
                                    ("train.activation_checkpointing", t.activation_checkpointing,
                                     ("none", "full", "selective")),
                                    ("train.fp8", t.fp8, ("none", "tensor", "row", "block")),
                                    ("train.fp8_grad", t.fp8_grad, ("e5m2", "e4m3")),
                                    ("data.loss_mask", self.data.loss_mask, ("auto", "on", "off")),
                                    ("ckpt.async_", self.ckpt.async_, ("auto", "true", "false")),
                                    ("train.cuda_graph", t.cuda_graph, ("auto", "true", "false"))):
            if value not in choices:
                raise ConfigError(f"{key} must be {'|'.join(choices)}, got {value!r}")
        if not self.out_dir.strip():
            raise ConfigError("--out_dir is empty: name the run directory")
        if not self.data.dataset.strip():
            raise ConfigError("--data.dataset is empty: name a dataset or a path/glob of .bin shards")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: choose one")
        if m.n_embd % m.n_head:
            raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
        if t.seq_len > m.block_size:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds the model's context model.block_size={m.block_size}")
        if t.sample_tokens >= m.block_size:
            raise ConfigError(f"train.sample_tokens={t.sample_tokens}: a sample starts from one token and fits in the "
                              f"context, so at most model.block_size-1 = {m.block_size - 1}")
        if t.tokens_per_step % (t.micro_batch * t.seq_len):
            raise ConfigError(f"train.tokens_per_step={t.tokens_per_step} is not a multiple of micro_batch*seq_len = "
                              f"{t.micro_batch}*{t.seq_len} = {t.micro_batch * t.seq_len}")
        if p.reduce_dtype != "fp32" and p.zero != 0:
            raise ConfigError("parallel.reduce_dtype=bf16 is implemented for DDP (parallel.zero=0) only")
        if p.grad_dests == "on" and p.zero not in (0, 2):
            raise ConfigError("parallel.grad_dests=on applies to DDP and ZeRO-2 (parallel.zero=0 or 2) only")
        if p.zero3_unit_blocks != 0 and p.zero != 3:
            raise ConfigError("parallel.zero3_unit_blocks applies to ZeRO-3 (parallel.zero=3) only")
        if p.sp and p.tp == 1:
            raise ConfigError("parallel.sp=true needs parallel.tp > 1 (sequence parallel shards within the tp group)")
        if p.sp_keep_gathered and not p.sp:
            raise ConfigError("parallel.sp_keep_gathered=true applies to sequence parallel: set parallel.sp=true")
        if p.tp > 1 and m.n_head % p.tp:
            raise ConfigError(f"model.n_head={m.n_head} is not divisible by parallel.tp={p.tp}")
        if p.tp > 1 and (4 * m.n_embd) % p.tp:
            raise ConfigError(f"the MLP width 4*model.n_embd={4 * m.n_embd} is not divisible by parallel.tp={p.tp}")
        if p.sp and t.seq_len % p.tp:
            raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp} (needed by sp)")
        self._check_cp()
        self._check_tp_streams()
        self._check_pipeline()
        self._check_evals()
        self._check_moe()
        self._check_fp8()
        if t.cuda_graph == "true" and t.dtype == "fp16":
            raise ConfigError("train.cuda_graph=true does not support train.dtype=fp16 (the loss scale changes between "
                              "steps); use bf16")
        if t.cuda_graph == "true" and t.compile:
            raise ConfigError("train.cuda_graph=true and train.compile=true: use one (torch.compile's own graphs are "
                              "mode='reduce-overhead')")

    def _check_cp(self) -> None:
        """Context parallel (nanopara/cp.py): every sequence is cut into 2*cp chunks, two per cp rank (zigzag)."""
        p, t = self.parallel, self.train
        if p.cp == 1:
            return
        if t.seq_len % (2 * p.cp):
            raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by 2*parallel.cp = {2 * p.cp} (context "
                              f"parallel cuts each sequence into 2*cp equal chunks, two per rank)")
        if p.sp and (t.seq_len // p.cp) % p.tp:
            raise ConfigError(f"train.seq_len/parallel.cp = {t.seq_len // p.cp} tokens per cp rank are not divisible "
                              f"by parallel.tp={p.tp} (needed by sp)")
        if t.compile:
            raise ConfigError("train.compile=true with parallel.cp > 1 is not supported: ring attention's send/recv "
                              "run eagerly inside the attention op")
        if p.cp_keep_kv == "true" and p.cp_impl != "ring":
            raise ConfigError("parallel.cp_keep_kv=true applies to parallel.cp_impl=ring (Ulysses sends no K/V ring)")
        heads = self.model.n_head // p.tp
        if p.cp_impl == "ulysses" and heads % p.cp:
            raise ConfigError(f"parallel.cp_impl=ulysses splits each rank's model.n_head/parallel.tp = {heads} heads "
                              f"over parallel.cp={p.cp} ranks: they must divide (or use parallel.cp_impl=ring)")

    def _check_tp_streams(self) -> None:
        """parallel.tp_streams=2 (nanopara/tp_streams.py): each micro-batch as two halves on two streams."""
        m, p, t = self.model, self.parallel, self.train
        why = p.tp_streams > 1 and next((w for off, w in (
            (p.tp == 1, "parallel.tp > 1 (it hides tensor parallel's collectives)"),
            (t.micro_batch % p.tp_streams, f"train.micro_batch={t.micro_batch} divisible by it (equal halves)"),
            (p.pp > 1 or p.cp > 1, "parallel.pp = 1 and parallel.cp = 1 (not built for them yet)"),
            (m.moe_experts > 0, "a dense model (model.moe_experts=0: the halves' aux losses and expert loads)"),
            (t.fp8 != "none", "train.fp8=none (the FP8 weight casts are cached across the two streams)"),
            (t.compile, "train.compile=false (it runs the model's stages, not a compiled forward)"),
            (p.zero > 1, "parallel.zero <= 1 (ZeRO-2/3 reduce or gather per micro-step from Python)"),
            (p.grad_dests == "on", "parallel.grad_dests=auto|off (each weight gets two gradients a micro-step)"),
            (p.sp and m.dropout > 0, "model.dropout=0 under parallel.sp=true (its per-rank RNG hooks wrap the "
                                     "forward, which the halves' stages bypass)")) if off), None)
        if why:
            raise ConfigError(f"parallel.tp_streams={p.tp_streams} needs {why}")

    def _check_fp8(self) -> None:
        """FP8 (nanopara/fp8.py) with the layouts it is not built for; compile is fine (one graph break per FP8
        Linear, whose forward runs eagerly), and so are DDP, ZeRO-1/2/3, pp (every rank converts its own part) and
        tp/sp (the column/row-parallel linears run FP8 on their shards, tp.py)."""
        t, p = self.train, self.parallel
        if t.fp8 == "none":
            for key, set_ in (("fp8_filter", t.fp8_filter.strip() not in ("", "auto")), ("fp8_delayed", t.fp8_delayed),
                              ("fp8_grad", t.fp8_grad != "e5m2")):
                if set_:
                    raise ConfigError(f"train.{key} applies to FP8 training only: set train.fp8=tensor|row|block")
            return
        if t.fp8_delayed and t.fp8 != "tensor":
            raise ConfigError(f"train.fp8_delayed=true needs one scale per tensor (train.fp8=tensor), not "
                              f"train.fp8={t.fp8}: row and block scales follow each row or block as it comes")

    def _check_evals(self) -> None:
        """train.eval_every runs evals.py's tasks on the whole model each dp rank holds (train.run_evals)."""
        m, p, t = self.model, self.parallel, self.train
        tasks = [s.strip() for s in t.eval_tasks.split(",")]
        if any(s not in EVAL_TASKS for s in tasks):
            raise ConfigError(f"train.eval_tasks must be a comma-separated list of {'|'.join(EVAL_TASKS)}, "
                              f"got {t.eval_tasks!r}")
        if t.eval_every == 0:
            return
        why = ("parallel.pp > 1 (each rank holds only its stages)" if p.pp > 1 else
               "parallel.tp > 1 (each rank holds slices of the weights)" if p.tp > 1 else
               "parallel.cp > 1 (the model's forward takes this rank's chunks of each sequence)" if p.cp > 1 else
               "parallel.zero=3 (sharded weights: untested with evals.py's lockstep forwards)" if p.zero == 3 else "")
        if why:
            raise ConfigError(f"train.eval_every needs the whole model on every dp rank, not {why}; evaluate the "
                              f"checkpoints with eval.py instead")
        if "hellaswag" in tasks and m.vocab_size < 50257:
            raise ConfigError(f"train.eval_tasks=hellaswag is tokenized with GPT-2's 50257 tokens; this model has "
                              f"model.vocab_size={m.vocab_size}")

    def _check_moe(self) -> None:
        """MoE (moe_experts > 0) where it is built: one device, dp/ZeRO, tp (+sp: experts whole on every tp rank), pp,
        expert parallel (ep.py) with DDP/ZeRO-1/2/3, tp and pp."""
        m, p, t = self.model, self.parallel, self.train
        if m.moe_experts == 0:
            if p.ep > 1:
                raise ConfigError(f"parallel.ep={p.ep} shards the experts of MoE layers, and this model has none: "
                                  f"set model.moe_experts (or --preset=gpt2_moe / tiny_moe)")
            return
        from nanopara.moe import IMPLS, check_moe_config  # lazy: moe.py imports torch
        if m.moe_impl not in IMPLS:
            raise ConfigError(f"model.moe_impl must be {'|'.join(IMPLS)}, got {m.moe_impl!r}")
        try:
            check_moe_config(m)
        except ValueError as e:
            raise ConfigError(f"model.{e}") from None
        if t.cuda_graph == "true" and m.moe_impl not in ("auto", "triton"):  # moe.py: only Triton's path is sync-free
            raise ConfigError(f"train.cuda_graph=true with model.moe_impl={m.moe_impl}: that PyTorch path reads expert "
                              f"bounds on the host, which a capture cannot hold; use moe_impl=auto or triton")
        if t.cuda_graph == "true" and p.ep > 1:
            raise ConfigError("train.cuda_graph=true with parallel.ep > 1: expert parallel runs under data-parallel "
                              "engines, whose hooks a replay would skip")
        if p.ep > 1:  # expert parallel (ep.py); that ep divides dp*cp is checked with the world size (check_layout)
            if m.moe_experts % p.ep:
                raise ConfigError(f"model.moe_experts={m.moe_experts} is not divisible by parallel.ep={p.ep} (each ep "
                                  f"rank holds moe_experts/ep experts)")

    def _check_pipeline(self) -> None:
        """The pipeline checks that need no world size (those that need m, the micro-batches per step, are in
        parallel.check_layout: m = tokens_per_step / (micro_batch * seq_len * dp))."""
        p, t, n_layer = self.parallel, self.train, self.model.n_layer
        layers = pp_layers_list(p.pp_layers) if p.pp_layers.strip() != "auto" else None
        if p.pp == 1:
            if p.pp_virtual > 1 or layers:
                key = f"pp_virtual={p.pp_virtual}" if p.pp_virtual > 1 else f"pp_layers={p.pp_layers!r}"
                raise ConfigError(f"parallel.{key} applies to pipeline parallel only: set parallel.pp > 1")
            return
        if p.pp_schedule == "interleaved" and p.pp_virtual < 2:
            raise ConfigError("parallel.pp_schedule=interleaved needs parallel.pp_virtual >= 2 (model chunks per rank)")
        if p.pp_virtual > 1 and p.pp_schedule != "interleaved":
            raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp_schedule=interleaved (the other "
                              f"schedules run one chunk per rank)")
        n = p.pp * p.pp_virtual
        if n_layer < n:
            raise ConfigError(f"model.n_layer={n_layer} is fewer blocks than the parallel.pp*parallel.pp_virtual = "
                              f"{p.pp}*{p.pp_virtual} = {n} chunks: every chunk needs at least one")
        if p.pp_layers.strip() == "auto":
            layers = stage_layers(self)
        elif layers is None and n_layer % n:
            raise ConfigError(f"model.n_layer={n_layer} is not divisible by parallel.pp*parallel.pp_virtual = "
                              f"{p.pp}*{p.pp_virtual} = {n}: set parallel.pp_layers (blocks per chunk, e.g. "
                              f"\"{','.join(str(n_layer // n + (i < n_layer % n)) for i in range(n))}\", or auto) "
                              f"to split unevenly")
        if layers is not None and (len(layers) != n or sum(layers) != n_layer):
            raise ConfigError(f"parallel.pp_layers={p.pp_layers!r} must give the blocks of each of the "
                              f"pp*pp_virtual = {n} chunks, summing to model.n_layer={n_layer}")
        if p.zero >= 2:
            raise ConfigError(f"parallel.zero={p.zero} with parallel.pp > 1: ZeRO-2/3 reduce-scatter (ZeRO-3 also "
                              f"re-gathers) per micro-batch in model order, while a pipeline interleaves the "
                              f"micro-batches' forwards and backwards chunk by chunk; use parallel.zero=1 (sharded "
                              f"optimizer states, as Megatron-LM and DeepSpeed's pipeline engine do)")
        if t.compile:
            raise ConfigError("train.compile=true with parallel.pp > 1 is not supported: the pipeline runs its chunks "
                              "eagerly between sends and receives")


EVAL_TASKS = ("hellaswag",)  # train.eval_tasks' choices (train.run_evals)


def balanced_layers(n_layer: int, chunks: int, head_blocks: float) -> list[int]:
    """Blocks per chunk with the last chunk's lm_head + loss counted as head_blocks blocks of work: the last chunk
    gets fewer blocks, the others share the rest evenly (earlier chunks one more where it does not divide)."""
    last = min(range(1, n_layer - chunks + 2),  # the busiest chunk's work, smallest; ties: more blocks last
               key=lambda k: (max(k + head_blocks, -(-(n_layer - k) // (chunks - 1))), -k))
    q, r = divmod(n_layer - last, chunks - 1)
    return [q + (i < r) for i in range(chunks - 1)] + [last]


def stage_layers(cfg: "Config") -> list[int] | None:
    """parallel.pp_layers resolved: blocks per chunk, or None for an even split. auto: the head's matmul (2 * vocab
    * n_embd flops a token, forward; the backward twice that, as a block's) against a block's (24 * n_embd^2 +
    4 * seq_len * n_embd), so gpt_1b at pp2 splits 10,8 (measured: results/scaleout_h200.txt's rows use it)."""
    p, m = cfg.parallel, cfg.model
    if p.pp_layers.strip() != "auto":
        return pp_layers_list(p.pp_layers)
    chunks = p.pp * p.pp_virtual
    if p.pp == 1 or chunks < 2 or m.n_layer < chunks:
        return None
    head = 2 * m.padded_vocab / (24 * m.n_embd + 4 * cfg.train.seq_len)
    return balanced_layers(m.n_layer, chunks, head)


def pp_layers_list(text: str) -> list[int] | None:
    """parallel.pp_layers as blocks per chunk ("7,6,6,5" -> [7, 6, 6, 5]); None for "even" or "" (an even split).
    "auto" is resolved by stage_layers, which needs the model."""
    if text.strip() in ("", "even"):
        return None
    try:
        layers = [int(s) for s in text.split(",")]
    except ValueError:
        layers = []
    if not layers or min(layers) < 1:
        raise ConfigError(f"parallel.pp_layers={text!r}: expected positive block counts separated by commas, "
                          f"one per chunk (e.g. \"7,6,6,5\")")
    return layers


def _positive(v) -> bool:
    return v >= 1


def _non_negative(v) -> bool:
    return v >= 0


# The range of every numeric key, checked first by Config.check (key, rule as the user reads it, test).
_RULES = [
    ("seed", "in [0, 2**32)", lambda v: 0 <= v < 2 ** 32),
    *[(f"model.{k}", ">= 1", _positive) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                                                    "vocab_multiple")],
    ("model.dropout", "in [0, 1)", lambda v: 0 <= v < 1),
    *[(f"model.{k}", ">= 1", _positive) for k in ("moe_every", "moe_top_k")],
    *[(f"model.{k}", ">= 0", _non_negative) for k in ("moe_experts", "moe_capacity", "moe_aux_coef", "moe_z_coef",
                                                        "moe_bias_rate", "moe_hidden", "moe_shared")],
    *[(f"train.{k}", ">= 1", _positive) for k in ("steps", "micro_batch", "seq_len", "val_steps", "log_every",
                                                    "max_bad_steps")],
    *[(f"train.{k}", ">= 0", _non_negative) for k in ("tokens_per_step", "warmup_steps", "weight_decay",
                                                        "grad_clip", "val_every", "sample_every", "sample_tokens",
                                                        "eval_every", "eval_limit")],
    ("train.lr", "in (0, 1]", lambda v: 0 < v <= 1),
    ("train.min_lr_frac", "in [0, 1]", lambda v: 0 <= v <= 1),
    *[(f"train.{k}", "in [0, 1)", lambda v: 0 <= v < 1) for k in ("beta1", "beta2")],
    ("train.eps", "in (0, 1)", lambda v: 0 < v < 1),
    ("parallel.dp", ">= 1, or -1 (whatever is left of the world size)", lambda v: v >= 1 or v == -1),
    *[(f"parallel.{k}", ">= 1", _positive) for k in ("tp", "pp", "pp_virtual", "cp", "ep", "ep_chunks", "timeout_s")],
    ("parallel.tp_overlap", ">= 0", _non_negative),
    ("parallel.tp_streams", "1 or 2", lambda v: v in (1, 2)),
    ("parallel.zero", "0, 1, 2 or 3", lambda v: v in (0, 1, 2, 3)),
    ("parallel.bucket_mb", "> 0", lambda v: v > 0),
    ("parallel.zero3_unit_blocks", ">= 1 (or 0: auto)", _non_negative),
    ("ckpt.every", ">= 0", _non_negative),
    ("ckpt.keep", ">= 1", _positive),
]
