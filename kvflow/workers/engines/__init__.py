"""Inference engines behind one interface (:mod:`kvflow.workers.engines.base`).

:data:`ENGINES` is the one registry of engine names; optional abilities are
the protocols of :mod:`kvflow.workers.engines.capabilities`.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvflow.workers.engines.base import Engine, EngineError
from kvflow.workers.engines.capabilities import (
    ClearsKvCache,
    DecodesFromKv,
    DumpsKvEvents,
    ExposesKvLayout,
    HasTokenizer,
    PrefillsAlone,
    Sleeps,
)

__all__ = [
    "ENGINES",
    "engine_class",
    "make_engine",
    "Engine",
    "EngineError",
    "DecodesFromKv",
    "DumpsKvEvents",
    "ExposesKvLayout",
    "HasTokenizer",
    "PrefillsAlone",
    "Sleeps",
    "ClearsKvCache",
]

ENGINES: dict[str, str] = {
    "mocker": "kvflow.workers.engines.mocker:MockerEngine",
    "hf": "kvflow.workers.engines.hf:HfEngine",
    "vllm": "kvflow.workers.engines.vllm:VllmEngine",
}
"""Engine name -> ``module:Class``; modules are imported on use, so torch loads only for ``hf``."""


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as ``name`` in :data:`ENGINES` (imported now).

    Raises:
        ValueError: unknown engine name.
        ImportError: the engine's packages are not installed (e.g. vllm).
    """
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, **kwargs: Any) -> Engine:
    """Build an engine by name; imports lazily so torch loads only for ``hf``.

    Raises:
        ValueError: unknown engine name.
        ImportError: the engine's packages are not installed (e.g. vllm).
    """
    return engine_class(name)(**kwargs)
