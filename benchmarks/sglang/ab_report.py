"""The A/B's report: one line per result, kvcore over each baseline, the table, the failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def row_line(r: dict[str, Any]) -> str:
    """One result as the progress and the table show it."""
    where = f"{r['pool']}/{r['layout']}/p{r['page_size']}"
    if r["op"]:
        where += f"/host-{r['host_fragmentation']}/{r['op']}"
    if r.get("not_runnable"):
        return f"{where:<40} {r['path']:<15} not runnable: {r['not_runnable']}"
    ok = ("yes" if r["identical"] else "NO") + (" SUSPECT-TIMING" if r["suspect_timing"] else "")
    share = r.get("share_of_ceiling") or 0.0
    return (
        f"{where:<40} {r['path']:<15} {r['gbps']:>7.2f} GB/s {100 * share:>4.0f}% "
        f"of {r['ceiling_gbps']:.1f}  ok={ok}  {r.get('sms', '')}"
    )


def speedups(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvcore over each baseline (stock, or the direct model) on the same data, where both ran."""
    key = ("pool", "layout", "page_size", "host_fragmentation", "op")
    baselines: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r["path"].startswith(("stock", "model")) and r.get("gbps"):
            baselines.setdefault(tuple(r.get(k) for k in key), []).append(r)
    out = []
    for r in results:
        if not (r["path"].startswith("kvcore") and r.get("gbps")):
            continue
        for base in baselines.get(tuple(r.get(k) for k in key), []):
            ratio = r["gbps"] / base["gbps"]
            out.append({**{k: r[k] for k in key}, "vs": base["path"], "x": ratio})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"device: {report['device']}  torch {report['torch']}  sglang {report['sglang']}  "
        f"sgl_kernel: {report['sgl_kernel']}",
        f"{report['tokens']} tokens, {report['layers']} layers; load = layer "
        f"{report['load_layer']}, backup = all layers",
        f"JIT modules: {report['jit_modules']}",
        "",
    ]
    lines += [row_line(r) for r in report["results"]]
    ratios = speedups(report["results"])
    if ratios:
        lines.append("")
        lines.append("kvcore over each baseline, same indices:")
        for s in ratios:
            lines.append(
                f"  {s['pool']}/{s['layout']}/p{s['page_size']}/host-{s['host_fragmentation']}"
                f"/{s['op']}: {s['x']:.2f}x vs {s['vs']}"
            )
    if report["prefix_reload"]:
        lines.append("")
        lines.append("evicted-prefix round trip (backup all layers, overwrite, reload all layers):")
        for r in report["prefix_reload"]:
            where = f"{r['pool']}/{r['layout']}/p{r['page_size']}/host-{r['host_fragmentation']}"
            if r.get("not_runnable"):
                lines.append(f"  {where:<34} {r['path']:<15} not runnable: {r['not_runnable']}")
                continue
            lines.append(
                f"  {where:<34} {r['path']:<15} evict {r['evict_gbps']:.2f} GB/s  reload "
                f"{r['reload_gbps']:.2f} GB/s ({r['reload_ms']:.1f} ms)  "
                f"ok={'yes' if r['identical'] else 'NO'}"
            )
    return "\n".join(lines)


def failures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Results that ran and did not match byte for byte."""
    rows = [*report["results"], *report["prefix_reload"]]
    return [r for r in rows if not r.get("not_runnable") and r.get("identical") is False]
