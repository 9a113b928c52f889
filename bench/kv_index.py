"""KV index speed: kvflow's KvIndex against Dynamo's RadixTree Python binding.

Workload, built from the Mooncake conversation trace (first 40 minutes):
requests are assigned round-robin to ``--workers`` workers (``--assign
prefix``: by a hash of the conversation's first private block, so turns of
one conversation share a worker), each with an LRU
prefix cache of ``--capacity`` blocks of ``--block-size`` tokens. Per
request, in arrival order:

1. a lookup (``find_matches``) of the prompt's block hashes, as the router
   does before choosing a worker;
2. a stored event for the prompt blocks its worker did not hold (parent =
   the last block it did hold);
3. a removed event for the blocks the worker's LRU evicted to make room
   (tail blocks first, as vLLM frees them).

Each Mooncake ``hash_id`` (512 tokens) gives ``512 / block_size`` blocks whose
local hashes are XXH3-64 of ``(hash_id, j)``; sequence hashes are chained as
in :mod:`kvflow.schemas.block_hash`. Dynamo's tree is keyed by local hashes and
its events carry both (``block_hash`` = sequence, ``tokens_hash`` = local).

Both indexes run the same operations in the same order, one event per call,
each from the bytes its router would read off the wire: kvflow gets one
:class:`~kvflow.schemas.KvEventBatch` per event in its kv-events wire form
(binary, schema version 2; ``--wire json`` for the version-1 JSON form),
decoded by :func:`~kvflow.schemas.decode_kv_frame` and folded by
``KvIndex.apply``, as the router's projection does; Dynamo gets the
pre-serialized JSON bytes its ``RadixTree.apply_event`` takes (the only form
its Python binding accepts), parsed inside the timed call.
``events_with_decode_per_s`` and the ``events_with_decode`` ratio compare the
two full paths, bytes on the wire to index updated; ``events_per_s`` times
kvflow's ``apply`` alone. Query hashes are rebuilt from JSON just before each
lookup on both sides (the router hashes a prompt just before it routes it).
Every call is timed; the two sides alternate passes ``--repeat`` times, and
each operation's time is its fastest pass (the machine may be shared);
``best_pass`` figures use the fastest whole pass instead.

Both processes run pinned to one CPU (``--cpu``, default 0; ``--no-pin``
leaves them free): Dynamo's ``RadixTree`` starts a thread of its own, so
unpinned its figures depend on how the host's scheduler places and wakes
two threads, and moved several-fold between hosts and runs; pinned, both
sides get one core, the same one. Dynamo runs in its own virtual environment
(``--dynamo-python``; default the first of ``/tmp/dynbase/venv/bin/python``,
built by ``shared/dynamo_baseline/setup.sh``, and ``/tmp/dynvenv/bin/python``
that exists; ``ai-dynamo-runtime==1.6.1``) as a subprocess; without it the
Dynamo figures are null with a reason. The two indexes' overlap scores are
compared lookup by lookup.

``--routing`` also replays the trace through the offline simulator with 8
mocker workers under ``kv``, ``approx``, ``round_robin`` and ``random``, and
reports prefix hit rate, TTFT p50/p99 and TPOT p99 of each (a few minutes).
``kv`` gets a :class:`~kvflow.router.index.KvIndex` fed by the engines' KV
events. ``approx`` expires predictions by ``RouteRequest.now_ms``; where the
simulator does not set it, only its per-worker capacity bound applies.

    python bench/kv_index.py [--limit N] [--repeat 5] [--assign prefix] [--block-map python]
                             [--wire binary|json] [--cpu 0 | --no-pin] [--dynamo-python PATH] [--routing]

Last stdout line: one JSON object with the figures.

Trace attribution: kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl, Apache-2.0.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # measure the checkout this script is in, not another install of kvflow
    sys.path.insert(0, str(ROOT))
TRACE_NAME = "mooncake_conversation_first40min.jsonl"
DYNAMO_PYTHONS = ("/tmp/dynbase/venv/bin/python", "/tmp/dynvenv/bin/python")


def default_dynamo_python() -> str:
    """The first Dynamo venv python of :data:`DYNAMO_PYTHONS` that exists (else the first)."""
    return next((p for p in DYNAMO_PYTHONS if Path(p).exists()), DYNAMO_PYTHONS[0])


def pin(cpu: int | None) -> list[int]:
    """Pin this process (and children started later) to ``cpu``; None leaves it. Returns the CPUs it may use."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return sorted(os.sched_getaffinity(0))


