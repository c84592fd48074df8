#!/usr/bin/env bash
# Launch ONE real vLLM instance (prefill or decode) with NIXL (pull or push) on a CPU-only machine.
#
#   deploy/vllm/launch-cpu.sh --role prefill|decode --port HTTP_PORT --side-port NIXL_PORT
#                             [--core N] [--name INSTANCE] [--otlp URL] [--lease SECONDS]
#                             [--env DIR] [--model DIR] [--served-name NAME]
#                             [--nixl-progress delay|busy|off] [--progress-delay-us N] [--amx]
#                             [--handoff pull|push] [--engine-id ID]
#                             [--kv-events ENDPOINT [--kv-events-replay ENDPOINT] [--kv-events-topic T]]
#
# The script execs vLLM's OpenAI server, so its PID is the server's PID; the engine core and
# worker are its children (stop the process group). It binds 127.0.0.1 only and keeps NIXL's
# side channel and UCX on loopback.
#
#   --role        prefill -> kv_producer, decode -> kv_consumer
#   --port        HTTP port of the OpenAI server (/v1/*, /health, /metrics)
#   --side-port   NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT); P returns it as remote_port
#   --core        CPU core for the model's OpenMP threads (P on 0, D on 1 on a 2-core box)
#   --name        instance name; becomes OTEL_SERVICE_NAME of its spans (default: role)
#   --otlp        OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces (default: off)
#   --lease       kv_lease_duration in seconds: how long P keeps blocks for an absent D (vLLM: 30)
#   --env         the CPU vLLM venv made by setup-cpu-env.sh (default: .vllm-cpu)
#   --model       model directory (default: ENV/tiny-llama); --served-name (default: tiny)
#   --nixl-progress     NIXL's progress thread: delay (default: waits up to --progress-delay-us,
#                       1000, between polls and wakes on UCX events), busy (NIXL as shipped: spins
#                       a core at 100 %), off (no thread: transfers can stall; see README.md)
#   --handoff     pull (default: NixlConnector, D reads P's blocks) or push (NixlPushConnector, vLLM
#                 0.32+: D registers its blocks and P writes into them); P and D must say the same
#   --engine-id   kv_transfer_config.engine_id (default: vLLM draws a new one at each start)
#   --amx               let vLLM's CPU attention use its AMX kernels (default: off, AVX-512; the AMX
#                       decode kernel dies with SIGILL on some VMs that advertise AMX)
#   --kv-events         publish KV cache events (--kv-events-config, ZMQ publisher) on ENDPOINT and
#                       report cached prompt tokens in responses (--enable-prompt-tokens-details).
#                       vLLM binds ENDPOINT only when it holds "*", "::", ipc:// or inproc:// and
#                       connects otherwise: use ipc:///path (or tcp://*:PORT) for a subscriber that
#                       connects. Default: off (vLLM's default, no events)
#   --kv-events-replay  the replay (ROUTER) endpoint, always bound, e.g. tcp://127.0.0.1:PORT
#   --kv-events-topic   the topic of every message (default: empty)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"
ROLE="" PORT="" SIDE_PORT="" CORE=0 NAME="" OTLP="" LEASE="" ENV_DIR=.vllm-cpu MODEL="" SERVED=tiny
NIXL_PROGRESS=delay PROGRESS_DELAY_US=1000
AMX=0 KV_EVENTS="" KV_EVENTS_REPLAY="" KV_EVENTS_TOPIC="" HANDOFF=pull ENGINE_ID=""
while [ $# -gt 0 ]; do
  case "$1" in
    --role) ROLE=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --side-port) SIDE_PORT=$2; shift 2 ;;
    --core) CORE=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --otlp) OTLP=$2; shift 2 ;;
    --lease) LEASE=$2; shift 2 ;;
    --env) ENV_DIR=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --served-name) SERVED=$2; shift 2 ;;
    --nixl-progress) NIXL_PROGRESS=$2; shift 2 ;;
    --progress-delay-us) PROGRESS_DELAY_US=$2; shift 2 ;;
    --amx) AMX=1; shift ;;
    --handoff) HANDOFF=$2; shift 2 ;;
    --engine-id) ENGINE_ID=$2; shift 2 ;;
    --kv-events) KV_EVENTS=$2; shift 2 ;;
    --kv-events-replay) KV_EVENTS_REPLAY=$2; shift 2 ;;
    --kv-events-topic) KV_EVENTS_TOPIC=$2; shift 2 ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "launch-cpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
