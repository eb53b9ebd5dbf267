#!/usr/bin/env bash
# Issue 42 item 0 in the offline WebUI of /work/webui-tools, with the WebUI lock: two and three
# ControlNet units beside the SD1.5 FP32 checkpoint placed on a card of 0.8x its size (3253 MiB).
# Phase ref: uncapped, VRAM Guard's accordion off; phase card: the emulated card with the
# placement, the plain WebUI (accordion off) then VRAM Guard (a git-archive snapshot of the branch).
# Restores the extension symlink and config.json.
set -uo pipefail
OUT=${OUT:-/work/vg-h42multi}
CASES=${CASES:-two,three,two_hires,two_img2img}
CARD=${CARD:-3253MiB}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
export PORT=${PORT:-7871} WAIT_S=1200
source "$(dirname "$0")/host/snapshot.sh"
vg_snapshot
PY=/work/webui-venv/bin/python
CLIENT="$BRANCH/tests/acceptance/webui_controlnet.py"
URL=http://127.0.0.1:$PORT
LOG=$OUT/ref.log /work/webui-tools/launch.sh --vram-guard-log-level INFO || exit 1
$PY "$CLIENT" ref --url "$URL" --out "$OUT/ref" --cases "$CASES"
/work/webui-tools/stop.sh
LOG=$OUT/card.log /work/webui-tools/launch.sh --vram-guard-log-level INFO --vram-guard-emulate-vram "$CARD" \
  --vram-guard-place-checkpoint || exit 1
$PY "$CLIENT" run --plain --url "$URL" --out "$OUT/plain" --ref "$OUT/ref" --cases two
$PY "$CLIENT" run --url "$URL" --out "$OUT/vg" --ref "$OUT/ref" --cases "$CASES"
echo "done $(date -u +%T)"