def default_trace() -> Path:
    """The repo copy of the trace if present, else the shared one."""
    local = ROOT / "examples" / "traces" / TRACE_NAME
    return local if local.exists() else ROOT.parent / "shared" / "traces" / TRACE_NAME


# ---- workload (needs kvflow's venv) ---------------------------------------


def build_workload(trace: Path, workers: int, capacity: int, block_size: int, limit: int | None,
                   assign: str = "round_robin") -> dict:
    """Operations of the benchmark, in order.

    Returns ``{"ops": [...], "stats": {...}}`` where each op is
    ``("q", seq_hashes, local_hashes)`` or
    ``("s", worker, parent | None, seq_hashes, local_hashes)`` or
    ``("r", worker, seq_hashes)``.
    """
    import xxhash

    from kvflow.schemas.block_hash import XXH3_SEED, chain_sequence_hashes

    if 512 % block_size:
        raise SystemExit(f"--block-size must divide 512, got {block_size}")
    per_id = 512 // block_size
    pack = struct.Struct("<QQ").pack
    xxh = xxhash.xxh3_64_intdigest
    locals_cache: dict[int, list[int]] = {}
    lrus = [OrderedDict() for _ in range(workers)]
    ops: list[tuple] = []
    n_req = stored = removed = hits = blocks_total = 0
    with trace.open() as fh:
        for line in fh:
            if limit is not None and n_req >= limit:
                break
            rec = json.loads(line)
            n_blocks = rec["input_length"] // block_size
            local: list[int] = []
            for hid in rec["hash_ids"]:
                got = locals_cache.get(hid)
                if got is None:
                    got = locals_cache[hid] = [xxh(pack(hid, j), XXH3_SEED) for j in range(per_id)]
                local.extend(got)
            local = local[:n_blocks]
            seq = chain_sequence_hashes(local)
            if assign == "prefix":  # the conversation's first block after the shared one picks the worker
                key = rec["hash_ids"][1] if len(rec["hash_ids"]) > 1 else rec["hash_ids"][0]
                w = xxh(pack(key, 0), 0) % workers
            else:
                w = n_req % workers
            n_req += 1
            blocks_total += len(seq)
            ops.append(("q", seq, local))
            lru = lrus[w]
            cached = 0
            for h in seq:
                if h not in lru:
                    break
                cached += 1
            hits += cached
            if cached < len(seq):
                ops.append(("s", w, seq[cached - 1] if cached else None, seq[cached:], local[cached:]))
                stored += len(seq) - cached
            for h in reversed(seq):  # head touched last: evicted last
                lru[h] = None
                lru.move_to_end(h)
            evicted = []
            while len(lru) > capacity:
                evicted.append(lru.popitem(last=False)[0])
            if evicted:
                ops.append(("r", w, evicted))
                removed += len(evicted)
    n_events = sum(1 for op in ops if op[0] != "q")
    return {"ops": ops, "stats": {
        "requests": n_req, "events": n_events, "lookups": n_req, "blocks_stored": stored,
        "blocks_removed": removed, "lookup_blocks": blocks_total,
        "lru_hit_rate": round(hits / blocks_total, 4) if blocks_total else 0.0,
    }}


