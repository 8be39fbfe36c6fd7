#!/usr/bin/env bash
# Runs extra_selection.txt (beside this file) through the shared peer harness: each Lightning test unmodified
# and rewritten for strategy="fsdp2". Needs the harness and Lightning's tests in ../shared/peer/ next to the
# checkout (not part of CI) and this project installed (pip install -e ".[test]").
#   bash integration_tests/peer/run_extra.sh [ID_SUBSTRING ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER="${PEER_DIR:-$HERE/../../../shared/peer}"
[[ -f "$PEER/harness/peer.py" ]] || { echo "peer harness not found at $PEER (set PEER_DIR)" >&2; exit 2; }
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
WORK="${PEER_WORK:-${TMPDIR:-/tmp}/fsdp-peer}"
mkdir -p "$WORK"; export PEER_PYDEPS="$WORK/.pydeps"
[[ -f "$PEER_PYDEPS/pytest_timeout.py" && -d "$PEER_PYDEPS/cloudpickle" ]] ||
  python -m pip install -q --no-deps --target "$PEER_PYDEPS" pytest-timeout cloudpickle
OUT="${PEER_OUT:-$WORK/results/extra-$(date +%Y%m%d-%H%M%S)}"
args=(--selection "$HERE/extra_selection.txt" --tests-src "$PEER/lightning_tests" --out "$OUT" --timeout "${PEER_TIMEOUT:-240}")
(($#)) && args+=(--only "$@")
echo "results -> $OUT"
python "$PEER/harness/peer.py" "${args[@]}"
