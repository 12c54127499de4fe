#!/usr/bin/env python3
"""Golden fixtures for Qwen3-VL-MoE from Hugging Face transformers (tests/data/qwen3vlmoe-tiny).

Runs where torch + transformers + safetensors are installed (the GPU machine). Builds a tiny
random Qwen3VLMoeForConditionalGeneration (sparse layers around a dense one listed in
mlp_only_layers, an untied head, a 1024-token vocabulary with the vision tokens at its end so
that the fixture stays small), writes it as the released checkpoints are laid out (nested
config.json, bf16 safetensors under model.visual.* / model.language_model.* / lm_head.*, the
fused experts as mlp.experts.gate_up_proj [E, H, 2I] and mlp.experts.down_proj [E, I, H]), reads
it back with from_pretrained to prove that HF takes that layout, and records in fp32 with TF32
off and the eager experts implementation:

  golden.safetensors  pixel values, position ids, vision embeddings and DeepStack features,
                      every hidden state, each sparse layer's router logits and top-k expert ids,
                      logits (top-8 and logsumexp per row); one training step's gradients with
                      and without the load-balancing loss
  golden.json         token ids, greedy ids, the LM loss, the aux loss, tolerances, versions

Token ids are drawn directly (no tokenizer): the model tests feed ids, and the tokenizer and chat
template are the dense families' fixtures' business.

Usage: make_moe_golden.py --out tests/data/qwen3vlmoe-tiny
"""
import argparse, json, math, os

import numpy as np
import torch

VOCAB = 1024
TOKENS = dict(image_token_id=1000, video_token_id=1001, vision_start_token_id=1002,
              vision_end_token_id=1003)
PAD = 1010
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.001,
            initializer_range=0.2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                          "mrope_interleaved": True},
            rope_theta=5000000.0)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
              patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 1], in_channels=3,
              hidden_act="gelu_pytorch_tanh", initializer_range=0.05)
IMAGES = [(96, 64), (64, 128)]  # (width, height): 6 and 8 merged rows


def sparse_layers():
    return [l for l in range(TEXT["num_hidden_layers"])
            if l not in TEXT["mlp_only_layers"] and (l + 1) % TEXT["decoder_sparse_step"] == 0]


