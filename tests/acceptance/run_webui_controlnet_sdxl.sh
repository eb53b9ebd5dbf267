#!/usr/bin/env bash
# SDXL + an SDXL ControlNet (docs/webui-acceptance.md, Run 13) in the offline WebUI of /work/webui-tools,
# with the WebUI lock: phase ref (uncapped, VRAM Guard's accordion off: the reference pictures), then
# one phase per card in CARDS (the checkpoint placed on an emulated card of that size). VRAM Guard is a
# git-archive snapshot of BRANCH; the extension link and config.json are put back on exit.
# Models: tests/acceptance/host/make_sdxl.py sdxl controlnet approx.
set -uo pipefail
OUT=${OUT:-/tmp/vg-cn-sdxl}
CARDS=${CARDS:-8000MiB}
CASES=${CASES:-one,hires,img2img}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
export PORT=${PORT:-7874} WAIT_S=1200
PY=/work/webui-venv/bin/python
source "$(dirname "$0")/host/snapshot.sh"
vg_snapshot
client() { $PY "$OUT/snap/tests/acceptance/webui_controlnet.py" "$@" --url "http://127.0.0.1:$PORT" \
  --models control_sdxl_mid_random --cases "$CASES" --size 128; }
rc=0
for phase in ref $CARDS; do
  t0=$SECONDS
  EXTRA=(--vram-guard-log-level INFO)
  [ "$phase" = ref ] || EXTRA+=(--vram-guard-emulate-vram "$phase" --vram-guard-place-checkpoint)
  echo "== $phase $(date -u +%T)"
  LOG=$OUT/$phase.log /work/webui-tools/launch.sh "${EXTRA[@]}" --ckpt /work/webui/models/Stable-diffusion/sdxl-random.safetensors || { rc=1; break; }
  echo "ready after $((SECONDS - t0)) s"; free -g
  if [ "$phase" = ref ]; then client ref --out "$OUT/ref" || rc=1
  else client run --out "$OUT/vg-$phase" --ref "$OUT/ref" || rc=1; fi
  grep -n "VRAM Guard\|Traceback\|Error" "$OUT/$phase.log" | tail -40
  /work/webui-tools/stop.sh
  echo "$phase took $((SECONDS - t0)) s"
done
exit $rc
