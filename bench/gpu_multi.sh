#!/usr/bin/env bash
# Multi-GPU evidence (run on a 2- or 4-GPU machine). Usage: bash bench/gpu_multi.sh SECTION... ; results in $OUT.
#   tests  NCCL tests of dp/tp (need >= 2 GPUs)
#   comm   ring all-reduce vs NCCL bus bandwidth on 2 and N GPUs
#   dp     GPT-2 124M tokens/s: our DDP and ZeRO-1/2/3 vs torch DDP at dp = 1, 2, N; ZeRO memory on gpt2_1558m
#   scale  DDP scaling 1 -> N on this machine (30 timed steps): torch DDP, ours fp32 and bf16 reduction, no-comm control
#   zero3  ZeRO-3 prefetch depth 1 vs 2 against our DDP, twice interleaved, one profiled step per mode; then B=32/GPU
#   zero3u ZeRO-3 units of 1, 2, 3, 4 blocks (parallel.zero3_unit_blocks) against our DDP, twice interleaved, at
#          B=16/GPU (where the forward is host-bound) and B=32; one profiled step per mode
#   acc    GPT-2's batch of 524,288 tokens (B=16 x T=1024, 32 micro-steps on one GPU, 32/N on N): torch DDP and
#          ours at 1 and N GPUs, ZeRO-1/2 and ZeRO-3 (units of 3 blocks) at N; scaling against the same run; then
#          one micro-step of B=32 per GPU, the same modes
#   tp     tp = 2 and N on gpt2_124m and gpt_1b, sp off/on: tokens/s, MFU, memory, comm overhead
#   ab     engine A/B: this tree against OLD=<dir of another commit's tree> (git archive REV | tar -x -C dir),
#          DDP and ZeRO-2 at GPT-2's batch (32/N micro-steps), new, old, new, old in separate processes; then one
#          micro-step of B=32 per GPU (our DDP's scaling against the one-GPU run of the same tree, no-comm control)
#   tpspeed  issue #30: PRESET (gpt_1b) at B=8 x 1024: BASE runs (1 GPU eager/graphed, dp2 ZeRO-3, tp2 and tp2+sp of
#          OLD=<tree before>), then tp2 with sp in SPS, parallel.tp_overlap in OVERLAPS ("0 4"), cuda_graph in
#          GRAPHS ("false true"), SP's parallel.sp_keep_gathered in KEEPS ("false"), of NEW (default this tree):
#          tokens/s, MFU, memory, exposed comm per layer
#   layouts  issue #28: PRESET (gpt_1b) through bench_layout.py (train.py's step, synthetic tokens): 1 GPU, dpN, tpN
#          (+sp, +CUDA graph), tpN/2 x dp2, ppN, tp2 x pp2, pp2 x dp2 at G=32 sequences of 1024 a step; 1 GPU, cpN,
#          tp2 x cp2, cp2 x dp2 at one sequence of 16k, 1 GPU, cpN and cp2 + ZeRO-1 at four 16k sequences a step,
#          cpN ring and Ulysses at one sequence of CP_LONG (131072) tokens.
#          RUNS="label ..." runs some. Then, for the same issue:
#          sections pp, cp and ep below
#   layouts3d  issue #29 (8 GPUs): 1 GPU, dpN + ZeRO-1, tp2 x pp2 x dpN/4, tp4 x pp2 (+sp) at G=64 sequences of 1024
#          a step; tp2 x cp2 x dpN/4 at 16k (PRESET gpt_1b, then PRESET=gpt2_1558m); with `ep` for the MoE (ep8, ep4)
#   compose  layouts built without GPU numbers yet: FP8 on 1 GPU / tp2 (+sp, +CUDA graph), gpt2_moe (FP8 experts) under pp2,
#          tp2 + sp, ep2 + ZeRO-3 and (4 GPUs) ep2 x pp2, each beside its plain run
#   pp     bench_pp.py: ppN (N = the GPUs) with PP_SCHEDULES at m = PP_M (16), PRESET (gpt_1b), Triton kernels
#   cp     bench_cp.py: cpN at one sequence of CP_T (32768) tokens: efficiency, exposed comm, Ulysses, zigzag balance;
#          CP_ARGS="--memory" adds peak memory at T/2 and T and the longest T that fits
#   ep     bench_ep.py: gpt2_moe on 1 GPU, dpN, epN and (N > 2) epN/2 x dp2, one profiled step per layout
#   train  train.py's own step time (metrics.jsonl, bench/step_times.py) at B=16, one micro-step, on 1 and N GPUs,
#          this tree and OLD="<dir> ..." (other commits' trees) alternating, twice; needs data/shards/shakespeare
#   tuned    last: the shipped tuning table plus every kernel choice tuned on this machine, to $OUT (copy it over
#            kernels/tuned/ and commit, so later fresh machines skip those tunings)
# Planning a device call (what cost whole calls before): a call returns at most 8 files, so tar $OUT's folders into
# one; keep the sum of the command's own `timeout`s under the call's limit, or nothing comes back; a fresh machine
# tunes every kernel shape on first use (FP8 and grouped GEMM layouts spend 1-2 minutes of each process tuning:
# run `tuned` at the end and commit the table); lanes on one host: CUDA_VISIBLE_DEVICES=0,1 ... (N follows it).
# bench/lanes.sh does all of this: lanes with their GPUs, one time limit, one tar, the tuning table.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
lay() {  # LABEL NGPU TRAIN.PY-FLAGS...: one bench_layout.py run of PRESET $P, unless RUNS names others
  label=$1; n=$2; shift 2
  case " ${RUNS:-all} " in *" all "*|*" $label "*) ;; *) return ;; esac
  timeout ${LAY_TIMEOUT:-180} $PY -m torch.distributed.run --standalone --nproc_per_node=$n \
    bench/bench_layout.py --out "$OUT" --label "$label" -- --preset=$P "$@"; }
