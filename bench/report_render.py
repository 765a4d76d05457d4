"""The report's markdown and charts: sections 1 and 2 from the measurements this script made (report.json), the
header, section 4, and the helpers section 3 (bench/report_benches.py) shares: tables, bar charts, the provenance
line every rendered part starts with, and what stands in for a part left out as stale.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np

import deepspeed_swap
from common import table_cell
from report_traffic import (BASELINE_COLUMNS, BASELINE_TAGS, INTERNAL_COLUMNS, RATIOS, SHARED_COLUMNS,
                            baseline_rows, deepspeed_name, traffic_formulas, traffic_label, traffic_rows)
from report_train import TRAIN_COLUMNS, extra_ef_run, train_rows


# ---- tables and charts -------------------------------------------------------------------------------------------

def pyplot():
    """matplotlib, headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_bars(ax, labels: list[str], values: list[float], roof: list[bool], *, log: bool = False,
              fmt: str = "{:.3g}", fontsize: int = 8) -> None:
    """Horizontal bars on ``ax``, top to bottom, rooflines (``roof``) hatched in grey, each labelled with its value."""
    bars = ax.barh(range(len(labels)), values, color=["#bbbbbb" if r else "#3a76af" for r in roof])
    for bar, r in zip(bars, roof):
        bar.set_hatch("//" if r else "")
    ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    for i, v in enumerate(values):
        ax.text(v, i, " " + fmt.format(v), va="center", fontsize=7)


def save_figure(fig, path: Path, suptitle: str | None = None) -> None:
    """Writes ``fig`` as a PNG (with an overall title when given) and frees it."""
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def bar_chart(path: Path, labels: list[str], values: list[float], *, title: str, xlabel: str,
              roofline: set[str] = frozenset(), log: bool = False, fmt: str = "{:.3g}") -> None:
    """Horizontal bars, rooflines hatched in grey, each bar labelled with its value."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.4))
    draw_bars(ax, labels, values, [lab in roofline for lab in labels], log=log, fmt=fmt)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.15)
    save_figure(fig, path)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` holds (key, header, format) triples as for ``print_table``."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---:" if fmt else "---" for _, _, fmt in columns) + "|"]
    for row in rows:
        cells = [table_cell(row.get(key), fmt) for key, _, fmt in columns]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# Options that only say where files go: left out of the commands the report shows (they change no result).
PLACEMENT_OPTIONS = ("--dir", "--json", "--out", "--results-dir")


def shown_command(command: str) -> str:
    """``command`` without its placement options (``PLACEMENT_OPTIONS``), so it reads the same on any machine."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in PLACEMENT_OPTIONS:
            skip = True
        elif not word.startswith(tuple(o + "=" for o in PLACEMENT_OPTIONS)):
            kept.append(word)
    return shlex.join(kept)


# ---- provenance: what every rendered part starts with ------------------------------------------------------------

def machine_line(machine: dict) -> str:
    """'<cpu>, <n> cores (<m> usable), <RAM>, kernels <isa>' from a record's machine description."""
    parts = [str(machine.get("cpu", "?"))]
    cores, usable = machine.get("cores"), machine.get("cpus_usable")
    parts.append(f"{cores} cores" + (f" ({usable} usable)" if usable not in (None, cores) else ""))
    if machine.get("ram_bytes"):
        parts.append(f"{machine['ram_bytes'] / 2**30:.1f} GiB RAM")
    if machine.get("kernel_isa"):
        parts.append(f"kernels {machine['kernel_isa']}")
    if machine.get("flags") is not None:
        parts.append("flags " + (" ".join(machine["flags"]) or "none of note"))
    return ", ".join(parts)


