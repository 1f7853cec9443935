#!/usr/bin/env bash
# Multi-host test on one machine: a gateway and two workers, each in its own network namespace
# ("host"), linked by veth pairs to a bridge, talking ZeroMQ over TCP with CURVE. The gateway finds
# the workers by DNS (--worker-dns: a name with two A records, from the gateway host's /etc/hosts).
# Then worker host 1 loses its link (`ip link set down`) while serving, comes back, and worker
# host 2 goes away for good (process killed, namespace deleted, name record removed); the gateway
# keeps serving on whatever is left. Needs root (ip netns). Everything is torn down on any exit.
#
#   bash scripts/netns_test.sh          (PYTHON=... picks the interpreter; default: python)
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
ID=$$
NS_LAN=cde-lan-$ID NS_GW=cde-gw-$ID NS_W1=cde-w1-$ID NS_W2=cde-w2-$ID
NET=10.213.0 PORT=5555 HTTP=127.0.0.1:8000
W1=$NET.2:$PORT W2=$NET.3:$PORT
TMP=$(mktemp -d /tmp/cde-netns.XXXXXX)
PIDS=()

log() { printf '[netns %3ds] %s\n' "$SECONDS" "$*"; }
fail() { log "FAIL: $*"; for f in "$TMP"/*.log; do echo "--- $f"; tail -n 30 "$f"; done; exit 1; }

cleanup() {
    local pid deadline=$((SECONDS + 15))
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    for ns in "$NS_GW" "$NS_W1" "$NS_W2" "$NS_LAN"; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "/etc/netns/$NS_GW" "$TMP"
}
trap cleanup EXIT

# ---- the network: one bridge in its own namespace, one veth pair per host ----------------------
ip netns add "$NS_LAN" || fail "cannot create network namespaces: ip netns add needs root (CAP_SYS_ADMIN); pytest -m \"not netns\" deselects this test"
ip -n "$NS_LAN" link add br0 type bridge
ip -n "$NS_LAN" link set br0 up
addr=1
for ns in "$NS_GW" "$NS_W1" "$NS_W2"; do
    ip netns add "$ns"
    peer=p$addr
    ip link add eth0 netns "$ns" type veth peer name "$peer" netns "$NS_LAN"
    ip -n "$NS_LAN" link set "$peer" master br0 up
    ip -n "$ns" addr add "$NET.$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    addr=$((addr + 1))
done
# `ip netns exec` shows /etc/netns/NS/hosts as the namespace's /etc/hosts: our DNS. Written in
# place (same inode), so later edits reach the bind mount.
mkdir -p "/etc/netns/$NS_GW"
HOSTS=/etc/netns/$NS_GW/hosts
printf '127.0.0.1 localhost\n%s cde-workers\n%s cde-workers\n' "$NET.2" "$NET.3" > "$HOSTS"
log "3 hosts on $NET.0/24: gateway $NET.1, workers $W1 and $W2"

# ---- model, keys, processes ---------------------------------------------------------------------
"$PY" -m cde make-model --preset tiny "$TMP/model" > /dev/null
"$PY" -m cde keys generate "$TMP/keys" > /dev/null
K=$TMP/keys
start() {  # start NS LOGNAME ARGS...: a cde process inside a namespace
    local ns=$1 name=$2; shift 2
    ip netns exec "$ns" env OMP_NUM_THREADS=1 "$PY" -m cde "$@" > "$TMP/$name.log" 2>&1 &
    PIDS+=($!)
}
for w in 1 2; do
    ns=NS_W$w
    start "${!ns}" "worker$w" worker --model "$TMP/model" --served-model-name tiny --device cpu \
        --bind "tcp://0.0.0.0:$PORT" --curve-secret-key "$K/worker.key_secret" --curve-authorized-keys "$K/gateway.key"
done
W1_PID=${PIDS[0]} W2_PID=${PIDS[1]}
start "$NS_GW" gateway gateway --host 127.0.0.1 --port 8000 --log-level info --worker-dns cde-workers:$PORT \
    --dns-interval 1 --heartbeat-timeout 3 --curve-secret-key "$K/gateway.key_secret" --curve-server-key "$K/worker.key"

gw() { ip netns exec "$NS_GW" "$@"; }
alive_workers() {  # "ip:port ..." of the live workers, per the gateway's /health
    gw curl -s --max-time 5 "http://$HTTP/health" |
        "$PY" -c 'import json,sys; print(" ".join(sorted(w["name"] for w in json.load(sys.stdin)["workers"] if w["alive"])))' 2>/dev/null || true
}
wait_alive() {  # wait_alive "EXPECTED" SECONDS
    local deadline=$((SECONDS + $2))
    until [ "$(alive_workers)" = "$1" ]; do
        [ $SECONDS -lt $deadline ] || fail "live workers: '$(alive_workers)', wanted '$1'"
        sleep 0.5
    done
}
complete() {  # one completion; prints its HTTP status
    gw curl -s -o "$TMP/last.json" -w '%{http_code}' --max-time 60 "http://$HTTP/v1/completions" \
        -H 'Content-Type: application/json' \
        -d '{"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0, "tokens_per_step": 8}'
}
expect_completions() {  # expect_completions N: N concurrent completions, all 200
    local codes
    codes=$(for _ in $(seq "$1"); do complete & done; wait)
    [ "$(echo "$codes" | grep -o 200 | wc -l)" = "$1" ] || fail "statuses: $codes ($(cat "$TMP/last.json"))"
}

wait_alive "$W1 $W2" 180
log "gateway found both workers through DNS over CURVE: $(grep -c 'discovered worker' "$TMP/gateway.log") discovered"
expect_completions 4
log "4 concurrent completions: 200"

# ---- worker host 1 drops off the network mid-generation ----------------------------------------
stream() {  # a long streaming completion into $TMP/stream$1.txt
    gw curl -sN --max-time 120 "http://$HTTP/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "tiny", "prompt": "x", "max_tokens": 320, "temperature": 0, "tokens_per_step": 2, "stream": true}' \
        > "$TMP/stream$1.txt" &
    STREAMS+=($!)
}
STREAMS=()
stream 1
stream 2  # least-outstanding routing: one stream per worker
deadline=$((SECONDS + 60))
until [ -s "$TMP/stream1.txt" ] && [ -s "$TMP/stream2.txt" ]; do
    [ $SECONDS -lt $deadline ] || fail "no first block on both streams"
    sleep 0.2
done
ip -n "$NS_W1" link set eth0 down
log "worker host 1: link down while both streams run"
wait "${STREAMS[@]}" || true  # checked below by what the streams say
errors=$(grep -l '"error"' "$TMP"/stream?.txt | wc -l)
finished=$(grep -l '"finish_reason": *"length"' "$TMP"/stream?.txt | wc -l)
[ "$errors" = 1 ] && [ "$finished" = 1 ] || fail "wanted one failed and one finished stream: $(tail -c 300 "$TMP"/stream?.txt)"
reason=$(grep -ho '"message": *"[^"]*"' "$TMP"/stream?.txt | head -n 1)
echo "$reason" | grep -q "$W1 failed: no heartbeat" || fail "unexpected error: $reason"
log "the stream on worker 1 ended with an explicit error ($reason); the one on worker 2 finished"
wait_alive "$W2" 10
expect_completions 3
log "3 completions with worker 1 unreachable: 200 (served by worker 2)"

ip -n "$NS_W1" link set eth0 up
wait_alive "$W1 $W2" 30
log "worker host 1: link up, back in service"

# ---- worker host 2 goes away for good ----------------------------------------------------------
kill "$W2_PID"
wait "$W2_PID" || true
ip netns del "$NS_W2"
printf '127.0.0.1 localhost\n%s cde-workers\n' "$NET.2" > "$HOSTS"
wait_alive "$W1" 15
deadline=$((SECONDS + 15))
until grep -q "dropping worker tcp://$W2" "$TMP/gateway.log"; do
    [ $SECONDS -lt $deadline ] || fail "gateway kept the departed worker's link"
    sleep 0.5
done
expect_completions 3
log "worker host 2 deleted and out of DNS: link dropped, 3 completions: 200 (worker 1)"
kill -0 "$W1_PID" || fail "worker 1 exited"
log "PASS"
