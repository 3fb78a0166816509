"""Chat through the openai client as the end-to-end tests send it: many texts at once, so the server batches them."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any


def ask(client: Any, model: str, texts: list[str], max_tokens: int = 8, concurrency: int = 8) -> list[tuple[str, str]]:
    """(answer, x-skillpool-route header) per text, sent concurrently so the server batches them."""

    def one(text: str) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens
        )
        return raw.parse().choices[0].message.content or "", raw.headers.get("x-skillpool-route", "")

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, texts))