PY=${PY:-python3}
N=$(nvidia-smi -L | wc -l)  # the GPUs this process may use (CUDA_VISIBLE_DEVICES lanes on one host)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && N=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
run() { $PY -m torch.distributed.run --standalone --nproc_per_node="$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader  # (stdout only: a call returns at most 8 files)
for s in "$@"; do
  case $s in
    tests) $PY -m pytest -q -m gpu tests/test_dp.py tests/test_tp.py 2>&1 | tail -8 | tee "$OUT/tests_multi.txt" ;;
    comm)  for n in 2 $N; do run $n bench/bench_comm.py --quick --out "$OUT/comm_$n.json" 2>&1 | tail -12; done \
             | tee "$OUT/comm.txt" ;;
    dp)    { run 1 bench/bench_dp.py --quick --modes torch_ddp,ddp --large '' --out "$OUT/dp_1.json"
             run 2 bench/bench_dp.py --quick --modes torch_ddp,ddp,zero1,zero2,zero3 --large '' --out "$OUT/dp_2.json"
             run $N bench/bench_dp.py --quick --out "$OUT/dp_$N.json"; } 2>&1 | grep -v Warning | tee "$OUT/dp.txt" ;;
    scale) { run 1 bench/bench_dp.py --modes torch_ddp,ddp --large '' --out "$OUT/scale_1.json"
             for k in $(seq 1 $((N - 1))); do  # every other card alone: are the cards equally fast?
               CUDA_VISIBLE_DEVICES=$k run 1 bench/bench_dp.py --modes ddp --large '' | tail -1 | sed "s/^/GPU $k alone: /"
             done
             run $N bench/bench_dp.py --modes ddp:single,ddp:nocomm,torch_ddp,ddp,ddp:bf16,zero1,zero2,zero3 \
               --large '' --baseline "$OUT/scale_1.json" --out "$OUT/scale_$N.json"
             # GPT-2's 0.5M-token batch (B=16 x T=1024 x 32 sequences per step on one GPU, 32/N micro-steps on N)
             run 1 bench/bench_dp.py --modes torch_ddp,ddp --accum 32 --warmup 1 --steps 4 --large '' \
               --out "$OUT/scale_1_acc.json"
             run $N bench/bench_dp.py --modes torch_ddp,ddp --accum $((32 / N)) --warmup 2 --steps $((4 * N)) --large '' \
               --baseline "$OUT/scale_1_acc.json" --out "$OUT/scale_${N}_acc.json"
           } 2>&1 | grep -v Warning | tee "$OUT/scale.txt" ;;
    zero3) { run $N bench/bench_dp.py --modes ddp,zero3,zero3:p2,ddp,zero3,zero3:p2 --large '' --out "$OUT/zero3_$N.json"
             run $N bench/bench_dp.py --modes ddp,zero3,zero3:p2 --large '' --steps 5 --profile "$OUT/prof" >/dev/null
             cat "$OUT"/prof/*.txt > "$OUT/zero3_profiles.txt"; rm -r "$OUT/prof"; grep profile "$OUT/zero3_profiles.txt"
             run $N bench/bench_dp.py --modes ddp,zero3,ddp,zero3 --micro_batch 32 --large '' --out "$OUT/zero3_b32_$N.json"
           } 2>&1 | grep -v Warning | tee "$OUT/zero3.txt" ;;
    zero3u) { u=zero3:u1,zero3:u2,zero3:u3,zero3:u4
             run $N bench/bench_dp.py --modes ddp,$u,ddp,$u --large '' --out "$OUT/zero3u_$N.json"
             run $N bench/bench_dp.py --modes ddp,$u --large '' --steps 5 --profile "$OUT/prof" >/dev/null
             cat "$OUT"/prof/*.txt > "$OUT/zero3u_prof.txt"; rm -r "$OUT/prof"; grep profile "$OUT/zero3u_prof.txt"
             run $N bench/bench_dp.py --modes ddp,$u --micro_batch 32 --large '' --out "$OUT/zero3u_b32_$N.json"
           } 2>&1 | grep -v Warning | tee "$OUT/zero3u.txt" ;;
    acc)   { run 1 bench/bench_dp.py --modes torch_ddp,ddp --accum 32 --warmup 1 --steps 4 --large '' \
               --out "$OUT/acc_1.json"
             run $N bench/bench_dp.py --modes torch_ddp,ddp,zero1,zero2,zero3:u3,torch_ddp,ddp,zero2 --accum $((32 / N)) \
               --warmup 2 --steps $((4 * N)) --large '' --baseline "$OUT/acc_1.json" --out "$OUT/acc_$N.json"
             run 1 bench/bench_dp.py --modes torch_ddp,ddp --micro_batch 32 --large '' --out "$OUT/one_1.json"
             run $N bench/bench_dp.py --modes torch_ddp,ddp,zero1,zero2,zero3:u3 --micro_batch 32 --large '' \
               --baseline "$OUT/one_1.json" --out "$OUT/one_$N.json"
           } 2>&1 | grep -v Warning | tee "$OUT/acc.txt" ;;
    tp)    { for n in 2 $N; do run $n bench/bench_tp.py --preset gpt2_124m --quick --out "$OUT/tp124_$n.json"; done
             run $N bench/bench_tp.py --preset gpt2_124m --sp --quick --out "$OUT/tp124sp_$N.json"
             run $N bench/bench_tp.py --preset gpt_1b --quick --out "$OUT/tp1b_$N.json"
             run $N bench/bench_tp.py --preset gpt_1b --sp --quick --out "$OUT/tp1bsp_$N.json"; } 2>&1 \
             | grep -v Warning | tee "$OUT/tp.txt" ;;
    ab)    { [ -d "${OLD:-}" ] || { echo "ab: set OLD to another commit's tree"; exit 2; }
             here=$PWD
             for tree in new old new old; do
               [ $tree = new ] && cd "$here" || cd "$OLD"
               TRITON_CACHE_DIR=$HOME/.triton_$tree run $N bench/bench_dp.py --modes ddp,zero2,ddp,zero2 \
                 --accum $((32 / N)) --warmup 2 --steps $((4 * N)) --large '' --out "$OUT/ab_acc_${tree}_$N.json" \
                 | tail -5 | sed "s/^/$tree: /"
             done
             for tree in new old; do
               [ $tree = new ] && cd "$here" || cd "$OLD"
               run 1 bench/bench_dp.py --modes ddp --micro_batch 32 --large '' --out "$OUT/ab_one_${tree}_1.json" \
                 | tail -1 | sed "s/^/$tree 1 GPU: /"
               run $N bench/bench_dp.py --modes ddp:nocomm,ddp,zero2,ddp --micro_batch 32 --large '' \
                 --baseline "$OUT/ab_one_${tree}_1.json" --out "$OUT/ab_one_${tree}_$N.json" | tail -5 | sed "s/^/$tree: /"
             done; cd "$here"
           } 2>&1 | grep -v Warning | tee "$OUT/ab.txt" ;;
    train) { for d in ${OLD:-}; do [ -d "$d" ] || { echo "train: OLD: no tree $d"; exit 2; }; done
             [ -n "${OLD:-}" ] || { echo "train: set OLD to other commits' trees"; exit 2; }
             here=$PWD; args="--preset=gpt2_124m --device=cuda --model.kernels=torch --train.micro_batch=16
               --train.steps=60 --train.val_every=0 --train.sample_tokens=0 --train.log_every=1000
               --ckpt.final=false --data.data_dir=$here/data/shards"
             for n in 1 $N; do for pass in 1 2; do for tree in "$here" $OLD; do
               cd "$tree"; name=$([ "$tree" = "$here" ] && echo new || basename "$tree")
               rm -rf /tmp/np_train; run $n train.py $args --out_dir=/tmp/np_train >/dev/null 2>&1
               $PY "$here/bench/step_times.py" /tmp/np_train | sed "s|^/tmp/np_train|$n GPU $name|"
             done; done; done; cd "$here"
           } 2>&1 | grep -v Warning | tee "$OUT/train.txt" ;;
    tpspeed) # issue #30: tp2 / tp2+sp before (OLD tree) and after, overlap off (0) and on, eager and graphed
           [ -d "${OLD:-}" ] || { echo "tpspeed: set OLD to the tree before (git archive REV | tar -x -C dir)"; exit 2; }
           P=${PRESET:-gpt_1b}; common="--preset=$P --train.micro_batch=${B:-8} --train.seq_len=1024"
           new=${NEW:+--tree $NEW}  # NEW: this tree, or another (e.g. a committed snapshot)
           prof() { label=$1; n=$2; shift 2  # a stuck run (NP_STACKS_AFTER: its stacks) must not eat the lane
             timeout ${LAY_TIMEOUT:-180} $PY -m torch.distributed.run --standalone --nproc_per_node=$n "$@" \
               --out "$OUT" --label "$label" -- $common $FLAGS || echo "$label: exit $?"; }
           { for b in ${BASE:-1gpu 1gpu_graph dp2_zero3 old_tp2 old_tp2_sp}; do case $b in
               1gpu) FLAGS="" prof $b 1 bench/bench_layout.py $new ;;
               1gpu_graph) FLAGS="--train.cuda_graph=true" prof $b 1 bench/bench_layout.py $new ;;
               dp2_zero3) FLAGS="--parallel.zero=3" prof $b 2 bench/bench_layout.py $new ;;
               old_tp2) FLAGS="--parallel.tp=2" prof $b 2 bench/bench_layout.py --tree "$OLD" ;;
               old_tp2_sp) FLAGS="--parallel.tp=2 --parallel.sp=true" prof $b 2 bench/bench_layout.py --tree "$OLD" ;;
             esac; done
             for g in ${GRAPHS:-false true}; do for ov in ${OVERLAPS:-0 4}; do for sp in ${SPS:-false true}; do
               for keep in $([ $sp = true ] && echo ${KEEPS:-false} || echo false); do
               FLAGS="--parallel.tp=2 --parallel.sp=$sp --parallel.tp_overlap=$ov --train.cuda_graph=$g" \
               FLAGS="$FLAGS$([ $keep = true ] && echo ' --parallel.sp_keep_gathered=true')" \
                 prof tp2$([ $sp = true ] && echo _sp)$([ $keep = true ] && echo _keep)_ov$ov$([ $g = true ] && echo _graph) \
                 2 bench/bench_layout.py $new
             done; done; done; done; } 2>&1 | grep -v -e Warning -e OMP_NUM -e '^\*\*\*' -e '^ *_warn' -e '^$' \
             | tee -a "$OUT/tpspeed_$P.txt" ;;
    layouts) # issue #28: train.py's step (bench_layout.py) per layout on N GPUs against 1 GPU and dp-only, PRESET
           # (gpt_1b) at GPT-2's T=1024 and G (32) sequences a step; then T=16k (CP) layouts. RUNS picks some.
           P=${PRESET:-gpt_1b}; G=${G:-32}; h=$((N / 2))
           t1k="--train.seq_len=1024 --train.tokens_per_step=$((G * 1024))"
           t16k="--train.seq_len=16384 --model.block_size=16384 --train.micro_batch=1 --train.tokens_per_step=16384"
           { lay 1gpu 1 $t1k --train.micro_batch=8
             lay dp$N $N $t1k --train.micro_batch=8
             lay tp$N $N $t1k --train.micro_batch=8 --parallel.tp=$N
             lay tp${N}_sp $N $t1k --train.micro_batch=8 --parallel.tp=$N --parallel.sp=true
             lay tp${N}_graph $N $t1k --train.micro_batch=8 --parallel.tp=$N --train.cuda_graph=true
             lay tp${h}_dp2 $N $t1k --train.micro_batch=8 --parallel.tp=$h
             lay pp$N $N $t1k --train.micro_batch=2 --parallel.pp=$N --parallel.pp_layers=${PP_LAYERS:-5,5,5,3}
             lay tp2_pp2 $N $t1k --train.micro_batch=4 --parallel.tp=2 --parallel.pp=2 --parallel.pp_layers=10,8
             lay pp2_dp2 $N $t1k --train.micro_batch=4 --parallel.pp=2 --parallel.pp_layers=10,8
             lay 1gpu_16k 1 $t16k
             lay cp${N}_16k $N $t16k --parallel.cp=$N
             lay tp2_cp2_16k $N $t16k --parallel.tp=2 --parallel.cp=2
             lay cp2_dp2_16k $N $t16k --parallel.cp=2
             # four 16k sequences a step with ZeRO-1: the gradient reduction and AdamW amortised as a real run's
             lay 1gpu_16k_acc4 1 $t16k --train.tokens_per_step=65536
             lay cp${N}_16k_acc4_zero1 $N $t16k --parallel.cp=$N --train.tokens_per_step=65536 --parallel.zero=1
             lay cp2_16k_acc4_zero1 2 $t16k --parallel.cp=2 --train.tokens_per_step=65536 --parallel.zero=1
             # one sequence of CP_LONG (131072) tokens: about the longest cp4 fits without recompute (bench_cp --memory)
             # (expandable segments: the ring at 128k on cp4 ran out of memory with 10.4 GB reserved but unallocated)
             tl="--train.seq_len=${CP_LONG:-131072} --model.block_size=${CP_LONG:-131072} --train.micro_batch=1"
             ( export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
               lay cp${N}_long $N $tl --train.tokens_per_step=${CP_LONG:-131072} --parallel.cp=$N
               lay cp${N}_long_ulysses $N $tl --train.tokens_per_step=${CP_LONG:-131072} --parallel.cp=$N \
                 --parallel.cp_impl=ulysses )
           } 2>&1 | grep -v -e Warning -e OMP_NUM -e '^\*\*\*' -e '^ *_warn' -e '^$' | tee -a "$OUT/layouts_$P.txt" ;;
    layouts3d) # issue #29 (8 GPUs): 3D layouts of PRESET (gpt_1b; gpt2_1558m) against 1 GPU and dpN at G (64)
           # sequences of 1024 a step, and tp2 x cp2 x dp at 16k; the stages balanced for the head (bench_pp.py's rule)
           P=${PRESET:-gpt_1b}; G=${G:-64}
           L2=$($PY -c "import sys; sys.path.insert(0, 'bench'); from bench_pp import PRESETS, balanced_layers as b
m = PRESETS['$P']().model; print(','.join(map(str, b(m.n_layer, 2, 2 * m.padded_vocab / (24 * m.n_embd + 4096)))))")
           t1k="--train.seq_len=1024 --train.tokens_per_step=$((G * 1024))"
           t16k="--train.seq_len=16384 --model.block_size=16384 --train.micro_batch=1 --train.tokens_per_step=$((N / 4 * 16384))"
           { lay 1gpu 1 $t1k --train.micro_batch=8
             lay dp$N $N $t1k --train.micro_batch=8 --parallel.zero=1
             lay tp2_pp2_dp$((N / 4)) $N $t1k --train.micro_batch=4 --parallel.tp=2 --parallel.pp=2 --parallel.pp_layers=$L2 \
               --parallel.zero=1
             lay tp4_pp2 $N $t1k --train.micro_batch=4 --parallel.tp=4 --parallel.pp=2 --parallel.pp_layers=$L2
             lay tp4_pp2_sp $N $t1k --train.micro_batch=4 --parallel.tp=4 --parallel.sp=true --parallel.pp=2 \
               --parallel.pp_layers=$L2
             lay 1gpu_16k 1 $t16k --train.tokens_per_step=16384
             lay tp2_cp2_dp$((N / 4))_16k $N $t16k --parallel.tp=2 --parallel.cp=2 --parallel.zero=1
           } 2>&1 | grep -v -e Warning -e OMP_NUM -e '^\*\*\*' -e '^ *_warn' -e '^$' | tee -a "$OUT/layouts3d_$P.txt" ;;
    compose) # the compositions without GPU numbers yet: FP8 on tp2 (+sp, +CUDA graph) of gpt_1b; gpt2_moe under
           # pp2, tp2 + sp, ep2 x pp2 and ep x ZeRO-3, each against its plain run (bench_layout.py, 1 or 2+ GPUs)
           P=gpt_1b; t1k="--train.seq_len=1024 --train.micro_batch=8 --train.tokens_per_step=$((N * 8192))"
           { lay 1gpu_fp8 1 $t1k --train.tokens_per_step=8192 --train.fp8=tensor
             lay 1gpu_fp8_graph 1 $t1k --train.tokens_per_step=8192 --train.fp8=tensor --train.cuda_graph=true
             lay tp2 2 $t1k --train.tokens_per_step=8192 --parallel.tp=2
             lay tp2_fp8 2 $t1k --train.tokens_per_step=8192 --parallel.tp=2 --train.fp8=tensor
             lay tp2_sp_fp8 2 $t1k --train.tokens_per_step=8192 --parallel.tp=2 --parallel.sp=true --train.fp8=tensor
             lay tp2_fp8_graph 2 $t1k --train.tokens_per_step=8192 --parallel.tp=2 --train.fp8=tensor \
               --train.cuda_graph=true
             P=gpt2_moe; m="--train.seq_len=1024 --train.micro_batch=8"
             lay moe_1gpu 1 $m --train.tokens_per_step=32768
             lay moe_1gpu_fp8_experts 1 $m --train.tokens_per_step=32768 --train.fp8=row --train.fp8_filter='*.experts'
             lay moe_pp2 2 $m --train.tokens_per_step=32768 --parallel.pp=2 --parallel.pp_layers=8,4
             lay moe_tp2_sp 2 $m --train.tokens_per_step=16384 --parallel.tp=2 --parallel.sp=true
             lay moe_ep2_zero3 2 $m --train.tokens_per_step=16384 --parallel.ep=2 --parallel.zero=3
             [ $N -ge 4 ] && lay moe_ep2_pp2 4 $m --train.tokens_per_step=32768 --parallel.ep=2 --parallel.pp=2 \
               --parallel.pp_layers=8,4
           } 2>&1 | grep -v -e Warning -e OMP_NUM -e '^\*\*\*' -e '^ *_warn' -e '^$' | tee -a "$OUT/compose.txt" ;;
    pp)    run $N bench/bench_pp.py --preset ${PRESET:-gpt_1b} --kernels auto --n_micro ${PP_M:-16} \
             --schedules ${PP_SCHEDULES:-1f1b,interleaved:2,zb} --compare '' --out "$OUT/pp$N.jsonl" 2>&1 \
             | grep -v -e Warning -e OMP_NUM | tee "$OUT/pp$N.txt" ;;
    cp)    run $N bench/bench_cp.py --seq_len ${CP_T:-32768} --steps 3 --out "$OUT/cp$N" ${CP_ARGS:-} 2>&1 \
             | grep -v -e Warning -e OMP_NUM | tee "$OUT/cp$N.txt" ;;
    ep)    run $N bench/bench_ep.py --layouts single,dp$N,ep$N$([ $N -gt 2 ] && echo ,ep$((N / 2))) --profile --out "$OUT/ep$N" \
             2>&1 | grep -v -e Warning -e OMP_NUM | tee "$OUT/ep$N.txt" ;;
    tuned) f=$($PY -m kernels.tuning --export | sed -n 's/.* to \(.*\.json\).*/\1/p')  # shipped table + this machine's
           [ -n "$f" ] && cp "$f" "$OUT/" && echo "tuning table $(basename "$f") -> \$OUT: copy it over kernels/tuned/" ;;
    *) echo "unknown section $s"; exit 2 ;;
  esac
done
