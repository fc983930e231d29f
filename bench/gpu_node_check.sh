#!/usr/bin/env bash
# The one prepared GPU check of the node layer, for the `device` tool (one H200-class GPU, ~15 min of
# device time in all). Installs nothing: it uses whatever python/torch the machine has (a CUDA build).
#
#   run(command="bash bench/gpu_node_check.sh", timeout_s=540)
#
# 1. the GPU-marked tests of the node layer (parking into pinned memory, NCCL sharding, tiny switch);
# 2. python -m bench.node --preset 1.3b --ranks 1 --json: A2V (1.3B-class DiT, 30 blocks, bf16) ->
#    SR switch, all-resident vs parked. Figures go to $OUT/node_1.3b.json when $OUT is set.
#
# Expected (to be confirmed on the first lent GPU; not yet measured):
#   * switch_overhead_ms per direction: < 10 ms (the target). With prefetch of the incoming model's
#     first 2 blocks during the outgoing stage's last step, the visible part is only a stream wait;
#     without it, it is the H2D copy of the root params + block 0 (1.3B: ~90 MB bf16 -> ~2-4 ms at
#     25-50 GB/s pinned).
#   * peak_bytes (cuda allocated) of the parked run below the resident run by about the SR model's
#     size while A2V runs (and vice versa), i.e. parked peak ~ max(model) + activations.
#   * stage_s / frames_per_s: equal within noise between resident and parked (copies overlap compute).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_node_gpu.py -x 2>&1 | tail -15 || echo "gpu tests failed (rc=$?)"
timeout 280 "$PY" -m bench.node --preset 1.3b --ranks 1 --steps 4 --chunks 3 --json | tee "$OUT/node_1.3b.json"
