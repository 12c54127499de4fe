#!/usr/bin/env python3
"""HF transformers peer for `iris bench`: the same figures on the same geometry with random
weights (torch, bf16, sdpa attention), printed as one JSON object on the last line. The family
comes from the config's model_type (Qwen3-VL, Qwen2.5-VL, Qwen2-VL).

  python3 bench/peers/hf_transformers.py --config bench/configs/qwen3vl_2b.json
"""
import argparse, json, time

import torch
from transformers import AutoConfig, AutoModelForImageTextToText


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    raw = json.load(open(a.config))
    cfg = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa",
                                                        torch_dtype=torch.bfloat16)
    model.eval()
    dev = "cuda"
    P = cfg.vision_config.patch_size
    pdim = 3 * cfg.vision_config.temporal_patch_size * P * P
    out = {}

    def vision(name, sides, t=1):
        grids = torch.tensor([[t, s // P, s // P] for s in sides], device=dev)
        n = int(grids.prod(-1).sum())
        pix = torch.rand(n, pdim, device=dev, dtype=torch.bfloat16) * 2 - 1
        with torch.no_grad():
            t = timed(lambda: model.model.visual(pix, grid_thw=grids), a.iters)
        out[f"vision_{name}"] = {"ms": t * 1e3, "tokens_per_s": n / 4 / t}
        return t

    t1 = vision("1x448", [448])
    vision("1x896", [896])
    vision("1x1344", [1344])
    t8 = vision("8x448", [448] * 8)
    out["vision_multi_over_single"] = t8 / t1
    # An 8-frame video of 448-pixel frames: one grid step per temporal_patch_size frames.
    vision("video_8x448", [448], t=8 // cfg.vision_config.temporal_patch_size)

    for T in (512, 4096):
        ids = torch.randint(0, 151000, (1, T), device=dev)
        with torch.no_grad():
            t = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), a.iters)
        out[f"prefill_{T}"] = {"tokens_per_s": T / t}

    ctx, steps = 1024, 64
    ids = torch.randint(0, 151000, (1, ctx), device=dev)
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        past, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            o = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
        nxt.item()
        t = (time.perf_counter() - t0) / steps
    out["decode"] = {"context": ctx, "tokens_per_s": 1 / t}

    # Time to first token: one 896x896 image plus 32 text tokens, through the whole model.
    g = torch.tensor([[1, 896 // P, 896 // P]], device=dev)
    n = int(g.prod())
    pix = torch.rand(n, pdim, device=dev, dtype=torch.bfloat16) * 2 - 1
    text = torch.randint(0, 151000, (32,), device=dev)
    ids = torch.cat([text[:16], torch.tensor([cfg.vision_start_token_id], device=dev),
                     torch.full((n // 4,), cfg.image_token_id, device=dev),
                     torch.tensor([cfg.vision_end_token_id], device=dev), text[16:]])[None]
    mm = (ids == cfg.image_token_id).int()
    kw = dict(input_ids=ids, pixel_values=pix, image_grid_thw=g, logits_to_keep=1)
    if cfg.model_type == "qwen3_vl":
        kw["mm_token_type_ids"] = mm
    with torch.no_grad():
        t = timed(lambda: model(**kw).logits.argmax(-1).item(), a.iters)
    out["ttft_ms"] = t * 1e3
    out["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out))


if __name__ == "__main__":
    main()
