#!/usr/bin/env bash
# Several GPU jobs side by side on one lent host, within one device call, every result back in one file.
#
#   LIMIT=520 bash bench/lanes.sh "0:bash bench/gpu_suite.sh tests" "1:bash bench/gpu_suite.sh evalbooks" \
#       "2,3:RUNS='tp2 tp2_fp8' bash bench/gpu_multi.sh compose"
#
# Each argument is "GPUS:COMMAND": COMMAND runs under CUDA_VISIBLE_DEVICES=GPUS with OUT set to its own folder
# (lane1, lane2, ... in argument order), and is killed after LIMIT seconds (default 520) however it stands, so
# the call's own limit is never reached. Then the tail of every lane's log is printed and all lanes' folders go
# into $OUT/lanes.tgz: a device call brings back at most 8 files, and nothing at all when it times out.
# Without a "GPUS:" prefix (digits and commas) the command gets every GPU. After the lanes, `tuned` (bench/gpu_suite.sh) adds the tuning table.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-520}
R=$(mktemp -d /tmp/lanes.XXXX)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
t0=$(date +%s); i=0; pids=()
for lane in "$@"; do
  i=$((i + 1)); mkdir -p "$R/lane$i"
  if [[ $lane =~ ^([0-9,]+):(.*)$ ]]; then gpus=${BASH_REMATCH[1]}; cmd=${BASH_REMATCH[2]}; else gpus=""; cmd=$lane; fi
  echo "lane$i GPUs ${gpus:-all}: $cmd" | tee "$R/lane$i/command.txt"
  ( [ -n "$gpus" ] && export CUDA_VISIBLE_DEVICES=$gpus
    OUT="$R/lane$i" timeout -k 10 "$LIMIT" bash -c "$cmd" > "$R/lane$i/log" 2>&1
    echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$R/lane$i/log" ) &
  pids+=($!)
done
wait "${pids[@]}"
OUT="$R" bash bench/gpu_suite.sh tuned > "$R/tuned.txt" 2>&1
for d in "$R"/lane*; do echo "== $(basename "$d"): $(cat "$d/command.txt")"; grep -v -e '^nanopara: tuning' -e Warning "$d/log" \
  | tail -${TAIL:-15} | cut -c1-300; done
tar czf "$OUT/lanes.tgz" -C "$R" . && echo "all lanes: $OUT/lanes.tgz ($(du -h "$OUT/lanes.tgz" | cut -f1)), $(( $(date +%s) - t0 )) s"
