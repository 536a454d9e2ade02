#!/usr/bin/env bash
# One device call's worth of GPU evidence. Usage: bash bench/gpu_suite.sh SECTION... (results under $OUT or out/)
#   tests    GPU test suite (bf16 numerics at real sizes)
#   kernels  per-kernel benchmarks (attention, its Hopper Gluon kernels, layernorm, cross-entropy, adamw)
#   lnsweep  LayerNorm tiles and bandwidth per shape, A/B against .carry/old if that checkout exists
#   e2e      GPT-2 124M training throughput: nanopara vs torch / torch.compile
#   curve    GPT-2 124M loss curve on the offline book corpus (needs .carry/data: `make carry`, carried along)
#   evalbooks  issue #31: gpt2_124m trained on books as `curve` (runs under /tmp), then eval.py HellaSwag, val loss
#            and GSM8K (EVAL_TASKS; needs .carry/data/eval/{hellaswag,gsm8k})
#   moebooks   issue #27: gpt2_moe (top-1 = the dense model's active compute, with a softmax and a sigmoid gate, and
#            top-2) on books as `curve`, then
#            eval.py HellaSwag + val loss: against evalbooks' dense run (same tokens, same flags); BOOKS_RUNS="moe_top1"
#            runs some (lanes: one run per GPU); CURVE_STEPS (3000) sets the length of every books run
#   generate   issue #31: bench/bench_generate.py (ours vs Hugging Face generate), equal and mixed prompt lengths;
#            lists any local HF GPT-2 weights
#   posttrain  issue #31: bench/post_train_demo.py $PT_ARGS, rl.py keys for every RL run in $PT_RL_ARGS (runs
#            under /tmp/post_train$PT_TAG; JSON + logs to $OUT)
#   fp8      FP8 end to end (issue #26): fp8bench (bench/bench_fp8_e2e.py throughput + profile, ~4 min) then
#            fp8curve (gpt_1b on books, train.fp8=none vs tensor, 1000 steps each, and their comparison)
#   fp8bench  fp8's first half alone
#   fp8curve  fp8's second half alone
#   tuned    last: the shipped tuning table plus every kernel choice tuned on this machine, to $OUT (copy it over
#            kernels/tuned/ and commit, so later fresh machines skip those tunings)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$PWD/.carry/data/tiktoken_cache NANOPARA_MIRROR=${NANOPARA_MIRROR:-$PWD/.carry/data}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for s in "$@"; do
  case $s in
    tests)   $PY -m pytest -q -m gpu tests 2>&1 | tail -25 | tee "$OUT/tests_gpu.txt" ;;
    kernels) for k in attention attention_hopper layernorm cross_entropy adamw; do
               $PY -m kernels.$k --quick --out "$OUT/kernels.jsonl" 2>&1 | tee "$OUT/bench_$k.txt" | tail -14; done ;;
    lnsweep) $PY bench/sweep_layernorm.py $([ -d .carry/old/kernels ] && echo --old .carry/old) \
               --out "$OUT/sweep_layernorm.jsonl" 2>&1 | tee "$OUT/sweep_layernorm.txt" | grep -v picked ;;
    e2e)     $PY bench/bench_gpt.py --out "$OUT/e2e.jsonl" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.txt" | tail -12 ;;
    curve)   [ -f data/shards/books/books_val_000000.bin ] || \
               $PY data/prepare.py books --mirror .carry/data > "$OUT/prepare.txt" 2>&1
             $PY train.py --preset=gpt2_124m --data.dataset=books --out_dir="$OUT/curve" --train.micro_batch=16 \
               --train.steps=${CURVE_STEPS:-3000} --train.warmup_steps=200 --train.lr=1.2e-3 --train.val_every=250 \
               --train.log_every=50 --ckpt.final=false ${CURVE_ARGS:-} 2>&1 | grep -v '^ \|^[{}]' | tee "$OUT/curve.txt" | tail -8 ;;
    evalbooks|moebooks)
             [ -f data/shards/books/books_val_000000.bin ] || \
               $PY data/prepare.py books --mirror .carry/data > "$OUT/prepare_$s.txt" 2>&1
             if [ $s = evalbooks ]; then runs="dense:--preset=gpt2_124m"
             else runs="moe_top1:--preset=gpt2_moe,--model.moe_top_k=1,--model.moe_renorm=false moe_top2:--preset=gpt2_moe"
               runs="$runs moe_top1_sigmoid:--preset=gpt2_moe,--model.moe_top_k=1,--model.moe_renorm=false,--model.moe_score=sigmoid"; fi
             [ -n "${BOOKS_RUNS:-}" ] && runs=$(for r in $runs; do case " $BOOKS_RUNS " in *" ${r%%:*} "*) echo $r;; esac; done)
             for r in $runs; do name=${r%%:*}; flags=$(echo "${r#*:}" | tr ',' ' '); dir=/tmp/np_runs/books_$name
               $PY train.py $flags --data.dataset=books --out_dir=$dir --overwrite=true --train.micro_batch=16 \
                 --train.steps=${CURVE_STEPS:-3000} --train.warmup_steps=200 --train.lr=1.2e-3 --train.val_every=500 \
                 --train.log_every=100 ${CURVE_ARGS:-} 2>&1 | grep -v '^ \|^[{}]' > "$OUT/books_$name.txt"
               tail -3 "$OUT/books_$name.txt"; cp $dir/metrics.jsonl "$OUT/books_${name}_metrics.jsonl"
               $PY eval.py --out_dir=$dir --tasks=${EVAL_TASKS:-hellaswag,loss,gsm8k} --batch=32 ${EVAL_ARGS:-} \
                 --out="$OUT/books_evals.jsonl" 2>&1 \
                 | grep -v '^ ' | tail -4 | sed "s/^/$name: /"; done ;;
    generate) ls -d ~/.cache/huggingface/hub/*gpt2* 2>/dev/null | sed 's/^/local HF weights: /'
             $PY bench/bench_generate.py --out "$OUT" ${GEN_ARGS:-} 2>&1 | tee "$OUT/generate.txt" | tail -14
             mkdir -p "$OUT/mixed"; $PY bench/bench_generate.py --mixed --out "$OUT/mixed" ${GEN_ARGS:-} 2>&1 \
               | tee "$OUT/generate_mixed.txt" | tail -6 ;;
    posttrain) d=/tmp/post_train${PT_TAG:-}; rm -rf $d
             $PY bench/post_train_demo.py --out $d ${PT_ARGS:-} ${PT_RL_ARGS:+--rl_args="$PT_RL_ARGS"} 2>&1 | tail -20 | tee "$OUT/post_train${PT_TAG:-}.txt"
             cp $d/post_train.json "$OUT/post_train${PT_TAG:-}.json" 2>/dev/null
             tail -c 20000 $d/runs/sft.log > "$OUT/post_train${PT_TAG:-}_sft_log.txt" 2>/dev/null ;;
    fp8|fp8bench|fp8curve)
             if [ "$s" != fp8curve ]; then
               $PY bench/bench_fp8_e2e.py --profile --out "$OUT/fp8_e2e.jsonl" ${FP8_ARGS:-} 2>&1 \
                 | tee "$OUT/fp8_e2e.txt" | grep -v '^{' | tail -45; fi
             if [ "$s" != fp8bench ]; then
               [ -f data/shards/books/books_val_000000.bin ] || \
                 $PY data/prepare.py books --mirror .carry/data > "$OUT/prepare.txt" 2>&1
               for m in none tensor; do
                 $PY train.py --preset=gpt_1b --data.dataset=books --out_dir="$OUT/fp8_curve_$m" --train.fp8=$m \
                   --train.steps=${FP8_CURVE_STEPS:-1000} --train.micro_batch=8 --train.warmup_steps=100 \
                   --train.log_every=50 --train.val_every=250 --ckpt.final=false ${FP8_CURVE_ARGS:-} 2>&1 \
                   | grep -v '^ \|^[{}]' | tee "$OUT/fp8_curve_$m.txt" | tail -4; done
               $PY bench/bench_fp8_e2e.py --compare "$OUT/fp8_curve_none" "$OUT/fp8_curve_tensor" \
                 --plot "$OUT/fp8_curve.png" --out "$OUT/fp8_e2e.jsonl" 2>&1 | tee "$OUT/fp8_compare.txt"; fi ;;
    tuned) f=$($PY -m kernels.tuning --export | sed -n 's/.* to \(.*\.json\).*/\1/p')  # shipped table + this machine's
           [ -n "$f" ] && cp "$f" "$OUT/" && echo "tuning table $(basename "$f") -> \$OUT: copy it over kernels/tuned/" ;;
    *) echo "unknown section $s"; exit 2 ;;
  esac
done
