#!/usr/bin/env bash
# datadir.sh DIR [NAME ...]
# A WebUI data folder (`--data-dir DIR`) whose extensions/ holds links to exactly the extensions
# NAMEd, so that runs with different extensions never see each other's (the host's own
# $WEBUI/extensions is not read with --data-dir). Prints the launch.sh arguments to use it:
#   --data-dir DIR --models-dir $WEBUI/models
# NAME: a folder under $EXT_DIR (`build.sh extensions`), `vram-guard` (-> $VG, default /work/main),
# `fixed-rng` (-> this repository's tests/acceptance/webui_fixed_rng), or an absolute path.
# DIR/config.json gets sd_model_checkpoint = sd15-random.safetensors when it names none (as
# build.sh's config step); everything else in DIR (outputs, the hash cache, ui-config) is kept.
set -euo pipefail
TOOLS=$(cd "$(dirname "$0")" && pwd)
WEBUI=/work/webui VENV=/work/webui-venv EXT_DIR=/work/webui-ext
# shellcheck disable=SC1091
[ -f "$TOOLS/host.env" ] && . "$TOOLS/host.env"
VG=${VG:-/work/main}
# this repository (for fixed-rng): REPO, else the checkout this script runs from (the copy build.sh
# installs into $TOOLS is outside it: pass REPO then)
REPO=${REPO:-$(git -C "$(dirname "$(readlink -f "$0")")" rev-parse --show-toplevel 2> /dev/null || echo "$VG")}
[ $# -ge 1 ] || { echo "usage: datadir.sh DIR [NAME ...]" >&2; exit 2; }
DIR=$1
shift
mkdir -p "$DIR/extensions"
find "$DIR/extensions" -mindepth 1 -maxdepth 1 -type l -delete
for name in "$@"; do
  case "$name" in
    vram-guard) src=$VG link=vram-guard ;;
    fixed-rng) src=$REPO/tests/acceptance/webui_fixed_rng link=vg-fixed-rng ;;
    /*) src=$name link=$(basename "$name") ;;
    *) src=$EXT_DIR/$name link=$name ;;
  esac
  [ -d "$src" ] || { echo "datadir.sh: $name: no folder $src" >&2; exit 1; }
  ln -sfn "$src" "$DIR/extensions/$link"
done
"$VENV/bin/python" - "$DIR/config.json" << 'EOF'
import json, os, sys
path = sys.argv[1]
cfg = json.load(open(path)) if os.path.exists(path) else {}
if "sd_model_checkpoint" not in cfg:
    cfg["sd_model_checkpoint"] = "sd15-random.safetensors"
    json.dump(cfg, open(path, "w"), indent=4)
EOF
ls -l "$DIR/extensions" | awk 'NR > 1 {print "datadir.sh: " $9 " -> " $11}' >&2
echo "--data-dir $DIR --models-dir $WEBUI/models"
