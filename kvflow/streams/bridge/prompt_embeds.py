"""Reading the ``prompt_embeds`` of a completions body.

The field is the base64 of a tensor saved with ``torch.save`` (the format
OpenAI-compatible servers take for prompt embeddings), shape
``[seq_len, hidden]``, dtype float32, float16 or bfloat16. It is read with
``torch.load(weights_only=True)``, which unpickles tensors and plain
containers only (no code from the payload runs). The bridge checks what it
can without the model (base64, a dense 2-D tensor of an accepted dtype,
finite values, ``seq_len`` within the prompt limit); the worker's engine
checks ``hidden`` and the dtype against the model (400 there).
"""

from __future__ import annotations

import base64
import binascii
import io

from kvflow.schemas.prompt_embeds import EMBEDS_DTYPES, PromptEmbeds
from kvflow.streams.bridge.errors import BridgeError, invalid_request, payload_too_large

__all__ = ["decode_prompt_embeds"]

_PARAM = "prompt_embeds"


def _bad(message: str) -> BridgeError:
    return invalid_request(f"prompt_embeds: {message}", param=_PARAM, code="invalid_value")


def decode_prompt_embeds(data: str, max_rows: int) -> PromptEmbeds:
    """The request-record form of a body's ``prompt_embeds``.

    Raises:
        BridgeError: 400 not base64, not a saved tensor, not a dense 2-D
            tensor of float32/float16/bfloat16, empty, or not finite; 413
            more than ``max_rows`` rows (the prompt token limit).
    """
    import torch

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("not valid base64") from None
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any unreadable payload is the client's mistake
        raise _bad("not a tensor saved with torch.save") from None
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        raise _bad("not a dense tensor")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in EMBEDS_DTYPES:
        raise _bad(f"dtype {dtype}; one of {', '.join(EMBEDS_DTYPES)} is required")
    if tensor.dim() != 2 or tensor.shape[0] < 1 or tensor.shape[1] < 1:
        raise _bad(f"shape {list(tensor.shape)}; [seq_len, hidden] is required")
    if tensor.shape[0] > max_rows:
        raise payload_too_large(f"The prompt has {tensor.shape[0]} positions; the limit is {max_rows}.", param=_PARAM)
    if not bool(torch.isfinite(tensor).all()):
        raise _bad("values must be finite")
    flat = tensor.contiguous().view(torch.uint8) if tensor.element_size() > 1 else tensor.contiguous()
    return PromptEmbeds.of(flat.numpy().tobytes(), (int(tensor.shape[0]), int(tensor.shape[1])), dtype)
