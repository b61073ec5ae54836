"""What the CPU benchmarks report: per-run summaries, the side-by-side table and its plot.

A run is keyed by its kind and variant: "engine", "daemon", "hf", "vllm", then suffixes
"_1req" (the workload's first request alone) and "_bf16" (e.g. "daemon_1req_bf16"); each
run is compared with the HF and vLLM runs of the same suffix.
"""

from __future__ import annotations

import statistics

# Request-level stats printed and plotted, in this order.
STATS = ("mean", "p50", "p99")
KIND_COLORS = {"engine": "C0", "daemon": "C1", "vllm": "C2", "hf": "C3"}
# Run names and keys: fp32 runs (and "auto", the engine's own choice: fp32 on the CPU, bf16 on
# GPUs, as HF's baseline there) keep the plain ones.
SHORT = {"float32": "", "bfloat16": "bf16"}


def dtype_label(dtype: str) -> str:
    return f", {SHORT[dtype]}" if SHORT.get(dtype) else ""


def summarize(name: str, wall: float, per_request: list[tuple[float, float, int]]) -> dict:
    """per_request: (first token time - t0, last token time - t0, output tokens)."""
    ttft = [f for f, _, _ in per_request]
    itl = [(last - first) / (n - 1) for first, last, n in per_request if n > 1]
    total = sum(n for _, _, n in per_request)

    def stats(xs):
        xs = sorted(xs)
        return {
            "mean": statistics.fmean(xs),
            "p50": xs[len(xs) // 2],
            "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))],
        }

    return {
        "name": name,
        "wall_s": wall,
        "output_tokens": total,
        "tok_per_s": total / wall,
        "ttft_s": stats(ttft),
        "itl_s": stats(itl),
    }


def _kind(key: str) -> str:
    return key.split("_")[0]


def _peer(runs: dict, kind: str, key: str) -> dict | None:
    """The ``kind`` run with ``key``'s suffix ("engine_1req_bf16" -> "hf_1req_bf16"), else
    (a sampling variant such as "engine_mixed") the plain one."""
    return runs.get(kind + key[len(_kind(key)) :], runs.get(kind))


def add_ratios(runs: dict) -> None:
    """x_hf: against HF fp32; x_its_hf: against HF of the same dtype and batch; x_vllm:
    against vLLM of the same dtype and batch (ours / vLLM)."""
    base = runs.get("hf")
    for key, r in runs.items():
        same_hf = _peer(runs, "hf", key)
        vllm = _peer(runs, "vllm", key) if _kind(key) not in ("vllm", "hf") else None
        r["x_hf"] = r["tok_per_s"] / base["tok_per_s"] if base else None
        r["x_its_hf"] = r["tok_per_s"] / same_hf["tok_per_s"] if same_hf else None
        r["x_vllm"] = r["tok_per_s"] / vllm["tok_per_s"] if vllm else None


def display_order(runs: dict) -> list[str]:
    """The workload's runs first, then the single-request ones; fp32 before bf16; then
    engine, daemon, vLLM, HF (variants such as "engine_mixed" after their plain run)."""
    kinds = list(KIND_COLORS)
    return sorted(
        runs, key=lambda k: ("_1req" in k, k.endswith("_bf16"), kinds.index(_kind(k)) if _kind(k) in kinds else 0)
    )


def print_table(title: str, runs: dict) -> None:
    add_ratios(runs)
    print(f"\n{title}")
    print(
        f"{'run':44s} {'tok/s':>8s} {'x HF':>6s} {'x its HF':>9s} {'x vLLM':>7s} {'TTFT mean/p50/p99 (s)':>24s} "
        f"{'ITL mean/p50/p99 (ms)':>24s}"
    )

    def ratio(x):
        return f"{x:.2f}" if x is not None else "-"

    for key in display_order(runs):
        r = runs[key]
        t, i = r["ttft_s"], r["itl_s"]
        print(
            f"{r['name']:44s} {r['tok_per_s']:8.1f} {ratio(r['x_hf']):>6s} {ratio(r['x_its_hf']):>9s} "
            f"{ratio(r['x_vllm']):>7s} {t['mean']:8.2f}/{t['p50']:.2f}/{t['p99']:.2f} "
            f"{i['mean'] * 1e3:9.1f}/{i['p50'] * 1e3:.1f}/{i['p99'] * 1e3:.1f}"
        )
    print(
        "x HF: against HF fp32 static batch 16; x its HF: against the HF run of the same dtype and batch; "
        "x vLLM: ours / vLLM-CPU offline, same dtype and batch"
    )


def plot(path: str, workloads: dict[str, dict]) -> None:
    """One row per workload: output tok/s, TTFT and ITL (mean/p50/p99) of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(workloads), 3, figsize=(18, 5.5 * len(workloads)), squeeze=False)
    for row, (title, runs) in zip(axes, workloads.items()):
        keys = display_order(runs)
        names = [runs[k]["name"] for k in keys]
        ys = range(len(keys))
        colors = [KIND_COLORS.get(_kind(k), "C4") for k in keys]
        bars = row[0].barh(ys, [runs[k]["tok_per_s"] for k in keys], color=colors)
        row[0].bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
        row[0].set_yticks(list(ys), names, fontsize=8)
        row[0].invert_yaxis()
        row[0].set_xlabel("output tok/s")
        row[0].set_title(f"{title}: throughput")
        for ax, metric, scale, unit in ((row[1], "ttft_s", 1, "s"), (row[2], "itl_s", 1e3, "ms")):
            height = 0.8 / len(STATS)
            for j, stat in enumerate(STATS):
                ax.barh(
                    [y + (j - 1) * height for y in ys],
                    [runs[k][metric][stat] * scale for k in keys],
                    height=height,
                    label=stat,
                )
            ax.set_yticks(list(ys), [""] * len(keys))
            ax.invert_yaxis()
            ax.set_xlabel(unit)
            ax.set_title(f"{title}: {'TTFT' if metric == 'ttft_s' else 'ITL'} per request")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
