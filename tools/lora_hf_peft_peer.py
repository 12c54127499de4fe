"""Run on the GPU machine (torch, transformers, peft). HF PEFT LoRA training peer for Qwen3-VL-8B geometry (random bf16 weights, sdpa): one 896x896
image (784 tokens) and text to 3,800 tokens per sample, micro-batch 1, rank 32, alpha 32 on q/k/v/o and
gate/up/down, AdamW on the adapters. Prints tokens/s over the timed steps and peak memory.
argv: config.json steps samples_per_step"""
import json, sys, time
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from peft import LoraConfig, get_peft_model

cfg_path, steps, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = Qwen3VLConfig(**json.load(open(cfg_path)))
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
T, img_tokens = 3800, 784
ids = torch.randint(0, 150000, (1, T), device="cuda")
ids[0, 10:10 + img_tokens] = cfg.image_token_id
ids[0, 9] = cfg.vision_start_token_id
ids[0, 10 + img_tokens] = cfg.vision_end_token_id
labels = ids.clone(); labels[0, :10 + img_tokens + 1] = -100
mm = (ids == cfg.image_token_id).int()
px = torch.randn(3136, 3 * 2 * 16 * 16 if cfg.vision_config.patch_size == 16 else 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
grid = torch.tensor([[1, 56, 56]], device="cuda")
def micro():
    try:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px, image_grid_thw=grid, labels=labels, mm_token_type_ids=mm)
    except TypeError:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px, image_grid_thw=grid, labels=labels)
    (out.loss / accum).backward()
    return out.loss.item()
for s in range(steps):
    if s == 1:
        torch.cuda.synchronize(); t0 = time.time()
    for _ in range(accum):
        loss = micro()
    opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
dt = time.time() - t0
tok = (steps - 1) * accum * T
print("HF PEFT peer: %.1f tokens/s (%d steps of %d samples after one warm-up step, %.2f s/step), peak memory %.1f GiB, last loss %.3f"
      % (tok / dt, steps - 1, accum, dt / (steps - 1), torch.cuda.max_memory_allocated() / 2**30, loss))
