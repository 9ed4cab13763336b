"""Speculative decoding with DeepSeek-V3's MTP layer as the draft model (decode side).

- `draft_model.py`: loads the MTP layer (checkpoint, built-in seed, or dummy weights);
- `slots.py`: the per-sequence slot pool (draft tokens, draft distributions) and acceptance counters;
- `verify.py`: greedy acceptance and rejection sampling (target distribution preserved);
- `decoder.py`: the decode step that scores `1 + nextn` positions per sequence in one target
  forward, and the draft passes that follow every step.
"""
