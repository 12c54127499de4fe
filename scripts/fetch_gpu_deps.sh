#!/usr/bin/env bash
# Unpacks the -dev packages that the GPU machine lacks (yaml-cpp, CLI11, PCRE2, stb, libjpeg-turbo,
# libwebp, libtiff) into .deps/, which a device run carries and the build finds through
# -DIRIS_DEPS_PREFIX=.deps. Run here (a Debian 12 machine with apt), not on the GPU machine, which
# reaches no package registry.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(libyaml-cpp-dev libyaml-cpp0.7 libcli11-dev libpcre2-dev libpcre2-8-0 libpcre2-16-0
  libpcre2-32-0 libpcre2-posix3 libstb-dev libstb0
  libjpeg62-turbo-dev libjpeg62-turbo  # JPEG images, decoded as PIL decodes them
  # WebP and TIFF images, and the libraries libtiff links that the GPU machine's image lacks
  # (zlib, liblzma and libzstd it has: unpacked here they would shadow its own for every program).
  libwebp-dev libwebp7 libwebpdemux2 libwebpmux3 libtiff-dev libtiff6 libtiffxx6 libjbig0 liblerc4
  libdeflate0)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "${packages[@]}" >/dev/null)
rm -rf "$root/.deps"
mkdir -p "$root/.deps"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$root/.deps"; done
echo "unpacked ${#packages[@]} packages into $root/.deps"
