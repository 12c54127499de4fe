#!/usr/bin/env python3
"""Writes a random-weight Qwen-VL checkpoint (any family the config's model_type names) in Hugging Face format (config.json, sharded bf16
safetensors, tokenizer.json) from a config such as recipes/configs/qwen3vl_2b.json, for load and
first-call measurements of iris generate against peers on the same files. Needs torch and
transformers (the GPU machine has both); uses the GPU when there is one, for a fast init.

  python3 tools/make_random_checkpoint.py --config recipes/configs/qwen3vl_2b.json \\
      --tokenizer tests/data/qwen3vl-tiny/tokenizer.json --out /tmp/qwen3vl-2b-random
"""
import argparse, os, shutil

import torch
from transformers import AutoConfig, AutoModelForImageTextToText


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default="2GB", help="max_shard_size of save_pretrained")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    shutil.copy(a.config, os.path.join(a.out, "config.json"))
    shutil.copy(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
    cfg = AutoConfig.from_pretrained(a.out)
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.shard)
    # config.json as the hub ships it (save_pretrained writes transformers 5.x's nested layout,
    # which Qwen2.5-VL and Qwen2-VL checkpoints on the hub do not have).
    shutil.copy(a.config, os.path.join(a.out, "config.json"))
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e9:.2f}B parameters written to {a.out}")


if __name__ == "__main__":
    main()
