"""Records of the responses-log topic: the conversation of each stored response.

``/v1/responses`` writes one :class:`StoredResponse` per answered request
(unless the caller sends ``store: false``); a later request naming it in
``previous_response_id`` continues from its ``messages``, on any bridge.
"""

from __future__ import annotations

from pydantic import Field

from kvflow.schemas.base import Record
from kvflow.schemas.requests import ChatMessage

__all__ = ["StoredResponse"]


class StoredResponse(Record):
    """One stored response: the conversation up to and including its answer.

    ``messages`` are the chained history, the request's input and the
    assistant's output, in order; the request's ``instructions`` are not
    among them (a chained request brings its own). ``created_ms`` is epoch ms.
    """

    response_id: str = Field(min_length=1, max_length=256)
    model: str
    messages: list[ChatMessage]
    created_ms: int = 0