def provenance_line(verdict: dict, machine: dict | None, when: str | None) -> str:
    """The line every rendered part starts with: its record, commit, date and machine, and whether it is fresh."""
    what = f"Record `{verdict['file']}`" if verdict.get("file") else "Measured by this script"
    if verdict.get("in_commit"):
        what += f" (committed in `{verdict['in_commit']}`, blob `{(verdict.get('blob') or '?')[:12]}`)"
    commit = verdict.get("commit")
    at = (f"commit `{commit[:12]}` ({(verdict.get('commit_time') or '?')[:10]})" if commit
          else "no recorded commit")
    line = f"{what}: measured {when or '?'} at {at}"
    if machine:
        line += f", on {machine_line(machine)}"
    if verdict["fresh"]:
        return line + ". Fresh: the code it measures is unchanged since."
    return f"**STALE**: {'; '.join(verdict['reasons'])}.\n\n{line}."


def left_out(title: str, verdict: dict, refresh: str) -> str:
    """What stands in the report for a stale part when --allow-stale is not given."""
    where = f"`{verdict['file']}`" if verdict.get("file") else "this measurement"
    commit = verdict.get("commit")
    return (f"{title}\n\n**Left out, stale**: {where}"
            + (f" (measured at commit `{commit[:12]}`)" if commit else "") + f": {'; '.join(verdict['reasons'])}. "
            f"Refresh it with `{refresh}` at the current commit"
            + (", commit the record," if verdict.get("file") else "")
            + " and rerun this report (`--allow-stale` renders it marked instead).\n")


# ---- plots of sections 1 and 2 -----------------------------------------------------------------------------------

