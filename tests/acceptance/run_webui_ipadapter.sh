#!/usr/bin/env bash
# Issue 42 (IP-Adapter) in the offline WebUI (docs/webui-acceptance.md, Run 10): the uncapped
# pictures (VRAM Guard's accordion off), then VRAM Guard on an emulated card ($CARDS), the
# client's cases ip,ip_plus (webui_controlnet.py). VRAM Guard is a git-archive snapshot of this
# branch in a data folder of its own (datadir.sh: the host's extensions/ links are not touched).
# SDXL: CKPT=/work/webui/models/Stable-diffusion/sdxl-random.safetensors CASES=ip_sdxl,ip_plus_sdxl
# CARDS="16000MiB 8000MiB" (the checkpoint placed where it does not fit: --vram-guard-place-checkpoint).
set -uo pipefail
OUT=${OUT:-/tmp/vg-ipadapter}
CARDS=${CARDS:-"6000MB"}
CASES=${CASES:-ip,ip_plus}
CKPT_ARGS=(${CKPT:+--ckpt "$CKPT"})
export PORT=${PORT:-7873} WAIT_S=1200
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
PY=/work/webui-venv/bin/python
mkdir -p "$OUT"
exec 9>/work/webui-tools/lock
echo "waiting for the lock $(date -u +%T)"; flock 9; echo "lock taken $(date -u +%T)"
rm -rf "$OUT/snap" && mkdir -p "$OUT/snap" && git -C "$REPO" archive HEAD | tar -x -C "$OUT/snap"
echo "snapshot of $(git -C "$REPO" rev-parse --short HEAD)"
trap '/work/webui-tools/stop.sh' EXIT
$PY "$OUT/snap/tests/acceptance/host/make_ipadapter.py"
read -r -a DD <<< "$(VG=$OUT/snap bash "$OUT/snap/tests/acceptance/host/datadir.sh" "$OUT/wd" vram-guard \
  /work/webui/extensions/sd-webui-controlnet | tail -1)"
CLIENT="$PY $OUT/snap/tests/acceptance/webui_controlnet.py"
LOG=$OUT/ref.log /work/webui-tools/launch.sh "${DD[@]}" "${CKPT_ARGS[@]}" --vram-guard-log-level INFO || exit 1
$CLIENT ref --url http://127.0.0.1:$PORT --out "$OUT/ref" --cases "$CASES"
/work/webui-tools/stop.sh
for card in $CARDS; do
  LOG=$OUT/vg-$card.log /work/webui-tools/launch.sh "${DD[@]}" "${CKPT_ARGS[@]}" --vram-guard-log-level INFO \
    --vram-guard-emulate-vram "$card" --vram-guard-place-checkpoint || exit 1
  $CLIENT run --url http://127.0.0.1:$PORT --out "$OUT/vg-$card" --ref "$OUT/ref" --cases "$CASES"
  grep -n "IP-Adapter\|predicted\|Traceback" "$OUT/vg-$card.log" | tail -20
  /work/webui-tools/stop.sh
done
