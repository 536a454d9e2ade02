#!/bin/bash
# Before/after a refactor on one GPU machine, in one run: train.py of another commit's tree (OLD, e.g. from
# `git archive <rev> | tar -x -C out/old`) and of this tree, same data, seed and flags; then bench/compare_runs.py.
#   bash bench/ab_train.sh OLD [OUT]    (needs 2 GPUs and tinyshakespeare's shards: make data)
# Rows: gpt2_124m on one GPU; gpt_1b at tp2 under a CUDA graph; gpt_1b at pp2 (1F1B, micro-batch 2, m = 16).
set -u
OLD=$(cd "$1" && pwd); OUT=${2:-out/ab}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); PY=${PY:-python3}
C="--data.data_dir=$PWD/data/shards --data.dataset=shakespeare --train.val_every=0 --train.sample_tokens=0 \
   --ckpt.final=false --train.log_every=5"
run() {  # name nproc seconds flags...
  name=$1; n=$2; lim=$3; shift 3
  for side in old new; do
    dir=.; [ $side = old ] && dir=$OLD
    ( cd "$dir" && timeout "$lim" $PY -m torch.distributed.run --standalone --nproc_per_node="$n" train.py $C \
        --out_dir="$OUT/${side}_$name" "$@" > "$OUT/${side}_$name.log" 2>&1 ) || echo "failed: $side $name"
  done
}
run gpt2_124m 1 75 --preset=gpt2_124m --train.steps=40
run gpt_1b_tp2_graph 2 100 --preset=gpt_1b --parallel.tp=2 --train.cuda_graph=true --train.tokens_per_step=32768 \
  --train.steps=15
run gpt_1b_pp2_mb2 2 100 --preset=gpt_1b --parallel.pp=2 --train.micro_batch=2 --train.tokens_per_step=32768 \
  --train.steps=15
$PY bench/compare_runs.py "$OUT" gpt2_124m gpt_1b_tp2_graph gpt_1b_pp2_mb2 | tee "$OUT/ab.jsonl"
