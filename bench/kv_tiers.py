"""KV cache tiers on the Mooncake conversation trace (offline replay): G1 alone vs + G2 (+ G3),
tier-aware vs tier-blind routing.

Replays the first 40 minutes of the public Mooncake conversation trace on 8
simulated mocker workers with a small G1 (``--num-kv-blocks``, default 4,096
blocks of 64 tokens: 32 GiB of KV at the mocker's 128 KiB a token, about what
an 80 GB accelerator has left for Llama-3.1-8B's KV) under the ``kv`` policy:

- ``G1`` only;
- ``G1+G2``: a host-memory tier of ``--host-gb`` GiB per worker;
- ``G1+G2+G3``: plus a disk tier of ``--disk-gb`` GiB per worker;

each of the last two twice: tier-aware (the cost credits host and disk
blocks at their default weights, 0.75 and 0.25) and tier-blind (weights 0:
the router ignores what the lower tiers hold), plus a reference run with the
mocker's default G1 (16,384 blocks) and no tiers. Every run is the same
``kvflow replay`` the CLI does (printed per run).

    python bench/kv_tiers.py [--trace PATH] [--workers 8] [--num-kv-blocks 4096] [--host-gb 128]
                             [--disk-gb 1024] [--plot docs/kv_tiers.png] [--out-dir DIR]

Prints a markdown table; writes the plot (TTFT p50/p99 and recomputed
prefill tokens per run) when ``--plot`` is given and each run's JSON report
into ``--out-dir``. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvflow.replay import run_offline
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.workers.engines.mocker_core import MockerConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"
GIB = 1 << 30


def runs(args) -> list[tuple[str, list[str], MockerConfig, KvPolicyConfig | None]]:
    """(name, CLI flags, engine config, cost weights) of every run."""
    g1 = ["--num-kv-blocks", str(args.num_kv_blocks)]
    host = ["--kv-host-gb", str(args.host_gb)]
    disk = ["--kv-disk-gb", str(args.disk_gb)]
    blind = ["--kv-host-weight", "0", "--kv-disk-weight", "0"]
    small = dict(num_kv_blocks=args.num_kv_blocks)
    h = dict(kv_host_bytes=int(args.host_gb * GIB))
    d = dict(kv_disk_bytes=int(args.disk_gb * GIB))
    blind_cfg = KvPolicyConfig(host_weight=0.0, disk_weight=0.0)
    return [
        ("G1 16,384 blocks (reference)", [], MockerConfig(), None),
        ("G1", g1, MockerConfig(**small), None),
        ("G1+G2, tier-aware", g1 + host, MockerConfig(**small, **h), None),
        ("G1+G2, tier-blind", g1 + host + blind, MockerConfig(**small, **h), blind_cfg),
        ("G1+G2+G3, tier-aware", g1 + host + disk, MockerConfig(**small, **h, **d), None),
        ("G1+G2+G3, tier-blind", g1 + host + disk + blind, MockerConfig(**small, **h, **d), blind_cfg),
    ]


def plot(rows: list[dict], path: Path) -> None:
    """Two panels: TTFT p50/p99 (ms) and recomputed prefill tokens (millions), one bar group per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    a.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, label="p99")
    a.set_ylabel("TTFT (ms)")
    a.legend()
    b.bar(list(x), [r["recomputed_prefill_tokens"] / 1e6 for r in rows], 0.6, color="tab:red")
    b.set_ylabel("recomputed prefill tokens (millions)")
    for ax in (a, b):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Mooncake conversation trace, 8 mocker workers: KV cache tiers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--host-gb", type=float, default=128.0)
    p.add_argument("--disk-gb", type=float, default=1024.0)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for name, flags, mocker, kv in runs(args):
        cmd = (f"kvflow replay {args.trace.relative_to(ROOT) if args.trace.is_relative_to(ROOT) else args.trace} "
               f"--mode offline --workers {args.workers} --policy kv {' '.join(flags)}").rstrip()
        t0 = time.perf_counter()
        json_path = args.out_dir / f"{len(rows)}.json" if args.out_dir else None
        r = run_offline(args.trace, workers=args.workers, policy="kv", mocker_config=mocker, kv_config=kv,
                        progress=False, json_path=json_path)
        tiers = r.kv_tiers or {}
        rows.append({
            "run": name, "command": cmd, "prefix_hit_rate": round(r.prefix_hit_rate, 4),
            "tier_hit_rates": {k: round(v, 4) for k, v in (r.tier_hit_rates or {}).items()},
            "ttft_p50_ms": round(r.ttft_ms.p50, 1), "ttft_p99_ms": round(r.ttft_ms.p99, 1),
            "tpot_p99_ms": round(r.tpot_ms.p99, 1), "sla_attainment": round(r.sla_attainment or 0.0, 4),
            "recomputed_prefill_tokens": r.recomputed_prefill_tokens,
            "onboarded_host_blocks": int(tiers.get("onboarded_host_blocks", 0)),
            "onboarded_disk_blocks": int(tiers.get("onboarded_disk_blocks", 0)),
            "demoted_blocks": int(tiers.get("demoted_blocks", 0)),
            "wall_s": round(time.perf_counter() - t0, 1),
        })
        print(f"# {cmd}", flush=True)
    print()
    print("| run | prefix hit rate (device / host / disk) | TTFT p50 / p99 (ms) | recomputed prefill tokens "
          "| SLA attainment | TPOT p99 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["tier_hit_rates"]
        print(f"| {r['run']} | {r['prefix_hit_rate']:.3f} ({t.get('device', 0):.3f} / {t.get('host', 0):.3f} / "
              f"{t.get('disk', 0):.3f}) | {r['ttft_p50_ms']:,.1f} / {r['ttft_p99_ms']:,.1f} | "
              f"{r['recomputed_prefill_tokens']:,} | {r['sla_attainment']:.2%} | {r['tpot_p99_ms']:.1f} |")
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"trace": args.trace.name, "workers": args.workers, "num_kv_blocks": args.num_kv_blocks,
                      "host_gb": args.host_gb, "disk_gb": args.disk_gb, "runs": rows}))


if __name__ == "__main__":
    main()
