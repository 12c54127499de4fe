#!/usr/bin/env python3
"""Writes an SFT set for throughput and memory runs of the SFT recipes: a JSONL in HF messages
layout whose samples each hold one PNG image (drawn here: gradients, discs and bars, at sides
from 768 to 1024 pixels in steps of 32) and a multi-turn conversation of English-like text,
filled until the sample reaches --tokens tokens (image pads included) under the Qwen chat
format. Token counts come from the tokenizer.json given, so the samples land just under the
recipe's train.seq_length instead of being dropped as too long.

  python3 tools/make_sft_data.py --out /tmp/sft --n 64 --tokens 4096 \
      --tokenizer tests/data/qwen3vl-tiny/tokenizer.json

Needs numpy and the `tokenizers` package (both come with transformers).
"""
import argparse, json, math, os, random, struct, zlib

import numpy as np

from tokenizers import Tokenizer

WORDS = ("the a of to and in is it that for on with as was at by this be from or have an are "
         "image shows left right top bottom corner colour red green blue yellow purple orange "
         "light dark shape circle square bar line edge gradient pattern object scene background "
         "foreground near far above below between next inside outside large small wide narrow "
         "bright soft sharp smooth rough surface texture detail region area part whole pixel "
         "describe explain compare count where what which how many why because so then also "
         "first second third finally however therefore example question answer reason step "
         "model picture view frame centre middle half quarter size position direction angle "
         "appears seems looks contains includes covers crosses touches overlaps follows").split()


def png(path, w, h, rng):
    """A deterministic picture: a two-colour gradient with discs and bars, as an RGB PNG."""
    c0 = np.array([rng.randrange(256) for _ in range(3)], np.float32)
    c1 = np.array([rng.randrange(256) for _ in range(3)], np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    t = ((xx + yy) / (w + h))[..., None]
    img = (c0 * (1 - t) + c1 * t).astype(np.uint8)
    for _ in range(rng.randrange(1, 4)):
        y0, bh = rng.randrange(h), rng.randrange(8, h // 10)
        img[y0:y0 + bh] = [rng.randrange(256) for _ in range(3)]
    for _ in range(rng.randrange(2, 6)):
        cx, cy, r = rng.randrange(w), rng.randrange(h), rng.randrange(w // 16, w // 4)
        img[(xx - cx) ** 2 + (yy - cy) ** 2 <= r * r] = [rng.randrange(256) for _ in range(3)]
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, 3 * w)], axis=1).tobytes()

    def chunk(kind, data):
        c = struct.pack(">I", len(data)) + kind + data
        return c + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 6)))
        f.write(chunk(b"IEND", b""))


def image_tokens(w, h, patch=16, merge=2, min_pixels=64 * 32 * 32, max_pixels=16384 * 32 * 32):
    """Qwen's smart_resize, then one token per merged 2x2 patch window."""
    f = patch * merge
    hb, wb = round(h / f) * f, round(w / f) * f
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / f) * f, math.floor(w / beta / f) * f
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    return (hb // f) * (wb // f)


def sentence(rng, n):
    words = [rng.choice(WORDS) for _ in range(n)]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096, help="train.seq_length to fill up to")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--side", type=int, default=0,
                    help="every image SIDE x SIDE pixels (default: random sides 768-1024)")
    ap.add_argument("--text", type=int, default=0,
                    help="text tokens per sample instead of filling up to --tokens")
    a = ap.parse_args()
    tok = Tokenizer.from_file(a.tokenizer)
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)
    os.makedirs(os.path.join(a.out, "images"), exist_ok=True)
    rng = random.Random(a.seed)
    # <|im_start|>role\n ... <|im_end|>\n per turn, and <|vision_start|> <|vision_end|>.
    turn_overhead, vision_overhead = 5, 2
    lengths = []
    with open(os.path.join(a.out, "train.jsonl"), "w") as f:
        for i in range(a.n):
            w, h = rng.randrange(768, 1025, 32), rng.randrange(768, 1025, 32)
            if a.side:
                w = h = a.side
            name = f"images/{i:05d}.png"
            png(os.path.join(a.out, name), w, h, rng)
            budget = a.tokens - image_tokens(w, h) - vision_overhead - 8  # slack for the template
            if a.text:
                budget = min(budget, a.text)
            messages, used = [], 0
            while True:
                q = " ".join(sentence(rng, rng.randrange(6, 16)) for _ in range(rng.randrange(2, 6)))
                ans = " ".join(sentence(rng, rng.randrange(8, 20))
                               for _ in range(rng.randrange(10, 40)))
                cost = count(q) + count(ans) + 2 * turn_overhead
                if used + cost > budget:
                    # Fill what is left with one last short answer.
                    left = budget - used - 2 * turn_overhead - count(q)
                    if left < 16:
                        break
                    words = ans.split()
                    while words and count(" ".join(words)) > left:
                        words = words[:max(1, len(words) * 9 // 10)]
                    ans = " ".join(words)
                    cost = count(q) + count(ans) + 2 * turn_overhead
                user = [{"type": "text", "text": q}]
                if not messages:
                    user.insert(0, {"type": "image", "image": name})
                messages += [{"role": "user", "content": user},
                             {"role": "assistant", "content": ans}]
                used += cost
                if used + 64 > budget:
                    break
            f.write(json.dumps({"messages": messages}) + "\n")
            lengths.append(used + image_tokens(w, h) + vision_overhead)
    print(f"{a.n} samples in {a.out}/train.jsonl, estimated tokens {min(lengths)}-{max(lengths)}")


if __name__ == "__main__":
    main()
