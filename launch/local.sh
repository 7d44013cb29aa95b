#!/usr/bin/env bash
# Single-process training: CPU, one GPU, or all GPUs of one host (one JAX process).
#
#   launch/local.sh CONFIG[:ARG] [--config.FIELD=VALUE ...]
#
#   launch/local.sh configs/cpu_demo.py
#   taskset -c 0,1 launch/local.sh configs/cpu_demo.py          # pin to 2 cores
#   WORKDIR=/ckpt/run1 launch/local.sh configs/carl.py:qwen2_5_7b --config.train.steps=10
#
# Environment:
#   WORKDIR   run directory, passed as --config.workdir (default
#             /tmp/agentrl/<file>-<arg>); a --config.workdir=... argument wins.
#   AGENTRL   the agentrl command (default: `agentrl`, else `python3 -m agentrl.cli`).
#   DRY_RUN   1: print the command instead of running it.
#
# JAX uses every local device (JAX_PLATFORMS=cpu forces the CPU). With
# engine `vllm` (e.g. configs/grpo.py:qwen2_5_7b,vllm) start the servers first
# (launch/vllm_servers.sh) and pass their URLs:
#   --config.rollout.vllm_urls=http://host:8000 --config.rollout.vllm_urls=http://host:8001
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  exit 2
fi
config="$1"
shift

if [[ -n "${AGENTRL:-}" ]]; then
  read -r -a agentrl <<< "$AGENTRL"
elif command -v agentrl > /dev/null 2>&1; then
  agentrl=(agentrl)
else
  agentrl=(python3 -m agentrl.cli)
fi

file="${config%%:*}"
arg=""
if [[ "$config" == *:* ]]; then
  arg="${config#*:}"
fi
name="$(basename "$file" .py)${arg:+-${arg//,/-}}"
workdir="${WORKDIR:-/tmp/agentrl/${name}}"

command=("${agentrl[@]}" train --config "$config" "--config.workdir=${workdir}" "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${command[@]}"
  printf '\n'
  exit 0
fi
mkdir -p "$workdir"
exec "${command[@]}"
