#!/usr/bin/env bash
# webui_extensions.sh OUT GROUP CARD CASES [client args]
# One WebUI start for webui_extensions.py (docs/webui-extensions.md): a data dir with GROUP's
# extensions (datadir.sh), then
#   CARD = ref:  the WebUI without VRAM Guard, `ref` of CASES
#   CARD = SIZE: with VRAM Guard on an emulated card of SIZE (e.g. 4400MB): `run` (VRAM Guard on)
#                then `run --plain` (the accordion off) of CASES
# NOWEBUI=1: the API alone (--nowebui): Ultimate SD Upscale's `script_name` answered 422 "Script
# 'ultimate sd upscale' not found" in UI mode here, and worked with --nowebui (not investigated).
# GROUP: builtin (no other extension) | a comma list of datadir.sh names. Port $PORT (7871); the
# WebUI's log is OUT/logs/GROUPTAG-CARD.log; the server is stopped afterwards.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export REPO=${REPO:-$(git -C "$HERE" rev-parse --show-toplevel)}  # datadir.sh's fixed-rng
T=${TOOLS:-/work/webui-tools}
PY=${PY:-/work/webui-venv/bin/python}
export PORT=${PORT:-7871}
OUT=$1 GROUP=$2 CARD=$3 CASES=$4
shift 4
exts=()
[ "$GROUP" = builtin ] || IFS=, read -r -a exts <<< "$GROUP"
tag=$(echo "$GROUP" | tr ',' '+')
mkdir -p "$OUT/logs"
LOG="$OUT/logs/$tag-$CARD.log"
flags=()
# ADetailer: its models from models/adetailer only, never the hub (its own flag: only with it loaded)
[[ ",$GROUP," == *,adetailer,* ]] && flags+=(--ad-no-huggingface)
[ "${NOWEBUI:-0}" = 1 ] && flags+=(--nowebui)
if [ "$CARD" = ref ]; then
  args=$(bash "$T/datadir.sh" "/work/data-$tag-ref" ${exts[@]+"${exts[@]}"}) || exit 1
else
  args=$(bash "$T/datadir.sh" "/work/data-$tag" ${exts[@]+"${exts[@]}"} vram-guard) || exit 1
  flags+=(--vram-guard-emulate-vram "$CARD" --vram-guard-log-level INFO)
fi
# shellcheck disable=SC2086
LOG=$LOG "$T/launch.sh" $args ${flags[@]+"${flags[@]}"} || exit 1
C=("$PY" "$HERE/webui_extensions.py")
common=(--cases "$CASES" --url "http://127.0.0.1:$PORT" --out "$OUT" --log "$LOG" "$@")
if [ "$CARD" = ref ]; then
  "${C[@]}" ref "${common[@]}"
else
  "${C[@]}" run "${common[@]}"
  "${C[@]}" run --plain "${common[@]}"
fi
"$T/stop.sh"