def perturb_(model, seed):
    """Non-trivial norms, and bf16-representable weights (the checkpoint stores bf16)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.ndim == 1:
                base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
                prm.copy_(base + 0.1 * torch.randn(prm.shape, generator=g))
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))


def released_layout(state):
    """The fused experts as the released checkpoints store them: [E, H, 2I] and [E, I, H]."""
    H, I, E = TEXT["hidden_size"], TEXT["moe_intermediate_size"], TEXT["num_experts"]
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj") and tuple(v.shape) == (E, 2 * I, H):
            v = v.transpose(1, 2)
        elif k.endswith("mlp.experts.down_proj") and tuple(v.shape) == (E, H, I):
            v = v.transpose(1, 2)
        out[k] = v.contiguous()
    return out


def use_eager_experts(model):
    """The per-expert loop, whose order of sums is the plainest reference (spec 1.4)."""
    for how in ("set_experts_implementation",):
        f = getattr(model, how, None)
        if f is not None:
            try:
                f("eager")
                return "eager (set_experts_implementation)"
            except Exception:
                pass
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
        tc = getattr(model.config, "text_config", None)
        if tc is not None:
            tc._experts_implementation = "eager"
        return "eager (config._experts_implementation)"
    return "default (no experts implementation switch in this transformers)"


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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=10)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    os.makedirs(a.out, exist_ok=True)
    defaults = transformers.Qwen3VLMoeTextConfig()
    meta = dict(transformers=transformers.__version__, torch=torch.__version__,
                text_config_defaults={k: getattr(defaults, k, None) for k in (
                    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                    "norm_topk_prob")})
    cfg = Qwen3VLMoeConfig(text_config=dict(TEXT), vision_config=dict(VISION),
                           tie_word_embeddings=False, **TOKENS)
    model = Qwen3VLMoeForConditionalGeneration(cfg).float()
    perturb_(model, a.seed)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # The checkpoint as the hub ships it, then read back by HF itself.
    cfg.save_pretrained(a.out)
    with open(os.path.join(a.out, "config.json")) as f:
        cj = json.load(f)
    cj["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    cj["torch_dtype"] = "bfloat16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cj, f, indent=2)
    state = released_layout({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    save_file(state, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    meta["checkpoint_shapes"] = {k: list(v.shape) for k, v in state.items() if "layers.0.mlp" in k}
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(a.out, torch_dtype=torch.float32,
                                                               attn_implementation="eager")
    for k, v in model.state_dict().items():
        assert k in original, k
        assert torch.equal(v.float(), original[k].float()), f"{k} did not survive the round trip"
    meta["experts_implementation"] = use_eager_experts(model)
    # The rotary inverse frequencies follow the model's dtype: a bf16 checkpoint rotates with
    # bf16-rounded frequencies, as the dense goldens do (make_golden.py).
    model.to(torch.bfloat16).to(torch.float32)
    model.eval().to(a.device)
    dev = a.device

    try:
        from transformers import Qwen2VLImageProcessor as ImgProc
    except ImportError:
        from transformers import Qwen2VLImageProcessorFast as ImgProc
    improc = ImgProc(patch_size=16, temporal_patch_size=2, merge_size=2,
                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                     size={"shortest_edge": 4096, "longest_edge": 16777216})
    from PIL import Image
    images = []
    for w, h in IMAGES:
        img = rng.integers(0, 256, size=(h, w, 3)).astype(np.uint8)
        images.append(Image.fromarray(img, "RGB"))
    ip = improc(images=images, return_tensors="pt")
    pixel_values, grid_thw = ip["pixel_values"].float(), ip["image_grid_thw"]

    def text(n):
        return [int(x) for x in rng.integers(0, 1000, size=n)]

    ids = text(5)
    for thw in grid_thw.tolist():
        ids += [TOKENS["vision_start_token_id"]] + [TOKENS["image_token_id"]] * (
            thw[0] * thw[1] * thw[2] // 4) + [TOKENS["vision_end_token_id"]] + text(4)
    ids += text(6)
    input_ids = torch.tensor([ids])
    text_ids = torch.tensor([text(23)])
    mm_types = (input_ids == TOKENS["image_token_id"]).int()

    T = {"pixel_values": pixel_values, "image_grid_thw": grid_thw.to(torch.int64),
         "input_ids": input_ids.to(torch.int64), "text_input_ids": text_ids.to(torch.int64)}
    k = TEXT["num_experts_per_tok"]
    with torch.no_grad():
        vout = model.model.visual(pixel_values.to(dev), grid_thw=grid_thw.to(dev))
        if isinstance(vout, tuple):
            emb, deep = vout[0], vout[1]
        else:
            emb = getattr(vout, "pooler_output", None)
            if emb is None:
                emb = vout.last_hidden_state
            deep = getattr(vout, "deepstack_features", None)
            if deep is None:
                deep = getattr(vout, "deepstack_feature_lists", [])
        if isinstance(emb, (list, tuple)):
            emb = torch.cat(list(emb), 0)
        T["vision.embeds"] = emb.float().cpu()
        for i, d in enumerate(deep or []):
            T[f"vision.deepstack.{i}"] = d.float().cpu()
        rope_kw = dict(input_ids=input_ids.to(dev), image_grid_thw=grid_thw.to(dev),
                       attention_mask=torch.ones_like(input_ids).to(dev))
        try:
            pos, deltas = model.model.get_rope_index(mm_token_type_ids=mm_types.to(dev), **rope_kw)
        except TypeError:
            pos, deltas = model.model.get_rope_index(**rope_kw)
        T["position_ids"] = pos.to(torch.int64).cpu()
        T["rope_deltas"] = deltas.to(torch.int64).cpu()

        def run_logits(ids_, with_image, prefix):
            kw = dict(input_ids=ids_.to(dev), attention_mask=torch.ones_like(ids_).to(dev),
                      output_hidden_states=True, output_router_logits=True)
            if with_image:
                kw.update(pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
                          mm_token_type_ids=mm_types.to(dev))
            out = call(model, **kw)
            lg = out.logits[0].float().cpu()
            top = lg.topk(8, dim=-1)
            T[f"{prefix}.top8_values"] = top.values.clone()
            T[f"{prefix}.top8_ids"] = top.indices.to(torch.int64).clone()
            T[f"{prefix}.logsumexp"] = torch.logsumexp(lg, -1).clone()
            for li, hs in enumerate(out.hidden_states):
                T[f"{prefix}.hidden.{li}"] = hs[0].float().cpu()
            routers = list(out.router_logits)
            assert len(routers) == len(sparse_layers()), (len(routers), sparse_layers())
            for layer, rl in zip(sparse_layers(), routers):
                rl = rl.reshape(-1, TEXT["num_experts"]).float().cpu()
                T[f"{prefix}.router_logits.{layer}"] = rl
                p = torch.softmax(rl, -1, dtype=torch.float32)
                T[f"{prefix}.router_ids.{layer}"] = p.topk(k, -1).indices.to(torch.int64)

        run_logits(input_ids, True, "mm")
        run_logits(text_ids, False, "text")

        def greedy(ids_, with_image):
            kw = dict(input_ids=ids_.to(dev), attention_mask=torch.ones_like(ids_).to(dev),
                      do_sample=False, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                      eos_token_id=None, pad_token_id=PAD)
            if with_image:
                kw.update(pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
                          mm_token_type_ids=mm_types.to(dev))
            try:
                out = model.generate(**kw)
            except TypeError:
                kw.pop("mm_token_type_ids", None)
                out = model.generate(**kw)
            return out[0, ids_.shape[1]:].tolist()

        meta["mm_greedy_ids"] = greedy(input_ids, True)
        meta["text_greedy_ids"] = greedy(text_ids, False)

    # One training step on the second half of the prompt: the LM loss alone, then with the
    # load-balancing loss as HF adds it when asked for the router logits.
    labels = input_ids.clone()
    labels[labels == TOKENS["image_token_id"]] = -100
    labels[0, :input_ids.shape[1] // 2] = -100
    T["labels"] = labels.to(torch.int64)
    model.train()
    for with_aux in (False, True):
        model.zero_grad(set_to_none=True)
        out = call(model, input_ids=input_ids.to(dev),
                   attention_mask=torch.ones_like(input_ids).to(dev),
                   pixel_values=pixel_values.to(dev), image_grid_thw=grid_thw.to(dev),
                   labels=labels.to(dev), mm_token_type_ids=mm_types.to(dev),
                   output_router_logits=with_aux)
        out.loss.backward()
        tag = "grad_aux." if with_aux else "grad."
        gnorm2 = 0.0
        for name, prm in model.named_parameters():
            g = prm.grad.detach().float().cpu()
            gnorm2 += float((g.double() ** 2).sum())
            T[tag + name] = g
        if with_aux:
            meta["aux_loss"] = float(out.aux_loss)
            meta["loss_with_aux"] = out.loss.item()
            meta["grad_aux_norm"] = math.sqrt(gnorm2)
        else:
            meta["loss"] = out.loss.item()
            meta["grad_norm"] = math.sqrt(gnorm2)
    meta["sparse_layers"] = sparse_layers()
    meta["tensors"] = {n: dict(shape=list(v.shape), dtype=str(v.dtype)) for n, v in T.items()}
    meta["tolerance"] = dict(fp32_rel=1e-4, fp32_abs=1e-4, bf16_rel=3e-2)
    save_file({n: v.contiguous() for n, v in T.items()}, os.path.join(a.out, "golden.safetensors"))
    with open(os.path.join(a.out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print("wrote", a.out, "tensors:", len(T), "loss", meta["loss"], "aux", meta["aux_loss"],
          "greedy", meta["mm_greedy_ids"], meta["text_greedy_ids"], meta["experts_implementation"])


if __name__ == "__main__":
    main()