class KvflowRunner:
    """Times kvflow's KvIndex on ``ops``, one repetition per :meth:`run` call.

    Events are decoded from their wire form (``wire``: ``"binary"``, what
    workers publish, or ``"json"``, the version-1 form) just before being
    applied, as the router's projection does (:func:`~kvflow.schemas.decode_kv_frame`
    then ``KvIndex.apply``), so ``apply`` sees fresh objects; decode and
    apply are timed separately and together. Query hashes are rebuilt from
    JSON just before each lookup (untimed), as the router computes them just
    before it routes; the Dynamo side does the same.
    """

    def __init__(self, ops: list[tuple], block_size: int, block_map: str = "default", wire: str = "binary") -> None:
        from kvflow.schemas import BlockRemoved, BlockStored, KvEventBatch, encode

        self.block_size = block_size
        self.block_map = block_map
        to_bytes = encode if wire == "binary" else (  # version 1: pydantic JSON, as workers published it before
            lambda b: b.model_copy(update={"schema_version": 1}).model_dump_json(exclude_none=True).encode())
        self.items: list[tuple[str, bytes | str]] = []
        names = [f"worker-{i}" for i in range(64)]
        next_id: dict[int, int] = {}
        for op in ops:
            if op[0] == "q":
                self.items.append(("q", json.dumps(op[1])))
                continue
            w = op[1]
            eid = next_id.get(w, 0)
            next_id[w] = eid + 1
            ev = (BlockStored(parent_block_hash=op[2], block_hashes=op[3]) if op[0] == "s"
                  else BlockRemoved(block_hashes=op[2]))
            self.items.append(("e", to_bytes(KvEventBatch(worker_id=names[w], event_id=eid, block_size=block_size,
                                                          ts_ms=0, events=[ev]))))
        self.n_events = sum(1 for kind, _ in self.items if kind == "e")
        self.n_lookups = len(self.items) - self.n_events
        self.scores: list[dict[int, int]] | None = None

    def run(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """One pass; returns per-operation seconds: (apply per event, decode per event,
        find_matches per lookup, decode + apply per event, timed as one)."""
        from kvflow.router.index import KvIndex
        from kvflow.schemas import decode_kv_frame

        if self.block_map == "python":
            from kvflow.router._blockmap_py import BlockMap

            index = KvIndex(self.block_size, block_map=BlockMap)
        else:
            index = KvIndex(self.block_size)
        apply, find, loads, pc = index.apply, index.find_matches, json.loads, time.perf_counter
        t_ev: list[float] = []
        t_dec: list[float] = []
        t_q: list[float] = []
        t_full: list[float] = []
        out = [] if self.scores is None else None
        for kind, data in self.items:
            if kind == "q":
                seq = loads(data)
                t0 = pc()
                res = find(seq)
                t_q.append(pc() - t0)
                if out is not None:
                    out.append(res)
            else:
                t0 = pc()
                batch = decode_kv_frame(data)
                t1 = pc()
                apply(batch)
                t2 = pc()
                t_ev.append(t2 - t1)
                t_dec.append(t1 - t0)
                t_full.append(t2 - t0)
        if out is not None:
            self.scores = [{int(k.split("-")[1]): v for k, v in s.device.items()} for s in out]
        return t_ev, t_dec, t_q, t_full


# ---- Dynamo side (runs in Dynamo's venv; stdlib + dynamo only) -------------


def dynamo_worker(path: str) -> None:
    """Subprocess entry: load the pickled ops, then time one pass of Dynamo's
    RadixTree per ``run`` line on stdin, printing one JSON line per pass.

    Runs on the CPUs it inherited from the parent (the parent pins itself
    before starting it); the first line reports them and the thread count.
    """
    import gc
    from importlib.metadata import version

    from dynamo._core import RadixTree  # type: ignore[import-not-found]

    with open(path, "rb") as fh:
        ops = pickle.load(fh)
    prepared = []
    next_id: dict[int, int] = {}
    for op in ops:
        if op[0] == "q":
            prepared.append(("q", json.dumps(op[2])))
            continue
        w = op[1]
        eid = next_id.get(w, 0)
        next_id[w] = eid + 1
        if op[0] == "s":
            data = {"stored": {"parent_hash": op[2], "blocks": [
                {"block_hash": s, "tokens_hash": t} for s, t in zip(op[3], op[4])]}}
        else:
            data = {"removed": {"block_hashes": op[2]}}
        prepared.append(("e", w, json.dumps({"event_id": eid, "data": data}).encode()))
    del ops
    gc.collect()
    gc.freeze()
    probe = RadixTree()  # the tree starts a thread of its own: count it
    with open("/proc/self/status") as fh:
        threads = next((int(line.split()[1]) for line in fh if line.startswith("Threads:")), None)
    del probe
    print(json.dumps({"ready": True, "version": version("ai-dynamo-runtime"),
                      "cpus": sorted(os.sched_getaffinity(0)), "threads_with_a_tree": threads,
                      "wire_bytes": sum(len(op[2]) for op in prepared if op[0] == "e")
                      / max(1, sum(1 for op in prepared if op[0] == "e"))}), flush=True)
    first = True
    pc, loads = time.perf_counter, json.loads
    for line in sys.stdin:
        if line.strip() != "run":
            break
        tree = RadixTree()
        apply, find = tree.apply_event, tree.find_matches
        t_ev: list[float] = []
        t_q: list[float] = []
        scores = []
        for op in prepared:
            if op[0] == "q":
                seq = loads(op[1])
                t0 = pc()
                res = find(seq)
                t_q.append(pc() - t0)
                if first:
                    scores.append([[int(k[0]) if isinstance(k, tuple) else int(k), v] for k, v in res.scores.items()])
            else:
                t0 = pc()
                apply(op[1], op[2])
                t_ev.append(pc() - t0)
        print(json.dumps({"event_seconds": t_ev, "find_matches_seconds": t_q, "scores": scores if first else None}),
              flush=True)
        first = False
        del tree


class DynamoRunner:
    """Drives :func:`dynamo_worker` in Dynamo's venv, one pass per :meth:`run`.

    Raises:
        RuntimeError: the subprocess failed to start or died.
    """

    def __init__(self, python: str, ops: list[tuple], tmp: str) -> None:
        path = os.path.join(tmp, "ops.pkl")
        with open(path, "wb") as fh:
            pickle.dump(ops, fh, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc = subprocess.Popen([python, __file__, "--dynamo-worker", path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hello = self._read()
        self.version = hello["version"]
        self.cpus = hello.get("cpus")
        self.threads = hello.get("threads_with_a_tree")
        self.wire_bytes = hello.get("wire_bytes", 0.0)
        self.scores: list[dict[int, int]] | None = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip()[-800:]
            raise RuntimeError(f"Dynamo subprocess exited ({self.proc.wait()}): {err}")
        return json.loads(line)

    def run(self) -> tuple[list[float], list[float]]:
        """One pass; returns per-operation seconds: (apply_event per event, find_matches per lookup)."""
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        out = self._read()
        if out["scores"] is not None:
            self.scores = [dict(pairs) for pairs in out["scores"]]
        return out["event_seconds"], out["find_matches_seconds"]

    def close(self) -> None:
        """End the subprocess."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _elementwise_min(best: list[list[float]] | None, new: tuple[list[float], ...]) -> list[list[float]]:
    if best is None:
        return [list(x) for x in new]
    return [list(map(min, a, b)) for a, b in zip(best, new)]


def compare(ops: list[tuple], block_size: int, repeat: int, dynamo_python: str, block_map: str = "default",
            wire: str = "binary") -> dict:
    """Alternate kvflow and Dynamo passes ``repeat`` times and summarise both.

    The machine may be shared, so every operation's time is the fastest of
    its ``repeat`` passes (the same estimator on both sides); rates are
    operations / sum of those times. ``best_pass`` rates use the fastest
    whole pass instead. Runs on this process's CPUs (see :func:`pin`); the
    Dynamo subprocess inherits them.
    """
    import gc

    kv = KvflowRunner(ops, block_size, block_map, wire)
    dyn, dyn_err = None, None
    kv_min = dyn_min = None
    kv_pass = [float("inf")] * 4
    dyn_pass = [float("inf")] * 2
    with tempfile.TemporaryDirectory() as tmp:
        if not Path(dynamo_python).exists():
            dyn_err = (f"no Dynamo venv python at {dynamo_python} (shared/dynamo_baseline/setup.sh, or pip install "
                       f"ai-dynamo-runtime==1.6.1 in a venv)")
        else:
            try:
                dyn = DynamoRunner(dynamo_python, ops, tmp)
            except (RuntimeError, OSError, ValueError) as exc:
                dyn_err = str(exc)
        gc.collect()
        gc.freeze()
        try:
            for _ in range(repeat):
                res = kv.run()
                kv_min = _elementwise_min(kv_min, res)
                kv_pass = [min(a, sum(b)) for a, b in zip(kv_pass, res)]
                if dyn is not None:
                    try:
                        res = dyn.run()
                    except (RuntimeError, ValueError) as exc:
                        dyn_err, dyn = str(exc), None
                        continue
                    dyn_min = _elementwise_min(dyn_min, res)
                    dyn_pass = [min(a, sum(b)) for a, b in zip(dyn_pass, res)]
        finally:
            if dyn is not None:
                dyn.close()
    t_ev, t_dec, t_q, t_full = (sum(x) for x in kv_min)
    n_ev, n_q = kv.n_events, kv.n_lookups
    result: dict = {"kvflow": {
        "wire": wire, "wire_bytes_per_event": round(sum(len(d) for k, d in kv.items if k == "e") / n_ev, 1),
        "events_per_s": round(n_ev / t_ev), "find_matches_per_s": round(n_q / t_q),
        "events_with_decode_per_s": round(n_ev / t_full),
        "best_pass": {"events_per_s": round(n_ev / kv_pass[0]), "find_matches_per_s": round(n_q / kv_pass[2]),
                      "events_with_decode_per_s": round(n_ev / kv_pass[3])},
        "event_seconds": round(t_ev, 4), "decode_seconds": round(t_dec, 4),
        "events_with_decode_seconds": round(t_full, 4), "find_matches_seconds": round(t_q, 4),
    }, "dynamo": None, "dynamo_error": dyn_err, "ratio": None, "scores_agree": None}
    if dyn is not None and dyn_min is not None:
        d_ev, d_q = (sum(x) for x in dyn_min)
        result["dynamo"] = {
            "version": dyn.version, "cpus": dyn.cpus, "threads_with_a_tree": dyn.threads,
            "wire_bytes_per_event": round(dyn.wire_bytes, 1),
            "events_per_s": round(n_ev / d_ev), "find_matches_per_s": round(n_q / d_q),
            "best_pass": {"events_per_s": round(n_ev / dyn_pass[0]), "find_matches_per_s": round(n_q / dyn_pass[1])},
            "event_seconds": round(d_ev, 4), "find_matches_seconds": round(d_q, 4),
        }
        result["ratio"] = {
            "events": round(d_ev / t_ev, 2), "find_matches": round(d_q / t_q, 2),
            "events_with_decode": round(d_ev / t_full, 2),
            "best_pass_events": round(dyn_pass[0] / kv_pass[0], 2),
            "best_pass_events_with_decode": round(dyn_pass[0] / kv_pass[3], 2),
            "best_pass_find_matches": round(dyn_pass[1] / kv_pass[2], 2),
        }
        agree = sum(1 for a, b in zip(kv.scores, dyn.scores) if a == b)
        result["scores_agree"] = f"{agree}/{len(kv.scores)}"
    return result


# ---- routing quality (offline simulator) -----------------------------------


def run_routing(trace: Path, policies: list[str]) -> dict:
    """Replay ``trace`` with 8 mocker workers under each policy; summary figures per policy."""
    from kvflow.replay.report import build_report
    from kvflow.replay.simulator import SimConfig, Simulation
    from kvflow.replay.traces import read_trace
    from kvflow.router import kv_policy
    from kvflow.router.index import KvIndex
    from kvflow.workers.engines.mocker_core import MockerConfig

    out = {}
    for policy in policies:
        tr = read_trace(trace)
        mock = MockerConfig()
        index = KvIndex(mock.block_size) if policy in kv_policy.EVENT_POLICIES else None
        sim = Simulation(tr, SimConfig(workers=8, policy=policy, mocker=mock), kv_hook=index)
        if index is not None:
            sim.table.kv_index = index
        res = sim.run()
        rep = build_report(res.records, res.itl_gaps_ms, mode="offline", trace=tr.name, trace_format=tr.format,
                           policy=policy, workers=res.worker_ids, seed=0, sla_ttft_ms=500.0, sla_itl_ms=50.0,
                           block_size=mock.block_size, total_kv_blocks=mock.num_kv_blocks * 8, busy_ms=res.busy_ms,
                           timeline=res.timeline, wall_time_s=res.wall_time_s, options={})
        out[policy] = {
            "prefix_hit_rate": round(rep.prefix_hit_rate, 4),
            "ttft_p50_ms": round(rep.ttft_ms.p50, 1), "ttft_p99_ms": round(rep.ttft_ms.p99, 1),
            "tpot_p99_ms": round(rep.tpot_ms.p99, 2), "failed": rep.failed,
            "sim_wall_s": round(res.wall_time_s, 1),
        }
        print(f"routing {policy}: {out[policy]}", file=sys.stderr)
    return out


def _compiled() -> bool:
    from kvflow.router.index import COMPILED

    return COMPILED


def main() -> None:
    """Parse arguments, run both indexes (and optionally routing), print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=16384, help="KV blocks per worker")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--assign", choices=["round_robin", "prefix"], default="round_robin",
                    help="how requests are spread over workers")
    ap.add_argument("--dynamo-python", default=None,
                    help=f"python of a venv with ai-dynamo-runtime (default: first existing of {DYNAMO_PYTHONS})")
    ap.add_argument("--wire", choices=["binary", "json"], default="binary",
                    help="kvflow's kv-events wire form: binary (schema version 2, what workers publish) or json (v1)")
    ap.add_argument("--cpu", type=int, default=0, help="CPU both processes are pinned to")
    ap.add_argument("--no-pin", action="store_true", help="do not pin (figures then depend on the host's scheduler)")
    ap.add_argument("--block-map", choices=["default", "python"], default="default",
                    help="python: time the pure-Python block map (the fallback without the compiled one)")
    ap.add_argument("--routing", action="store_true", help="also replay kv/approx/round_robin/random")
    ap.add_argument("--dynamo-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dynamo_worker:
        dynamo_worker(args.dynamo_worker)
        return
    cpus = pin(None if args.no_pin else args.cpu)
    trace = args.trace or default_trace()
    wl = build_workload(trace, args.workers, args.capacity, args.block_size, args.limit, args.assign)
    result: dict = {
        "bench": "kv_index", "trace": trace.name, "assign": args.assign, "workers": args.workers,
        "capacity_blocks": args.capacity,
        "block_size": args.block_size, "repeat": args.repeat, "workload": wl["stats"],
        "pinned": not args.no_pin, "cpus": cpus,
        "block_map": args.block_map if args.block_map == "python" else ("compiled" if _compiled() else "python"),
        **compare(wl["ops"], args.block_size, args.repeat, args.dynamo_python or default_dynamo_python(),
                  args.block_map, args.wire),
    }
    if args.routing:
        result["routing"] = run_routing(trace, ["kv", "approx", "round_robin", "random"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
