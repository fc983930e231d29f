#!/usr/bin/env bash
# System tools the tests need: ffmpeg/ffprobe (an independent decoder for our MP4s) and espeak-ng
# (speech for the synthetic training data). Installed from Debian's packages when missing.
set -euo pipefail
need=()
command -v ffprobe >/dev/null 2>&1 || need+=(ffmpeg)
command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)
if ((${#need[@]})); then
  echo "installing ${need[*]} from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
