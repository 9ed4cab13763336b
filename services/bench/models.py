"""The server's `/v1/models`: the model to ask for when none is named, and a hint after a 404."""

from __future__ import annotations

from typing import Optional

import httpx


def list_models(base_url: str, api_key: Optional[str] = None, timeout_s: float = 10.0) -> list[str]:
    """Model ids the server lists. Raises ValueError, naming the URL, when it cannot be read."""
    base = base_url.rstrip("/")
    url = (base[: -len("/v1")] if base.endswith("/v1") else base) + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return [m["id"] for m in response.json()["data"]]
    except httpx.HTTPError as e:
        raise ValueError(f"cannot read the models of {url}: {type(e).__name__}: {e or 'connection failed'}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{url} did not answer with an OpenAI model list ({type(e).__name__}: {e})") from None


def first_model(base_url: str, api_key: Optional[str] = None) -> str:
    models = list_models(base_url, api_key)
    if not models:
        raise ValueError(f"{base_url} lists no model: pass --model")
    return models[0]
