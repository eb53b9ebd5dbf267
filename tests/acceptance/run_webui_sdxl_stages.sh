#!/usr/bin/env bash
# SDXL hires (stage by stage) + FP16 overflow comparison in the offline WebUI of /work/webui-tools
# (docs/webui-acceptance.md, SDXL), with the WebUI lock:
# phase plain (no VRAM Guard; stage probe + vae-dtype helper), phase extension (the same plus
# VRAM Guard as a git-archive snapshot of the branch). Restores the extension symlinks and config.
set -uo pipefail
OUT=${OUT:-/work/vg-sdxl2/out}
PHASES=${PHASES:-"plain extension"}
ONLY=${ONLY:-}
SEEDS=${SEEDS:-}  # comma-separated seeds of the hires jobs (the client's default: 1234)
FP16_SIZE=${FP16_SIZE:-256x64}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
# extra WebUI flags of the plain phase only, e.g. PLAIN_ARGS=--opt-sdp-attention (another attention
# implementation: the host's own float noise); the phase's log says which one it applied
read -r -a PLAIN_EXTRA <<< "${PLAIN_ARGS:-}"
mkdir -p "$OUT"
exec 9>/work/webui-tools/lock
echo "waiting for the lock $(date -u +%T)"
flock 9
echo "lock taken $(date -u +%T)"; free -g; uptime
export PORT=7946 WAIT_S=1200
CKPT=/work/webui/models/Stable-diffusion/sdxl-random.safetensors
PY=/work/webui-venv/bin/python
E=/work/webui/extensions
L=$E/vram-guard
prev=$(readlink "$L" || true)
cp /work/webui/config.json "$OUT/config.json.before"
rm -rf "$OUT/snap" && mkdir -p "$OUT/snap" && git -C "$BRANCH" archive HEAD | tar -x -C "$OUT/snap"
echo "snapshot of $(git -C "$BRANCH" rev-parse --short HEAD)"
restore() {
  /work/webui-tools/stop.sh
  if [ -n "$prev" ]; then ln -sfn "$prev" "$L"; else rm -f "$L"; fi
  rm -f "$E/vg-stage-probe" "$E/vg-vae-dtype"
  # the overflow VAE leaves models/VAE (kept in OUT)
  [ -f /work/webui/models/VAE/vg-overflow-vae-for-sdxl.safetensors ] && mv /work/webui/models/VAE/vg-overflow-vae-for-sdxl.safetensors "$OUT/"
  cp "$OUT/config.json.before" /work/webui/config.json
  ls -la "$E"
  echo "restored $(date -u +%T)"
}
trap restore EXIT
ln -sfn "$OUT/snap/tests/acceptance/webui_stage_probe" "$E/vg-stage-probe"
ln -sfn "$OUT/snap/tests/acceptance/webui_vae_dtype" "$E/vg-vae-dtype"
export VG_STAGE_DUMP=$OUT/probe VG_VAE_DTYPE_ROUTE=1
mkdir -p "$VG_STAGE_DUMP"
rc=0
for phase in $PHASES; do
  t0=$SECONDS
  echo "== $phase $(date -u +%T)"
  EXTRA=()
  if [ "$phase" = plain ]; then
    rm -f "$L"
    EXTRA=(${PLAIN_EXTRA[@]+"${PLAIN_EXTRA[@]}"})
  else
    ln -sfn "$OUT/snap" "$L"
    EXTRA=(--vram-guard-log-level INFO)
  fi
  ls -la "$E"
  LOG=$OUT/$phase.log /work/webui-tools/launch.sh ${EXTRA[@]+"${EXTRA[@]}"} --ckpt "$CKPT" \
    || { /work/webui-tools/stop.sh; mv "$OUT/$phase.log" "$OUT/$phase-failed-start.log";
         LOG=$OUT/$phase.log /work/webui-tools/launch.sh ${EXTRA[@]+"${EXTRA[@]}"} --ckpt "$CKPT"; } \
    || { rc=1; break; }
  echo "ready after $((SECONDS - t0)) s"
  $PY "$OUT/snap/tests/acceptance/webui_sdxl_stages.py" "$phase" --url http://127.0.0.1:$PORT --out "$OUT" \
    --stage-dump "$VG_STAGE_DUMP" --log "$OUT/$phase.log" --fp16-size "$FP16_SIZE" --upscaler "${UPSCALER:-ESRGAN_x4-tiny-random}" \
    --overflow-cmd "$PY /work/webui-tools/make_vae_sdxl_overflow.py" ${ONLY:+--only $ONLY} ${SEEDS:+--seeds $SEEDS} || rc=1
  grep -m1 "Applying attention optimization" "$OUT/$phase.log"
  free -g; uptime
  grep -n "Model loaded\|Traceback\|Error" "$OUT/$phase.log" | tail -5
  /work/webui-tools/stop.sh
  echo "$phase took $((SECONDS - t0)) s"
done
exit $rc
