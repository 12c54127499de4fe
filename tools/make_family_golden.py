#!/usr/bin/env python3
"""Golden fixtures for the Qwen2-VL and Qwen2.5-VL families from Hugging Face transformers.

Runs where torch + transformers + safetensors + Pillow are installed (the GPU machine). For each
preset it writes an HF checkpoint directory as the hub ships these families (a flat config.json
with rope_scaling {"type": "mrope"}, weights named visual.* / model.* / lm_head.*), reloads it with
from_pretrained to prove that HF reads that layout, and then records, in fp32 with TF32 off:

  golden.safetensors  vision embeddings, position ids, every hidden state, logits (top-8 and
                      logsumexp per row), one training step's loss and gradients
  golden.json         prompts, token ids, greedy ids, the loss, tolerances
  config_nested.json  the same config in transformers 5.x's nested layout (text_config)
  images/*.png        the input images

Usage: make_family_golden.py --preset qwen2_5_vl --out DIR --tokenizer-dir DIR
"""
import argparse, json, math, os, shutil

import numpy as np
import torch
from PIL import Image

TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
              vision_end_token_id=151653)

# The text width is 16 (one head of 16, the smallest the CUDA attention kernels take) so that the
# embedding tables (the real tokenizer needs about 152k rows) keep the fixtures small: the whole
# working tree travels to the GPU machine.
PRESETS = {
    # Three vision blocks, the middle one full attention between two windowed ones; images of
    # 5x7 and 9x3 merged units give 4 and 3 windows of 4x4 units (window_size 112 = 4 units of
    # 28 pixels). Untied head with the 7B's vocabulary.
    "qwen2_5_vl": dict(
        seed=1, arch="Qwen2_5_VLForConditionalGeneration", model_type="qwen2_5_vl",
        vocab=152064, tie=False,
        text=dict(hidden_size=16, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=1, num_key_value_heads=1, mrope_section=[2, 3, 3],
                  rope_theta=1000000.0),
        vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=16,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu",
                    in_channels=3),
    ),
    "qwen2_vl": dict(
        seed=2, arch="Qwen2VLForConditionalGeneration", model_type="qwen2_vl",
        vocab=151936, tie=True,
        text=dict(hidden_size=16, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=1, num_key_value_heads=1, mrope_section=[2, 3, 3],
                  rope_theta=1000000.0),
        vision=dict(depth=3, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=16,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                    hidden_act="quick_gelu", in_channels=3),
    ),
}
IMAGES = [(200, 150, "gradient"), (96, 260, "checker")]
PROMPT = "Describe these two pictures."
TEXT_PROMPT = "Write one sentence about CUDA graphs."
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def make_image(w, h, kind):
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "gradient":
        img = np.stack([x / max(w - 1, 1) * 255, y / max(h - 1, 1) * 255, (x + y) % 256], -1)
    else:
        c = ((x // 12 + y // 12) % 2) * 255
        img = np.stack([c, 255 - c, (x * 3) % 256], -1)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def build_model(p):
    import transformers
    t, v = p["text"], p["vision"]
    text = dict(vocab_size=p["vocab"], hidden_size=t["hidden_size"],
                intermediate_size=t["intermediate_size"],
                num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=t["num_attention_heads"],
                num_key_value_heads=t["num_key_value_heads"], max_position_embeddings=32768,
                rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=p["tie"],
                initializer_range=0.2, use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"],
                                 "mrope_section": t["mrope_section"]},
                rope_theta=t["rope_theta"])
    vision = dict(v, initializer_range=0.05)
    if p["model_type"] == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=p["tie"], **TOKENS)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                         tie_word_embeddings=p["tie"], **TOKENS)
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    return model.float()


