"""Run on the GPU machine (torch, transformers, peft). Iris LoRA adapters against Hugging Face PEFT on the tiny fixture (fp32, TF32 off).
argv: fixture iris_adapter_dir iris_logits.safetensors peft_adapter_out prompt_text
(iris_logits: `iris generate -m fixture --lora iris_adapter_dir -p prompt_text --logits-out ...`)
1. PEFT loads Iris's exported adapter (every adapter weight must be loaded, none missing or left
   over); its last-row logits of the prompt are compared with iris generate --lora's.
2. PEFT saves an adapter of its own (random, B not zero) for iris generate --lora to read."""
import json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer
from peft import PeftModel, LoraConfig, get_peft_model

fixture, iris_adapter, iris_logits_path, peft_out, prompt = sys.argv[1:6]
torch.backends.cuda.matmul.allow_tf32 = False
tok = AutoTokenizer.from_pretrained(fixture)
msgs = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
if not torch.is_tensor(ids):
    ids = ids["input_ids"]
print("prompt tokens (python)", ids.shape[1])

def base():
    m = AutoModelForImageTextToText.from_pretrained(fixture, dtype=torch.float32, attn_implementation="eager")
    m.to(torch.bfloat16).to(torch.float32)
    return m.eval()

def last_logits(m):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()

def rel(a, b):
    return float((a - b).norm() / b.norm())

# 1. Iris's adapter in PEFT.
model = PeftModel.from_pretrained(base(), iris_adapter)
sd = load_file(f"{iris_adapter}/adapter_model.safetensors")
loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
want = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v for k, v in sd.items()}
missing = [k for k in loaded if k not in want]
extra = [k for k in want if k not in loaded]
mismatch = [k for k in want if k in loaded and not torch.equal(loaded[k].float(), want[k].float())]
print("PEFT adapter modules", len(loaded) // 2, "missing", len(missing), "unexpected", len(extra), "value mismatches", len(mismatch))
peft_logits = last_logits(model)
iris_logits = load_file(iris_logits_path)["logits"].float()
base_logits = last_logits(base())
print("Iris adapter: relative L2 of iris generate --lora to PEFT %.3g (adapter vs base %.3g); argmax iris %d peft %d"
      % (rel(iris_logits, peft_logits), rel(peft_logits, base_logits), int(iris_logits.argmax()), int(peft_logits.argmax())))

# 2. An adapter PEFT saves, for iris to read.
torch.manual_seed(7)
cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
pm = get_peft_model(base(), cfg)
with torch.no_grad():
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.05)
pm.save_pretrained(peft_out)
torch.save(last_logits(pm), f"{peft_out}/peft_logits.pt")
print("saved PEFT adapter with", sum(1 for n, _ in pm.named_parameters() if "lora_A" in n), "modules")
