"""Section 3 of the report, the store's benchmarks: the renderers of the update kernel's, the store update's (on
the disk and on an emulated slow disk), the checkpoint's and the CSD scaling's records (``bench/report_benches.py``
lists them in ``BENCHES``). Each returns the record's default command and its markdown (table, facts, chart)."""

from __future__ import annotations

from pathlib import Path

from report_render import bar_chart, draw_bars, md_table, pyplot, save_figure


def render_update_kernel(d: dict, out: Path) -> tuple[str, str]:
    med = d["median_s"]
    names = list(med)
    topk = next((k for k in names if k.startswith("nsp top-k ")), None)
    ratio = float(topk.split()[-1].rstrip("%")) / 100 if topk else 0.01
    command = f"python bench/update_kernel.py --size {d['size']} --threads {d['threads']} --repeats {d['repeats']}"
    if d.get("pages", "huge") != "huge":
        command += f" --memory-pages {d['pages']}"
    if abs(ratio - 0.01) > 1e-12:
        command += f" --ratio {ratio:g}"
    roof = {k for k in names if k.startswith("roofline")}
    bpp = d.get("bytes_per_param", {})
    rows = [{"name": k, "ms": v * 1e3, "gparams": d["size"] / v / 1e9,
             "bpp": f"{bpp[k]:g}" if k in bpp else ""} for k, v in med.items()]
    bar_chart(out / "update_kernel.png", names, [d["size"] / v / 1e9 for v in med.values()],
              title=f"fp32 Adam update of {d['size'] / 2**20:.0f}M params, {d['threads']} threads, ISA {d['isa']} "
                    f"(median of {d['repeats']}; {d['time']})", xlabel="Gparam/s (higher is better)", roofline=roof)
    body = md_table(rows, [("name", "contender", ""), ("ms", "median ms", ".1f"), ("gparams", "Gparam/s", ".3f"),
                           ("bpp", "B/param moved", "")])
    notes = "; ".join(f"{k}: {v}" for k, v in d.get("notes", {}).items())
    share = d.get("huge_page_share")
    if share:  # which memory pages each contender streamed (bench/page_backing.py)
        notes += (f"\n\nMemory pages: `--memory-pages {d.get('pages')}` (THP mode {d.get('thp_mode')}); share of "
                  "each contender's streamed bytes on 2 MiB pages: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in share.items()))
    checks = "\n".join(f"- {c['check']}: {c['ratio']:.2f}x (target {c['target']:.2f}x, "
                       f"{'met' if c['met'] else 'missed'})" for c in d.get("checks", []))
    crc = d.get("crc32c_gbps")
    crc_lines = ""
    if crc:
        page = d.get("crc32c_page_bytes", 4 << 20) >> 20
        crc_lines = (f"\n\nPage checksum (CRC-32C of a {page} MiB page, GB/s, each implementation the CPU has):\n"
                     + "\n".join(f"- {isa}: " + (f"{rate:.1f} GB/s" if isinstance(rate, (int, float))
                                                 else f"not run ({rate})") for isa, rate in crc.items()))
    return command, f"{body}\n\n{notes}\n\n{checks}{crc_lines}\n\n![update kernel](update_kernel.png)"


def render_store_update(d: dict, out: Path) -> tuple[str, str]:
    """Reads store_update.json tolerantly: its contenders are found by name (any whose name mentions DeepSpeed or
    "baseline" is a baseline of the disk group) and each sentence of the facts appears only when the record has
    its fields, so that a record with other or more baselines still renders."""
    command = "python bench/store_update.py" + "".join(
        f" {flag} {fmt(d[key])}" for flag, key, fmt in (
            ("--state-mib", "state_bytes", lambda v: f"{v / 2**20:g}"), ("--repeats", "repeats", str),
            ("--page-mib", "page_bytes", lambda v: f"{v / 2**20:g}"), ("--pages-in-flight", "pages_in_flight", str),
            ("--threads", "threads", str), ("--dir", "directory", str)) if key in d)
    med = d["median_s"]
    moved = d["bytes_read_per_update"] + d["bytes_written_per_update"]
    n = d["params"]

    def find(prefix: str) -> str | None:
        return next((k for k in med if k.strip().startswith(prefix)), None)

    # The file tier and the baselines move the same page bytes; the perfect update is their disk roofline.
    raw = [(k, v) for k, v in med.items() if k.startswith("raw disk")]
    baselines = [k for k in med if "deepspeed" in k.lower() or "baseline" in k.lower()]
    disk = ([("perfect update (disk roofline)", d["perfect_update_s"])] if "perfect_update_s" in d else [])
    disk += [(find("nsp file tier"), med.get(find("nsp file tier")))] + [(k.strip(), med[k]) for k in baselines]
    memory = [(k, med.get(k)) for k in [find("kernel alone")] + [k for k in med if k.startswith("memory tier")]]
    memory += [(k.strip(), v) for k, v in med.items() if k.strip().startswith("diag")]
    # A raw probe moves the probe's bytes once; "read + write at once" moves them twice (a read and a write).
    rows = [{"name": k, "ms": v * 1e3,
             "gbs": d["probe_bytes"] * (2 if "at once" in k else 1) / v / 1e9 if "probe_bytes" in d else None}
            for k, v in raw]
    rows += [{"name": k, "ms": v * 1e3, "gbs": moved / v / 1e9} for k, v in disk if k]
    rows += [{"name": k, "ms": v * 1e3, "gbs": n * (28 if "kernel" in k or "no param" in k else 32) / v / 1e9}
             for k, v in memory if k]
    listed = {r["name"].strip() for r in rows}
    rows += [{"name": k.strip(), "ms": v * 1e3} for k, v in med.items() if k.strip() not in listed]  # the rest
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.2))
    for ax, group, title in ((axes[0], disk, "file tier vs disk (GB/s of pages moved)"),
                             (axes[1], memory, "memory tier vs the kernel alone (Mparam/s)")):
        group = [(k, v) for k, v in group if k]
        vals = [moved / v / 1e9 if ax is axes[0] else n / v / 1e6 for _, v in group]
        roof = ["roofline" in k or "kernel alone" in k for k, _ in group]
        draw_bars(ax, [k for k, _ in group], vals, roof, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.margins(x=0.2)
    png = "store_update_slow_disk.png" if d.get("slow_disk") else "store_update.png"
    save_figure(fig, out / png,
                f"store update, {n / 2**20:.0f}M params"
                + (f" ({d['state_bytes'] / 2**20:.0f} MiB of p, m, v)" if "state_bytes" in d else "") + ", "
                f"median of {d.get('repeats', '?')} ({d.get('time', '?')})")
    body = md_table(rows, [("name", "contender", ""), ("ms", "median ms", ".1f"), ("gbs", "GB/s moved", ".3f")])

    def fact(template: str, *keys: str) -> str:
        return template.format(*(d[k] for k in keys)) if all(k in d for k in keys) else ""

    probe = (f"fastest write: {d['probe_write'].split(': ')[-1]}; fastest read: {d['probe_read'].split(': ')[-1]}"
             if "probe_write" in d and "probe_read" in d else d.get("probe_mode", "?"))
    facts = " ".join(f for f in (
        fact(f"Raw disk ({probe}): write {{:.3f}} GB/s, read {{:.3f}} GB/s.", "write_gbs", "read_gbs"),
        fact("File tier at {:.1f}% of the perfect update.", "file_tier_pct_of_disk"),
        fact("Baseline at {:.1f}% of the perfect update", "baseline_pct_of_disk")
        + fact(" (nsp vs baseline: {:.2f}x", "nsp_vs_baseline_speedup")
        + fact("; baseline Adam: {}", "baseline_adam")
        + (")." if "nsp_vs_baseline_speedup" in d else "." if "baseline_pct_of_disk" in d else ""),
        fact("Memory tier (jitted, as the transforms run it) at {:.1f}% of the kernel alone",
             "memory_tier_pct_of_kernel")
        + fact(" ({:.1f}% counting its 32 B/param against the kernel's 28)",
               "memory_tier_pct_of_kernel_roofline_adjusted")
        + ("." if "memory_tier_pct_of_kernel" in d else ""),
        _perfect_swap_fact(d.get("perfect_serial_swap") or {}),
        _footprint_fact(d.get("buffer_footprint") or {}),
        _slow_disk_fact(d.get("slow_disk") or {}),
    ) if f)
    checks = "\n".join(f"- {c.get('check', '?')}: "
                       + (f"{c['value']:.3g}" if isinstance(c.get("value"), (int, float)) else str(c.get("value")))
                       + f" ({'met' if c.get('met') else 'missed'})" for c in d.get("checks", []))
    return command, f"{body}\n\n{facts}\n\n{checks}\n\n![store update]({png})"


def _slow_disk_fact(disk: dict) -> str:
    """Where the record ran on bench/slow_disk.py's emulated disk: its rates, and the file tier against the serial
    swap that disk's nominal rates allow."""
    if "read_gbps" not in disk:
        return ""
    text = (f"On an emulated slow disk, {disk.get('emulator', 'bench/slow_disk.py')}: reads {disk['read_gbps']:g} "
            f"GB/s, writes {disk['write_gbps']:g} GB/s from one budget; the perfect update is its nominal floor")
    swap = disk.get("serial_swap_at_nominal_rates")
    if swap:
        text += (f" (the raw probes, through FUSE, reach {disk['nominal_floor_s'] / swap['probes_floor_s']:.0%} of "
                 f"it); a serial swap at the nominal rates (floor + {swap['adam_s'] * 1e3:.0f} ms of Adam) takes "
                 f"{swap['s'] * 1e3:.0f} ms: nsp {swap['nsp_speedup']:.3f}x")
    return text + "."


def _footprint_fact(f: dict) -> str:
    """The diagnostic rows that land the probes' requests in as many buffers as the file tier's page buffers, not
    in the one buffer the probes reuse: what that buffer is worth, and the file tier against the floor they give."""
    if "file_tier_pct" not in f:
        return ""
    return (f"Diagnostic (not the target's floor): the probes land every request in one reused buffer; landing them "
            f"in {f['buffers']} buffers in turn, as the file tier's page buffers hold its pages, the read took "
            f"{f['read_s'] * 1e3:.0f} ms instead of {f['one_buffer_read_s'] * 1e3:.0f} and the write "
            f"{f['write_s'] * 1e3:.0f} instead of {f['one_buffer_write_s'] * 1e3:.0f}; against the floor those give "
            f"({f['floor_s'] * 1e3:.0f} ms) the file tier is at {f['file_tier_pct']:.1f}%.")


def _perfect_swap_fact(perfect: dict) -> str:
    """The file tier against the perfect serial swap: overall, and in the rounds where both read their pages the
    same way (direct or buffered), with how the file tier read each round."""
    if "nsp_speedup" not in perfect:
        return ""
    text = f"Against the perfect serial swap: nsp {perfect['nsp_speedup']:.2f}x"
    same = perfect.get("same_read_method")
    if same:
        text += (f"; in the {len(same['rounds'])} rounds where both read pages the same way, nsp "
                 f"{same['nsp_s'] * 1e3:.0f} ms vs {same['perfect_s'] * 1e3:.0f} ms ({same['nsp_speedup']:.2f}x)")
    if perfect.get("nsp_reads_per_round"):
        text += f"; nsp read its pages per round: {', '.join(perfect['nsp_reads_per_round'])}"
    return text + "."


def render_checkpoint(d: dict, out: Path) -> tuple[str, str]:
    default_mib = 128 if d.get("quick") else 1024
    mib = round(d["state_bytes"] / 2**20)
    command = "python bench/checkpoint.py" + (" --quick" if d.get("quick") else "")
    command += f" --state-mib {mib}" if mib != default_mib else ""
    command += f" --repeats {d['repeats']} --num-shards {d['num_shards']} --page-mib {d['page_bytes'] / 2**20:g}"
    rows = d["rows"]
    bar_chart(out / "checkpoint.png", [r["name"] for r in rows], [r["median_s"] for r in rows],
              title=f"checkpoint save of {d['state_bytes'] / 2**20:.0f} MiB of state, median of {d['repeats']} "
                    f"({d['time']})", xlabel="seconds (log; lower is better)",
              roofline={r["name"] for r in rows if r["name"].startswith("raw")}, log=True, fmt="{:.3g} s")
    body = md_table(rows, [("name", "contender", ""), ("median_s", "median s", ".4f"),
                           ("gbps", "state GB/s", ".2f"), ("ratio", "x nsp snapshot", ".1f")])
    snap = d.get("snapshot", {})
    facts = (f"nsp snapshot vs orbax StandardCheckpointer: {d['ratio_orbax_standard']:.1f}x (target "
             f"{d['target_ratio']:.0f}x: {'met' if d['target_met'] else 'missed'}); snapshot method "
             f"{snap.get('method')}, {snap.get('linked_files')} page files linked, {snap.get('copied_bytes')} "
             "bytes copied. The raw write is the roofline of any checkpoint that copies the state.")
    later = d.get("cost_later")
    if later:
        lrows = [{**r, "replaced": r.get("replaced", "-")} for r in later["rows"]]
        facts += ("\n\n**The cost paid later.** A page file that a snapshot links is replaced, not rewritten in "
                  "place, the next time the store writes it (a new file renamed over it). Versions alternate "
                  "between two slots, so the first update after a snapshot writes the other slot and the second "
                  "rewrites the snapshotted one. Both updates after a snapshot against two with none, the two "
                  f"kinds of round alternating, median of {d['repeats']} (extra: median of the per-round "
                  "differences; pages replaced: page files that got a new inode):\n\n"
                  + md_table(lrows, [("name", "", ""), ("snapshot", "after a snapshot (s)", ".4f"),
                                     ("none", "no snapshot (s)", ".4f"), ("extra", "extra (s)", "+.4f"),
                                     ("replaced", "pages replaced (snapshot / none)", "")])
                  + f"\n\nA checkpoint by snapshot costs its own time plus that extra: {later['snapshot_s']:.4f} + "
                  f"{later['extra_s']:.4f} = **{later['total_s']:.4f} s**, against orbax Standard's "
                  f"{later['total_s'] * later['ratio_orbax_standard']:.4f} s "
                  f"(**{later['ratio_orbax_standard']:.1f}x**) and orbax from the store's "
                  f"{later['total_s'] * later['ratio_orbax_from_store']:.4f} s "
                  f"({later['ratio_orbax_from_store']:.1f}x), all in this run.")
    else:
        facts += " (This record predates the measurement of the cost a snapshot adds to the next updates.)"
    return command, f"{body}\n\n{facts}\n\n![checkpoint](checkpoint.png)"


def render_csd_scaling(d: dict, out: Path) -> tuple[str, str]:
    from csd_scaling import LABELS, SCHEMES, figure_table, plot  # matplotlib only when this section renders

    command = d.get("command") or "python bench/csd_scaling.py --calibrate"
    plot(d["gpus"], out / "csd_scaling.png", chart=bool(d.get("figure_11a")))
    parts = []
    for gpu, result in d["gpus"].items():
        rows = [{"devices": r["devices"],
                 **{f"{s}_s": r["step_s"][s] for s in SCHEMES},
                 **{f"{s}_x": r["speedup"][s] for s in SCHEMES if s != "baseline"}} for r in result["rows"]]
        columns = [("devices", "devices", "d")]
        for s in SCHEMES:
            columns.append((f"{s}_s", f"{LABELS[s]} step s", ".2f"))
            if s != "baseline":
                columns.append((f"{s}_x", f"{LABELS[s]} vs baseline", ".2f"))
        compress = (f"; SU+O+C's Top-K {result['compress_s']:.2f} s, {result['compress_source']}"
                    if "compress_s" in result else "")
        parts.append(f"**{gpu.upper()}** (forward + backward {result['compute_s']:.2f} s, "
                     f"{result['compute_source']}{compress}):\n\n" + md_table(rows, columns))
    checks = md_table([{**c, "holds": "yes" if c["holds"] else "**no**"} for c in d["checks"]],
                      [("gpu", "GPU", ""), ("check", "check", ""), ("value", "model", ""), ("target", "target", ""),
                       ("holds", "holds", "")])
    held = sum(c["holds"] for c in d["checks"])
    facts = (f"A {d['params'] / 1e9:.1f}B-parameter state on nsp's CSD model clock (`nsp.csd`, {d['dataflow']} "
             f"dataflow; link figures {', '.join(f'{k} {v:g}' for k, v in d['figures'].items())}). "
             f"{held} of {len(d['checks'])} shape targets hold.")
    if d["dataflow"] == "paper":
        facts += (" In the paper's dataflow each device has one buffer set (Smart-Infinity §IV-B), so its P2P "
                  "transfers, updater and, for SU+O+C, Top-K decompressor take turns, while the host's read of the "
                  "new params from its SSD fills the SSD's idle time (`nsp.csd.clock`, `in_turn`).")
    if "compress_s" in next(iter(d["gpus"].values())):
        facts += (" SU+O+C's Top-K costs the GPU time: the paper's released code fetches each fp16 gradient "
                  "back from the host and sorts all of it; `nsp.csd.paper.compress_s` charges what that measured "
                  "on an H200 (the section on Smart-Infinity's Top-K selection), carried to the paper's GPUs by "
                  "their memory bandwidths and links.")
    fig = d.get("figure_11a")
    if fig:
        counts = list(fig["rows"][0]["points"])
        table = md_table(*figure_table(fig["rows"]))
        base = [r["points"][counts[-1]] for r in fig["rows"] if r["scheme"] == "BASE"]
        parts.append("Fig. 11(a) read off the paper's chart, each scheme's speedup over the baseline on 1 device, "
                     f"model / paper (a comparison, not a target; {fig['source']}). From 1 to {counts[-1]} devices "
                     f"the model's baseline gains {min(b['model'] for b in base):.2f}-"
                     f"{max(b['model'] for b in base):.2f}x, the paper's {min(b['paper'] for b in base):.2f}-"
                     f"{max(b['paper'] for b in base):.2f}x: the model's curves rise higher, while the ratios between "
                     "schemes at one device count are what the checks compare.\n\n" + table)
    cal = d.get("calibration")
    if cal:
        med = cal["median_s"]
        facts += (f" Calibration on this machine: a {cal['params'] / 2**20:.0f}M-parameter one-shard file-tier "
                  f"update, model {med['model_s']:.3f} s vs measured {med['measured_wall_s']:.3f} s (medians of "
                  f"{cal['repeats']} rounds), model / measured {cal['ratio']:.2f}: the {cal['target']:.0%} target "
                  + ("holds." if cal["holds"] else "is **missed**."))
    else:
        facts += " This record has no calibration (`--calibrate`)."
    emu = d.get("emulator")
    if emu:
        table = md_table(emu["rows"], [("devices", "devices", "d"), ("scheme", "scheme", ""),
                                       ("predicted_s", "plan s", ".4f"), ("emulated_s", "emulated s", ".4f"),
                                       ("ratio", "plan / emulated", ".3f"), ("bottleneck", "plan's bottleneck", "")])
        held = sum(r["holds"] for r in emu["rows"])
        parts.append(f"`nsp plan` against the emulated devices (one real update on a `csd` store of N devices, "
                     f"{emu['params_per_device'] / 2**20:.0f}M params each, the same figures, nsp's dataflow): "
                     f"{held} of {len(emu['rows'])} within {emu['tolerance']:.0%}.\n\n{table}")
    return command, "\n\n".join(parts) + f"\n\n{checks}\n\n{facts}\n\n![csd scaling](csd_scaling.png)"