def perturb_(model, seed):
    """Non-trivial norms and biases, and bf16-representable weights (the checkpoint stores bf16)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.ndim == 1:
                base = 1.0 if (("norm" in name or "ln_q" in name) and name.endswith("weight")) else 0.0
                prm.copy_(base + 0.1 * torch.randn(prm.shape, generator=g))
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))


def flatten_config(nested, p):
    """The released hub layout: text fields at the top level, rope_scaling of type mrope."""
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters", None) or {}
    text.pop("rope_scaling", None)
    for k in ("model_type", "architectures", "dtype", "torch_dtype", "layer_types"):
        text.pop(k, None)
    flat.update(text)
    flat["rope_theta"] = rope.get("rope_theta", p["text"]["rope_theta"])
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": p["text"]["mrope_section"]}
    flat.pop("rope_parameters", None)
    flat["model_type"] = p["model_type"]
    flat["architectures"] = [p["arch"]]
    flat["vision_token_id"] = 151654
    flat["tie_word_embeddings"] = p["tie"]
    flat["torch_dtype"] = "bfloat16"
    return flat


def hub_names(state):
    """transformers 5.x module names -> the released checkpoints' names."""
    out = {}
    for k, v in state.items():
        if k.startswith("model.visual."):
            k = "visual." + k[len("model.visual."):]
        elif k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        out[k] = v
    return out


