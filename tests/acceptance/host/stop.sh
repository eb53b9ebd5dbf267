#!/usr/bin/env bash
# Stop the WebUI that launch.sh started on $PORT (7861): its process group, TERM then KILL.
set -uo pipefail
TOOLS=$(cd "$(dirname "$0")" && pwd)
PORT=${PORT:-7861}
PIDFILE="$TOOLS/run/webui-$PORT.pid"
[ -f "$PIDFILE" ] || { echo "stop.sh: no $PIDFILE"; exit 0; }
pid=$(cat "$PIDFILE")
if ! kill -0 "$pid" 2> /dev/null; then
  echo "stop.sh: pid $pid (port $PORT) is not running"
  rm -f "$PIDFILE"
  exit 0
fi
pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
# its own group (launch.sh's background mode, or `setsid bash launch.sh --fg`): end the whole group
if [ "$pgid" = "$pid" ]; then target=(-- "-$pid"); else target=("$pid"); fi
kill -TERM "${target[@]}" 2> /dev/null
for _ in $(seq 1 40); do
  kill -0 "$pid" 2> /dev/null || break
  sleep 0.5
done
if kill -0 "$pid" 2> /dev/null; then
  kill -KILL "${target[@]}" 2> /dev/null
  sleep 1
fi
rm -f "$PIDFILE"
echo "stop.sh: stopped pid $pid (port $PORT)"
