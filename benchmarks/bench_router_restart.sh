#!/usr/bin/env bash
# W8 with the router killed and started again mid-run (issue 16's "restart the router" run).
#
# A Ray head is started on this host (`ray start --head`); the server runs two replicas on it
# with --ray-address, so they are detached, named actors that outlive the server's process.
# `prefixserve bench run` drives W8 against the server; KILL_AT seconds in, the server is killed
# (SIGKILL: no cleanup, as a crash) and started again with the same flags. The new server adopts
# the replicas and rebuilds its index from their snapshots. Requests that arrive while no server
# listens fail (connection refused) and are counted as errors by the client.
#
#   benchmarks/bench_router_restart.sh OUT_DIR [extra `prefixserve serve` flags...]
# Environment: SCALE (0.5), RATE (3.0), POOL_BLOCKS (1000 per replica = 32,000 tokens in all),
# KILL_AT (30 s), PORT (8765), RAY_PORT (6390), MODEL (the packaged default model).
set -euo pipefail
OUT=${1:?usage: bench_router_restart.sh OUT_DIR [serve flags...]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$ROOT/.venv/bin
SCALE=${SCALE:-0.5}
RATE=${RATE:-3.0}
POOL_BLOCKS=${POOL_BLOCKS:-1000}
KILL_AT=${KILL_AT:-30}
PORT=${PORT:-8765}
RAY_PORT=${RAY_PORT:-6390}
MODEL=${MODEL:-$("$BIN/python" -c 'from prefixserve.bench.cli import default_model_dir; print(default_model_dir())')}
mkdir -p "$OUT"
URL=http://127.0.0.1:$PORT

"$BIN/ray" start --head --port "$RAY_PORT" --num-cpus 2 --include-dashboard=false \
    --disable-usage-stats > "$OUT/ray_start.log" 2>&1
SERVER_PID=
cleanup() {
    [ -n "$SERVER_PID" ] && kill -INT "$SERVER_PID" 2>/dev/null && sleep 5
    "$BIN/ray" stop --force > /dev/null 2>&1 || true
}
trap cleanup EXIT

serve() {  # $1: log file, then extra flags; starts the server, waits until it answers
    local log=$1
    shift
    "$BIN/prefixserve" serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --served-model-name "$(basename "$MODEL")" --block-size 16 --max-model-len 4096 \
        --max-num-batched-tokens 2048 --max-num-seqs 128 --num-kv-blocks "$POOL_BLOCKS" \
        --disable-log-stats --max-tokens-per-tenant 0 --no-kv-store --replicas 2 \
        --threads-per-replica 1 --routing-policy prefix \
        --ray-address "127.0.0.1:$RAY_PORT" "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    until curl -sf "$URL/v1/models" > /dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$log"; exit 1; }
        sleep 0.2
    done
}

serve "$OUT/server_1.log" "$@"
"$BIN/prefixserve" bench run --base-url "$URL" --name prefixserve-2x1-prefix-router-restart \
    --workloads W8 --scale "$SCALE" --request-rate "$RATE" --concurrency 32 \
    --model "$MODEL" --out "$OUT/run" > "$OUT/bench.log" 2>&1 &
BENCH_PID=$!
sleep "$KILL_AT"
kill -9 "$SERVER_PID"
DOWN=$(date +%s.%N)
sleep 1  # the port is free once the process is gone
serve "$OUT/server_2.log" "$@"
UP=$(date +%s.%N)
curl -s "$URL/metrics" | grep -E '^prefixserve_engine_router_' \
    > "$OUT/metrics_after_restart.txt" || true
wait "$BENCH_PID"
curl -s "$URL/metrics" | grep -E '^prefixserve_(engine_router|replica)' > "$OUT/metrics_end.txt" || true
python3 -c "print(f'router down for {$UP - $DOWN:.1f} s')" | tee "$OUT/downtime.txt"
