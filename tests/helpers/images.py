"""Real encoded test images, drawn here: shapes of distinct colours on a background, PNG-encoded."""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw


def make_png(width: int = 48, height: int = 40, seed: int = 0, mode: str = "RGB") -> bytes:
    """A PNG of `width` x `height` with a few random ellipses and rectangles; "RGBA" adds
    half-transparent shapes, so RGB conversion has to composite them."""
    rng = random.Random(seed)

    def colour() -> tuple[int, ...]:
        rgb = tuple(rng.randrange(256) for _ in range(3))
        return rgb + (rng.choice([80, 160, 255]),) if mode == "RGBA" else rgb

    image = Image.new(mode, (width, height), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = rng.randrange(width - 4), rng.randrange(height - 4)
        box = (x0, y0, rng.randrange(x0 + 2, width), rng.randrange(y0 + 2, height))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour())
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