def call(model, **kw):
    """transformers revisions differ on whether the forward takes mm_token_type_ids."""
    try:
        return model(**kw)
    except TypeError:
        kw.pop("mm_token_type_ids", None)
        return model(**kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=12)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(p["seed"])
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast

    os.makedirs(os.path.join(a.out, "images"), exist_ok=True)
    model = build_model(p)
    perturb_(model, p["seed"])

    # The checkpoint as the hub ships it, then read back by HF itself.
    tmp = os.path.join(a.out, "_hf5")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "config.json")) as f:
        nested = json.load(f)
    with open(os.path.join(a.out, "config_nested.json"), "w") as f:
        json.dump(nested, f, indent=2)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(flatten_config(nested, p), f, indent=2)
    from safetensors.torch import load_file
    state = hub_names(load_file(os.path.join(tmp, "model.safetensors")))
    if p["tie"]:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(a.out, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer_dir, f), os.path.join(a.out, f))
    template = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                            "chat_templates", "qwen2_vl.jinja")
    cfg_path = os.path.join(a.out, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tcfg = json.load(f)
    with open(template, encoding="utf-8", newline="") as f:
        tcfg["chat_template"] = f.read()
    with open(cfg_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(tcfg, indent=2, ensure_ascii=False))

    model = AutoModelForImageTextToText.from_pretrained(a.out, torch_dtype=torch.float32,
                                                        attn_implementation="eager")
    assert type(model).__name__ == p["arch"], type(model).__name__
    # The rotary inverse frequencies are buffers that follow the model's dtype: a checkpoint run
    # in bf16 rotates with bf16-rounded frequencies, as the Qwen3-VL goldens do (make_golden.py).
    model.to(torch.bfloat16).to(torch.float32)
    model.eval().to(a.device)
    dev = a.device

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.out, "tokenizer.json"))
    try:
        from transformers import Qwen2VLImageProcessor as ImgProc
    except ImportError:
        from transformers import Qwen2VLImageProcessorFast as ImgProc
    improc = ImgProc(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
                     image_std=CLIP_STD, min_pixels=3136, max_pixels=12845056)
    improc.save_pretrained(a.out)

    images = []
    for i, (w, h, kind) in enumerate(IMAGES):
        im = make_image(w, h, kind)
        im.save(os.path.join(a.out, "images", f"image{i}.png"))
        images.append(im)
    vis = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images)
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    prompt = f"{system}<|im_start|>user\n{vis}{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    text_prompt = f"{system}<|im_start|>user\n{TEXT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    ip = improc(images=images, return_tensors="pt")
    pixel_values, grid_thw = ip["pixel_values"].float(), ip["image_grid_thw"]
    expanded = prompt
    for thw in grid_thw.tolist():
        n = thw[0] * thw[1] * thw[2] // 4
        expanded = expanded.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    expanded = expanded.replace("<|placeholder|>", "<|image_pad|>")
    input_ids = torch.tensor([tok(expanded)["input_ids"]])
    text_ids = torch.tensor([tok(text_prompt)["input_ids"]])
    mm_types = (input_ids == 151655).int()

    T = {}
    meta = dict(preset=a.preset, transformers=transformers.__version__, torch=torch.__version__,
                prompt=prompt, text_prompt=text_prompt,
                image_files=[f"images/image{i}.png" for i in range(len(images))],
                image_sizes=[[w, h] for (w, h, _) in IMAGES])
    T["pixel_values"] = pixel_values
    T["image_grid_thw"] = grid_thw.to(torch.int64)
    T["input_ids"] = input_ids.to(torch.int64)
    T["text_input_ids"] = text_ids.to(torch.int64)
    with torch.no_grad():
        vout = model.model.visual(pixel_values.to(dev), grid_thw=grid_thw.to(dev))
        emb = getattr(vout, "pooler_output", None)
        if emb is None:
            emb = vout if torch.is_tensor(vout) else vout.last_hidden_state
        if isinstance(emb, (list, tuple)):
            emb = torch.cat(list(emb), 0)
        T["vision.embeds"] = emb.float().cpu()
        rope_kw = dict(input_ids=input_ids.to(dev), image_grid_thw=grid_thw.to(dev),
                       attention_mask=torch.ones_like(input_ids).to(dev))
        try:
            pos, deltas = model.model.get_rope_index(mm_token_type_ids=mm_types.to(dev), **rope_kw)
        except TypeError:
            pos, deltas = model.model.get_rope_index(**rope_kw)
        T["position_ids"] = pos.to(torch.int64).cpu()
        T["rope_deltas"] = deltas.to(torch.int64).cpu()

        def run_logits(ids, with_image, prefix):
            kw = dict(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev),
                      output_hidden_states=True)
            if with_image:
                kw.update(pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
                          mm_token_type_ids=mm_types.to(dev))
            out = call(model, **kw)
            lg = out.logits[0].float().cpu()
            T[f"{prefix}.logits_last"] = lg[-1].clone()
            top = lg.topk(8, dim=-1)
            T[f"{prefix}.top8_values"] = top.values.clone()
            T[f"{prefix}.top8_ids"] = top.indices.to(torch.int64).clone()
            T[f"{prefix}.logsumexp"] = torch.logsumexp(lg, -1).clone()
            for li, hs in enumerate(out.hidden_states):
                T[f"{prefix}.hidden.{li}"] = hs[0].float().cpu()

        run_logits(input_ids, True, "mm")
        run_logits(text_ids, False, "text")

        def greedy(ids, with_image):
            kw = dict(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev),
                      do_sample=False, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                      eos_token_id=None, pad_token_id=151643)
            if with_image:
                kw.update(pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
                          mm_token_type_ids=mm_types.to(dev))
            try:
                out = model.generate(**kw)
            except TypeError:
                kw.pop("mm_token_type_ids", None)
                out = model.generate(**kw)
            return out[0, ids.shape[1]:].tolist()

        meta["mm_greedy_ids"] = greedy(input_ids, True)
        meta["text_greedy_ids"] = greedy(text_ids, False)

    # One training step: the loss on the second half of the prompt, every parameter's gradient.
    labels = input_ids.clone()
    labels[labels == 151655] = -100
    labels[0, :input_ids.shape[1] // 2] = -100
    T["labels"] = labels.to(torch.int64)
    model.train()
    out = call(model, input_ids=input_ids.to(dev), attention_mask=torch.ones_like(input_ids).to(dev),
               pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
               labels=labels.to(dev), mm_token_type_ids=mm_types.to(dev))
    out.loss.backward()
    meta["loss"] = out.loss.item()
    vocab_rows = sorted(set(input_ids[0].tolist()) | set(range(0, p["vocab"], 997)))
    T["grad_rows_of_vocab"] = torch.tensor(vocab_rows, dtype=torch.int64)
    gnorm2 = 0.0
    for name, prm in model.named_parameters():
        g = prm.grad.detach().float().cpu()
        gnorm2 += float((g.double() ** 2).sum())
        full_vocab = g.ndim == 2 and g.shape[0] == p["vocab"]
        T["grad." + name] = g[vocab_rows].clone() if full_vocab else g
    meta["grad_norm"] = math.sqrt(gnorm2)
    meta["tensors"] = {k: dict(shape=list(v.shape), dtype=str(v.dtype)) for k, v in T.items()}
    meta["tolerance"] = dict(fp32_rel=1e-4, fp32_abs=1e-4, bf16_rel=3e-2)
    save_file({k: v.contiguous() for k, v in T.items()}, os.path.join(a.out, "golden.safetensors"))
    with open(os.path.join(a.out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    print("wrote", a.out, "tensors:", len(T), "loss", meta["loss"], "greedy", meta["mm_greedy_ids"],
          "text greedy", meta["text_greedy_ids"])


if __name__ == "__main__":
    main()