def plot_traffic(traffic: dict, shared: list[dict], internal: list[dict], M: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    shared = [r for r in shared if r.get("total") is not None]  # not the baseline rows DeepSpeed could not run
    labels = [traffic_label(r["key"], traffic, short=True) for r in shared]
    y = np.arange(len(shared))
    axes[0].barh(y, [r["total"] / M for r in shared], color="#3a76af", label="measured")
    axes[0].scatter([r["formula_total"] / M for r in shared], y, marker="D", color="black", zorder=3,
                    label="formula", s=18)
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("shared-link bytes per step / M")
    axes[0].legend(fontsize=7)
    axes[0].set_title("shared link (host <-> store)", fontsize=9)
    nsp_rows = [r for r in internal if r["read"] is not None]
    yi = np.arange(len(nsp_rows))
    axes[1].barh(yi - 0.2, [r["read"] / M for r in nsp_rows], 0.4, label="pages read", color="#3a76af")
    axes[1].barh(yi + 0.2, [r["write"] / M for r in nsp_rows], 0.4, label="pages written", color="#e0873a")
    axes[1].set_yticks(yi, [traffic_label(r["key"], traffic, short=True) for r in nsp_rows], fontsize=7)
    axes[1].invert_yaxis()
    axes[1].set_xlabel("internal bytes per step / M")
    axes[1].legend(fontsize=7)
    axes[1].set_title("store internal link", fontsize=9)
    save_figure(fig, path)


def plot_loss_curves(train: dict, path: Path) -> int:
    """Training loss vs step for every run (moving average); returns the averaging window."""
    plt = pyplot()
    steps = train["config"]["steps"]
    window = max(1, steps // 50)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    cmap = plt.get_cmap("viridis")
    for r in train["runs"]:
        losses = np.asarray(r["losses"])
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        x = np.arange(window, len(losses) + 1)
        if r["ratio"] is None:
            style = {"color": "black" if r["kind"] == "optax" else "#d62728",
                     "linestyle": "-" if r["kind"] == "optax" else ":", "linewidth": 1.6}
        else:
            shade = cmap(RATIOS.index(r["ratio"]) / (len(RATIOS) - 1) * 0.85)
            style = {"color": shade, "linewidth": 1.0,
                     "linestyle": "-." if extra_ef_run(r, train["runs"]) else "-" if r["error_feedback"] else "--"}
        ax.plot(x, smooth, label=r["name"], **style)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {window})" if window > 1 else "training loss")
    ax.set_title(f"{train['config']['model']} GPT, batch {train['config']['batch']} x {train['config']['seq']} "
                 f"tokens, seed {train['config']['seed']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return window


def plot_loss_vs_ratio(train: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for ef, style in ((True, "-o"), (False, "--s")):
        pts = sorted((r["ratio"], r["held_out_loss"]) for r in train["runs"]
                     if r["error_feedback"] is ef and not extra_ef_run(r, train["runs"]))
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], style,
                label="Top-K + error feedback" if ef else "Top-K, no error feedback")
    for r, marker in zip([r for r in train["runs"] if extra_ef_run(r, train["runs"])], "^vD<>"):
        ax.plot([r["ratio"] * 100], [r["held_out_loss"]], marker, color="gray",
                label=r["name"].removeprefix("nsp "))
    for r, color in zip(train["runs"][:2], ("black", "#d62728")):
        ax.axhline(r["held_out_loss"], color=color, linestyle=":", linewidth=1, label=r["name"])
    ax.set_xscale("log")
    ax.set_xticks([c * 100 for c in RATIOS], [f"{c:.0%}" for c in RATIOS])
    ax.set_xlabel("gradient entries kept")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    save_figure(fig, path)


# ---- the report --------------------------------------------------------------------------------------------------

def section_header(measurements: dict) -> str:
    m = measurements["machine"]
    v = measurements["versions"]
    verdicts = measurements.get("provenance", {})
    render_git = measurements.get("rendered_at", {})
    fresh = [k for k, x in verdicts.items() if x["fresh"]]
    stale = [k for k, x in verdicts.items() if not x["fresh"]]
    t_seed, s_seed = measurements["traffic"]["seed"], measurements["train"]["config"]["seed"]
    lines = [
        "# nsp results",
        "",
        f"Generated {measurements['generated']} by `{shown_command(measurements['command'])}` in "
        f"{measurements['elapsed_s'] / 60:.1f} min"
        + (" (section 2 is a `--quick` smoke run: few training steps, not for conclusions)."
           if measurements["train"].get("quick") else ".")
        + (f" Re-rendered {measurements['rerendered']} (section 3 read again from `bench/results/`)."
           if measurements.get("rerendered") else ""),
        "Regenerate with `python bench/report.py` (options: `--help`). Every number below comes from a measurement "
        "made by that script (raw values in [`report.json`](report.json)) or from a benchmark's JSON record in "
        "`bench/results/`, committed to git. Each part names its record, the commit it was measured at and the "
        "machine; a part whose code changed after that commit is stale and "
        + ("rendered marked **STALE** (`--allow-stale`)." if measurements.get("allow_stale") else
           "left out, with the reason.")
        + f" Rendered at commit `{(render_git.get('commit') or '?')[:12]}` (`{render_git.get('describe')}`"
        + (f"; {render_git.get('dirty_count')} tracked files with uncommitted changes" if render_git.get("dirty")
           else "; no uncommitted changes") + "): "
        + (f"{len(fresh)} of {len(verdicts)} parts fresh" + (f", stale: {', '.join(stale)}." if stale else ".")),
        "",
        "## Machine and versions",
        "",
        md_table([{"k": "CPU", "v": m["cpu"]}, {"k": "cores", "v": str(m["cores"])}]
                 + [{"k": k, "v": v} for k, v in (
                     ("SIMD flags", " ".join(m["flags"]) if m.get("flags") is not None else None),
                     ("RAM", f"{m['ram_bytes'] / 2**30:.1f} GiB" if m.get("ram_bytes") else None)) if v]
                 + [{"k": "platform", "v": m["platform"]}, {"k": "python", "v": m["python"]},
                  {"k": "nsp kernel ISA / threads", "v": f"{measurements['isa']} / {measurements['threads']}"},
                  {"k": "JAX devices", "v": measurements["devices"]},
                  {"k": "environment", "v": measurements["env"] or "(no NSP_* / XLA_* variables set)"}],
                 [("k", "machine", ""), ("v", "", "")]),
        "",
        md_table([{"lib": k, "ver": val} for k, val in v.items()], [("lib", "library", ""), ("ver", "version", "")]),
        "",
        f"Seeds (`--seed`): section 1's params and gradients come from `np.random.default_rng({t_seed})`; section 2 "
        f"initialises the GPT with `nnx.Rngs({s_seed})` and draws its training batches with `Batcher(seed={s_seed})` "
        f"and its held-out batches with `Batcher(seed={s_seed + 1})`. Nothing else is random. The benchmarks of "
        "section 3 seed their own inputs (see each script).",
        "",
    ]
    return "\n".join(lines)


def baseline_text(traffic: dict) -> tuple[str, str]:
    """(where the baseline rows come from, what their bytes hold against the formula and the OS's counts)."""
    M = 2 * traffic["params"]
    rows = {k: m for k, m in traffic["measured"].items() if k.startswith("baseline")}
    ds = deepspeed_name(traffic)
    if ds is None:
        return ("The baseline rows of this (older) record were modelled with nsp's own engine: whole-state reads "
                "and writes of the store's page files, Adam on the host, not DeepSpeed's swapper.", "")
    missing = {k: m["unavailable"] for k, m in rows.items() if "unavailable" in m}
    measured = {k: m for k, m in rows.items() if "unavailable" not in m}
    info = traffic["deepspeed"]
    parts = []
    if missing:
        parts.append("**The baseline rows " + ", ".join(BASELINE_TAGS[k] for k in missing) + " are left out**: "
                     + "; ".join(sorted(set(missing.values())))
                     + ". Nothing stands in for them (no model of the baseline with nsp's own engine). "
                     f"Install DeepSpeed with `{info.get('install', deepspeed_swap.INSTALL_HINT)}` to measure them.")
    if not measured:
        return " ".join(parts), ""
    d = next(iter(measured.values()))["deepspeed"]
    aio = d["aio"]
    sub = info.get("sub_group_size_default")
    parts.insert(0, (
        f"The baseline rows are {ds}'s optimizer swap (ZeRO-Infinity's `offload_optimizer: {{device: nvme}}`), driven "
        "through DeepSpeed's own ops by `bench/deepspeed_swap.py` and measured on a real step, in the "
        f"{d['arrangement']} arrangement: {d['aio_handles']} aio handle (DeepSpeed's default aio settings: "
        f"block_size {aio['block_size']:,}, queue_depth {aio['queue_depth']}, intra_op_parallelism "
        f"{aio['intra_op_parallelism']}, single_submit {aio['single_submit']}, overlap_events "
        f"{aio['overlap_events']}), sub_group_size {sub:.0e} (its default), so "
        + (f"one sub-group of all {d['sub_group_numel']:,} params;" if d["sub_groups"] == 1 else
           f"{d['sub_groups']} sub-groups of up to {d['sub_group_numel']:,} params;")
        + " per sub-group p, m, v swapped in (`async_pread` into page-locked buffers, "
        f"`wait`), {d['optimizer']} on them, swapped out (`async_pwrite`, `wait`). Its swap files are its own (one "
        "per tensor and sub-group, opened O_DIRECT by the aio op, not fsynced, as DeepSpeed's swapper does not "
        "sync), in the same temporary folder as the nsp stores. Serial, not pipelined: the pipelined arrangement "
        "overlaps the same reads and writes, so Table I's bytes are the same, and serial is the simpler one to "
        "count. Row (a) copies the gradient from host memory into the pinned gradient buffer at swap-in (as ZeRO "
        "hands over an unswapped gradient partition); row (a') first swaps it out to each sub-group's gradient file "
        "through the same aio handle and reads it back with the sub-group's state (ZeRO-Infinity's gradient offload "
        "to NVMe). \"to store\" / \"from store\" of these rows are the swapper's own counters (`bytes_written` / "
        "`bytes_read`, added up at each of its aio calls) over the second step; the first sets up DeepSpeedCPUAdam's "
        "state. After the two steps the params in its swap files have moved from p0 by float64 Adam's update to a "
        "relative error of " + ", ".join(f"{m['update_rel_err']:.2g} in row {BASELINE_TAGS[k]}"
                                         for k, m in measured.items()) + "."))

    notes = []
    for key, m in measured.items():
        tag = BASELINE_TAGS[key]
        pad = m["swapped_numel"] - m["numel"]
        f = traffic_formulas(traffic["params"])["baseline"]
        gap_to, gap_from = m["to_store"] - f["to_store"], m["from_store"] - f["from_store"]
        what = (f"Row {tag} moves p, m, v ({m['state_read']:,} B read, {m['state_written']:,} B written = "
                f"{m['state_read'] / M:.4g} M / {m['state_written'] / M:.4g} M)")
        if m["grad_read"] or m["grad_written"]:
            what += (f" and the gradient ({m['grad_written']:,} B written before the step, {m['grad_read']:,} B "
                     f"read back = {m['grad_written'] / M:.4g} M / {m['grad_read'] / M:.4g} M)")
        else:
            what += ", not the gradient, which stays in host memory"
        what += (f": {float(gap_to) / M:+.4g} M to the store and {float(gap_from) / M:+.4g} M from it against the "
                 "formula" if gap_to or gap_from else ": the formula's bytes exactly")
        if not (m["grad_read"] or m["grad_written"]):
            what += (", which also counts ZeRO-Infinity's gradient round trip through storage (2M written by the "
                     "backward, 2M read by the optimizer), the part row (a') adds")
        notes.append(what + ".")
        if pad:
            notes.append(f"DeepSpeed pads every swapped tensor to a multiple of AIO_ALIGNED_BYTES x "
                         f"intra_op_parallelism: row {tag} swaps {m['swapped_numel']:,} entries per tensor for N = "
                         f"{m['numel']:,}, {pad * 4:,} bytes of padding per tensor and direction, counted in its "
                         "bytes and not in the formula.")
    if all(m["swapped_numel"] == m["numel"] for m in measured.values()):
        notes.append("N is a whole number of DeepSpeed's aio alignment (AIO_ALIGNED_BYTES x intra_op_parallelism), "
                     "so its swap files carry no padding.")
    extra = [(BASELINE_TAGS[k], m["os_storage_read"] - m["from_store"],
              m["os_storage_written"] - m["to_store"]) for k, m in measured.items()]
    odd = [f"row {t}: {r:+,} B read, {w:+,} B written" for t, r, w in extra if r or w]
    check = (
        "**Baseline bytes, counted three ways** (the second step): the swapper's own counters; the bytes of the "
        "tensors its aio handle was handed, split by swap file (`CountedAio` in `bench/report_traffic.py`: the p, m, v "
        "files and the gradient files; \"calls = counters\" checks that they add up to the counters); and the OS's "
        "counts from `/proc/self/io` over the step. DeepSpeed's aio submits its reads and writes with io_submit on "
        "files opened O_DIRECT: they pass through no read or write system call, so rchar / wchar do not count them "
        "(what those columns show is the process's other system-call I/O in the step, less rchar's own probe of "
        "/proc/self/io); the block-layer counts (read_bytes / write_bytes: what the process fetched from and sent "
        "to the block device, which O_DIRECT I/O reaches without the page cache) do, and the next column is what "
        "they hold beyond the swapper's counters"
        + (" (" + "; ".join(odd) + ": block-layer I/O the kernel charged to this process during the step beyond "
           "the bytes handed to the swapper's aio calls)" if odd else
           ": nothing, to the byte")
        + ". Last column: the params' change in the swap files over the two steps against float64 Adam's.")
    return " ".join(parts), " ".join(notes) + "\n\n" + check + "\n\n" + md_table(baseline_rows(traffic),
                                                                                 BASELINE_COLUMNS)


def section_traffic(traffic: dict, out: Path, provenance: str) -> str:
    shared, internal = traffic_rows(traffic)
    n = traffic["params"]
    M = 2 * n
    dense = traffic["measured"]["dense"]
    plot_traffic(traffic, shared, internal, M, out / "traffic.png")
    baseline_where, baseline_bytes = baseline_text(traffic)
    return "\n".join([
        "## 1. Traffic per optimizer step (Smart-Infinity Table I)",
        "",
        provenance,
        "",
        f"Command: `{shown_command(traffic['command'])}` (measured {traffic.get('time', '?')})",
        "",
        f"N = {n:,} fp32 params (one flat vector `{{\"w\": float32[{n}]}}`); M = 2N = {M:,} bytes (the model in 16-bit "
        f"bytes), fp32 transport = 2M per tensor. One file-tier store shard with pages of "
        f"{traffic['page_bytes']:,} bytes: {dense['pages_per_state']} whole pages per state and no padding "
        f"(the store's padded vector holds {dense['padded_total']:,} entries = N). Adam (p, m, v). Each row is "
        "the second step on a fresh store (the first compiles or builds buffers); seed "
        f"{traffic['seed']}.",
        "",
        "Where the numbers come from: nsp rows are `store.stats()` of a store opened with `nsp.storage.open(..., "
        "tier=\"file\")` and stepped through a jitted `nsp.optim.adam(..., store=store)` (Top-K rows: "
        "`compression=nsp.optim.TopK(c)`). \"to store\" is gradients (and, for the baseline, state) going in; "
        "\"from store\" is params (and state) coming out.",
        "",
        baseline_where,
        "",
        "Formulas: baseline 6M state read + 6M state written + 2M gradients written + 2M gradients read = 16M; "
        "SmartUpdate 2M gradients in + 2M params out; SmartComp at ratio c: c x N x (4 + 4) bytes in (fp32 value + "
        "int32 index per kept entry) + 2M params out.",
        "",
        "**Shared link** (bytes per step):",
        "",
        md_table(shared, SHARED_COLUMNS),
        "",
        *([baseline_bytes, ""] if baseline_bytes else []),
        "**Store internal link** (pages read and written inside the store, bytes per step), with the OS's count of "
        "the bytes this process's read and write system calls moved during the step (`/proc/self/io` rchar / "
        "wchar, less what reading that file adds). The OS figures are an independent check of the counters; the "
        "last column is what the system calls moved beyond them: each page file's 4-byte CRC-32C trailer and, in "
        "writes, the shard manifest a commit rewrites. The baseline has no row here: DeepSpeed's swapper updates "
        "on the host, so everything it moves crosses the shared link (its OS check is the table above).",
        "",
        md_table(internal, INTERNAL_COLUMNS),
        "",
        "Formula: near-storage update reads 3 states x 4 B/param and writes 3 x 4 B/param = 6M each way.",
        "",
        "![traffic](traffic.png)",
        "",
    ])


def section_training(train: dict, out: Path, provenance: str) -> str:
    cfg = train["config"]
    window = plot_loss_curves(train, out / "loss_curves.png")
    plot_loss_vs_ratio(train, out / "loss_vs_ratio.png")
    rows = train_rows(train)
    err = train["dense_rel_err"]
    checkpoints = sorted({1, 10, 100, len(err)} & set(range(1, len(err) + 1)))
    data = train["data"]
    ok = train["dense_rel_err_max"] <= 1e-5
    first_above = next((i + 1 for i, e in enumerate(err) if e > 1e-5), None)
    return "\n".join([
        "## 2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16)",
        "",
        provenance,
        "",
        f"Command: `{shown_command(train['command'])}` (measured {train.get('time', '?')}; training took "
        f"{train['wall_s'] / 60:.1f} min of it)",
        "",
        f"Model `{cfg['model']}` ({train['model_params']:,} params), byte-level, trained for {cfg['steps']} steps of "
        f"{cfg['batch']} x {cfg['seq']} tokens on {data['source']} ({data['tokens']:,} tokens; the last 5% held "
        f"out), batches `Batcher(seed={cfg['seed']})`. Every run: `optax.clip_by_global_norm({cfg['clip']:g})`, then "
        f"AdamW (b1 {cfg['b1']:g}, b2 {cfg['b2']:g}, weight decay {cfg['weight_decay']:g}) with `nsp train`'s "
        f"schedule (linear warm-up over {min(cfg['warmup_steps'], cfg['steps'])} steps to {cfg['lr']:g}, cosine "
        f"decay to {cfg['lr'] * cfg['min_lr_ratio']:g}), except a run whose name gives its own b1, b2 and peak (the "
        "moment decays recommended for Top-K near 1%, `nsp.optim.TOPK_ADAM_BETAS`, and a higher peak learning "
        "rate). nsp runs keep their state in a memory-tier store; Top-K "
        "runs compress the clipped gradient with `nsp.optim.TopK(c, error_feedback=..., residual_decay=..., "
        "lazy=...)`: with error feedback the unsent remainder is scaled by `residual_decay` each step (the table's "
        "error-feedback column; 1 is classic error feedback, nsp's default); a lazy store update moves only the "
        "entries sent that step, a dense one runs AdamW on the whole decompressed gradient (the store-update "
        "column; dense is nsp's default). All runs advance in "
        "lockstep on the same batches; each step is timed to completion (the store's update included), and the "
        f"step time is the median over steps 2..{cfg['steps']} (step 1 compiles). Held-out loss: the mean over "
        f"{cfg['eval_batches']} fixed held-out batches (`Batcher(seed={cfg['seed'] + 1})`); before training it is "
        f"{train['start_held_out_loss']:.4f}.",
        "",
        f"**nsp dense vs optax.adamw**: max relative param difference ||p_nsp - p_optax|| / ||p_optax|| over all "
        f"{len(err)} steps = **{train['dense_rel_err_max']:.3g}** "
        f"({'within' if ok else 'above'} the 1e-5 that tests/test_optim.py allows over 50 steps); at steps "
        + ", ".join(f"{s}: {err[s - 1]:.3g}" for s in checkpoints) + "."
        + ("" if first_above is None else f" It first exceeds 1e-5 at step {first_above}: float32 rounding "
           "differences (the kernel's fused arithmetic vs XLA's) that training amplifies step after step."),
        "",
        md_table(rows, TRAIN_COLUMNS),
        "",
        "![loss curves](loss_curves.png)\n\nTraining loss per step"
        + (f" (moving average over {window} steps)" if window > 1 else "") + ", every run.",
        "",
        "![held-out loss vs ratio](loss_vs_ratio.png)",
        "",
    ])


def section_csd() -> str:
    return "\n".join([
        "## 4. Scaling from the CSD emulator",
        "",
        "`tier=\"csd\"` runs each store shard on an emulated computational-storage device "
        "(`libnsp_backend_csd.so`): the shard's pages in a directory of its own, a worker of its own and the real "
        "kernel, with time kept on a model clock that charges every page to the device's SSD, its updater and the "
        "host link all devices share (`ffi/backends/csd/csd_clock.h`). On one machine every emulated device still "
        "reads and writes the same disk with the same two cores, so the wall time of N of them measures that one disk, not "
        "N devices, and no wall-clock scaling plot is drawn. The scaling is read off the devices' model clocks "
        "instead: section 3's \"N computational-storage devices\" part holds the model's Fig. 11(a) table and "
        "`nsp plan` against one real update on 1, 2, 4 and 10 emulated devices (`bench/csd_scaling.py "
        "--calibrate`).",
        "",
    ])


SECTION_TITLES = {"traffic": "## 1. Traffic per optimizer step (Smart-Infinity Table I)",
                  "train": "## 2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16)"}


def render_report(measurements: dict, benches: str, out: Path) -> Path:
    """Writes ``out``/REPORT.md and the plots of sections 1 and 2 from ``measurements`` (report.json's content);
    ``benches`` is section 3, rendered from the benchmarks' records (``report_benches.render_benches``)."""
    out.mkdir(parents=True, exist_ok=True)
    allow_stale = bool(measurements.get("allow_stale"))
    verdicts = measurements["provenance"]
    parts = [section_header(measurements)]
    for key, section in (("traffic", section_traffic), ("train", section_training)):
        verdict = verdicts[key]
        if verdict["fresh"] or allow_stale:
            parts.append(section(measurements[key], out,
                                 provenance_line(verdict, measurements["machine"], measurements[key].get("time"))))
        else:
            parts.append(left_out(SECTION_TITLES[key], verdict, "python bench/report.py"))
    parts.append(benches)
    parts.append(section_csd())
    path = out / "REPORT.md"
    path.write_text("\n".join(parts).rstrip() + "\n")
    return path
