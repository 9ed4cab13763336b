"""`random-mm`: chat requests with random text and random-noise PNG images as data URLs.

Each request carries --random-mm-base-items-per-request images of --random-mm-image-size pixels
beside a random prompt of --random-input-len tokens. Noise does not compress, so each image
costs the server its full decode. Image tokens are not counted here: the server's
`usage.prompt_tokens` gives the prompt's full length.
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image

from services.bench.datasets.options import DatasetOptions, make_prompt, sample_len
from services.bench.records import BenchRequest
from services.bench.tokens import TokenSource


def build(options: DatasetOptions, tokens: TokenSource) -> list[BenchRequest]:
    if options.token_ids:
        raise ValueError("random-mm requests are chat messages: --prompt-format token-ids does not apply")
    width, height = options.random_mm_image_size
    if width < 1 or height < 1 or options.random_mm_base_items_per_request < 0:
        raise ValueError("--random-mm-image-size needs positive sides, --random-mm-base-items-per-request >= 0")
    rng = random.Random(options.seed)
    requests = []
    for _ in range(options.num_prompts):
        input_len = sample_len(rng, options.random_input_len, options.random_range_ratio)
        output_len = sample_len(rng, options.random_output_len, options.random_range_ratio)
        prompt, prompt_len = make_prompt(rng, tokens, input_len, token_ids=False)
        pictures = [random_png(rng, width, height) for _ in range(options.random_mm_base_items_per_request)]
        requests.append(BenchRequest(prompt, prompt_len, output_len, images=pictures))
    return requests


def random_png(rng: random.Random, width: int, height: int) -> str:
    """A PNG of random RGB pixels, as a data URL."""
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
