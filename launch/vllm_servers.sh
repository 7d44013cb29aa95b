#!/usr/bin/env bash
# Start N vLLM OpenAI-compatible servers on this host for VLLMEngine (rollouts).
#
#   launch/vllm_servers.sh MODEL_DIR [NUM_SERVERS]
#
#   launch/vllm_servers.sh /models/Qwen2.5-7B-Instruct 4            # GPUs 0-3, ports 8000-8003
#   TP=2 GPU_OFFSET=4 launch/vllm_servers.sh /models/Qwen3-8B 2      # GPUs 4-5 and 6-7
#   LORA_RANK=16 launch/vllm_servers.sh /models/Qwen2.5-7B-Instruct  # PORTool (LoRA sync)
#   SERVER=agentrl launch/vllm_servers.sh tiny 2                     # CPU stand-in
#
# Server i uses GPUs GPU_OFFSET + i*TP ... + TP-1 and port BASE_PORT + i, and
# serves the model as SERVED_MODEL_NAME. The script prints the trainer flags
# (--config.rollout.vllm_urls=...), then waits; Ctrl-C / SIGTERM stops every
# server it started.
#
# What VLLMEngine (agentrl/rollout/vllm_engine.py) needs from each server
# (docs/rollouts.md, "Running real vLLM servers"):
#   --logprobs-mode processed_logprobs    logprobs of the sampling distribution
#                                         (after temperature / top-p / top-k)
#   VLLM_USE_FLASHINFER_SAMPLER=0         the sampler that returns them
#   --generation-config vllm              ignore generation_config.json defaults
#   --enable-prefix-caching               turns of one trajectory reuse their KV
#   --served-model-name policy            the `model` of requests
#                                         (config.rollout.vllm_model)
#   VLLM_SERVER_DEV_MODE=1                /collective_rpc (update_config,
#                                         reload_weights) and /reset_prefix_cache
#                                         for full-weight sync
#   --enable-lora --max-lora-rank R       /v1/load_lora_adapter for LoRA sync
#   --max-loras 2 and                     (LORA_RANK > 0; R >= model.lora.rank;
#   VLLM_ALLOW_RUNTIME_LORA_UPDATING=True  two slots: the new adapter loads while
#                                          the old one drains)
# Checked against vLLM 0.11 (VLLMEngine needs >= 0.10.2); check the flags again
# when the vLLM version changes. MAX_MODEL_LEN must cover the config's
# rollout.max_context_tokens. An API key: export VLLM_API_KEY (vLLM reads it;
# VLLMEngine reads a key from the variable its api_key_env names). Weight sync
# goes through files: the trainer's workdir must be readable here, same path.
#
# Environment (defaults): TP (1), GPU_OFFSET (0), BASE_PORT (8000), HOST
# (0.0.0.0; agentrl: 127.0.0.1, this machine only), SERVED_MODEL_NAME
# (policy), MAX_MODEL_LEN (8192), GPU_MEMORY_UTILIZATION (0.85), DTYPE
# (bfloat16; agentrl: float32), LORA_RANK (0: off), SERVER (vllm | agentrl:
# `agentrl serve`, the JAX engine behind the same protocol, for CPU runs),
# EXTRA_ARGS (more server flags), LOG_DIR (./logs/vllm), READY_TIMEOUT (900 s
# to wait for /health; 0: do not wait), DRY_RUN (1: print the commands only).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
model="$1"
num_servers="${2:-1}"
server="${SERVER:-vllm}"
tp="${TP:-1}"
gpu_offset="${GPU_OFFSET:-0}"
base_port="${BASE_PORT:-8000}"
served="${SERVED_MODEL_NAME:-policy}"
max_model_len="${MAX_MODEL_LEN:-8192}"
gpu_memory="${GPU_MEMORY_UTILIZATION:-0.85}"
lora_rank="${LORA_RANK:-0}"
log_dir="${LOG_DIR:-./logs/vllm}"
ready_timeout="${READY_TIMEOUT:-900}"
dry_run="${DRY_RUN:-0}"
read -r -a extra <<< "${EXTRA_ARGS:-}"

case "$server" in
  vllm) dtype="${DTYPE:-bfloat16}" host="${HOST:-0.0.0.0}" ;;
  agentrl) dtype="${DTYPE:-float32}" host="${HOST:-127.0.0.1}" ;;
  *) echo "vllm_servers.sh: SERVER=$server; use vllm or agentrl" >&2; exit 2 ;;
esac

server_command() {  # server_command INDEX -> the command in the array `command`
  local index="$1"
  local port=$(( base_port + index ))
  if [[ "$server" == "agentrl" ]]; then
    read -r -a command <<< "${AGENTRL:-agentrl}"
    command+=(serve --model "$model" --served-model-name "$served" --host "$host"
              --port "$port" --max-model-len "$max_model_len" --dtype "$dtype" "${extra[@]}")
    return
  fi
  local first=$(( gpu_offset + index * tp ))
  command=(env "CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $(( first + tp - 1 )))"
           VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
           VLLM_USE_FLASHINFER_SAMPLER=0
           vllm serve "$model" --served-model-name "$served" --host "$host" --port "$port"
           --tensor-parallel-size "$tp" --dtype "$dtype" --max-model-len "$max_model_len"
           --gpu-memory-utilization "$gpu_memory" --logprobs-mode processed_logprobs
           --generation-config vllm --enable-prefix-caching)
  if (( lora_rank > 0 )); then
    command+=(--enable-lora --max-lora-rank "$lora_rank" --max-loras 2)
  fi
  command+=("${extra[@]}")
}

pids=()
stop() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2> /dev/null || true
  done
}
trap stop EXIT INT TERM

urls=()
url_host="$host"
if [[ "$host" == "0.0.0.0" ]]; then
  url_host="$(hostname)"
fi
if [[ "${DRY_RUN:-0}" != "1" ]]; then
  mkdir -p "$log_dir"
fi
for (( i = 0; i < num_servers; i++ )); do
  server_command "$i"
  urls+=("http://${url_host}:$(( base_port + i ))")
  if [[ "$dry_run" == "1" ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    continue
  fi
  "${command[@]}" > "${log_dir}/server_${i}.log" 2>&1 &
  pids+=("$!")
  echo "vllm_servers.sh: server $i (pid $!) on ${urls[-1]}, log ${log_dir}/server_${i}.log"
done

flags=""
for url in "${urls[@]}"; do
  flags+=" --config.rollout.vllm_urls=${url}"
done
echo "trainer / rollout-worker flags: --config.rollout.engine=vllm" \
     "--config.rollout.vllm_model=${served}${flags}"
if [[ "$dry_run" == "1" ]]; then
  exit 0
fi

if (( ready_timeout > 0 )); then
  for url in "${urls[@]}"; do
    waited=0
    until curl -fsS "${url}/health" > /dev/null 2>&1; do
      if (( waited >= ready_timeout )); then
        echo "vllm_servers.sh: ${url} not ready after ${ready_timeout} s; see ${log_dir}" >&2
        exit 1
      fi
      sleep 5
      waited=$(( waited + 5 ))
    done
    echo "vllm_servers.sh: ${url} ready"
  done
fi
wait
