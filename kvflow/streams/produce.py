"""``kvflow produce``: one chat request through Kafka alone, streamed to stdout."""

from __future__ import annotations

import sys

from kvflow.schemas import ChatMessage, FinalResponse, SamplingParams, TokenDelta
from kvflow.settings import Settings
from kvflow.streams.client import KvflowClient

__all__ = ["produce_chat"]


async def produce_chat(settings: Settings, text: str, *, model: str, max_tokens: int = 64,
                       temperature: float = 0.0) -> int:
    """Send ``text`` as a user message; print deltas as they arrive, then usage.

    Returns a process exit code: 0 on success, 1 if the request failed.
    """
    async with KvflowClient(settings) as client:
        request = client.new_request(model, messages=[ChatMessage(role="user", content=text)],
                                     sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature))
        async for event in client.stream(request):
            if isinstance(event, TokenDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, FinalResponse):
                if event.error is not None:
                    print(f"\nerror {event.error.status}: {event.error.message}", file=sys.stderr)
                    return 1
                u = event.usage
                print(f"\n[{event.finish_reason.value}] worker={event.worker_id} prompt_tokens={u.prompt_tokens} "
                      f"completion_tokens={u.completion_tokens} cached_tokens={u.cached_tokens}", file=sys.stderr)
    return 0
