#!/usr/bin/env python3
"""How far HF transformers' own bf16 training lands from its fp32 gradients on a tiny fixture (any
family: Qwen3-VL, Qwen2.5-VL, Qwen2-VL): the same per-tensor relative L2 error that
tests/training_gradients_test.cpp (CudaGoldenGradients) and tests/training_family_gradients_test.cpp
measure for Iris's CUDA step, for (1) fp32 (should reproduce the golden), (2) bf16 autocast
with fp32 weights (the usual mixed-precision setup, as bench/peers/hf_transformers_train.py), and
(3) a bf16 model (bf16 weights, activations and gradients). It shows what error bf16 arithmetic
itself costs at this fixture's far-end tensors.

  python3 tools/hf_bf16_gradient_error.py tests/data/qwen3vl-tiny tests/data/qwen25vl-tiny

Qwen3-VL-MoE (tests/data/qwen3vlmoe-tiny) runs with HF's default experts implementation, as HF
trains; its goldens' grad.* are the LM loss's alone.
"""
import json, math, sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText


def grads(model_dir, mode, g):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # As the goldens were made (make_golden.py, make_family_golden.py): eager attention, and the
    # rotary frequencies rounded through bf16 as a bf16 checkpoint's are.
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                        attn_implementation="eager")
    model.to(torch.bfloat16).to(torch.float32)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    model.to("cuda").train()
    ids = g["input_ids"].cuda()
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    image_id, video_id = cfg.get("image_token_id", 151655), cfg.get("video_token_id", 151656)
    mm = ((ids == image_id).int() + 2 * (ids == video_id).int())
    px = g["pixel_values"].cuda()
    if mode == "bf16":
        px = px.to(torch.bfloat16)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px,
              image_grid_thw=g["image_grid_thw"].cuda(), labels=g["labels"].cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
        try:
            # transformers 5.x places image tokens in M-RoPE from mm_token_type_ids; revisions
            # whose forward does not take it find them by id.
            out = model(**kw, mm_token_type_ids=mm)
        except TypeError:
            out = model(**kw)
    out.loss.backward()
    # make_golden.py keeps the embedding's rows of the prompt; make_family_golden.py the rows of
    # every vocabulary-sized gradient (the embedding and an untied head) in grad_rows_of_vocab.
    res = {}
    for name, p in model.named_parameters():
        gr = p.grad.detach().float().cpu()
        if "grad_rows_of_vocab" in g:
            if gr.ndim == 2 and gr.shape[0] == model.config.get_text_config().vocab_size:
                gr = gr[g["grad_rows_of_vocab"]]
        elif name == "model.language_model.embed_tokens.weight" and "grad_rows_of_embedding" in g:
            gr = gr[g["grad_rows_of_embedding"]]
        res[name] = gr
    return out.loss.item(), res


def main():
    for model_dir in sys.argv[1:]:
        report(model_dir)


def report(model_dir):
    g = load_file(f"{model_dir}/golden.safetensors")
    print(model_dir)
    for mode in ("fp32", "autocast", "bf16"):
        loss, res = grads(model_dir, mode, g)
        errs = []
        for name, gr in res.items():
            want = g["grad." + name].float()
            errs.append((math.sqrt(float(((gr - want).double() ** 2).sum()) /
                                   max(float((want.double() ** 2).sum()), 1e-300)), name))
        errs.sort(reverse=True)
        over2 = sum(e > 0.02 for e, _ in errs)
        print(f"{mode:8s} loss {loss:.6f}; worst per-tensor relative L2 {errs[0][0]:.4f} "
              f"({errs[0][1]}); {over2} tensors over 2%, {sum(e > 0.01 for e, _ in errs)} over 1%")
        for e, n in errs[:6]:
            print(f"    {e:.4f} {n}")


if __name__ == "__main__":
    main()
