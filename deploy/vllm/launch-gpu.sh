#!/usr/bin/env bash
# Launch ONE production vLLM instance (prefill or decode) on GPUs with NixlConnector, wired for
# pdscope: its /metrics for the collector and its OpenTelemetry spans to the collector's
# OTLP/HTTP receiver. Run one per P or D server; pdscope's proxy does the two-step routing.
#
#   deploy/vllm/launch-gpu.sh --role prefill|decode --model MODEL --name INSTANCE
#       [--port 8000] [--host 0.0.0.0] [--side-host THIS_NODE_IP] [--side-port 5600]
#       [--otlp http://COLLECTOR:4318/v1/traces] [--lease 30] [--tp 1]
#       [--served-name NAME] [--engine-id ID] [--dry-run] [-- EXTRA_VLLM_ARGS...]
#
#   --role         prefill -> kv_role kv_producer; decode -> kv_role kv_consumer
#   --model        HF id or local path; --served-name must match pdscope's model.name
#   --name         the instance name in pdscope.yaml; becomes OTEL_SERVICE_NAME
#   --port/--host  the OpenAI server (the proxy and collector must reach it)
#   --side-host    VLLM_NIXL_SIDE_CHANNEL_HOST: an address of THIS node that every decode node can
#                  reach (P returns it to the proxy as remote_host); default: first `hostname -I`
#   --side-port    VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600; +1 per data-parallel rank)
#   --otlp         --otlp-traces-endpoint; spans go over OTLP/HTTP protobuf
#   --lease        kv_lease_duration (s): how long P keeps a finished prefill's blocks for a D
#                  that has not pulled them (vLLM default 30; D heartbeats every lease/6 s)
#   --tp           --tensor-parallel-size
#   --engine-id    kv_transfer_config.engine_id (default: vLLM picks a uuid4 per start)
#   --dry-run      print the environment and command instead of running it
# Everything after `--` is passed to vLLM unchanged (e.g. --max-model-len, --gpu-memory-utilization).
# Needs a GPU build of vLLM (`pip install vllm`, its `vllm` command; or set VLLM_BIN) with NIXL
# (`pip install nixl`).
set -euo pipefail

ROLE="" MODEL="" NAME="" PORT=8000 HOST=0.0.0.0 SIDE_HOST="" SIDE_PORT=5600 OTLP="" LEASE=30 TP=1
SERVED="" ENGINE_ID="" DRY=0 VLLM_BIN=${VLLM_BIN:-vllm}
EXTRA=()
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
while [ $# -gt 0 ]; do
  case "$1" in
    --role) ROLE=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --side-host) SIDE_HOST=$2; shift 2 ;;
    --side-port) SIDE_PORT=$2; shift 2 ;;
    --otlp) OTLP=$2; shift 2 ;;
    --lease) LEASE=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --served-name) SERVED=$2; shift 2 ;;
    --engine-id) ENGINE_ID=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "launch-gpu.sh: unknown argument $1 (vLLM flags go after --)" >&2; exit 2 ;;
  esac
done
pd_kv_role launch-gpu.sh
[ -n "$MODEL" ] && [ -n "$NAME" ] || { echo "launch-gpu.sh: --model and --name are required" >&2; exit 2; }
SERVED=${SERVED:-$MODEL}
if [ -z "$SIDE_HOST" ]; then
  SIDE_HOST=$(hostname -I 2>/dev/null | awk '{print $1}')
  [ -n "$SIDE_HOST" ] || { echo "launch-gpu.sh: give --side-host (no address from hostname -I)" >&2; exit 2; }
fi

KV_CONFIG="{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"$KV_ROLE\""
[ -n "$ENGINE_ID" ] && KV_CONFIG+=", \"engine_id\": \"$ENGINE_ID\""
KV_CONFIG+=", \"kv_connector_extra_config\": {\"kv_lease_duration\": $LEASE}}"

export VLLM_NIXL_SIDE_CHANNEL_HOST=$SIDE_HOST VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_PORT
export OTEL_SERVICE_NAME=$NAME
ARGS=(serve "$MODEL" --served-model-name "$SERVED"
  --host "$HOST" --port "$PORT"
  --tensor-parallel-size "$TP"
  --kv-transfer-config "$KV_CONFIG")
pd_otlp_args
ARGS+=("${EXTRA[@]}")

if [ "$DRY" = 1 ]; then
  echo "VLLM_NIXL_SIDE_CHANNEL_HOST=$SIDE_HOST VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_PORT OTEL_SERVICE_NAME=$NAME${OTLP:+ OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf}"
  printf '%q ' "$VLLM_BIN" "${ARGS[@]}"; echo
  exit 0
fi
echo "launch-gpu.sh: $NAME ($ROLE) http=$HOST:$PORT nixl=$SIDE_HOST:$SIDE_PORT lease=${LEASE}s otlp=${OTLP:-off}"
exec "$VLLM_BIN" "${ARGS[@]}"
