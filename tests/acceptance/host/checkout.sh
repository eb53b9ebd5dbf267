#!/usr/bin/env bash
# checkout.sh MIRROR COMMIT DEST [TAG]
# A git checkout of COMMIT from a `fetch` snapshot (a bare git dir that lacks blobs >= ~4 MB).
# DEST becomes a small real repository (so the WebUI's `git rev-parse`/`git describe --tags` and the
# extensions list work): the commit's present objects are packed into it, the commit is marked
# shallow (no parents needed), and a sparse checkout leaves out the paths whose blobs the snapshot
# lacks (none of them is code). Idempotent: nothing is done when DEST is already at COMMIT.
set -euo pipefail
MIRROR=$1 COMMIT=$2 DEST=$3 TAG=${4:-}
full=$(git --git-dir="$MIRROR" rev-parse --verify "$COMMIT^{commit}")
# What the WebUI reads from an extension's repository (modules/extensions.py): an origin remote
# and an active branch; without either it logs a traceback for that extension at every start
# ("Remote named 'origin' didn't exist", "HEAD is a detached symbolic reference"). The origin is
# the snapshot it came from (never fetched from), the branch `pinned` (ref changes only).
finish() {
  git -C "$DEST" remote add origin "$MIRROR" 2> /dev/null || git -C "$DEST" remote set-url origin "$MIRROR"
  git -C "$DEST" update-ref refs/heads/pinned "$full"
  git -C "$DEST" symbolic-ref HEAD refs/heads/pinned
}
if [ -d "$DEST/.git" ] && [ "$(git -C "$DEST" rev-parse -q --verify HEAD 2>/dev/null)" = "$full" ]; then
  finish
  echo "checkout: $DEST already at ${full:0:12}"
  exit 0
fi
mkdir -p "$DEST"
git -C "$DEST" init -q
git -C "$DEST" config advice.detachedHead false
# every object of the commit that the snapshot holds, packed into DEST
missing=$(mktemp)
{
  echo "$full"
  git --git-dir="$MIRROR" rev-parse "$full^{tree}"
  git --git-dir="$MIRROR" ls-tree -r -t "$full" | awk '$2 != "commit" {print $3}'
} | git --git-dir="$MIRROR" cat-file --batch-check='%(objectname) %(objecttype)' \
  | awk '$2 != "missing" {print $1}' \
  | git --git-dir="$MIRROR" pack-objects -q "$DEST/.git/objects/pack/pack" > /dev/null
# paths whose blob is absent from the snapshot
git --git-dir="$MIRROR" ls-tree -r "$full" | awk -F'\t' '{split($1, a, " "); if (a[2] == "blob") print a[3] "\t" $2}' \
  | while IFS=$'\t' read -r obj path; do
      git --git-dir="$MIRROR" cat-file -e "$obj" 2>/dev/null || printf '%s\n' "$path"
    done > "$missing"
echo "$full" > "$DEST/.git/shallow"
git -C "$DEST" sparse-checkout init --no-cone
{
  echo '/*'
  sed 's/[][*?!\\#]/\\&/g; s|^|!/|' "$missing"
} > "$DEST/.git/info/sparse-checkout"
# (git reports each left-out path's blob as "invalid object" while it writes the index; harmless:
# those entries are skip-worktree and never read)
git -C "$DEST" checkout -q -f --detach "$full" 2> >(grep -v "^error: invalid object" >&2)
[ -n "$TAG" ] && git -C "$DEST" tag -f "$TAG" "$full" > /dev/null
finish
n=$(wc -l < "$missing")
echo "checkout: $DEST at ${full:0:12}${TAG:+ ($TAG)}; $n path(s) left out (blob not in the snapshot)"
sed 's/^/  left out: /' "$missing"
rm -f "$missing"
