#!/usr/bin/env bash
# The demo: installs the dependencies, builds Iris and describes the bundled fixture's two images
# with the tiny Qwen3-VL checkpoint (random weights, so the text is noise; the point is the
# pipeline and its timings).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
scripts/build.sh
fixture=tests/data/qwen3vl-tiny
build/iris generate -m "$fixture" --image "$fixture/images/image0.png" \
  --image "$fixture/images/image1.png" -p "Describe these two pictures." -n 12 --temp 0
