"""Worker pools and the grid that picks them: the global router's policy.

A deployment may split a model's workers into pools (each worker names its
pool in its heartbeat, ``WorkerHeartbeat.pool``; ``""`` is the default
pool), e.g. ``long-context`` workers with large KV caches beside
``low-latency`` workers kept lightly loaded. Each pool has its own prefill
and decode workers and so its own queues; the router first picks a pool for
each phase, then routes within it as usual.

:class:`PoolGrid` maps a request to pools with two grids, read from a
config file (:func:`load_pool_grid`, TOML or JSON):

* prefill: (ISL, TTFT target) → prefill pool;
* decode: (context length = ISL + max output tokens, ITL target) → decode pool.

Each axis has a resolution (``isl_step_tokens``, ``ttft_step_ms``,
``context_step_tokens``, ``itl_step_ms``): a value falls in cell
``floor(value / step)``, clamped to the grid, so values past the last
edge use the last row or column. A request without a TTFT or ITL target
(the SLA hints ``ttft_target_ms``/``itl_target_ms`` of
:class:`~kvflow.schemas.InferenceRequest`) uses ``default_ttft_ms`` /
``default_itl_ms``. Rows follow the length axis, columns the target axis
(``examples/pools.toml``)::

    [prefill]
    isl_step_tokens = 4096      # rows: ISL [0, 4096), [4096, 8192), >= 8192
    ttft_step_ms = 500          # columns: TTFT target [0, 500), >= 500 ms
    default_ttft_ms = 1000
    grid = [["low-latency", "low-latency"],
            ["long-context", "low-latency"],
            ["long-context", "long-context"]]

    [decode]
    context_step_tokens = 8192  # rows: context [0, 8192), >= 8192
    itl_step_ms = 25            # columns: ITL target [0, 25), >= 25 ms
    default_itl_ms = 50
    grid = [["low-latency", "low-latency"],
            ["long-context", "long-context"]]

A tight target (a small TTFT or ITL) falls in a low column: put the pool
that serves it fastest there.

Pure: no I/O except :func:`load_pool_grid`; no clock.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DecodeGrid", "PoolChoice", "PoolGrid", "PrefillGrid", "grid_cell", "load_pool_grid"]


def grid_cell(value: float, step: float, cells: int) -> int:
    """The cell of ``value`` on an axis of ``cells`` cells of width ``step``:
    ``floor(value / step)`` clamped to ``[0, cells - 1]``."""
    return min(max(int(value // step), 0), cells - 1)


def _check_grid(grid: list[list[str]]) -> None:
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("a pool grid must be a non-empty rectangle of pool names")


class PrefillGrid(BaseModel):
    """(ISL, TTFT target) → prefill pool (module docstring).

    Attributes:
        isl_step_tokens: row height, prompt tokens (> 0).
        ttft_step_ms: column width, ms (> 0).
        default_ttft_ms: the TTFT target of a request without one, ms. Defaults to ``1000``.
        grid: pool names, one row per ISL cell, one column per TTFT cell.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    isl_step_tokens: int = Field(gt=0)
    ttft_step_ms: float = Field(gt=0)
    default_ttft_ms: float = Field(default=1000.0, ge=0)
    grid: list[list[str]]

    @model_validator(mode="after")
    def _rectangle(self) -> "PrefillGrid":
        _check_grid(self.grid)
        return self

    def pool(self, isl: int, ttft_ms: float | None) -> str:
        """The prefill pool of a prompt of ``isl`` tokens with TTFT target ``ttft_ms`` (None: the default)."""
        row = grid_cell(isl, self.isl_step_tokens, len(self.grid))
        col = grid_cell(self.default_ttft_ms if ttft_ms is None else ttft_ms, self.ttft_step_ms, len(self.grid[0]))
        return self.grid[row][col]


class DecodeGrid(BaseModel):
    """(context length, ITL target) → decode pool (module docstring).

    Attributes:
        context_step_tokens: row height, tokens of prompt plus output (> 0).
        itl_step_ms: column width, ms (> 0).
        default_itl_ms: the ITL target of a request without one, ms. Defaults to ``50``.
        grid: pool names, one row per context cell, one column per ITL cell.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    context_step_tokens: int = Field(gt=0)
    itl_step_ms: float = Field(gt=0)
    default_itl_ms: float = Field(default=50.0, ge=0)
    grid: list[list[str]]

    @model_validator(mode="after")
    def _rectangle(self) -> "DecodeGrid":
        _check_grid(self.grid)
        return self

    def pool(self, context_tokens: int, itl_ms: float | None) -> str:
        """The decode pool of a sequence of ``context_tokens`` with ITL target ``itl_ms`` (None: the default)."""
        row = grid_cell(context_tokens, self.context_step_tokens, len(self.grid))
        col = grid_cell(self.default_itl_ms if itl_ms is None else itl_ms, self.itl_step_ms, len(self.grid[0]))
        return self.grid[row][col]


@dataclass(frozen=True, slots=True)
class PoolChoice:
    """The pools a request was placed in: ``prefill`` (a remote prefill's
    pool) and ``decode`` (the pool of the worker that decodes it, or serves
    it whole). ``fallback``: the chosen decode pool had no serving worker of
    the model, so every pool was considered."""

    prefill: str
    decode: str
    fallback: bool = False


class PoolGrid(BaseModel):
    """The global router's grids (module docstring).

    Raises:
        pydantic.ValidationError: a step <= 0, a ragged or empty grid, an unknown key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    prefill: PrefillGrid
    decode: DecodeGrid

    def choose(self, isl: int, max_tokens: int, ttft_ms: float | None = None,
               itl_ms: float | None = None) -> PoolChoice:
        """The pools of a request of ``isl`` prompt tokens and at most
        ``max_tokens`` output tokens, with its SLA hints (ms; None: the defaults)."""
        return PoolChoice(self.prefill.pool(isl, ttft_ms), self.decode.pool(isl + max_tokens, itl_ms))

    def pool_names(self) -> frozenset[str]:
        """Every pool either grid names."""
        return frozenset(p for g in (self.prefill.grid, self.decode.grid) for row in g for p in row)


def load_pool_grid(path: str | Path) -> PoolGrid:
    """Read a :class:`PoolGrid` from a TOML (``.toml``) or JSON file.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not valid TOML/JSON or not a valid grid
            (:class:`pydantic.ValidationError` and ``tomllib.TOMLDecodeError`` are ``ValueError``).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    return PoolGrid.model_validate(data)
