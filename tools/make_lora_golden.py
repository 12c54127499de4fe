#!/usr/bin/env python3
"""LoRA golden for the tiny Qwen3-VL fixture, in plain torch (fp32, TF32 off, no PEFT needed).

Adapters of rank 8 and alpha 16 on every language projection (q/k/v/o, gate/up/down) and the
vision blocks' attn.qkv, as PEFT's LoraLayer computes them: y = base(x) + (alpha / r) B(A(x)).
A and B are drawn here (B not zero, so that both gradients carry information) and written to the
golden, so the C++ test starts from the same adapters. Records, on the fixture's training sample
(golden.safetensors: input_ids, labels, pixel_values, image_grid_thw):

  golden_lora.safetensors  adapter.<PEFT-less HF name>  the starting adapters
                           grad.<name>                  their gradients of the mean loss
                           before.{top8_ids,top8_values,logsumexp}  logits with the adapters
                           after.{...}                  logits after one AdamW step of the adapters
                           after_adamw.<name>           the adapters after that step
  golden_lora.json         loss, the settings, the optimizer's

Usage (GPU machine): make_lora_golden.py --fixture tests/data/qwen3vl-tiny
"""
import argparse, json, math

import torch

RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION_TARGETS = ["attn.qkv"]
# eps well above the gradients' own rounding: the first Adam step is lr * g / (|g| + eps), which
# for a gradient near zero (one of this fixture's is 5e-8 against a largest of 4e-2) turns fp32
# rounding into a change of the whole update.
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-5, weight_decay=0.01)


class LoraLinear(torch.nn.Module):
    def __init__(self, base, a, b, scale):
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.scale = scale

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def adapted(name):
    if name.startswith("model.language_model.layers."):
        return any(name.endswith("." + t) for t in TARGETS)
    if name.startswith("model.visual.blocks."):
        return any(name.endswith("." + t) for t in VISION_TARGETS)
    return False


def top8(logits, prefix, T):
    lg = logits[0].float()
    top = torch.topk(lg, 8, dim=-1)
    T[prefix + ".top8_values"] = top.values.cpu().clone()
    T[prefix + ".top8_ids"] = top.indices.to(torch.int64).cpu().clone()
    T[prefix + ".logsumexp"] = torch.logsumexp(lg, -1).cpu().clone()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    dev = a.device
    g = load_file(f"{a.fixture}/golden.safetensors")
    # As the other goldens were made: eager attention, rotary frequencies rounded through bf16.
    model = AutoModelForImageTextToText.from_pretrained(a.fixture, dtype=torch.float32,
                                                        attn_implementation="eager")
    model.to(torch.bfloat16).to(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)

    gen = torch.Generator().manual_seed(20261128)
    scale = ALPHA / RANK
    lora = {}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, torch.nn.Linear) or not adapted(name):
            continue
        A = torch.randn(RANK, mod.in_features, generator=gen) * 0.05
        B = torch.randn(mod.out_features, RANK, generator=gen) * 0.05
        parent_name, child = name.rsplit(".", 1)
        wrapped = LoraLinear(mod, A, B, scale)
        setattr(model.get_submodule(parent_name), child, wrapped)
        lora[name] = wrapped
    model.to(dev).train()

    ids = g["input_ids"].to(dev)
    mm = (ids == 151655).int() + 2 * (ids == 151656).int()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
              pixel_values=g["pixel_values"].to(dev), image_grid_thw=g["image_grid_thw"].to(dev),
              labels=g["labels"].to(dev))

    def run():
        try:
            return model(**kw, mm_token_type_ids=mm)
        except TypeError:
            return model(**kw)

    T = {}
    for name, m in lora.items():
        T[f"adapter.{name}.lora_A.weight"] = m.lora_A.detach().cpu().clone()
        T[f"adapter.{name}.lora_B.weight"] = m.lora_B.detach().cpu().clone()
    out = run()
    top8(out.logits.detach(), "before", T)
    out.loss.backward()
    for name, m in lora.items():
        T[f"grad.{name}.lora_A.weight"] = m.lora_A.grad.detach().cpu().clone()
        T[f"grad.{name}.lora_B.weight"] = m.lora_B.grad.detach().cpu().clone()
    params = [p for m in lora.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW(params, foreach=True, **ADAMW)
    opt.step()
    for name, m in lora.items():
        T[f"after_adamw.{name}.lora_A.weight"] = m.lora_A.detach().cpu().clone()
        T[f"after_adamw.{name}.lora_B.weight"] = m.lora_B.detach().cpu().clone()
    with torch.no_grad():
        top8(run().logits, "after", T)

    save_file({k: v.contiguous() for k, v in T.items()}, f"{a.fixture}/golden_lora.safetensors")
    meta = dict(rank=RANK, alpha=ALPHA, target_modules=TARGETS + VISION_TARGETS,
                loss=out.loss.item(), adamw=dict(ADAMW, betas=list(ADAMW["betas"])),
                adapters=len(lora), tolerance=dict(fp32_rel=1e-4))
    with open(f"{a.fixture}/golden_lora.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{len(lora)} adapted modules, loss {meta['loss']:.6f}")


if __name__ == "__main__":
    main()
