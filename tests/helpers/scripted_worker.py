"""A colocated worker's client that generates by a fixed rule, for driving the real router, gateway
and HTTP app without an engine: deltas come from the real `OutputDiffer` over cumulative outputs,
as a worker makes them, with the characters that JSON and SSE framing must get right (quotes,
backslashes, non-ASCII, U+0085 / U+2028 / U+2029), stop strings that cut the text back, logprobs,
and bursts of deltas that arrive with no turn of the loop between them.
"""

from __future__ import annotations

import asyncio

from deepinfer_core.outputs import CompletionOutput
from services.common.deltas import OutputDiffer
from services.common.workers import POOL_COLOCATED, WorkerInfo, WorkerLoad
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry

VOCAB = 64
PIECES = (" hello", "é", "\u2028", "\x85", '"q"', "\\", "\U0001f642", "\n", "\u2029x", " w", "\t", "</s>", " ab", "c")
"""The text of token t is PIECES[t % len(PIECES)]."""


def token_at(prompt: list[int], seed: int, j: int) -> int:
    return (prompt[0] * 31 + j * 7 + seed * 13) % VOCAB


_UP_TO_THE_CONTEXT = 24
"""Tokens for `max_tokens=None`: an engine would go on to the context length; a few are enough here."""


class ScriptedWorker:
    def __init__(self, burst: int = 1, token_delay_s: float = 0.0):
        self.burst = burst
        """Deltas sent back to back before the loop turns."""
        self.token_delay_s = token_delay_s
        """A pause after each burst: requests that stay in flight a while, as a busy engine's do."""

    def info(self) -> WorkerInfo:
        big = 1 << 20
        return WorkerInfo(
            "scripted", POOL_COLOCATED, 0, "local", max_model_len=4096, block_size=16, num_blocks=big, max_num_seqs=big
        )

    async def generate(self, request_id, prompt, params, timeout, images=(), resumed_tokens=0):
        differ, tokens, text = OutputDiffer(), [], ""
        max_tokens = params.max_tokens or _UP_TO_THE_CONTEXT
        for j in range(max_tokens):
            t = token_at(prompt, params.seed or 0, j)
            tokens.append(t)
            text += PIECES[t % len(PIECES)]
            finish = stop = None
            for s in params.stop:
                if s in text:  # the engine cuts a stop string off and ends the sample
                    text, finish, stop = text[: text.index(s)], "stop", s
                    break
            if finish is None and j + 1 == max_tokens:
                finish = "length"
            out = CompletionOutput(0, text, list(tokens), logprobs=_logprobs(tokens, params.logprobs))
            out.finish_reason, out.stop_reason = finish, stop
            delta = differ.diff(out, num_cached_tokens=min(len(prompt), 2))
            if delta is not None:
                yield delta
            if finish is not None:
                return
            if (j + 1) % self.burst == 0:
                await asyncio.sleep(self.token_delay_s)

    async def abort(self, request_id, prefill) -> bool:
        return False

    async def stats(self, timeout) -> WorkerLoad:
        return WorkerLoad(worker_id="scripted")

    async def close(self) -> None:
        pass


def _logprobs(tokens: list[int], top: int | None):
    if top is None:
        return None
    return [{t: -0.5 - (t % 5) / 10, **{(t + k + 1) % VOCAB: -1.25 - k for k in range(top)}} for t in tokens]


async def scripted_router(worker: ScriptedWorker, config: RouterConfig | None = None) -> RouterCore:
    """A RouterCore whose only worker is `worker` (the colocated pool)."""
    registry = PoolRegistry(lambda info: worker)
    await registry.add(worker.info(), worker)
    return RouterCore(registry, config or RouterConfig(pools=(POOL_COLOCATED,)), "m")
