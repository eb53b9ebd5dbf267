#!/usr/bin/env bash
# Start the offline AUTOMATIC1111 v1.10.1 host (CPU, no network) on 127.0.0.1:$PORT.
#
#   PORT=7861 launch.sh [WebUI args]        background: waits until the WebUI is up, prints "ready"
#   PORT=7861 setsid bash launch.sh --fg [WebUI args] > log 2>&1 &    foreground (exec)
#
# Env: PORT (7861), LOG (background log; default $TOOLS/run/webui-$PORT.log), WAIT_S (600).
# The WebUI's pid (its process group in the background mode) goes to $TOOLS/run/webui-$PORT.pid;
# stop it with PORT=... stop.sh. "Up" means: the log shows "Startup time:" (printed after the
# extensions' app_started callbacks) and then the API answers; no request is sent before that
# line (an early request can catch the app between gradio's launch() and the WebUI adding its API
# middleware: "Cannot add middleware after an application has started").
set -uo pipefail
TOOLS=$(cd "$(dirname "$0")" && pwd)
WEBUI=/work/webui VENV=/work/webui-venv
# shellcheck disable=SC1091
[ -f "$TOOLS/host.env" ] && . "$TOOLS/host.env"
PORT=${PORT:-7861}
WAIT_S=${WAIT_S:-600}
RUN="$TOOLS/run"
PIDFILE="$RUN/webui-$PORT.pid"
mkdir -p "$RUN"

FG=0
ARGS=()
for a in "$@"; do
  if [ "$a" = "--fg" ]; then FG=1; else ARGS+=("$a"); fi
done

# offline: the CLIP tokenizer/config come from this cache; nothing may reach for the hub
export HF_HOME="$TOOLS/hf-home" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export GRADIO_ANALYTICS_ENABLED=False DO_NOT_TRACK=1 DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
CMD=("$VENV/bin/python" launch.py
  --skip-prepare-environment --skip-install --skip-version-check --skip-torch-cuda-test
  --use-cpu all --no-half --no-download-sd-model --api --server-name 127.0.0.1 --port "$PORT"
  ${ARGS[@]+"${ARGS[@]}"})

code() { curl -s -o /dev/null -m 5 -w '%{http_code}' "http://127.0.0.1:$PORT/sdapi/v1/options"; }

if [ "$(code)" != "000" ]; then
  echo "launch.sh: something already answers on port $PORT (stop it: PORT=$PORT $TOOLS/stop.sh)" >&2
  exit 1
fi
cd "$WEBUI" || exit 1

if [ "$FG" = 1 ]; then
  echo $$ > "$PIDFILE"
  exec "${CMD[@]}"
fi

LOG=${LOG:-$RUN/webui-$PORT.log}
: > "$LOG"
setsid "${CMD[@]}" > "$LOG" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$PIDFILE"
echo "launch.sh: WebUI pid $pid on port $PORT, log $LOG"
t0=$SECONDS
while :; do
  if ! kill -0 "$pid" 2> /dev/null; then
    echo "launch.sh: the WebUI exited during start; log tail:" >&2
    tail -30 "$LOG" >&2
    rm -f "$PIDFILE"
    exit 1
  fi
  if grep -q "Startup time:" "$LOG" && [ "$(code)" != "000" ]; then
    echo "ready after $((SECONDS - t0)) s: http://127.0.0.1:$PORT"
    exit 0
  fi
  if [ $((SECONDS - t0)) -ge "$WAIT_S" ]; then
    echo "launch.sh: not up after $WAIT_S s; stopping it. Log tail:" >&2
    tail -30 "$LOG" >&2
    PORT=$PORT "$TOOLS/stop.sh"
    exit 1
  fi
  sleep 2
done
