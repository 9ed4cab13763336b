"""A prefill worker's reads of image embeddings from vision encoders, off the event loop.

The NIXL agent is used from one thread only (its own executor); a failed or expired read is
FAILED_PRECONDITION with a message the router recognises (`EMBEDDINGS_UNAVAILABLE`): it then
encodes the images again and retries once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Optional

from deepinfer_core.errors import TransferError
from deepinfer_core.multimodal.embedding_handle import EMBEDDINGS_UNAVAILABLE
from services.common.errors import ErrorCode, ServiceError


class EmbeddingFetcher:
    def __init__(self, worker_id: str = ""):
        self.worker_id = worker_id
        self.reader = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeds-read")

    def _read(self, handles: list):
        if self.reader is None:
            from deepinfer_core.multimodal.embedding_reader import EmbeddingReader

            self.reader = EmbeddingReader()
        before = self.reader.seconds
        embeds = self.reader.read(handles)
        return embeds, self.reader.seconds - before

    async def read(self, handles: list) -> tuple[list, float]:
        """(the embeddings of every handle in order, seconds the READs took)."""
        loop = asyncio.get_running_loop()
        try:
            embeds, seconds = await loop.run_in_executor(self._thread, self._read, handles)
        except TransferError as e:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"{EMBEDDINGS_UNAVAILABLE}: {e}") from None
        return embeds, seconds

    @property
    def registered_bytes(self) -> int:
        return 0 if self.reader is None else self.reader.registered_bytes

    def close(self, timeout_s: Optional[float] = None) -> None:
        self._thread.shutdown(wait=False)
