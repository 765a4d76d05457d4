"""bench/gpu_step.py's figures: ``summarize`` (each contender's medians, its step split into forward/backward,
link and update, the share staleness 1 hides), ``judge`` (the targets on the headline contender), and what is
printed (``print_size``, ``summary_lines``)."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_table  # noqa: E402
from gpu_step_common import (FWD_BWD, HBM_RATIO_TARGET, HIDE_TARGET, NSP_VARIANTS, OPTAX_HBM,  # noqa: E402
                             OPTAX_PINNED, REFERENCE, nsp_name, short_error)


def stats_times(stats: dict[str, Any]) -> tuple[tuple[str, int] | None, tuple[str, int] | None, dict[str, int]]:
    """Time counters in a store's stats beyond the engine's own: (down key, ns), (up key, ns), all of them. A
    handler that times its copies names them with ``_ns`` keys (h2d/d2h, copy_in/copy_out, ...)."""
    engine = {"update_ns", "sync_ns", "commit_ns", "wait_ns"}
    extra = {k: v for k, v in stats.items() if k.endswith("_ns") and k not in engine and isinstance(v, (int, float))}
    down = up = None
    for key, value in extra.items():
        words = set(key.removesuffix("_ns").split("_"))
        if words & {"d2h", "down", "in", "grad", "grads", "gradient"} and down is None:
            down = (key, value)
        elif words & {"h2d", "up", "out", "params"} and up is None:
            up = (key, value)
    return down, up, extra

def summarize(size_rec: dict[str, Any], contenders: dict[str, Any], probe: dict[str, Any] | None,
              device) -> None:
    """Fills each contender's figures (medians per step, split, link) and the size's targets from the times so
    far (``contenders``: bench/gpu_step_contenders.py's, by name)."""
    recs = size_rec["contenders"]
    for c in contenders.values():
        rec = c.rec
        if not c.times:
            continue
        k = c.steps_per_call
        rec["times_s"] = list(c.times)
        rec["step_ms"] = median(c.times) / k * 1e3
        if c.drains:
            drains = c.drains[-len(c.times):]
            rec["drain_ms"] = median(drains) * 1e3
            rec["steady_step_ms"] = median([t - d for t, d in zip(c.times, drains)]) / k * 1e3
        if c.store is not None:
            try:
                stats = c.store.stats()
                rec["stats"] = stats
                shard = c.store.shard_stats()
                backend = [s.get("backend") for s in shard if s.get("backend")]
                if backend:
                    rec["backend_stats"] = backend
            except Exception as e:  # noqa: BLE001
                rec["stats_error"] = short_error(e)

    fb = recs.get(FWD_BWD, {}).get("step_ms")
    size_rec["fwd_bwd_ms"] = fb
    for name, rec in recs.items():
        if "step_ms" not in rec or name == FWD_BWD:
            continue
        step = rec.get("steady_step_ms", rec["step_ms"])
        split: dict[str, Any] = {"fwd_bwd_ms": fb, "step_ms": step}
        link: dict[str, Any] = {}
        stats = rec.get("stats")
        if stats is not None:
            updates = stats.get("updates") or 0
            if updates:
                split["update_ms"] = stats.get("update_ns", 0) / updates / 1e6
                split["update_source"] = "store stats update_ns per update"
                split["wait_ms"] = stats.get("wait_ns", 0) / updates / 1e6
                link["down_bytes"] = stats.get("shared_in_bytes", 0) / updates
                link["up_bytes"] = stats.get("shared_out_bytes", 0) / updates
                link["bytes_source"] = "store stats shared_in_bytes / shared_out_bytes per update"
                down, up, extra = stats_times(stats)
                if extra:
                    link["time_counters"] = extra
                for side, found in (("down", down), ("up", up)):
                    if found is not None:
                        split[f"{side}_ms"] = found[1] / updates / 1e6
                        split[f"{side}_source"] = f"store stats {found[0]}"
            rec["params_adopted"] = stats.get("params_adopted")
        elif fb is not None:
            split["update_ms"] = max(step - fb, 0.0)
            split["update_source"] = "step - forward/backward (the update and any copies it needs)"
            if name == OPTAX_PINNED and rec.get("state_bytes"):
                link["down_bytes"] = link["up_bytes"] = rec["state_bytes"]
                link["bytes_source"] = ("the optax state's size: moved to the device before the update, back to "
                                        "pinned_host after it")
        if probe is not None and "down_bytes" in link:
            for side in ("down", "up"):
                if f"{side}_ms" not in split and probe.get(f"{side}_GBps"):
                    gbps = probe[f"{side}_GBps"] if name != OPTAX_PINNED else probe[
                        "up_GBps" if side == "down" else "down_GBps"]  # the offload moves state up first
                    split[f"{side}_ms"] = link[f"{side}_bytes"] / gbps / 1e6
                    split[f"{side}_source"] = "bytes at the link probe's GB/s (an estimate, not a counter)"
        for side in ("down", "up"):
            if split.get(f"{side}_ms") and link.get(f"{side}_bytes") is not None:
                link[f"{side}_GBps"] = link[f"{side}_bytes"] / (split[f"{side}_ms"] / 1e3) / 1e9
                link[f"{side}_GBps_source"] = ("the store's time counter" if "store stats" in split[f"{side}_source"]
                                               else "the link probe's (no counter to measure it by)")
        rec["split"] = split
        rec["link"] = link

    ref = recs.get(REFERENCE, {})
    ref_ms = ref.get("steady_step_ms", ref.get("step_ms"))
    for name, rec in recs.items():
        if "step_ms" in rec and ref_ms:
            rec["x_nsp"] = rec.get("steady_step_ms", rec["step_ms"]) / ref_ms

    # The share of the update staleness 1 hides, per staleness-1 contender.
    for tier, _, topk in NSP_VARIANTS:
        s0, s1 = recs.get(nsp_name(tier, 0, topk), {}), recs.get(nsp_name(tier, 1, topk), {})
        if "step_ms" not in s1 or fb is None:
            continue
        t_update = s0.get("split", {}).get("update_ms") or s1.get("split", {}).get("update_ms")
        if not t_update:
            continue
        t_s1 = s1.get("steady_step_ms", s1["step_ms"])
        s1["hidden_share"] = min(max((fb + t_update - t_s1) / t_update, 0.0), 1.0)
        s1["hidden_share_raw"] = (fb + t_update - t_s1) / t_update
        s1["hidden_share_inputs_ms"] = {"fwd_bwd": fb, "update": t_update, "step_stale1_steady": t_s1,
                                        "update_from": "staleness-0 twin" if s0.get("split", {}).get("update_ms")
                                        else "its own store's update_ns"}
        if "steady_step_ms" in s1:
            s1["hidden_share_with_drain"] = min(max((fb + t_update - s1["step_ms"]) / t_update, 0.0), 1.0)
        # The same question asked of everything the update adds to a step (its copies and the step's other work
        # around the store included): the share of (staleness-0 step - forward/backward) that staleness 1 removes.
        if "step_ms" in s0:
            t_s0 = s0.get("steady_step_ms", s0["step_ms"])
            if t_s0 > fb:
                s1["hidden_share_of_step_cost"] = min(max((t_s0 - t_s1) / (t_s0 - fb), 0.0), 1.0)

    size_rec["targets"] = judge(recs, fb)


def judge(recs: dict[str, Any], fb: float | None) -> dict[str, Any]:
    """The issue's targets on the headline contender (REFERENCE)."""
    ref = recs.get(REFERENCE, {})
    out: dict[str, Any] = {"contender": REFERENCE}
    if "step_ms" not in ref:
        out["status"] = f"not judged: {REFERENCE} {ref.get('status', 'did not run')}"
        return out
    ref_ms = ref.get("steady_step_ms", ref["step_ms"])
    twin = recs.get(nsp_name("memory", 0, False), {})
    update = twin.get("split", {}).get("update_ms") or ref.get("split", {}).get("update_ms")
    regime = fb is not None and update is not None and fb >= update
    out["regime"] = {"fwd_bwd_ms": fb, "update_ms": update, "fwd_bwd_at_least_update": regime}
    hidden = ref.get("hidden_share")
    if hidden is None:
        out["hides"] = {"status": "not judged: no hidden share measured"}
    elif not regime:
        out["hides"] = {"value": hidden, "target": HIDE_TARGET,
                        "status": "not judged: the forward/backward is shorter than the update at this batch x seq "
                                  f"({'MISSED' if hidden < HIDE_TARGET else 'met'} if it were)"}
    else:
        out["hides"] = {"value": hidden, "target": HIDE_TARGET, "status": "met" if hidden >= HIDE_TARGET else "MISSED"}
    hbm = recs.get(OPTAX_HBM, {}).get("step_ms")
    if hbm:
        ratio = ref_ms / hbm
        out["vs_hbm"] = {"ratio": ratio, "target": HBM_RATIO_TARGET,
                         "status": "met" if ratio <= HBM_RATIO_TARGET else "MISSED"}
    else:
        out["vs_hbm"] = {"status": f"not judged: {OPTAX_HBM} {recs.get(OPTAX_HBM, {}).get('status')}"}
    pinned = recs.get(OPTAX_PINNED, {}).get("step_ms")
    if pinned:
        ratio = ref_ms / pinned
        out["vs_pinned_host"] = {"ratio": ratio, "target": "< 1", "status": "met" if ratio < 1 else "MISSED"}
    else:
        out["vs_pinned_host"] = {"status": f"not judged: {OPTAX_PINNED} {recs.get(OPTAX_PINNED, {}).get('status')}"}
    # Every nsp contender against both optax contenders, for the record.
    out["all_nsp"] = {name: {"x_hbm": (rec.get("steady_step_ms", rec["step_ms"]) / hbm) if hbm else None,
                             "x_pinned_host": (rec.get("steady_step_ms", rec["step_ms"]) / pinned) if pinned else None}
                      for name, rec in recs.items() if name.startswith("nsp") and "step_ms" in rec}
    return out


def print_size(key: str, size_rec: dict[str, Any]) -> None:
    rows = []
    for name, rec in size_rec["contenders"].items():
        split, link = rec.get("split", {}), rec.get("link", {})
        status = rec.get("status", "")
        rows.append({"contender": name, "status": "ok" if status == "ok" else status[:40],
                     "step": rec.get("steady_step_ms", rec.get("step_ms")), "drain": rec.get("drain_ms"),
                     "x_nsp": rec.get("x_nsp"),
                     "fb": split.get("fwd_bwd_ms") if name != FWD_BWD else rec.get("step_ms"),
                     "down": split.get("down_ms"), "update": split.get("update_ms"), "up": split.get("up_ms"),
                     "down_mb": link.get("down_bytes", 0) / 1e6 if "down_bytes" in link else None,
                     "up_mb": link.get("up_bytes", 0) / 1e6 if "up_bytes" in link else None,
                     "down_gbps": link.get("down_GBps"), "up_gbps": link.get("up_GBps"),
                     "hidden": rec["hidden_share"] * 100 if "hidden_share" in rec else None})
    print_table(
        f"{key}: {size_rec['model']}, {size_rec['params'] / 1e6:.1f}M params, batch {size_rec['batch']} x "
        f"{size_rec['seq']} tokens, median of {size_rec.get('rounds')} interleaved rounds per step (nsp: steady, "
        "between drains); x nsp: the ratio to " + REFERENCE, rows,
        [("contender", "contender", ""), ("status", "status", ""), ("step", "step ms", ".2f"),
         ("x_nsp", "x nsp", ".2f"), ("fb", "fwd/bwd ms", ".2f"), ("down", "link down ms", ".2f"),
         ("update", "update ms", ".2f"), ("up", "link up ms", ".2f"), ("drain", "drain ms", ".2f"),
         ("down_mb", "down MB", ".1f"), ("up_mb", "up MB", ".1f"), ("down_gbps", "down GB/s", ".1f"),
         ("up_gbps", "up GB/s", ".1f"), ("hidden", "s1 hides %", ".0f")])
    t = size_rec.get("targets", {})
    regime = t.get("regime", {})
    if regime:
        longer = regime.get("fwd_bwd_at_least_update")
        print(f"  regime: forward/backward {fmt(regime.get('fwd_bwd_ms'))} ms vs update {fmt(regime.get('update_ms'))}"
              f" ms: forward/backward {'>=' if longer else '<'} update at batch {size_rec['batch']} x "
              f"{size_rec['seq']}")
    for what, label in (("hides", f"staleness 1 hides >= {HIDE_TARGET:.0%} of the update"),
                        ("vs_hbm", f"{REFERENCE} <= {HBM_RATIO_TARGET}x {OPTAX_HBM}"),
                        ("vs_pinned_host", f"{REFERENCE} faster than {OPTAX_PINNED}")):
        item = t.get(what, {})
        value = item.get("value", item.get("ratio"))
        print(f"  target: {label}: {fmt(value, '.3f')} -> {item.get('status', t.get('status'))}")
    for name, rec in size_rec["contenders"].items():
        if "hidden_share" in rec:
            of_step = rec.get("hidden_share_of_step_cost")
            print(f"  {name}: hides {rec['hidden_share']:.0%} of the update (its staleness-0 twin's update_ns), "
                  f"{fmt(None if of_step is None else of_step * 100, '.0f')}% of what the update adds to the "
                  "staleness-0 step")
    for name, rec in size_rec["contenders"].items():
        if "split" in rec and name.startswith("nsp"):
            srcs = {k: v for k, v in rec["split"].items() if k.endswith("_source")}
            if srcs:
                print(f"  {name}: " + "; ".join(f"{k.removesuffix('_source')} from {v}" for k, v in srcs.items()))
            break


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summary_lines(record: dict[str, Any]) -> list[str]:
    lines = [f"platform {record.get('platform')} ({record.get('device_kind')}); params check: "
             f"{record.get('params_check', {}).get('status')}"]
    for key, size in record.get("sizes", {}).items():
        t = size.get("targets", {})
        parts = []
        for what in ("hides", "vs_hbm", "vs_pinned_host"):
            item = t.get(what, {})
            value = item.get("value", item.get("ratio"))
            parts.append(f"{what} {fmt(value, '.3f')}: {item.get('status', t.get('status', '-'))}")
        failed_ = [n for n, r in size.get("contenders", {}).items() if str(r.get("status", "")).startswith("failed")]
        lines.append(f"{key} (batch {size.get('batch')} x {size.get('seq')}): " + "; ".join(parts)
                     + (f"; failed: {', '.join(failed_)}" if failed_ else ""))
    for what, why in record.get("skipped", {}).items():
        lines.append(f"skipped {what}: {why}")
    return lines

