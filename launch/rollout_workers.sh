#!/usr/bin/env bash
# Start K external rollout workers that write trajectory shards for a trainer.
#
#   launch/rollout_workers.sh K CONFIG[:ARG] --config.workdir=DIR [--config.FIELD=VALUE ...]
#
#   launch/rollout_workers.sh 4 configs/carl.py:qwen2_5_7b,vllm \
#       --config.workdir=/shared/ckpt/carl7b \
#       --config.rollout.vllm_urls=http://gpu3:8000 --config.rollout.vllm_urls=http://gpu3:8001
#
# Worker i runs
#   agentrl rollout-worker --config CONFIG --worker-id i \
#       --config.async_rollout.enabled=true --config.async_rollout.workers=TOTAL ...
# and writes shards atomically under the workdir's trajectories/ (or
# --config.async_rollout.shard_dir), which the trainer reads: give the
# trainer and every worker the same config, workdir and shard_dir on shared
# storage, and --config.async_rollout.enabled=true to the trainer too. The
# workers generate through the vLLM servers of launch/vllm_servers.sh (config
# arg `vllm`); they run tools and rewards on the CPU.
#
# Environment: WORKER_OFFSET (0: the first worker id; for workers on several
# hosts), TOTAL_WORKERS (K: all workers of the run), LOG_DIR (./logs/workers),
# AGENTRL (default `agentrl`), JAX_PLATFORMS (default cpu, so a worker on a
# GPU host does not take GPU memory), DRY_RUN (1: print the commands only).
# The script waits for the workers; Ctrl-C / SIGTERM stops the ones it started.
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
num_workers="$1"
config="$2"
shift 2
if [[ " $* " != *" --config.workdir="* && " $* " != *" --config.async_rollout.shard_dir="* ]]; then
  echo "rollout_workers.sh: pass --config.workdir=DIR (the trainer's, on shared storage)" >&2
  exit 2
fi
offset="${WORKER_OFFSET:-0}"
total="${TOTAL_WORKERS:-$num_workers}"
log_dir="${LOG_DIR:-./logs/workers}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
read -r -a agentrl <<< "${AGENTRL:-agentrl}"

pids=()
# shellcheck disable=SC2329  # called by the trap below
stop() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2> /dev/null || true
  done
}
trap stop INT TERM

if [[ "${DRY_RUN:-0}" != "1" ]]; then
  mkdir -p "$log_dir"
fi
for (( i = offset; i < offset + num_workers; i++ )); do
  command=("${agentrl[@]}" rollout-worker --config "$config" --worker-id "$i"
           --config.async_rollout.enabled=true "--config.async_rollout.workers=${total}" "$@")
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    continue
  fi
  "${command[@]}" > "${log_dir}/worker_${i}.log" 2>&1 &
  pids+=("$!")
  echo "rollout_workers.sh: worker $i (pid $!), log ${log_dir}/worker_${i}.log"
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