pd_kv_role launch-cpu.sh
[ -n "$PORT" ] && [ -n "$SIDE_PORT" ] || { echo "launch-cpu.sh: --port and --side-port are required" >&2; exit 2; }
PY="$ENV_DIR/bin/python"
[ -x "$PY" ] || { echo "launch-cpu.sh: no CPU vLLM env at $ENV_DIR (run make vllm-cpu)" >&2; exit 2; }
MODEL=${MODEL:-$ENV_DIR/tiny-llama}
NAME=${NAME:-$ROLE}

EXTRA="{}"
[ -n "$LEASE" ] && EXTRA="{\"kv_lease_duration\": $LEASE}"
case "$HANDOFF" in
  pull) CONNECTOR=NixlConnector ;;
  push) CONNECTOR=NixlPushConnector ;;
  *) echo "launch-cpu.sh: --handoff must be pull or push" >&2; exit 2 ;;
esac
ENGINE=""
[ -n "$ENGINE_ID" ] && ENGINE=", \"engine_id\": \"$ENGINE_ID\""
KV_CONFIG="{\"kv_connector\": \"$CONNECTOR\", \"kv_role\": \"$KV_ROLE\", \"kv_buffer_device\": \"cpu\", \"kv_connector_extra_config\": $EXTRA$ENGINE}"

# Offline, no telemetry home-calls, everything on loopback.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_HOST_IP=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_PORT
export UCX_NET_DEVICES=lo
# vLLM's CPU backend pins its OpenMP threads; "auto" would reserve cores for itself.
export VLLM_CPU_OMP_THREADS_BIND=$CORE
export OTEL_SERVICE_NAME=$NAME
# NIXL's progress thread busy-polls (pthrDelay=0); nixl-progress/sitecustomize.py changes that.
case "$NIXL_PROGRESS" in
  delay) export PDSCOPE_NIXL_PROGRESS_DELAY_US=$PROGRESS_DELAY_US ;;
  off) export PDSCOPE_NIXL_NO_PROGRESS_THREAD=1 ;;
  busy) ;;
  *) echo "launch-cpu.sh: --nixl-progress must be delay, busy or off" >&2; exit 2 ;;
esac
[ "$AMX" = 1 ] || export PDSCOPE_VLLM_CPU_NO_AMX=1
if [ "$NIXL_PROGRESS" != busy ] || [ "$AMX" = 0 ]; then
  export PYTHONPATH="$HERE/nixl-progress${PYTHONPATH:+:$PYTHONPATH}"
fi

ARGS=(-m vllm.entrypoints.openai.api_server
  --model "$MODEL" --served-model-name "$SERVED"
  --host 127.0.0.1 --port "$PORT"
  --dtype bfloat16 --max-model-len 512 --max-num-seqs 8
  --enforce-eager --kv-cache-memory-bytes 67108864
  --kv-transfer-config "$KV_CONFIG")
if [ -n "$KV_EVENTS" ]; then
  # Prefix caching stays on (vLLM's default); the events name the blocks it caches and drops.
  EVENTS="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"$KV_EVENTS\", \"topic\": \"$KV_EVENTS_TOPIC\""
  [ -n "$KV_EVENTS_REPLAY" ] && EVENTS="$EVENTS, \"replay_endpoint\": \"$KV_EVENTS_REPLAY\""
  ARGS+=(--kv-events-config "$EVENTS}" --enable-prompt-tokens-details)
elif [ -n "$KV_EVENTS_REPLAY$KV_EVENTS_TOPIC" ]; then
  echo "launch-cpu.sh: --kv-events-replay and --kv-events-topic need --kv-events" >&2; exit 2
fi
pd_otlp_args
echo "launch-cpu.sh: $NAME ($ROLE) http=127.0.0.1:$PORT nixl=127.0.0.1:$SIDE_PORT core=$CORE lease=${LEASE:-default} handoff=$HANDOFF otlp=${OTLP:-off} nixl_progress=$NIXL_PROGRESS kv_events=${KV_EVENTS:-off}"
exec "$PY" "${ARGS[@]}"
