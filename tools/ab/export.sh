#!/bin/bash
# Exports git refs as sources for an A/B of builds on the device machine (which gets a copy of
# the working tree, not the repository): `bash tools/ab/export.sh main wip/x` writes
# runs/ab/<name>/ (a ref's name with / as -), to carry to the device as "runs/ab" with
# tools/ab/run.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf runs/ab && mkdir -p runs/ab
for ref in "$@"; do
  name=${ref//\//-}
  mkdir runs/ab/$name
  git archive "$ref" | tar -x -C runs/ab/$name
  echo "$name $(git rev-parse --short "$ref")"
done
