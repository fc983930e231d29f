#!/usr/bin/env bash
# Continue a shipped `tiny` checkpoint's A2V and SR on one GPU, within a wall-clock deadline, and
# assemble the result, within a short GPU lease (one command of at most 10 min):
#
#   bash models/training/gpu_continue.sh        # or beside the GPU check (docs/training.md "On a GPU"):
#   STEPS=tests bash bench/gpu_node_check.sh >/dev/null 2>&1 & bash models/training/gpu_continue.sh; wait
#
# 1. the VAE of $BASE is reused (`train_all --stage reuse-vae`): same latents, so its decoder stays valid;
#    or, with VAE_STATE=FILE (train_vae's vae_state.pt of a new VAE, docs/quality.md, or that VAE
#    exported by `train_all --stage export-vae`, a .safetensors), that VAE: new latents, so A2V and SR
#    start from their seeded init and nothing is taken from $BASE;
# 2. a latent cache of $CLIPS train clips and $HELDOUT held-out ones, built by $WORKERS CPU processes
#    (960 clips: ~4x the CPU runs' 240 -- more identities for the longer training to see);
# 3. train_a2v and train_sr side by side on the one GPU (tiny models: neither fills it), warm-started
#    from $BASE (without VAE_STATE), until $DEADLINE less the assembly's margin; the A2V logs its
#    held-out flow loss;
# 4. `train_all --stage assemble` writes $OUT/tiny_gpu.safetensors; its decoder is the VAE's (without
#    VAE_STATE $BASE's): the chain fine-tune on the new SR runs on the CPU afterwards, docs/training.md.
# Installs nothing: the machine's python3 with its CUDA torch. Logs and the checkpoint land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp/gpu_continue}
BASE=${BASE:-models/checkpoints/tiny.safetensors}
D=${CACHE_DIR:-/tmp/longtake_gpu_cache}
CLIPS=${CLIPS:-960}
HELDOUT=${HELDOUT:-48}
WORKERS=${WORKERS:-12}
DEADLINE=${DEADLINE:-$((T0 + 540))}  # epoch seconds by which the checkpoint must be written
A2V_ARGS=${A2V_ARGS:---lr 5e-4 --batch-n 24 --batch-i 64 --mouth-weight 4}
SR_ARGS=${SR_ARGS:---lr 3e-4 --batch 64 --detail-weight 4 --feature-blur 0.8 --feature-weight 512 --reference-share 0.1 --pixel-weight 6}
DEVICE=${DEVICE:-cuda}  # cpu: the same flow on a machine without one (a dry run of the script)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$D"
log() { echo "[gpu_continue $(($(date +%s) - T0))s] $*" | tee -a "$OUT/gpu_continue.log"; }

if [ -n "${VAE_STATE:-}" ]; then  # a new VAE: its latents are new, so nothing else of $BASE fits them
  rm -f "$D/vae_final.pt" "$D/vae_state.pt" "$D/vae_reused.json"  # no earlier VAE's files are read
  case "$VAE_STATE" in
    *.safetensors)  # exported (train_all --stage export-vae): rescaled already, its figures carried
      "$PY" -m models.training.train_all --stage reuse-vae --from "$VAE_STATE" --cache-dir "$D" || exit 1 ;;
    *)  # train_vae's state: the cache workers rescale it (train_all.final_vae)
      cp "$VAE_STATE" "$D/vae_state.pt" || exit 1 ;;
  esac
  FROM=()
else
  "$PY" -m models.training.train_all --stage reuse-vae --from "$BASE" --cache-dir "$D" || exit 1
  FROM=(--from "$BASE")
fi
log "cache: $CLIPS train clips + $HELDOUT held-out, $WORKERS workers"
pids=()
for ((i = 0; i < WORKERS; i++)); do
  "$PY" -m models.training.train_all --stage cache --clips "$CLIPS" --clip-frames 24 --worker "$i" \
    --num-workers "$WORKERS" --threads 1 --cache-dir "$D" >/dev/null 2>&1 &
  pids+=($!)
done
"$PY" -m models.training.train_all --stage heldout-cache --clips "$HELDOUT" --clip-frames 24 --threads 1 \
  --cache-dir "$D" >/dev/null 2>&1 &
pids+=($!)
for p in "${pids[@]}"; do wait "$p" || { log "cache build failed"; exit 1; }; done
log "cache built: $(ls "$D/latents" | wc -l) shards"

minutes=$("$PY" -c "print(max(0.5, ($DEADLINE - 40 - $(date +%s)) / 60))")
log "training A2V and SR on $DEVICE for $minutes min each"
# shellcheck disable=SC2086  # the argument lists are meant to split
"$PY" -m models.training.train_a2v --device "$DEVICE" --threads 2 --minutes "$minutes" "${FROM[@]}" --cache-dir "$D" \
  --heldout-cache "$D/heldout_latents" $A2V_ARGS >"$OUT/a2v.log" 2>&1 &
a2v=$!
# shellcheck disable=SC2086
"$PY" -m models.training.train_sr --device "$DEVICE" --threads 2 --minutes "$minutes" "${FROM[@]}" --cache-dir "$D" \
  $SR_ARGS >"$OUT/sr.log" 2>&1 &
sr=$!
( while kill -0 $a2v 2>/dev/null; do sleep 60; command -v nvidia-smi >/dev/null &&
    log "gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"; done ) &
rc=0
wait $a2v || rc=1
wait $sr || rc=1
log "trainers done (rc $rc)"
tail -n 3 "$OUT/a2v.log" "$OUT/sr.log"
cp "$D"/*.jsonl "$OUT/" 2>/dev/null
[ $rc -eq 0 ] || exit 1
"$PY" -m models.training.train_all --stage assemble --clips "$CLIPS" --clip-frames 24 --cache-dir "$D" \
  "${FROM[@]}" --out "$OUT/tiny_gpu.safetensors" 2>&1 | tail -n 1
log "done: $(ls -la "$OUT/tiny_gpu.safetensors")"
