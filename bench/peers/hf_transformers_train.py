#!/usr/bin/env python3
"""HF transformers training peer: full fine-tuning of the same geometry as the Iris run it is
compared with, with random weights. fp32 master weights under bf16 autocast, sdpa attention,
torch's fused AdamW, gradient accumulation over --accumulation samples per optimizer step. Each
sample: one image of --image x --image pixels and --text text tokens (the last half labelled),
as the Iris mock data builds it. Prints one JSON object on the last line.

  python3 bench/peers/hf_transformers_train.py --config recipes/configs/qwen3vl_2b.json
"""
import argparse, json, time

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--image", type=int, default=896)
    ap.add_argument("--text", type=int, default=3072)
    ap.add_argument("--accumulation", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up)")
    a = ap.parse_args()
    cfg = Qwen3VLConfig(**json.load(open(a.config)))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa",
                                                            torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    vc = cfg.vision_config
    P, m = vc.patch_size, vc.spatial_merge_size
    side = a.image // P
    n_patches = side * side
    n_image_tokens = n_patches // (m * m)
    pdim = 3 * vc.temporal_patch_size * P * P
    vs = cfg.vision_start_token_id
    ve = cfg.vision_end_token_id
    text = torch.randint(0, 150000, (a.text,), device="cuda")
    ids = torch.cat([text[: a.text // 2], torch.tensor([vs], device="cuda"),
                     torch.full((n_image_tokens,), cfg.image_token_id, device="cuda"),
                     torch.tensor([ve], device="cuda"), text[a.text // 2:]]).unsqueeze(0)
    labels = torch.full_like(ids, -100)
    labels[0, -(a.text // 2):] = ids[0, -(a.text // 2):]
    # 0 text, 1 image: what the processor returns beside input_ids, for M-RoPE.
    mm_types = (ids == cfg.image_token_id).to(torch.int32)
    pixels = torch.randn(n_patches, pdim, device="cuda")
    grid = torch.tensor([[1, side, side]], device="cuda")
    tokens = ids.shape[1]

    def step():
        for _ in range(a.accumulation):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                            mm_token_type_ids=mm_types, labels=labels)
            (out.loss / a.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    res = {"tokens_per_s": tokens * a.accumulation / dt, "step_s": dt,
           "samples_per_s": a.accumulation / dt, "tokens_per_sample": tokens,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
