#!/usr/bin/env bash
# Regenerate constraints.txt: the exact versions CI installs (`.ci/run`, `make test` in a new environment).
# Builds a NEW virtual environment, installs the pinned CPU torch and this checkout's `.[dev]` with NO constraints
# (the newest releases the registry serves today), and writes what got installed. Run it on purpose, then run
# `bash .ci/run` and commit constraints.txt only when the suite passes (docs/development.md, "Dependencies").
# Usage: bash tools/write_constraints.sh   (from the checkout; BASE_PYTHON=python3.11 to choose the Python)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION ?= //p' Makefile)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/hf_unlearn_constraints.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"${BASE_PYTHON:-python3}" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "torch==$TORCH_VERSION"
"$PY" -m pip install -q -e ".[dev]"
{
  echo "# Versions CI installs (.ci/run: pip install -c constraints.txt), known to pass the suite together."
  echo "# Regenerated on purpose with: bash tools/write_constraints.sh  (newest releases; then run bash .ci/run)"
  echo "# Written $(date -u +%Y-%m-%d) with $("$PY" --version). Test against the newest releases: make test-latest"
  "$PY" -m pip freeze --exclude-editable | grep -v -i '^hf[-_]unlearn' | sed "s/^torch==.*/torch==$TORCH_VERSION/"
} > "$WORK/constraints.txt"
mv "$WORK/constraints.txt" constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
