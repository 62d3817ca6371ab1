#!/usr/bin/env bash
# Start (or stop) a local set of workers against the running dev stack: control, trainer, and per host
# host-0/host-1 a relay and a rollout worker. Pids go to $LAMINAR_HOME/workers.pids; `stop` kills only those.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR="${LAMINAR_HOME:-.laminar}"
PIDS="$HOME_DIR/workers.pids"
LAMINAR="${LAMINAR:-.venv/bin/laminar}"
mkdir -p "$HOME_DIR/logs"

if [[ "${1:-start}" == "stop" ]]; then
    [[ -f "$PIDS" ]] || { echo "no workers recorded in $PIDS"; exit 0; }
    while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$PIDS"
    rm -f "$PIDS"
    echo "stopped workers"
    exit 0
fi

start() {  # name, then the command
    local name=$1; shift
    "$@" > "$HOME_DIR/logs/$name.log" 2>&1 &
    echo $! >> "$PIDS"
    echo "started $name (pid $!, log $HOME_DIR/logs/$name.log)"
}
: > "$PIDS"
export LAMINAR_RELAY_TOKEN="${LAMINAR_RELAY_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
start control "$LAMINAR" worker --allow-faults control
start trainer "$LAMINAR" worker --allow-faults trainer
for i in 0 1; do
    start "relay-host-$i" env LAMINAR_HOST_ID="host-$i" "$LAMINAR" worker --allow-faults relay
    start "rollout-host-$i" env LAMINAR_HOST_ID="host-$i" "$LAMINAR" worker --allow-faults rollout --slots 2
done
