#!/usr/bin/env python3
"""Loads an HF-format directory written by `iris export` with HF transformers and compares its
logits after a text prompt with the ones Iris wrote (`iris generate --logits-out`).

  python3 tools/hf_check_export.py EXPORT_DIR IRIS_LOGITS.safetensors "prompt text"

The model goes through .to(bfloat16).to(float32) as the fixture's goldens did: that rounds the
rotary inv_freq buffer to bf16, which is the convention Iris follows (language/mrope.cpp).
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration

d, logits_file, text = sys.argv[1], sys.argv[2], sys.argv[3]
torch.backends.cuda.matmul.allow_tf32 = False
tok = PreTrainedTokenizerFast(tokenizer_file=f"{d}/tokenizer.json")
prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
ids = torch.tensor([tok(prompt)["input_ids"]])
model = Qwen3VLForConditionalGeneration.from_pretrained(d, torch_dtype=torch.float32)
model = model.to(torch.bfloat16).to(torch.float32).eval()
with torch.no_grad():
    hf = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
ours = load_file(logits_file)["logits"].float()
diff = (hf - ours).abs()
rel = (diff / (hf.abs() + 1e-6)).max().item()
ok = bool((diff <= 1e-4 * hf.abs() + 1e-4).all())
print(f"HF loaded {d}: {ids.shape[1]} prompt tokens, vocab {hf.numel()}")
print(f"max |HF - Iris| = {diff.max().item():.3e}, max relative = {rel:.3e}, "
      f"argmax HF {hf.argmax().item()} Iris {ours.argmax().item()}, within 1e-4: {ok}")
sys.exit(0 if ok else 1)
