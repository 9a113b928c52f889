"""Media embeddings in the hf engine (SmolLM2-135M-Instruct, CPU): spliced into
``inputs_embeds`` at their placeholder run, cached by their content hash, and
fed from the seeded media encoder projected into the model's hidden size."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from kvflow.schemas import MediaKind, SamplingParams
from kvflow.schemas.media import PLACEHOLDER_TOKEN_ID, media_content_hash
from kvflow.workers.engines.base import EngineConfig, EngineError, GenerateRequest, MediaInput
from kvflow.workers.engines.hf import HfEngine
from kvflow.workers.main import encode_target
from kvflow.workers.media_encoder import build_media_encoder

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made and read. Before it, scribes copied every page by hand, so a single book could take "
          "months of work and cost as much as a house. Within fifty years of the first press, printers in more "
          "than two hundred cities had made millions of books, and the price of reading fell so far that")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
async def engine():
    eng = HfEngine(EngineConfig(model=MODEL))
    await eng.start()
    yield eng
    await eng.stop()


def token_embeddings(eng: HfEngine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return eng._model.get_input_embeddings()(torch.tensor(ids)).detach().clone()


async def run(eng: HfEngine, request: GenerateRequest) -> tuple[list[int], int]:
    """Output ids and the prompt tokens served from the prefix cache."""
    tokens, cached = [], None
    async for out in eng.generate(request):
        cached = out.num_cached_tokens if cached is None else cached
        tokens += out.token_ids
    return tokens, cached


async def test_spliced_embeddings_stand_in_for_their_tokens_and_key_the_cache(engine):
    ids = engine.tokenizer.encode_prompt(PROMPT)
    bs = engine.block_size
    offset, n = bs + 3, 2 * bs  # the run starts inside block 1 and ends inside block 3
    assert len(ids) > offset + n + bs
    expected, _ = await run(engine, GenerateRequest("plain", ids, GREEDY))
    held = ids[offset:offset + n]
    placeholders = ids[:offset] + [PLACEHOLDER_TOKEN_ID] * n + ids[offset + n:]

    def media(content_hash: int, rows: torch.Tensor) -> tuple[MediaInput, ...]:
        return (MediaInput(offset, n, content_hash, rows),)

    own = media(1234, token_embeddings(engine, held))
    got, cached = await run(engine, GenerateRequest("spliced", placeholders, GREEDY, media=own))
    assert got == expected  # the run's embeddings are the held tokens' own: the same greedy output
    assert cached == bs  # block 0 precedes the media and is shared with the plain prompt; block 1 is salted

    again, cached = await run(engine, GenerateRequest("again", placeholders, GREEDY, media=own))
    assert again == expected and cached >= (len(ids) - 1) // bs * bs  # every full prompt block reused

    other = media(5678, token_embeddings(engine, list(reversed(held))))
    _, cached = await run(engine, GenerateRequest("other", placeholders, GREEDY, media=other))
    assert cached == bs  # the same placeholder ids, other media: nothing past block 0 is reused

    with pytest.raises(EngineError, match="shape"):
        await run(engine, GenerateRequest("bad", placeholders, GREEDY, media=media(1, torch.zeros(n - 1, 576))))
    with pytest.raises(EngineError, match="past the end"):
        await run(engine, GenerateRequest("far", placeholders[:offset + 1], GREEDY, media=own))


async def test_the_seeded_encoder_projects_images_into_the_models_embedding_space(engine):
    name, hidden = encode_target("hf", MODEL)
    assert name == MODEL and hidden == engine._embed_shape[0] == 576
    encoder = build_media_encoder(hidden)
    buf = io.BytesIO()
    Image.new("RGB", (80, 60), (10, 120, 240)).save(buf, "PNG")
    image = buf.getvalue()
    rows = encoder.encode(MediaKind.image, image)
    head = engine.tokenizer.encode_prompt("Describe the picture:")
    prompt = head + [PLACEHOLDER_TOKEN_ID] * encoder.media_tokens + engine.tokenizer.encode_prompt(" It shows")
    item = (MediaInput(len(head), encoder.media_tokens, media_content_hash(image), rows),)
    first, _ = await run(engine, GenerateRequest("img-1", prompt, GREEDY, media=item))
    second, cached = await run(engine, GenerateRequest("img-2", prompt, GREEDY, media=item))
    assert len(first) == GREEDY.max_tokens and second == first and cached > 0
