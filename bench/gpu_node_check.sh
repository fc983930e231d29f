#!/usr/bin/env bash
# The one prepared GPU check, for the `device` tool (one H200-class GPU, ~15 min of device time in all,
# one command of at most 10 min). Installs nothing: it uses the machine's python3 and its CUDA torch.
# The image lacks PyAV (pipeline.inputs) and diffusers (the `wan` VAE): carry them as archives in
# .gpu_py (the PyAV wheel is abi3, so the cp311 one runs under the machine's 3.12; unpacked there, both
# are ~130 MB, over what travels), which this script unpacks to /tmp/gpu_py and puts after the repo:
#
#   mkdir -p .gpu_py && echo /.gpu_py/ >> .git/info/exclude
#   pip download --no-deps av==18.1.0 -d .gpu_py            # or copy the wheel from the local index
#   (cd "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')" &&
#    zip -qr9 - diffusers importlib_metadata zipp -x '*__pycache__*') > .gpu_py/pkgs.zip
#   run(command="bash bench/gpu_node_check.sh", carry=[".gpu_py"], timeout_s=590)
#
# 1. the GPU-marked tests: the node layer (parking into pinned memory, NCCL sharding, tiny switch),
#    both families rendering end to end on CUDA against the same render on the CPU, and the A2V / SR
#    trainers on CUDA against the CPU (tests/gpu);
# 2. python -m bench.node --preset 1.3b --ranks 1: A2V (1.3B-class DiT, 30 blocks, bf16) -> SR switch,
#    all-resident vs parked;
# 3. python -m bench.gpu_wan: the `wan` family's DiT / VAE / encoders at the 1.3B and 14B shapes on one
#    GPU, random weights, 480p then 14B at 720p.
# (models/training/gpu_continue.sh trains the tiny A2V and SR on the same GPU; it can run beside step 1:
#  `STEPS=tests bash bench/gpu_node_check.sh >/dev/null 2>&1 & bash models/training/gpu_continue.sh; wait`.)
# Each step has its own timeout and writes to $OUT (gpu_tests.log, node_1.3b.json, wan_480p.json,
# wan_720p.json), so a step that runs long leaves the others' figures. STEPS picks some for a rerun
# (default: STEPS=tests,node,wan480,wan720).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu_py ]; then
  mkdir -p /tmp/gpu_py
  for a in .gpu_py/*.whl .gpu_py/*.zip; do [ -e "$a" ] && "$PY" -m zipfile -e "$a" /tmp/gpu_py; done
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_py"
fi
export PYTHONUNBUFFERED=1
STEPS=",${STEPS:-tests,node,wan480,wan720},"
step() { [[ "$STEPS" == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("av", "diffusers", "transformers", "numpy"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(name, "missing:", exc)
PY
run_step() {  # name, timeout in seconds, file under $OUT, command...
  local name=$1 secs=$2 out=$3
  shift 3
  step "$name" || return 0
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$out"
  echo "$name rc=${PIPESTATUS[0]}"
}
run_step tests 180 gpu_tests.log "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu
run_step node 110 node_1.3b.json "$PY" -m bench.node --preset 1.3b --ranks 1 --steps 4 --chunks 3 --json
run_step wan480 200 wan_480p.json "$PY" -m bench.gpu_wan --json --shapes 1.3b,14b --buckets 480p --repeats 2
run_step wan720 240 wan_720p.json "$PY" -m bench.gpu_wan --json --shapes 14b --buckets 720p --repeats 2
