"""Re-run the image stage alone from its recorded inputs.

Every :class:`~kvflow.schemas.ImageConditioning` the text stage wrote is on
``queue.diffusion``, seed and settings included. :func:`recorded_conditioning`
reads them back, and :func:`replay_diffusion` runs the image stage's own
code (:meth:`~kvflow.workers.images.stages.DiffusionStage.render`) on them
in this process, with no broker and no text stage: the same model on the
same hardware gives the images the deployment answered. ``kvflow
replay-images`` does both and writes the PNG files.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvflow.schemas import ImageConditioning, ImageResult, RecordError, WorkerRole, decode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.history import read_topic

__all__ = ["recorded_conditioning", "replay_diffusion", "write_pngs"]


async def recorded_conditioning(settings: Settings, catalog: Catalog | None = None,
                                request_ids: Iterable[str] | None = None) -> list[ImageConditioning]:
    """The conditioning records on ``queue.diffusion`` (of ``request_ids``
    when given), one per request (the first: a redelivered record repeats
    it), in topic order; records that do not decode are skipped.

    Raises:
        aiokafka.errors.KafkaError: the broker cannot be reached.
        TimeoutError: the topic was not read whole.
    """
    catalog = catalog or Catalog(settings.namespace)
    wanted = None if request_ids is None else set(request_ids)
    found: dict[str, ImageConditioning] = {}
    for msg in await read_topic(settings, catalog.queue(WorkerRole.diffusion)):
        try:
            record = decode(ImageConditioning, msg.value)
        except RecordError:
            continue
        if (wanted is None or record.request_id in wanted) and record.request_id not in found:
            found[record.request_id] = record
    return list(found.values())


def replay_diffusion(records: Sequence[ImageConditioning], model: str | None = None, *, device: str = "cpu",
                     worker_id: str = "replay") -> list[ImageResult]:
    """Render ``records`` with the image stage's code, in order, ignoring
    their deadlines. ``model`` is the model spec to load (default: each
    record's own model name, which is the spec for ``tiny-diffusion``; a
    local diffusers directory must be given by path); it loads once per
    distinct spec.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: a model cannot be resolved.
        ImportError: diffusers is not installed.
    """
    from kvflow.models.image import resolve_image_model
    from kvflow.workers.images.models import load_denoiser
    from kvflow.workers.images.stages import DiffusionStage

    stages: dict[str, DiffusionStage] = {}
    results = []
    for record in records:
        spec = model or record.request.model
        stage = stages.get(spec)
        if stage is None:
            name = resolve_image_model(spec).name
            stage = stages[spec] = DiffusionStage(load_denoiser(spec, device=device), name, worker_id)
        results.append(stage.render(record))
    return results


def write_pngs(results: Iterable[ImageResult], out_dir: Path) -> list[Path]:
    """Write each result's images as ``<request_id>-<i>.png`` under ``out_dir`` (created); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for result in results:
        for i, image in enumerate(result.images):
            path = out_dir / f"{result.request_id}-{i}.png"
            path.write_bytes(base64.b64decode(image))
            paths.append(path)
    return paths
