"""The two image stages of /v1/images/generations, without Kafka: the tiny
pipeline and a Stable Diffusion directory built here from random weights,
each split across a text stage and an image stage as the workers run them
(the whole path over the broker: tests/test_images_live.py)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from kvflow.cli import app
from kvflow.models.image import TINY_IMAGE_MODEL
from kvflow.schemas import (
    ImageConditioning,
    ImageRequest,
    ImageResult,
    ReplyTo,
    ResponseEvent,
    WorkerRole,
    decode,
    encode,
)
from kvflow.schemas.openai_images import parse_size
from kvflow.streams.catalog import Catalog
from kvflow.workers.main import build_image_stage

REPLY = ReplyTo(topic="ns.responses", partition=3)
DIFFUSION_QUEUE = Catalog("ns").queue(WorkerRole.diffusion)
DIFFUSION_TOPIC = DIFFUSION_QUEUE.name


def pixels(b64_png: str) -> np.ndarray:
    """The RGB pixels ``[height, width, 3]`` of a base64 PNG (which must decode as one)."""
    image = Image.open(io.BytesIO(base64.b64decode(b64_png)))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def image_request(**kw) -> ImageRequest:
    fields = dict(request_id="r1", model=TINY_IMAGE_MODEL, prompt="a red fox in the snow", n=2, width=32, height=48,
                  seed=7, diffusion_partition=5, reply_to=REPLY)
    fields.update(kw)
    return ImageRequest(**fields)


@pytest.fixture(scope="module")
def tiny_stages():
    """(text stage, image stage) of the tiny pipeline, built in this process (skips without diffusers)."""
    pytest.importorskip("diffusers")
    text, _ = build_image_stage(WorkerRole.conditioning, TINY_IMAGE_MODEL, worker_id="c0",
                                diffusion_topic=DIFFUSION_QUEUE)
    image, _ = build_image_stage(WorkerRole.diffusion, TINY_IMAGE_MODEL, worker_id="d0",
                                 diffusion_topic=DIFFUSION_QUEUE)
    return text, image


def run_both(stages, request: ImageRequest) -> tuple[ImageConditioning, ImageResult]:
    """Both stages on ``request``, each output through its wire form."""
    text, image = stages
    out = text.run(request)
    assert (out.topic, out.partition, out.key) == (DIFFUSION_TOPIC, request.diffusion_partition, request.request_id)
    conditioning = decode(ImageConditioning, encode(out.record))
    answer = image.run(conditioning)
    assert (answer.topic, answer.partition) == (REPLY.topic, REPLY.partition)
    return conditioning, decode(ResponseEvent, encode(answer.record))


@pytest.mark.slow
def test_tiny_pipeline_gives_seeded_pngs_of_the_asked_size(tiny_stages):
    conditioning, result = run_both(tiny_stages, image_request())
    assert conditioning.prompt_embeds.shape[1] == 32 and conditioning.negative_prompt_embeds is None
    assert conditioning.prompt_tokens > 0 and conditioning.request == image_request()
    assert isinstance(result, ImageResult) and result.error is None
    assert (result.width, result.height, result.seed, result.num_inference_steps) == (32, 48, 7, 3)
    first, second = (pixels(png) for png in result.images)
    assert first.shape == second.shape == (48, 32, 3) and not np.array_equal(first, second)
    assert first.std() > 10  # not a flat image

    again = tiny_stages[1].render(conditioning)  # the image stage alone, from its input record
    assert again.images == result.images
    _, other_seed = run_both(tiny_stages, image_request(seed=8))
    assert not np.array_equal(pixels(other_seed.images[0]), first)
    _, other_prompt = run_both(tiny_stages, image_request(prompt="a blue whale"))
    assert not np.array_equal(pixels(other_prompt.images[0]), first)
    _, default_size = run_both(tiny_stages, image_request(n=1, width=None, height=None))
    assert (default_size.width, default_size.height) == (64, 64) and pixels(default_size.images[0]).shape == (64, 64, 3)


@pytest.mark.slow
def test_stages_answer_errors_on_reply_to(tiny_stages):
    text, _ = tiny_stages
    too_big = run_both(tiny_stages, image_request(width=512, height=512))[1]
    assert too_big.images == [] and too_big.error.status == 400 and too_big.error.param == "size"
    other_model = text.run(image_request(model="sd-other"))
    assert (other_model.topic, other_model.partition) == (REPLY.topic, REPLY.partition)
    assert other_model.record.error.status == 404 and other_model.record.error.code == "model_not_found"
    late = text.run(image_request(deadline_ms=1))
    assert late.record.error.status == 504 and late.record.error.code == "deadline_exceeded"
    nowhere = text.run(image_request(diffusion_partition=DIFFUSION_QUEUE.partitions))
    assert (nowhere.topic, nowhere.record.error.status, nowhere.record.error.param) == (
        REPLY.topic, 400, "diffusion_partition")


def test_parse_size():
    assert parse_size("64x32") == (64, 32) and parse_size("auto") is None
    for bad in ("64", "64x", "x64", "0x64", "63x64", "64x2056", "64X64", " 64x64", "-8x8"):
        with pytest.raises(ValueError):
            parse_size(bad)


def build_stable_diffusion_dir(path):
    """A Stable Diffusion pipeline directory with tiny random weights and a
    52-token CLIP vocabulary (letters only), as `save_pretrained` writes it."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=16)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=32)
    StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(steps_offset=1, clip_sample=False), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False).save_pretrained(path / "tiny-sd")
    return path / "tiny-sd"


@pytest.fixture
def one_torch_thread():
    """Run the test with one intra-op torch thread (tiny tensors: threads only contend), then restore."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_stable_diffusion_directory_runs_split_across_the_stages(tmp_path, one_torch_thread):
    pytest.importorskip("diffusers")
    model_dir = str(build_stable_diffusion_dir(tmp_path))
    stages = tuple(build_image_stage(role, model_dir, worker_id=role.value, diffusion_topic=DIFFUSION_QUEUE)[0]
                   for role in (WorkerRole.conditioning, WorkerRole.diffusion))
    request = image_request(model="tiny-sd", width=24, height=16, num_inference_steps=2)
    conditioning, result = run_both(stages, request)
    # The text encoder's last hidden state, padded to the tokenizer's 16 tokens, and the empty prompt's for guidance.
    assert conditioning.prompt_embeds.shape == (16, 32) == conditioning.negative_prompt_embeds.shape
    assert result.error is None and (result.width, result.height) == (24, 16) and len(result.images) == 2
    assert pixels(result.images[0]).shape == (16, 24, 3)
    assert result.images == stages[1].render(conditioning).images
    _, default_size = run_both(stages, image_request(model="tiny-sd", n=1, width=None, height=None,
                                                     num_inference_steps=1))
    assert (default_size.width, default_size.height) == (16, 16)  # UNet sample size 8 x VAE scale factor 2


def test_up_refuses_one_image_stage_without_the_other():
    result = CliRunner().invoke(app, ["up", "--engine", "mocker", "--image-workers", "1", "--image-text-workers", "0"])
    assert result.exit_code == 2 and "both stages" in result.output


