# What launch-cpu.sh and launch-gpu.sh share; they source it (functions only, nothing runs here).

# pd_kv_role PROG: KV_ROLE for ROLE (prefill -> kv_producer, decode -> kv_consumer); else PROG's
# error and exit 2.
pd_kv_role() {
  case "$ROLE" in
    prefill) KV_ROLE=kv_producer ;;
    decode) KV_ROLE=kv_consumer ;;
    *) echo "$1: --role must be prefill or decode" >&2; exit 2 ;;
  esac
}

# pd_otlp_args: with OTLP set, vLLM's spans go there over OTLP/HTTP protobuf (added to ARGS).
pd_otlp_args() {
  if [ -n "$OTLP" ]; then
    export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf
    ARGS+=(--otlp-traces-endpoint "$OTLP")
  fi
}
