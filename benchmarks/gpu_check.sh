#!/usr/bin/env bash
# The GPU checks of issue 11, in one go (budget: 8 minutes on one GPU). Not run on a GPU yet: no GPU has
# been lent to this project's sessions so far (docs/benchmarks.md, "GPU check").
#
#   benchmarks/gpu_check.sh [OUT_DIR]            # every GPU of the machine (NCCL), results in OUT_DIR
#   GPU_CHECK_DEVICE=cpu benchmarks/gpu_check.sh # a dry run of the same script on 2 CPU ranks, tiny shapes
#
# 1. parity: ddp, fsdp2 and fsdp2_offload trained alike at 32-true (final parameters compared), and ddp and
#    fsdp2 at bf16-mixed and (on CUDA) 16-mixed with the sharded gradient scaler (each one's distance to the fp32
#    run; fsdp2's at most 2x ddp's);
# 2. speed: step time, tokens/s and MFU of a ~1B GPT at bf16-mixed under fsdp2, eager (goal >= 0.45 on an H200);
# 3. memory: torch.cuda.max_memory_allocated per rank of the 116M GPT (fp32, AdamW), ddp and fsdp2;
# 4. lifecycle: torch.cuda.memory_allocated after each of four fits in one process (one failing), flat.
# Each part writes OUT_DIR/<part>.json and prints one "[gpu_check]" line. One GPU means one rank: NCCL takes
# one rank per device, so the collectives are exercised across ranks only on a machine with 2 or more GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_results}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
    RANKS=$(python -c "import torch; print(min(torch.cuda.device_count(), 8))")
    if [ "$RANKS" -lt 1 ]; then echo "gpu_check: no CUDA device visible" >&2; exit 1; fi
    EXTRA=(--batch-size "${GPU_CHECK_BATCH_SIZE:-16}")
else
    RANKS=2
    EXTRA=(--tiny)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
mkdir -p "$OUT"
status=0
# Seconds per part, 8 minutes in all; the speed part (the ~1B model) is the longest.
for spec in parity:150 speed:180 memory:100 lifecycle:50; do
    part=${spec%%:*} limit=${spec##*:} start=$(date +%s)
    if ! timeout "$limit" python -m torch.distributed.run --standalone --nproc-per-node "$RANKS" benchmarks/gpu_check.py \
        --part "$part" --device "$DEVICE" --out "$OUT" "${EXTRA[@]}" > "$OUT/$part.log" 2>&1; then
        echo "gpu_check: part $part failed or ran past ${limit} s; the end of $OUT/$part.log:" >&2
        tail -20 "$OUT/$part.log" >&2
        status=1
    fi
    grep '^\[gpu_check\]' "$OUT/$part.log" || true
    echo "gpu_check: part $part took $(( $(date +%s) - start )) s"
done
python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for part in ("parity", "speed", "memory", "lifecycle"):
    path = out / f"{part}.json"
    print(f"{part}: {json.loads(path.read_text()) if path.exists() else 'no result'}")
PY
exit $status
