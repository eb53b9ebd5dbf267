# Sourced by the tests/acceptance/run_webui_*.sh runners (bash). `vg_snapshot` takes the machine's
# WebUI lock (held until the runner exits), puts a git-archive snapshot of $BRANCH's HEAD under
# $OUT/snap as extensions/vram-guard and, on exit, stops the WebUI on $PORT and puts the previous
# link and config.json back (and removes the links named in VG_EXTRA_LINKS). Needs OUT, BRANCH and PORT.
VG_LINK=/work/webui/extensions/vram-guard

vg_snapshot() {
  mkdir -p "$OUT"
  exec 9>/work/webui-tools/lock
  echo "waiting for the lock $(date -u +%T)"
  flock 9
  echo "lock taken $(date -u +%T)"; free -g
  VG_PREV=$(readlink "$VG_LINK" || true)
  cp /work/webui/config.json "$OUT/config.json.before"
  rm -rf "$OUT/snap" && mkdir -p "$OUT/snap" && git -C "$BRANCH" archive HEAD | tar -x -C "$OUT/snap"
  echo "snapshot of $(git -C "$BRANCH" rev-parse --short HEAD)"
  trap vg_restore EXIT
  ln -sfn "$OUT/snap" "$VG_LINK"
}

vg_restore() {
  /work/webui-tools/stop.sh
  rm -f ${VG_EXTRA_LINKS:-}
  if [ -n "$VG_PREV" ]; then ln -sfn "$VG_PREV" "$VG_LINK"; else rm -f "$VG_LINK"; fi
  cp "$OUT/config.json.before" /work/webui/config.json
  echo "restored $(date -u +%T): $(readlink "$VG_LINK")"
}
