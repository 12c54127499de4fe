# Recomputes the tiny fixture's text forward with HF transformers under several attention
# implementations and devices, and reports per-row max differences against the golden.
import sys, json, torch
from safetensors.torch import load_file
from transformers import Qwen3VLForConditionalGeneration
d = sys.argv[1]
g = load_file(d + "/golden.safetensors")
ids = g["text_input_ids"]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
for dev in ["cuda", "cpu"]:
    for impl in ["sdpa", "eager"]:
        m = Qwen3VLForConditionalGeneration.from_pretrained(d, torch_dtype=torch.float32, attn_implementation=impl).to(dev).eval()
        with torch.no_grad():
            out = m(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), output_hidden_states=True)
        h = out.hidden_states[1][0].float().cpu()
        diff = (h - g["text.hidden.1"]).abs().max(dim=-1).values
        print(dev, impl, "rowmax", " ".join(f"{x:.2e}" for x in diff.tolist()))
        lg = out.logits[0].float().cpu()
        print(dev, impl, "top8 max diff", (lg.topk(8,-1).values - g["text.top8_values"]).abs().max().item())
