"""Write reference.npz: frames resized by OpenCV 4.11 (INTER_AREA), Pillow 12.1 (BICUBIC) and
albumentations 1.4.18 (SmallestMaxSize), the versions Isaac-GR00T N1.6 pins. Run it in a
throwaway environment holding exactly those (see README.md); the tests never import them."""

from __future__ import annotations

import hashlib
import math
import sys

import albumentations as A
import cv2
import numpy as np
import PIL
from PIL import Image

AREA = [  # (source H, W) -> (destination H, W), one per OpenCV code path
    ((24, 32), (12, 16)),  # integer 2x2: (sum + 2) >> 2
    ((30, 36), (10, 12)),  # integer 3x3: sum / 9 rounded half to even
    ((47, 61), (25, 33)),  # fractional shrink: float32 pixel-area sums
    ((23, 31), (40, 53)),  # growth: area-mode fixed-point bilinear
    ((30, 20), (22, 35)),  # one axis shrinks, the other grows
    ((53, 79), (56, 83)),  # the tiny flavor's resize back after its crop
]
BICUBIC = [((56, 83), (56, 84)), ((47, 61), (28, 56)), ((61, 47), (84, 28)), ((40, 40), (33, 71))]
CHAIN = [((64, 96), 56), ((48, 48), 56), ((90, 120), 56), ((75, 50), 56)]
"""Isaac-GR00T's eval chain: (frame H, W), shortest_image_edge."""
CHAIN_REAL = [((480, 640), 256), ((256, 256), 256), ((224, 224), 256), ((720, 1280), 256)]
"""The same at real camera sizes."""
CROP = 0.95
FACTOR = 28
STORED_BYTES = 8000
"""Outputs up to this size are stored whole; larger ones as their shape and sha256."""


def pattern(h: int, w: int, seed: int) -> np.ndarray:
    """A reproducible uint8 [h, w, 3] frame: hashed texture, its top-left quarter quantised
    to 4 levels (flat areas: rounding ties)."""
    i, j, c = np.meshgrid(np.arange(h), np.arange(w), np.arange(3), indexing="ij")
    v = (i * 31 + j * 17 + c * 101 + seed * 7) ** 2 + i * j * 13
    img = ((v * 2654435761) >> 13 & 255).astype(np.uint8)
    img[: h // 2, : w // 2] = img[: h // 2, : w // 2] // 64 * 64
    return img


def smart_resize(h: int, w: int) -> tuple[int, int]:
    """Eagle's final size: sides rounded to multiples of 28 (the pixel-count bounds never
    bind at these sizes)."""
    hb, wb = max(FACTOR, round(h / FACTOR) * FACTOR), max(FACTOR, round(w / FACTOR) * FACTOR)
    assert 4 * 28 * 28 <= hb * wb <= 4096 * 28 * 28 and not math.isnan(hb)
    return hb, wb


def chain(img: np.ndarray, edge: int) -> np.ndarray:
    """SmallestMaxSize(INTER_AREA), centred crop of int(side * 0.95), SmallestMaxSize back,
    Pillow bicubic to Eagle's size."""
    resize = A.SmallestMaxSize(max_size=edge, interpolation=cv2.INTER_AREA, p=1.0)
    x = resize(image=img)["image"]
    h, w = x.shape[:2]
    ch, cw = max(1, int(h * CROP)), max(1, int(w * CROP))
    top, left = (h - ch) // 2, (w - cw) // 2
    x = resize(image=np.ascontiguousarray(x[top : top + ch, left : left + cw]))["image"]
    oh, ow = smart_resize(*x.shape[:2])
    return np.asarray(Image.fromarray(x).resize((ow, oh)))  # Pillow's default: BICUBIC


def store(data: dict[str, np.ndarray], name: str, y: np.ndarray) -> None:
    """``name``: the output itself, or ``name_shape`` + ``name_sha256`` when it is large."""
    if y.nbytes <= STORED_BYTES:
        data[name] = y
        return
    data[f"{name}_shape"] = np.array(y.shape)
    digest = hashlib.sha256(np.ascontiguousarray(y).tobytes()).digest()
    data[f"{name}_sha256"] = np.frombuffer(digest, dtype=np.uint8)


def main(out: str) -> None:
    data: dict[str, np.ndarray] = {}
    for k, ((h, w), (oh, ow)) in enumerate(AREA):
        y = cv2.resize(pattern(h, w, k), (ow, oh), interpolation=cv2.INTER_AREA)
        store(data, f"area_{k}", y)
    for k, ((h, w), (oh, ow)) in enumerate(BICUBIC):
        store(data, f"bicubic_{k}", np.asarray(Image.fromarray(pattern(h, w, k)).resize((ow, oh))))
    for k, ((h, w), edge) in enumerate(CHAIN + CHAIN_REAL):
        store(data, f"chain_{k}", chain(pattern(h, w, k), edge))
    versions = f"opencv {cv2.__version__}, Pillow {PIL.__version__}, albumentations {A.__version__}"
    data["versions"] = np.array(versions)
    np.savez_compressed(out, **data)
    print(out, versions)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reference.npz")
