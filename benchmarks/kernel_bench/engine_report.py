"""The tables `--engine` prints (markdown, like the kernel table), from the results dict the run fills."""

from __future__ import annotations

import statistics
from typing import Any, Optional

DECODE_HEADER = [
    "| ZOS | decode step ms | decode tok/s | GPU ms/step (events) | gap between steps µs (events) "
    "| GPU idle µs/step (profiler) | GPU busy | attended/seq | bytes/step "
    "(weights+KV) | GB/s | BW util | generate s | gen tok/s | vs transformers | peak GiB |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]  # fmt: skip


def fmt_or_na(value: Optional[float], fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, fmt) + suffix


def fmt_size(n: float) -> str:
    """Bytes with a decimal unit, three significant figures below 100 of the unit."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def _header(res: dict[str, Any]) -> list[str]:
    c = res["ceilings"]
    timer = "wall clock" if c["timer"] == "wall clock" else "wall clock (steps), CUDA events (ceilings)"
    return [
        f"engine bench: {res['preset']}, {res['layers']}/{res['layers_full']} layers, {res['dtype']}, device "
        f"{c['device']}: copy {c['copy_GBps']:.4g} GB/s (read+write), matmul {c['matmul_TFLOPs']:.3g} TFLOP/s; "
        f"times by {timer}",
        f"decode: batch {res['batch']} x context {res['context']}, {res['new_tokens']} new tokens each; "
        f"prefill: {res['prefill_tokens']} tokens",
    ]


def _traffic_line(res: dict[str, Any]) -> list[str]:
    mb = res.get("model_bytes")
    if mb is None or "unique_experts" not in res:
        return []
    unique, total_experts = res["unique_experts"], mb["num_experts"]
    experts = sum(u * e for u, e in zip(unique, mb["per_expert"]))
    touched = f"{statistics.fmean(unique):.1f}/{total_experts[0]}" if unique else "no MoE layers"
    return [
        f"weights {fmt_size(mb['total'])}; read per decode step {fmt_size(res['step_weight_bytes'])} = dense "
        f"{fmt_size(mb['dense'])} + embedding rows {fmt_size(res['batch'] * mb['embedding_row'])} + experts "
        f"{fmt_size(experts)} ({touched} per layer, {res['routing']}); KV {fmt_size(mb['kv_per_token'])}/token"
    ]


def _decode_row(r: dict[str, Any]) -> str:
    busy = None if r["busy_frac"] is None else r["busy_frac"] * 100
    return (
        f"| {'on' if r['zos'] else 'off'} | {r['step_ms_median']:.2f} | {r['decode_tok_s']:,.0f} | "
        f"{fmt_or_na(r.get('gpu_ms_per_step'), '.2f')} | {fmt_or_na(r.get('gap_us_per_step'), '.0f')} | "
        f"{fmt_or_na(r['idle_us_per_step'], '.0f')} | {fmt_or_na(busy, '.1f', '%')} | {r['attended_mean']:.0f} | "
        f"{fmt_size(r['bytes'])} | {r['gbps']:.4g} | {r['bw_util']:.1%} | {r['e2e_s']:.2f} | "
        f"{r['gen_tok_s']:,.0f} | {fmt_or_na(r.get('ratio_vs_hf'), '.2f', '×')} | {fmt_or_na(r['peak_gib'], '.1f')} |"
    )


def _transformers_lines(res: dict[str, Any]) -> list[str]:
    out = []
    if "transformers" in res:
        t = res["transformers"]
        out.append(
            f"\ntransformers generate (same tensors, greedy, batch {res['batch']}): {t['e2e_s']:.2f} s = "
            f"{t['gen_tok_s']:,.0f} tok/s; peak {fmt_or_na(res['peak_gib'].get('transformers'), '.1f', ' GiB')}"
        )
    if "transformers_error" in res:
        out.append(f"\ntransformers generate failed: {res['transformers_error']}")
    return out


def _prefill_table(res: dict[str, Any]) -> list[str]:
    if "prefill" not in res:
        return []
    p = res["prefill"]
    return [
        "",
        f"| prefill tokens (ZOS {'on' if p['zos'] else 'off'}) | ms (median) | tok/s | TFLOP/s | of matmul rate |",
        "|---:|---:|---:|---:|---:|",
        f"| {p['tokens']} | {p['ms_median']:.1f} | {p['tok_s']:,.0f} | {p['tflops']:.3g} | {p['mfu']:.1%} |",
    ]


def format_report(res: dict[str, Any]) -> str:
    """Every table of the phases that finished: header, decode traffic, decode rows, transformers, prefill."""
    out = _header(res) + _traffic_line(res)
    if res["decode"]:
        out += ["", *DECODE_HEADER, *(_decode_row(r) for r in res["decode"])]
    out += _transformers_lines(res) + _prefill_table(res)
    return "\n".join(out)
