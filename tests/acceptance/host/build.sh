#!/usr/bin/env bash
# Build (or complete) the offline AUTOMATIC1111 v1.10.1 host that the acceptance clients run
# against: the WebUI in $WEBUI, its venv in $VENV, the tools in $TOOLS (see README.md here).
# Nothing of the WebUI is in this repository: its sources come from `fetch` snapshots in $MIRRORS.
#
#   bash tests/acceptance/host/build.sh            # every step, skipping what is already done
#   bash tests/acceptance/host/build.sh venv models # only these steps
#
# Steps: sources venv tokenizer tools models config link, and (not run by default) extensions
# (the third-party extensions of docs/webui-extensions.md, checked out into $EXT_DIR) and smoke.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
WEBUI=${WEBUI:-/work/webui}
VENV=${VENV:-/work/webui-venv}
TOOLS=${TOOLS:-/work/webui-tools}
MIRRORS=${MIRRORS:-/work/.mirror}
PYTHON=${PYTHON:-python3.11}
EXT_LINK=${EXT_LINK:-/work/main}  # what extensions/vram-guard points at (the team relinks it)
EXT_DIR=${EXT_DIR:-/work/webui-ext}  # the extensions of `build.sh extensions` (linked per run by datadir.sh)
NICE=(nice -n "${NICE_LEVEL:-5}")
PY="$VENV/bin/python"
PIP=("${NICE[@]}" "$PY" -m pip --disable-pip-version-check -q)
# pip, without its warning for every package the machine's local extra indexes do not hold
pip_q() { "${PIP[@]}" "$@" 2> >(grep -v "^WARNING: Location '" >&2); }

# fetch snapshot folder name, pinned commit, destination, tag (v1.10.1 modules/launch_utils.py)
SOURCES=(
  "kklouzal+stable-diffusion-webui 82a973c04367123ae98bd9abdf80d9eda9b910e2 $WEBUI v1.10.1"
  "AUTOMATIC1111+stable-diffusion-webui-assets 6f7db241d2f8ba7457bac5ca9753331f0c266917 $WEBUI/repositories/stable-diffusion-webui-assets"
  "Stability-AI+stablediffusion cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf $WEBUI/repositories/stable-diffusion-stability-ai"
  "Stability-AI+generative-models 45c443b316737a4ab6e40413d7794a7f5657c19f $WEBUI/repositories/generative-models"
  "crowsonkb+k-diffusion ab527a9a6d347f364e3d185ba6d714e22d80cb3c $WEBUI/repositories/k-diffusion"
  "openai+CLIP d50d76daa670286dd6cacf3bcd80b5e4823fc8e1 $TOOLS/src/CLIP"
  "Mikubill+sd-webui-controlnet 56cec5b2958edf3b1807b7e7b2b1b5186dbd2f81 $WEBUI/extensions/sd-webui-controlnet v1.1.455"
)

# `build.sh extensions`: the extensions whose forwards or passes VRAM Guard must not make worse
# (issue 41), each at a pinned commit: snapshot folder, commit, folder name under $EXT_DIR. They are
# not linked into $WEBUI/extensions: datadir.sh links the ones a run wants into its own --data-dir.
EXTENSIONS=(
  "pkuliyi2015+multidiffusion-upscaler-for-automatic1111 22798f6822bc9c8a905b51da8954ee313b973331 multidiffusion-upscaler-for-automatic1111"
  "continue-revolution+sd-webui-animatediff a88e88912bcbae0531caccfc50fd639f6ea83fd0 sd-webui-animatediff"
  "Bing-su+adetailer 36189cbea735b85fd01e98ac42002b8ce6f0e41d adetailer"
  "Coyote-A+ultimate-upscale-for-automatic1111 2322caa480535b1011a1f9c18126d85ea444f146 ultimate-upscale-for-automatic1111"
  "wcde+sd-webui-kohya-hiresfix 05af98743ef57838d6c83bfbe07a2920dd339a7c sd-webui-kohya-hiresfix"
  "ljleb+sd-webui-freeu 75684923858445df87f7287192731e57d09def81 sd-webui-freeu"
  "ashen-sensored+sd_webui_SAG 83d66a6cd8af4b6c6d087f8f1c979f0da188d40b sd_webui_SAG"
)

