#!/usr/bin/env bash
# Issue 42 item 0 in the offline WebUI of /work/webui-tools, with the WebUI lock: two and three
# ControlNet units beside the SD1.5 FP32 checkpoint placed on a card of 0.8x its size (3253 MiB).
# PHASES (default ref,card,lowvram): ref: uncapped, VRAM Guard's accordion off; card: the emulated
# card with the placement, the plain WebUI (accordion off) then VRAM Guard (a git-archive snapshot
# of the branch); lowvram: the plain WebUI with --lowvram and the units' Low VRAM, the lowvram probe
# counting the bytes both move per step. Restores the extension symlink and config.json.
set -uo pipefail
OUT=${OUT:-/work/vg-h42multi}
CASES=${CASES:-two,three,two_hires,two_img2img}
PHASES=${PHASES:-ref,card,lowvram}
CARD=${CARD:-3253MiB}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
export PORT=${PORT:-7871} WAIT_S=1200
source "$(dirname "$0")/host/snapshot.sh"
vg_snapshot
PY=/work/webui-venv/bin/python
CLIENT="$OUT/snap/tests/acceptance/webui_controlnet.py"
URL=http://127.0.0.1:$PORT
phase() { [[ ",$PHASES," == *",$1,"* ]]; }
if phase ref; then
  LOG=$OUT/ref.log /work/webui-tools/launch.sh --vram-guard-log-level INFO || exit 1
  $PY "$CLIENT" ref --url "$URL" --out "$OUT/ref" --cases "$CASES"
  /work/webui-tools/stop.sh
fi
if phase card; then
  LOG=$OUT/card.log /work/webui-tools/launch.sh --vram-guard-log-level INFO --vram-guard-emulate-vram "$CARD" \
    --vram-guard-place-checkpoint || exit 1
  $PY "$CLIENT" run --plain --url "$URL" --out "$OUT/plain" --ref "$OUT/ref" --cases two
  $PY "$CLIENT" run --url "$URL" --out "$OUT/vg" --ref "$OUT/ref" --cases "$CASES"
  /work/webui-tools/stop.sh
fi
if phase lowvram; then
  # each case twice: the first loads the control models (counted as moves), the second is the step's traffic
  VG_EXTRA_LINKS=/work/webui/extensions/vg-lowvram-probe
  ln -sfn "$OUT/snap/tests/acceptance/webui_lowvram_probe" "$VG_EXTRA_LINKS"
  export VG_LOWVRAM_PROBE=$OUT/lowvram-probe.json
  rm -f "$VG_LOWVRAM_PROBE"
  LOG=$OUT/lowvram.log /work/webui-tools/launch.sh --vram-guard-log-level INFO --lowvram || exit 1
  $PY "$CLIENT" run --plain --url "$URL" --out "$OUT/lowvram" --ref "$OUT/ref" --lowvram-probe "$VG_LOWVRAM_PROBE" \
    --cases two_lowvram,two_lowvram,three_lowvram,three_lowvram
fi
echo "done $(date -u +%T)"
