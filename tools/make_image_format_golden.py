#!/usr/bin/env python3
"""Goldens for image files as Hugging Face transformers loads them: EXIF orientation, WebP, TIFF.

Writes small test images made from a formula with PIL (deterministic: no randomness, no clock),
then what transformers makes of each: `transformers.image_utils.load_image` (PIL.Image.open,
ImageOps.exif_transpose, convert("RGB")) and, for some, the Qwen3-VL image processor of
tests/data/qwen3vl-tiny/preprocessor_config.json (loaded the way tools/make_golden.py builds it).
Into --out:

  upright.png                  the 70x45 formula image every other file holds, stored turned
  jpeg_orient{1..8}.jpg        the image stored turned by the inverse of EXIF orientation k, with
                               that orientation in APP1 Exif: load_image gives it upright
  webp_lossless.webp, webp_lossy.webp, webp_alpha.webp (RGBA, lossless),
  webp_orient6.webp            (lossless, EXIF chunk, orientation 6)
  tiff_*.tif                   RGB (raw, LZW, JPEG), RGBA, LA, L, I;16, 1-bit (Group 4), palette,
                               CMYK, and tiff_orient8.tif (Orientation tag 8 in its own IFD)
  png_alpha.png, png_orient5.png (eXIf chunk)
  golden.safetensors           "<stem>.rgb": int32 [H, W, 3], load_image's pixels;
                               "<stem>.rgb_composited", for the files with alpha: the same file
                               opened and exif_transpose'd, then made RGB by
                               transformers.image_transforms.convert_to_rgb instead of
                               convert("RGB"). The name is historical (Iris once composited
                               alpha onto white); in transformers 5.17 convert_to_rgb is
                               convert("RGB") and drops alpha, so the two keys hold the same
                               pixels. Both are kept so that a transformers whose convert_to_rgb
                               treats alpha otherwise shows up as a difference between them;
                               "<stem>.pixel_values" f32 and "<stem>.image_grid_thw" int64 from
                               the image processor given load_image's image, for PIXEL_VALUE_STEMS
  golden.json                  per file: format, EXIF orientation, PIL mode, size as loaded,
                               lossless or not; versions of transformers, PIL, numpy

Usage (where torch, transformers and Pillow with WebP and libtiff are installed):
  python3 tools/make_image_format_golden.py --out tests/data/image_formats

--no-transformers writes the images and PIL's own pixels (the same steps as load_image, without
transformers and without pixel_values) for trying the script where transformers is missing; the
json then says so, and such a golden is not HF's.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
from PIL import Image, ImageOps

W, H = 70, 45
PIXEL_VALUE_STEMS = ["upright", "jpeg_orient6", "webp_lossy"]

# What exif_transpose applies for each orientation, and the inverse that stores the image so.
TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90,
}
INVERSE = {**TRANSPOSE, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def formula_rgb():
    """Smooth ramps (JPEG keeps them close) with an asymmetric mark, so that every turn and
    mirror gives other pixels."""
    y, x = np.mgrid[0:H, 0:W].astype(np.int64)
    r = x * 255 // (W - 1)
    g = y * 255 // (H - 1)
    b = (x * 3 + y * 5) % 256
    img = np.stack([r, g, b], -1)
    img[5:12, 8:30] = [250, 20, 40]  # a bar near the top left
    img[30:40, 55:62] = [10, 10, 200]  # a block near the bottom right
    return img.astype(np.uint8)


def formula_alpha():
    y, x = np.mgrid[0:H, 0:W].astype(np.int64)
    a = (x * 255 // (W - 1) + y * 2) % 256
    a[:, :4] = 0  # fully transparent columns whose colour is still stored
    a[:, -4:] = 255
    return a.astype(np.uint8)


def exif_bytes(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def stored(img, orientation):
    return img.transpose(INVERSE[orientation]) if orientation in INVERSE else img.copy()


def write_images(out):
    """The files and how each was made: {stem: (filename, dict of facts)}."""
    rgb = Image.fromarray(formula_rgb())  # uint8 [H, W, 3]: RGB
    rgba = Image.fromarray(np.dstack([formula_rgb(), formula_alpha()]))  # [H, W, 4]: RGBA
    assert rgb.mode == "RGB" and rgba.mode == "RGBA"
    # CMYK with black ink too, so that PIL's cmyk2rgb does more than invert.
    cmyk = np.dstack([255 - formula_rgb(), (np.arange(W)[None, :] * 3 % 200).repeat(H, 0)])
    cmyk = Image.frombytes("CMYK", (W, H), cmyk.astype(np.uint8).tobytes())
    grey16 = Image.fromarray(formula_rgb()[:, :, 0].astype(np.uint16) * 3)  # 2-D uint16: I;16
    files = {}

    def save(stem, ext, img, facts, **kw):
        name = stem + ext
        img.save(os.path.join(out, name), **kw)
        files[stem] = (name, facts)

    save("upright", ".png", rgb, dict(format="PNG", orientation=1, lossless=True))
    for k in range(1, 9):
        save(f"jpeg_orient{k}", ".jpg", stored(rgb, k),
             dict(format="JPEG", orientation=k, lossless=False),
             format="JPEG", quality=90, exif=exif_bytes(k))
    save("webp_lossless", ".webp", rgb, dict(format="WEBP", orientation=1, lossless=True),
         format="WEBP", lossless=True)
    save("webp_lossy", ".webp", rgb, dict(format="WEBP", orientation=1, lossless=False),
         format="WEBP", quality=80, method=4)
    save("webp_alpha", ".webp", rgba, dict(format="WEBP", orientation=1, lossless=True),
         format="WEBP", lossless=True, exact=True)
    save("webp_orient6", ".webp", stored(rgb, 6), dict(format="WEBP", orientation=6, lossless=True),
         format="WEBP", lossless=True, exif=exif_bytes(6))
    tiffs = [
        ("tiff_rgb", rgb, "raw"), ("tiff_rgb_lzw", rgb, "tiff_lzw"),
        ("tiff_rgb_jpeg", rgb, "jpeg"), ("tiff_ycbcr_jpeg", rgb.convert("YCbCr"), "jpeg"),
        ("tiff_rgba", rgba, "tiff_adobe_deflate"), ("tiff_la", rgba.convert("LA"), "raw"),
        ("tiff_grey", rgb.convert("L"), "packbits"), ("tiff_grey16", grey16, "raw"),
        ("tiff_bilevel", rgb.convert("L").point(lambda v: 255 if v > 100 else 0).convert("1"),
         "group4"),
        ("tiff_palette", rgb.quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=0), "raw"),
        ("tiff_cmyk", cmyk, "raw"),
    ]
    for stem, img, compression in tiffs:
        save(stem, ".tif", img, dict(format="TIFF", orientation=1,
                                     lossless=compression != "jpeg", compression=compression),
             format="TIFF", compression=compression)
    save("tiff_orient8", ".tif", stored(rgb, 8), dict(format="TIFF", orientation=8, lossless=True),
         format="TIFF", tiffinfo={0x0112: 8})
    save("png_alpha", ".png", rgba, dict(format="PNG", orientation=1, lossless=True), format="PNG")
    save("png_orient5", ".png", stored(rgb, 5), dict(format="PNG", orientation=5, lossless=True),
         format="PNG", exif=exif_bytes(5))
    return files


def pil_load_image(path):
    """transformers.image_utils.load_image for a local path, for --no-transformers."""
    image = Image.open(path)
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")


def write_safetensors(path, tensors):
    """safetensors' layout (an 8-byte little-endian header length, the JSON header, the data),
    written with numpy so that the script needs no torch for --no-transformers."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the images and the golden")
    ap.add_argument("--preprocessor", default=os.path.join(
        root, "tests", "data", "qwen3vl-tiny", "preprocessor_config.json"),
        help="a preprocessor_config.json; its folder is given to from_pretrained")
    ap.add_argument("--no-transformers", action="store_true",
                    help="PIL's pixels only, where transformers is not installed")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    from PIL import features
    for feature in ("webp", "libtiff", "jpg"):
        if not features.check(feature):
            sys.exit(f"this Pillow lacks {feature} support, which the golden needs")

    versions = {"PIL": Image.__version__, "numpy": np.__version__,
                "libjpeg": features.version("jpg"), "libwebp": features.version("webp"),
                "libtiff": features.version("libtiff"),
                "libjpeg_turbo": features.version("libjpeg_turbo")
                if "libjpeg_turbo" in features.get_supported_features() else None}
    convert_to_rgb = None
    if a.no_transformers:
        load_image, improc = pil_load_image, None
        versions["transformers"] = None
    else:
        import transformers
        from transformers.image_utils import load_image
        try:
            from transformers.image_transforms import convert_to_rgb
        except ImportError:
            pass
        try:
            from transformers import Qwen2VLImageProcessor as ImgProc
        except ImportError:
            from transformers import Qwen2VLImageProcessorFast as ImgProc
        improc = ImgProc.from_pretrained(os.path.dirname(os.path.abspath(a.preprocessor)))
        versions["transformers"] = transformers.__version__
        versions["image_processor"] = type(improc).__name__

    files = write_images(a.out)
    tensors, meta = {}, {}
    for stem, (name, facts) in files.items():
        path = os.path.join(a.out, name)
        opened = Image.open(path)
        loaded = load_image(path)
        assert loaded.mode == "RGB", (name, loaded.mode)
        pixels = np.asarray(loaded, dtype=np.uint8)
        tensors[stem + ".rgb"] = pixels.astype(np.int32)
        entry = dict(facts, file=name, mode=opened.mode, width=loaded.width,
                     height=loaded.height, has_alpha="A" in opened.mode)
        if entry["has_alpha"]:
            turned = ImageOps.exif_transpose(Image.open(path))
            # Without transformers: PIL's convert("RGB"), which is what
            # transformers.image_transforms.convert_to_rgb does in 5.17.
            via_hf = convert_to_rgb(turned) if convert_to_rgb is not None else turned.convert("RGB")
            tensors[stem + ".rgb_composited"] = np.asarray(via_hf, np.uint8).astype(np.int32)
        if improc is not None and stem in PIXEL_VALUE_STEMS:
            out = improc(images=[loaded], return_tensors="pt")
            tensors[stem + ".pixel_values"] = out["pixel_values"].float().numpy()
            tensors[stem + ".image_grid_thw"] = out["image_grid_thw"].to(dtype=int).numpy()
        meta[stem] = entry

    versions["convert_to_rgb"] = ("transformers.image_transforms" if convert_to_rgb is not None
                                  else "PIL convert(\"RGB\") in its place")
    write_safetensors(os.path.join(a.out, "golden.safetensors"), tensors)
    with open(os.path.join(a.out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump({"source": "PIL only (--no-transformers)" if a.no_transformers
                   else "transformers.image_utils.load_image",
                   "versions": versions, "upright": [W, H],
                   "pixel_value_stems": [] if improc is None else PIXEL_VALUE_STEMS,
                   "files": meta}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(files)} images and the golden to {a.out} ({versions})")


if __name__ == "__main__":
    main()
