#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL server for pdscope's tests and print its admin URL.
#   scripts/pg-test.sh start   -> prints postgresql://postgres@127.0.0.1:PORT/postgres
#   scripts/pg-test.sh stop
# Uses Debian's PostgreSQL server binaries; the cluster lives in $PDSCOPE_PG_DIR (default
# /tmp/pdscope-pg), listens on 127.0.0.1 only, trusts local connections, fsync off.
set -euo pipefail
PORT=${PDSCOPE_PG_PORT:-55432}
DIR=${PDSCOPE_PG_DIR:-/tmp/pdscope-pg}
BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$BIN" ] || [ ! -x "$BIN/postgres" ]; then
  echo "pg-test: no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql)" >&2
  exit 3
fi
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case "${1:-start}" in
  start)
    if ! "$BIN/pg_isready" -h 127.0.0.1 -p "$PORT" -q; then
      if [ ! -f "$DIR/PG_VERSION" ]; then
        mkdir -p "$DIR"
        [ "$(id -u)" = 0 ] && chown postgres "$DIR"
        as_pg "$BIN/initdb" -D "$DIR" -U postgres --auth=trust -E UTF8 >"$DIR.initdb.log" 2>&1 \
          || { cat "$DIR.initdb.log" >&2; exit 1; }
      fi
      as_pg "$BIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w -t 60 \
        -o "-p $PORT -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" \
        start >/dev/null || { tail -20 "$DIR/server.log" >&2; exit 1; }
    fi
    echo "postgresql://postgres@127.0.0.1:$PORT/postgres"
    ;;
  stop)
    [ -f "$DIR/PG_VERSION" ] && as_pg "$BIN/pg_ctl" -D "$DIR" -m fast -w stop >/dev/null 2>&1 || true
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
