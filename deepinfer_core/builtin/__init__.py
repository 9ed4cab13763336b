"""The embedded tiny model: config and tokenizer ship in the package, weights come from a fixed seed."""

from pathlib import Path

TINY_MODEL_DIR = str(Path(__file__).parent / "tiny")
TINY_MODEL_NAME = "deepinfer-tiny"
