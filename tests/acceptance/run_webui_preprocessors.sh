#!/usr/bin/env bash
# Issue 42 item 1 in the offline WebUI of /work/webui-tools (docs/webui-acceptance.md,
# "Preprocessor models"), with the WebUI lock: one WebUI start per phase, VRAM Guard as a
# git-archive snapshot of the branch, the annotator models of host/make_preprocessors.py.
#   ref    accordion off on a card nothing runs out of (REF_CARD): the reference pictures
#   cap    on CARD, in one start: the plain WebUI's jobs (PLAIN_CASES, accordion off), then
#          VRAM Guard's (CASES)
# Restores the extension symlink and config.json on exit.
set -uo pipefail
OUT=${OUT:-/work/vg-h42pre/out}
PHASES=${PHASES:-"ref cap"}
CARD=${CARD:?CARD=<size> (e.g. 6.2GB)}
REF_CARD=${REF_CARD:-16GB}
CASES=${CASES:-depth,ip,ip2,ipdepth,off}
PLAIN_CASES=${PLAIN_CASES:-ip,ipdepth,off}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
ANNOTATORS=/work/webui/models/annotator
export PORT=${PORT:-7872} WAIT_S=1200
PY=/work/webui-venv/bin/python
source "$(dirname "$0")/host/snapshot.sh"
vg_snapshot
$PY "$OUT/snap/tests/acceptance/host/make_preprocessors.py" --root "$ANNOTATORS" ${FORCE:+--force}
rc=0
for phase in $PHASES; do
  t0=$SECONDS
  size=$CARD
  case $phase in ref) size=$REF_CARD ;; cap) ;; *) echo "phase?"; exit 2 ;; esac
  echo "== $phase on $size $(date -u +%T)"
  LOG=$OUT/$phase.log /work/webui-tools/launch.sh --vram-guard-emulate-vram "$size" \
    --vram-guard-log-level INFO --controlnet-annotator-models-path "$ANNOTATORS" || { rc=1; break; }
  echo "ready after $((SECONDS - t0)) s"
  client() { $PY "$OUT/snap/tests/acceptance/webui_preprocessors.py" "$@" --url "http://127.0.0.1:$PORT" \
    --ref "$OUT/ref" --size "${SIZE:-128}"; }
  if [ "$phase" = ref ]; then
    client ref --out "$OUT/ref" --cases ip,ip2,ipdepth,depth,off || rc=1
  else
    client run --plain --out "$OUT/plain" --cases "$PLAIN_CASES"
    client run --out "$OUT/vg" --cases "$CASES" || rc=1
  fi
  grep -n "preprocessor\|Traceback\|out of memory" "$OUT/$phase.log" | grep -v "^.*DEBUG" | tail -25
  PORT=$PORT /work/webui-tools/stop.sh
  echo "$phase took $((SECONDS - t0)) s"
done
exit $rc
