#!/usr/bin/env bash
# System tools the tests need: ffmpeg/ffprobe (an independent decoder for our MP4s), espeak-ng
# (speech for the synthetic training data) and a headless Chromium (the live preview page).
# Installed from Debian's packages when missing.
set -euo pipefail
need=()
command -v ffprobe >/dev/null 2>&1 || need+=(ffmpeg)
command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)
# headless Chromium plays worker/delivery/static/preview.html in tests/integration/test_delivery_preview_page.py
command -v chromium-headless-shell >/dev/null 2>&1 || command -v chromium >/dev/null 2>&1 \
  || need+=(chromium-headless-shell)
if ((${#need[@]})); then
  echo "installing ${need[*]} from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
