#!/usr/bin/env bash
# Iris's LoRA adapter through llama.cpp, as a llama.cpp user takes it: convert_lora_to_gguf.py
# converts the adapter that `iris export RUN OUT --peft` wrote, convert_hf_to_gguf.py the base,
# and llama.cpp's one-shot CLI (llama-completion, the classic llama-cli; recent llama.cpp's
# llama-cli is the chat client on top of its server) decodes greedily with --lora. The text must
# equal `iris generate --lora`'s on the same base and prompt, and the adapter must change it
# (the same comparison without the adapter must differ, else the check proves nothing).
#
# Both sides run on the CPU in f32 (the base and the adapter converted to f32 GGUF), so the
# greedy tokens do not hinge on bf16 rounding. llama.cpp is not part of Iris: build it elsewhere
# (CPU backend is enough) and pass:
#   LLAMA_DIR         its source (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/,
#                     gguf-py/)
#   LLAMA_COMPLETION  its llama-completion binary
#   BASE              the base checkpoint (default tests/data/qwen3vl-tiny, with its tokenizer)
#   ADAPTER           the PEFT adapter folder (iris export --peft)
#   IRIS              the iris binary (default build/iris)
#   N                 tokens to generate (default 24)
# Python needs torch, transformers, safetensors, numpy, sentencepiece-free tokenizers (the GPU
# machine's has them). Exit 0 when both comparisons hold.
set -uo pipefail
: "${LLAMA_DIR:?set LLAMA_DIR to the llama.cpp source}" "${LLAMA_COMPLETION:?set LLAMA_COMPLETION}"
: "${ADAPTER:?set ADAPTER to the PEFT adapter folder}"
base=${BASE:-tests/data/qwen3vl-tiny}
iris=${IRIS:-build/iris}
n=${N:-24}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prompt="Write a short poem about the sea."
export PYTHONPATH=$LLAMA_DIR/gguf-py:$LLAMA_DIR

python3 "$LLAMA_DIR/convert_hf_to_gguf.py" "$base" --outtype f32 --outfile "$work/base.gguf" \
  >"$work/convert_base.log" 2>&1 || { tail -20 "$work/convert_base.log"; exit 1; }
python3 "$LLAMA_DIR/convert_lora_to_gguf.py" "$ADAPTER" --base "$base" --outtype f32 \
  --outfile "$work/adapter.gguf" >"$work/convert_lora.log" 2>&1 ||
  { tail -20 "$work/convert_lora.log"; exit 1; }
echo "convert_lora_to_gguf.py accepted the adapter: $(grep -c 'lora_[ab]' "$work/convert_lora.log" || true) log lines name lora tensors"
tail -3 "$work/convert_lora.log"

# The prompt as Iris renders it with the checkpoint's chat template; llama.cpp gets that text raw.
rendered=$("$iris" generate -m "$base" -p "$prompt" -n 1 --temp 0 --device cpu -v 2>&1 >/dev/null |
  sed -n '/^prompt:$/,$p' | sed '1d' | sed -n '1,/^<|im_start|>assistant$/p')

iris_text() {  # $@: extra iris flags
  "$iris" generate -m "$base" "$@" -p "$prompt" -n "$n" --temp 0 --device cpu --json 2>/dev/null |
    python3 -c 'import json,sys; sys.stdout.write(json.load(sys.stdin)["text"])'
}
llama_text() {  # $@: extra llama flags
  "$LLAMA_COMPLETION" -m "$work/base.gguf" "$@" -p "$rendered"$'\n' -n "$n" --temp 0 -no-cnv \
    --no-display-prompt --no-warmup -c 512 -t "$(nproc)" --simple-io --verbose-prompt 2>"$work/llama.log" </dev/null
}
status=0
for with in adapter base; do
  if [ $with = adapter ]; then
    want=$(iris_text --lora "$ADAPTER")
    got=$(llama_text --lora "$work/adapter.gguf")
  else
    want=$(iris_text)
    got=$(llama_text)
  fi
  grep -m1 "number of tokens in prompt" "$work/llama.log"
  printf '%s\n  iris:      %q\n  llama.cpp: %q\n' "$with" "$want" "$got"
  if [ "$want" != "$got" ]; then echo "  DIFFERENT"; status=1; else echo "  equal"; fi
  eval "text_$with=\$want"
done
if [ "$text_adapter" = "$text_base" ]; then
  echo "the adapter does not change the greedy text: the check proves nothing"
  status=1
fi
exit $status
