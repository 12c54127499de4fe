#!/usr/bin/env python3
"""Video goldens for every family from Hugging Face transformers' own video processors.

Runs where torch + transformers (with torchvision) are installed (the GPU machine), over the tiny
checkpoints the other generators wrote (tests/data/qwen3vl-tiny, qwen25vl-tiny, qwen2vl-tiny). The
video is a formula (frame_value below, the same formula the C++ tests write to a lossless FFV1
file), given to HF as its frames with their metadata, so that no container decoder is involved on
either side. For each family it writes, in the checkpoint's folder:

  video_preprocessor_config.json  the video processor (small pixel budget), as HF saves it
  golden_video.safetensors        the sampled frame indices, pixel_values_videos, video_grid_thw,
                                  the prompts' ids, position ids and rope deltas, the last row's top-16
                                  logits and logsumexp
  golden_video.json               the prompts, the greedy ids, the metadata, versions

Computed on the CPU in fp32 (TF32 off), with the rotary frequencies rounded through bf16 as the
other goldens do.

Usage: make_video_golden.py --data tests/data [--families qwen3_vl,qwen2_5_vl,qwen2_vl]
"""
import argparse, json, os, sys, traceback

import numpy as np
import torch

FRAMES, HEIGHT, WIDTH, VIDEO_FPS = 30, 100, 140, 12.0
PROMPT = "Describe this video."
MIXED_PROMPT = "Compare the picture with the video."
NEW_TOKENS = 8

FAMILIES = {
    # Qwen3-VL's budget is over all sampled frames: 5 frames of 100x140 within 32^2 x 40 pixels.
    "qwen3_vl": dict(dir="qwen3vl-tiny", processor="Qwen3VLProcessor",
                     video_processor="Qwen3VLVideoProcessor",
                     video_cfg=dict(size={"shortest_edge": 4096, "longest_edge": 32 * 32 * 40},
                                    patch_size=16, temporal_patch_size=2, merge_size=2,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                    fps=2.0, min_frames=4, max_frames=768,
                                    do_sample_frames=True)),
    # Qwen2/2.5: a per-frame budget (28^2 x 4 to 28^2 x 40 pixels).
    "qwen2_5_vl": dict(dir="qwen25vl-tiny", processor="Qwen2_5_VLProcessor",
                       video_processor="Qwen2VLVideoProcessor",
                       video_cfg=dict(size={"shortest_edge": 28 * 28 * 4,
                                            "longest_edge": 28 * 28 * 40},
                                      patch_size=14, temporal_patch_size=2, merge_size=2,
                                      image_mean=[0.48145466, 0.4578275, 0.40821073],
                                      image_std=[0.26862954, 0.26130258, 0.27577711],
                                      fps=2.0, min_frames=4, max_frames=768,
                                      do_sample_frames=True)),
    "qwen2_vl": dict(dir="qwen2vl-tiny", processor="Qwen2VLProcessor",
                     video_processor="Qwen2VLVideoProcessor",
                     video_cfg=dict(size={"shortest_edge": 28 * 28 * 4,
                                          "longest_edge": 28 * 28 * 40},
                                    patch_size=14, temporal_patch_size=2, merge_size=2,
                                    image_mean=[0.48145466, 0.4578275, 0.40821073],
                                    image_std=[0.26862954, 0.26130258, 0.27577711],
                                    fps=2.0, min_frames=4, max_frames=768,
                                    do_sample_frames=True)),
}


def frame_value(f, y, x, c):
    """Frame f's sample at row y, column x, channel c (uint8); tests/vision_video_test.cpp."""
    return (7 * f + 3 * y + 5 * x + 61 * c + ((x * y) >> 3)) & 255


def make_frames():
    f, y, x, c = np.meshgrid(np.arange(FRAMES), np.arange(HEIGHT), np.arange(WIDTH),
                             np.arange(3), indexing="ij")
    return frame_value(f, y, x, c).astype(np.uint8)  # [T, H, W, 3]


def metadata():
    from transformers.video_utils import VideoMetadata
    return VideoMetadata(total_num_frames=FRAMES, fps=VIDEO_FPS, width=WIDTH, height=HEIGHT,
                         duration=FRAMES / VIDEO_FPS, frames_indices=list(range(FRAMES)))