log() { echo "[build $(date -u +%T)] $*"; }
step_time() { log "$1 done in $(($(date +%s) - $2)) s"; }

step_sources() {
  local t0 line name commit dest tag missing=()
  t0=$(date +%s)
  for line in "${SOURCES[@]}"; do
    read -r name commit dest tag <<< "$line"
    [ -d "$MIRRORS/$name/repo" ] || missing+=("github:${name/+//}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing snapshots in $MIRRORS; bring them with the search tool's fetch:" >&2
    printf '  fetch %s\n' "${missing[@]}" >&2
    exit 2
  fi
  for line in "${SOURCES[@]}"; do
    read -r name commit dest tag <<< "$line"
    bash "$HERE/checkout.sh" "$MIRRORS/$name/repo" "$commit" "$dest" $tag
  done
  step_time sources "$t0"
}

# the WebUI's requirements_versions.txt less torch (installed first, pinned) and setuptools (pinned
# in constraints.txt); sd-webui-controlnet's requirements.txt with its own caps
step_venv() {
  local t0 stamp want reqs
  t0=$(date +%s)
  stamp="$VENV/.vg-host-stamp"
  want=$({ cat "$HERE/constraints.txt" "$WEBUI/requirements_versions.txt" \
    "$WEBUI/extensions/sd-webui-controlnet/requirements.txt"; declare -f step_venv; } | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "venv: $VENV up to date"
    return
  fi
  [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
  reqs=$(mktemp -d)
  grep -vE '^(torch|setuptools)([ =<>]|$)' "$WEBUI/requirements_versions.txt" > "$reqs/webui.txt"
  cp "$WEBUI/extensions/sd-webui-controlnet/requirements.txt" "$reqs/controlnet.txt"
  log "venv: pip, setuptools, torch"
  pip_q install -c "$HERE/constraints.txt" setuptools wheel
  pip_q install -c "$HERE/constraints.txt" torch torchvision
  log "venv: WebUI requirements"
  pip_q install -c "$HERE/constraints.txt" -r "$reqs/webui.txt"
  log "venv: openai CLIP (local source, as v1.10.1's launcher would from GitHub)"
  pip_q install --no-deps --no-build-isolation "$TOOLS/src/CLIP"
  log "venv: sd-webui-controlnet requirements"
  pip_q install -c "$HERE/constraints.txt" -r "$reqs/controlnet.txt"
  "${NICE[@]}" "$PY" -m pip check || true
  rm -rf "$reqs"
  echo "$want" > "$stamp"
  step_time venv "$t0"
}

step_tokenizer() {
  local t0
  t0=$(date +%s)
  "${NICE[@]}" "$PY" "$HERE/make_tokenizer.py" --hf-home "$TOOLS/hf-home"
  step_time tokenizer "$t0"
}

step_models() {
  local t0
  t0=$(date +%s)
  "${NICE[@]}" "$PY" "$HERE/make_models.py" --webui "$WEBUI" --hf-home "$TOOLS/hf-home" sd15 lora controlnet
  "${NICE[@]}" "$PY" "$HERE/make_esrgan.py" --webui "$WEBUI" --check \
    --variant tiny --variant wide --variant large --variant swinir
  step_time models "$t0"
}

step_tools() {
  mkdir -p "$TOOLS/run"
  local f
  for f in launch.sh stop.sh checkout.sh datadir.sh make_models.py make_esrgan.py make_tokenizer.py smoke.py README.md; do
    install -m 0755 "$HERE/$f" "$TOOLS/$f"
  done
  # launch.sh reads these paths
  cat > "$TOOLS/host.env" << EOF2
WEBUI=$WEBUI
VENV=$VENV
TOOLS=$TOOLS
EXT_DIR=$EXT_DIR
EOF2
  touch "$TOOLS/lock"
  log "tools: $TOOLS"
}

# the default checkpoint: v1.10.1 picks the first file in natural order when config.json names
# none, and "sd15-random-b" sorts before "sd15-random" ('-' < '.')
step_config() {
  "$PY" - "$WEBUI/config.json" << 'EOF2'
import json, os, sys
path = sys.argv[1]
cfg = json.load(open(path)) if os.path.exists(path) else {}
if "sd_model_checkpoint" not in cfg:
    cfg["sd_model_checkpoint"] = "sd15-random.safetensors"
    json.dump(cfg, open(path, "w"), indent=4)
    print(f"config: {path}: sd_model_checkpoint = sd15-random.safetensors")
else:
    print(f"config: {path}: sd_model_checkpoint already {cfg['sd_model_checkpoint']!r}")
EOF2
}

# only when there is no link yet: the team relinks it to the worktree under test, and a rebuild
# must not swap the extension under a WebUI that another session is starting (EXT_LINK=... with
# RELINK=1 to replace it)
step_link() {
  local link="$WEBUI/extensions/vram-guard"
  if [ -L "$link" ] && [ "${RELINK:-0}" != 1 ]; then
    log "link: $link -> $(readlink "$link") (kept; RELINK=1 EXT_LINK=DIR to change it)"
    return
  fi
  ln -sfn "$EXT_LINK" "$link"
  log "link: $link -> $EXT_LINK"
}

# the extensions (checkouts only: their install.py never runs, as with --skip-install), ADetailer's
# requirements (ultralytics >= 8.3.75 and rich, under constraints.txt: mediapipe stays 0.10.9, which
# sd-webui-controlnet needs; ADetailer only imports mediapipe for its mediapipe models), and the
# random-weight models they load: AnimateDiff motion modules (V2 and V1 layouts, from AnimateDiff's
# own motion_module.py) in its model folder, a YOLOv8n detector (ultralytics' own yaml) in
# models/adetailer
step_extensions() {
  local t0 line name commit dest missing=()
  t0=$(date +%s)
  for line in "${EXTENSIONS[@]}"; do
    read -r name commit dest <<< "$line"
    [ -d "$MIRRORS/$name/repo" ] || missing+=("github:${name/+//}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing snapshots in $MIRRORS; bring them with the search tool's fetch:" >&2
    printf '  fetch %s\n' "${missing[@]}" >&2
    exit 2
  fi
  for line in "${EXTENSIONS[@]}"; do
    read -r name commit dest <<< "$line"
    bash "$HERE/checkout.sh" "$MIRRORS/$name/repo" "$commit" "$EXT_DIR/$dest"
  done
  if ! "$PY" -c "import ultralytics, rich" 2> /dev/null; then
    log "extensions: ultralytics 8.3.75, rich (ADetailer)"
    pip_q install -c "$HERE/constraints.txt" "ultralytics==8.3.75" "rich>=13"
  fi
  "${NICE[@]}" "$PY" "$HERE/make_animatediff.py" --webui "$WEBUI" --animatediff "$EXT_DIR/sd-webui-animatediff"
  "${NICE[@]}" "$PY" "$HERE/make_adetailer.py" --webui "$WEBUI"
  install -m 0755 "$HERE/datadir.sh" "$TOOLS/datadir.sh"
  step_time extensions "$t0"
}

step_smoke() {
  local t0
  t0=$(date +%s)
  "${NICE[@]}" "$PY" "$HERE/smoke.py" --tools "$TOOLS" --out "${SMOKE_OUT:-/tmp/vg-host-smoke}"
  step_time smoke "$t0"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(sources venv tokenizer tools models config link)
T0=$(date +%s)
for s in "${steps[@]}"; do
  log "== $s"
  "step_$s"
done
log "all done in $(($(date +%s) - T0)) s: ${steps[*]}"
