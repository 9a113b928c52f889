"""Inference engines behind one interface (:mod:`kvflow.workers.engines.base`)."""

from __future__ import annotations

from typing import Any

from kvflow.workers.engines.base import Engine, EngineError

__all__ = ["ENGINES", "make_engine", "Engine", "EngineError"]

ENGINES = ("mocker", "hf", "vllm")


def make_engine(name: str, **kwargs: Any) -> Engine:
    """Build an engine by name; imports lazily so torch loads only for ``hf``.

    Raises:
        ValueError: unknown engine name.
        ImportError: the engine's packages are not installed (e.g. vllm).
    """
    if name == "mocker":
        from kvflow.workers.engines.mocker import MockerEngine

        return MockerEngine(**kwargs)
    if name == "hf":
        from kvflow.workers.engines.hf import HfEngine

        return HfEngine(**kwargs)
    if name == "vllm":
        from kvflow.workers.engines.vllm import VllmEngine

        return VllmEngine(**kwargs)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