def family(name, spec, data):
    import transformers
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    d = os.path.join(data, spec["dir"])
    VP = getattr(transformers, spec["video_processor"])
    vp = VP(**spec["video_cfg"])
    vp.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    try:
        from transformers import Qwen2VLImageProcessor as ImgProc
    except ImportError:
        from transformers import Qwen2VLImageProcessorFast as ImgProc
    improc = ImgProc.from_pretrained(d)
    Proc = getattr(transformers, spec["processor"])
    proc = Proc(image_processor=improc, tokenizer=tok, video_processor=vp,
                chat_template=tok.chat_template)

    frames = make_frames()
    T, meta = {}, dict(family=name, transformers=transformers.__version__,
                       torch=torch.__version__, frames=FRAMES, height=HEIGHT, width=WIDTH,
                       video_fps=VIDEO_FPS)
    try:
        idx = vp.sample_frames(metadata=metadata())
        T["sampled_indices"] = torch.as_tensor(np.asarray(idx)).to(torch.int64)
    except Exception:
        traceback.print_exc()

    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32,
                                                        attn_implementation="eager")
    model.to(torch.bfloat16).to(torch.float32)
    model.eval()
    image = Image.open(os.path.join(d, "images", "image0.png")).convert("RGB")

    def one(prefix, content, with_image):
        messages = [{"role": "user", "content": content}]
        text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        meta[prefix + ".rendered"] = text
        kw = dict(text=[text], videos=[frames], video_metadata=[metadata()],
                  do_sample_frames=True, return_tensors="pt")
        if with_image:
            kw["images"] = [image]
        inputs = proc(**kw)
        for k, v in inputs.items():
            # The mixed prompt's pixels are the video prompt's and the image's own (its golden
            # has them): only what the prompt adds is kept, so the fixtures stay small.
            if k == "attention_mask" or (prefix == "mixed" and k.startswith("pixel_values")):
                continue
            if torch.is_tensor(v):
                T[f"{prefix}.{k}"] = v.float() if v.is_floating_point() else v.to(torch.int64)
        if "second_per_grid_ts" in inputs:
            meta[prefix + ".second_per_grid_ts"] = [float(s) for s in inputs["second_per_grid_ts"]]
        ids = inputs["input_ids"]
        meta[prefix + ".decoded"] = tok.decode(ids[0])
        with torch.no_grad():
            rk = {k: inputs[k] for k in ("input_ids", "image_grid_thw", "video_grid_thw",
                                         "second_per_grid_ts", "attention_mask",
                                         "mm_token_type_ids") if k in inputs}
            try:
                pos, deltas = model.model.get_rope_index(**rk)
            except TypeError:
                rk.pop("mm_token_type_ids", None)
                pos, deltas = model.model.get_rope_index(**rk)
            T[prefix + ".position_ids"] = pos.to(torch.int64)
            T[prefix + ".rope_deltas"] = deltas.to(torch.int64)
            out = model(**inputs)
            last = out.logits[0, -1].float()
            top = last.topk(16)
            T[prefix + ".top16_values"] = top.values.clone()
            T[prefix + ".top16_ids"] = top.indices.to(torch.int64).clone()
            T[prefix + ".logsumexp"] = torch.logsumexp(last, 0).reshape(1).clone()
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 pad_token_id=151643)
            meta[prefix + ".greedy_ids"] = gen[0, ids.shape[1]:].tolist()
        print(name, prefix, "ids", ids.shape[1], "greedy", meta[prefix + ".greedy_ids"],
              "grid", inputs.get("video_grid_thw"), flush=True)

    one("video", [{"type": "video"}, {"type": "text", "text": PROMPT}], False)
    one("mixed", [{"type": "image"}, {"type": "video"}, {"type": "text", "text": MIXED_PROMPT}],
        True)
    meta["tensors"] = {k: dict(shape=list(v.shape), dtype=str(v.dtype)) for k, v in T.items()}
    save_file({k: v.contiguous() for k, v in T.items()},
              os.path.join(d, "golden_video.safetensors"))
    with open(os.path.join(d, "golden_video.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    print("wrote", d, sorted(T), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    for name in a.families.split(","):
        try:
            family(name, FAMILIES[name], a.data)
        except Exception:
            traceback.print_exc()
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
