"""Section 3 of the report: each benchmark's JSON record in bench/results/ rendered as a table, its facts and a
chart, under the line that names the record, its commit and machine (``BENCHES`` lists them, each with its title,
its default command and its renderer). Renderers read a record tolerantly: a record of an older layout renders
what it has, or is named unreadable with the command that regenerates it. The store's benchmarks (update kernel,
store update, checkpoint, CSD scaling) are rendered by bench/report_store_benches.py, the others here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common import REPO
from report_render import (PLACEMENT_OPTIONS, bar_chart, draw_bars, left_out, md_table, provenance_line, pyplot,
                           save_figure, shown_command)
from report_store_benches import render_checkpoint, render_csd_scaling, render_store_update, render_update_kernel


def bench_header(record: dict, command: str, exact_command: bool, verdict: dict) -> str:
    """The record's provenance line (file, commit, date, machine, fresh or STALE) and the command that made it."""
    how = "Produced by" if exact_command else "Command (rebuilt from the parameters the JSON records)"
    return (provenance_line(verdict, record.get("machine"), record.get("time")) + "\n"
            + f"{how}: `{shown_command(command)}`")


def _yes_no(value) -> str | None:
    return None if value is None else value if isinstance(value, str) else ("yes" if value else "NO")


def render_topk(d: dict, out: Path) -> tuple[str, str]:
    command = f"python bench/topk.py --size {d['size']} --ratio {d['ratio']:g} --repeats {d['repeats']}"
    return _render_topk(d, out, "topk.png", command, ".1f")


def render_topk_gpu(d: dict, out: Path) -> tuple[str, str]:
    command = (f"python bench/topk.py --size {d['size']} --ratio {d['ratio']:g} --repeats {d['repeats']} "
               f"--json bench/results/topk_gpu_{d['size']}.json  # on a GPU machine")
    command, body = _render_topk(d, out, "topk_gpu.png", command, ".2f")
    auto = (f"On {d.get('device_kind', 'the GPU')} \"nsp auto\" (what a user gets by default) ran the "
            f"{d.get('auto_path', '?')} path: {d['auto_speedup_min']:.2f}x lax.top_k at worst over the easy inputs"
            + (f", {d['auto_speedup_min_hard']:.2f}x over the hard ones" if "auto_speedup_min_hard" in d else "")
            + ". Off the CPU \"auto\" takes the threshold path only from 64M entries on "
            "(`nsp.primitives.topk.ACCELERATOR_THRESHOLD_MIN_SIZE`). The threshold path against the exact one on the "
            "easy inputs, size by size (`bench/results/topk_gpu_<N>.json`, the worse easy input; these records are not "
            "judged here): " + ", ".join(_threshold_vs_exact(r) for r in _topk_gpu_records()) + ". The machine "
            "line names the GPU machine's CPU; the GPU did the work.")
    return command, body + "\n\n" + auto


def _topk_gpu_records() -> list[dict]:
    """Every bench/results/topk_gpu_<N>.json, by size."""
    paths = (REPO / "bench" / "results").glob("topk_gpu_*.json")
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda d: d["size"])


def _threshold_vs_exact(d: dict) -> str:
    """"64M 1.67x (at <commit>)": the exact path's time over the threshold path's, on the easy input where that
    ratio is least."""
    ms = {(r["input"], r["method"]): r["median_ms"] for r in d["rows"] if not r["hard"]}
    easy = {i for i, _ in ms}
    ratio = min(ms[(i, "nsp exact")] / ms[(i, "nsp threshold")] for i in easy)
    return f"{d['size'] // 2**20}M {ratio:.2f}x (at `{(d['git'].get('commit') or '?')[:7]}`)"


def render_smartcomp_topk(d: dict, out: Path) -> tuple[str, str]:  # noqa: ARG001  (no figure)
    from nsp.csd import paper

    command = "python bench/smartcomp_topk.py  # on a GPU machine"
    rows = [{**r, "upload_ms": 1e3 * r["upload_s"], "select_ms": 1e3 * r["select_s"],
             "download_ms": 1e3 * r["download_s"]} for r in d["rows"]]
    table = md_table(rows, [("elements", "sub-group elements", ","), ("k", "k", ","),
                            ("upload_ms", "upload ms", ".2f"), ("upload_gbps", "upload GB/s", ".1f"),
                            ("select_ms", "select ms", ".2f"), ("select_gelem_per_s", "select G elem/s", ".2f"),
                            ("download_ms", "download ms", ".3f")])
    carried = ", ".join(f"{gpu.upper()} {paper.compress_s(gpu, paper.GPT2_4B_PARAMS):.2f} s"
                        for gpu in paper.MEMORY_GBPS)
    facts = (f"Smart-Infinity's released code selects SU+O+C's Top-K on the GPU: it uploads each fp16 gradient "
             f"sub-group from the host's page-locked swap buffer, sorts all of it by magnitude (`abs().sort()`), "
             f"gathers the top {d['density']:.0%} and sends the values and int32 positions back. Timed here on "
             f"{d['gpu']['name']} (torch {d['gpu'].get('torch')}), median of {d['repeats']}; the GPU's memory copied "
             f"at {d['memory_copy_gbps']:.0f} GB/s (read + written) and its page-locked upload ran at "
             f"{d['host_link_upload_gbps']:.1f} GB/s. `nsp.csd.paper.compress_s` carries the selection rate at "
             f"{d['select_elements']:,} elements ({d['select_gelem_per_s']:.2f} G elem/s) to the paper's GPUs by "
             f"their memory bandwidths, and the link at the same share of its peak: per step of the 4.0B model "
             f"of Fig. 11, {carried} (the CSD scaling section's SU+O+C pays them).")
    return command, table + "\n\n" + facts


def _render_topk(d: dict, out: Path, png: str, command: str, ms_format: str) -> tuple[str, str]:
    inputs = list(dict.fromkeys(r["input"] for r in d["rows"]))
    hard = [i for i in inputs if any(r.get("hard") for r in d["rows"] if r["input"] == i)]
    if not hard:
        command += " --easy-only" if "inputs" in d else ""
    cols = min(3, len(inputs))
    grid = -(-len(inputs) // cols)
    plt = pyplot()
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 3 * grid), squeeze=False)
    for ax, inp in zip(axes.flat, inputs):
        rows = [r for r in d["rows"] if r["input"] == inp]
        roof = [r["method"].startswith("roofline") for r in rows]
        draw_bars(ax, [r["method"] for r in rows], [r["median_ms"] for r in rows], roof, log=True,
                  fmt="{:.3g} ms")
        ax.set_title(f"{inp}{' (hard)' if inp in hard else ''}: median ms (log; lower is better)", fontsize=9)
        ax.margins(x=0.3)
    for ax in list(axes.flat)[len(inputs):]:
        ax.axis("off")
    where = f" on {d['device_kind']}" if d.get("platform", "cpu") != "cpu" else ""
    save_figure(fig, out / png,
                f"Top-K {d['ratio']:.0%} of {d['size']:,} entries (k = {d['k']:,}){where}, median of {d['repeats']} "
                f"({d['time']})")
    rows = [{**r, "input": r["input"] + (" (hard)" if r.get("hard") else ""), "correct": _yes_no(r.get("correct")),
             "fallback": _yes_no(r.get("fallback"))} for r in d["rows"]]
    columns = [("input", "input", ""), ("method", "method", ""), ("median_ms", "median ms", ms_format),
               ("speedup", "vs lax.top_k", ".2f"), ("l2_mass_pct", "L2 mass kept %", ".2f")]
    if any("correct" in r for r in d["rows"]):
        columns += [("correct", "correct", ""), ("fallback", "threshold fell back", "")]
    body = md_table(rows, columns)
    notes = []
    if hard:
        notes.append("Hard inputs (`bench/topk.py`'s docstring): many entries share the k-th largest magnitude, so "
                     "no sampled threshold passes between k and 2k candidates; the threshold method then runs "
                     "its exact fallback after the threshold pass (\"threshold fell back\": its candidate count "
                     "missed). \"correct\": the output checked against numpy (k distinct ascending indices, the "
                     "values at them, every kept magnitude at least the k-th largest and every larger one kept). "
                     f"Threshold method, worst over the easy inputs: {d['threshold_speedup_min']:.2f}x lax.top_k; "
                     f"over the hard ones: {d.get('threshold_speedup_min_hard', float('nan')):.2f}x.")
    return command, body + "".join(f"\n\n{n}" for n in notes) + f"\n\n![top-k]({png})"


def render_train_step(d: dict, out: Path) -> tuple[str, str]:
    models = d["models"]
    first = next(iter(models.values()))
    repeats = len(next(iter(first["times_s"].values())))
    command = "python bench/train_step.py" + ("" if "gpt2-124m" in models else " --quick")
    command += f" --repeats {repeats}" if repeats != 5 else ""
    split = bool(d.get("engine_cpus"))
    command += f" --engine-cpus {len(d['engine_cpus'])}" if split else ""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3), squeeze=False)
    parts = []
    for ax, (model, m) in zip(axes[0], models.items()):
        rows = m["rows"]
        ax.barh(range(len(rows)), [r["ms"] for r in rows], color="#3a76af")
        ax.set_yticks(range(len(rows)), [r["contender"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(r["ms"], i, f" {r['ms']:.3g}", va="center", fontsize=7)
        ax.set_title(f"{model} ({m['params'] / 1e6:.2f}M params): ms per step", fontsize=9)
        ax.margins(x=0.2)
        steady = m.get("staleness_hidden_fraction_steady")
        hides = (f"{steady:.0%} of the file tier's update in steady state, "
                 f"{m.get('staleness_hidden_fraction', float('nan')):.0%} counting each call's final drain"
                 if steady is not None else
                 f"{m.get('staleness_hidden_fraction', float('nan')):.0%} of the file tier's update")
        all_cores = [("ratio_all", "x optax all CPUs", ".2f")] if any("ratio_all" in r for r in rows) else []
        parts.append(f"**{model}** ({m['params']:,} params; staleness 1 hides {hides})\n\n"
                     + md_table(rows, [("contender", "contender", ""), ("ms", "step ms", ".1f"),
                                       ("ratio", "x optax", ".2f"), *all_cores, ("update_ms", "update ms", ".1f"),
                                       ("wait_ms", "wait ms", ".1f"), ("in", "link in B/step", ",.0f"),
                                       ("table1_in", "Table I in", ",.0f"),
                                       ("out", "link out B/step", ",.0f"), ("table1_out", "Table I out", ",.0f")]))
    parts.append("*update ms*: a step's update, start to commit (in the background for staleness 1); *wait ms*: how "
                 "long a staleness-1 step held its caller (the previous update's tail and the copies of gradient and "
                 "params); the rest of what staleness 1 does not hide is the forward/backward slowed by the update "
                 "running beside it.")
    name = "train_step_split" if split else "train_step"
    save_figure(fig, out / f"{name}.png", f"GPT train step (median of {repeats}; {d['time']})")
    if split:
        everywhere = d.get("optax_all_cpus")
        parts.insert(0, f"The update ran on CPUs {d['engine_cpus']} (`NSP_ENGINE_CPUS`), every forward/backward on "
                        f"CPUs {d['compute_cpus']}: a stand-in for a host whose forward/backward runs on an "
                        f"accelerator, so that a staleness-1 update competes with it for memory and caches, not "
                        f"for cores. Step times are those of fewer cores than the run above. "
                        + (f"The nsp contenders use CPUs {everywhere} in all, the pinned optax only "
                           f"{d['compute_cpus']}; so optax also ran on all of {everywhere}, in a process of its own "
                           "driven round by round in the same interleaved rounds (the row \"all N CPUs\"): "
                           "\"x optax all CPUs\" compares every contender with it at equal cores, beside the pinned "
                           "run's \"x optax\"." if everywhere else
                           "(This record has no optax run on all the CPUs; rerun the command to add it.)"))
    return command, "\n\n".join(parts) + f"\n\n![train step]({name}.png)"


def render_max_model(d: dict, out: Path) -> tuple[str, str]:
    command = f"python bench/max_model.py --cap-gib {d['cap_gib']:g} --width {d['width']} --seq {d['seq']}"
    rows = d["rows"]
    bar_chart(out / "max_model.png", [r["contender"] for r in rows], [r["params_m"] for r in rows],
              title=f"largest GPT (width {d['width']}) that trains under {d['cap_gib']:g} GiB of address space "
                    f"({d['time']})", xlabel="params (M; higher is better)", fmt="{:.1f} M")
    body = md_table(rows, [("contender", "contender", ""), ("layers", "layers", "d"), ("params_m", "params (M)", ".1f"),
                           ("ratio", "vs optax", ".2f"), ("peak_rss_gib", "peak RSS GiB", ".2f"),
                           ("step_s", "step s", ".1f")])
    return command, f"{body}\n\n![max model](max_model.png)"


def render_fault_campaign(d: dict, out: Path) -> tuple[str, str]:
    trials = d["trials"]
    one_slot = d.get("slots", 2) == 1
    command = (f"python bench/fault_campaign.py --trials {len(trials)} --steps {d['steps']} --seed {d['seed']}"
               + (" --slots 1 --json bench/results/fault_campaign_oneslot.json" if one_slot else ""))
    figure = "fault_campaign_oneslot.png" if one_slot else "fault_campaign.png"
    modes = list(dict.fromkeys(t["mode"] for t in trials))
    rows = []
    for mode in modes:
        ts = [t for t in trials if t["mode"] == mode]
        rows.append({"mode": mode, "trials": len(ts), "killed": sum(t["killed"] for t in ts),
                     "identical": sum(t["bit_identical"] for t in ts), "corrupt": sum(t["corrupt"] for t in ts),
                     "lost": max(t["lost_steps"] for t in ts)})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["trials"] for r in rows], 0.4, label="trials", color="#bbbbbb")
    ax.bar(x + 0.2, [r["identical"] for r in rows], 0.4, label="bit-identical after resume", color="#3a76af")
    ax.set_xticks(x, [r["mode"] for r in rows])
    ax.legend(fontsize=8)
    ax.set_title(f"fault campaign{', one-slot stores' if one_slot else ''}: {len(trials)} SIGKILLed runs of "
                 f"{d['steps']} steps ({d['time']})", fontsize=9)
    save_figure(fig, out / figure)
    body = md_table(rows, [("mode", "kill point", ""), ("trials", "trials", "d"), ("killed", "killed", "d"),
                           ("identical", "bit-identical", "d"), ("corrupt", "corrupt", "d"),
                           ("lost", "max lost steps", "d")])
    return command, f"{body}\n\n![fault campaign]({figure})"


BENCHES = {
    "update_kernel": ("Update kernel: nsp fused Adam vs optax, torch and the memory roofline",
                      "python bench/update_kernel.py", render_update_kernel),
    "store_update": ("Store update: file tier vs the raw disk and DeepSpeed's optimizer swap; memory tier vs the "
                     "kernel",
                     "python bench/store_update.py", render_store_update),
    "store_update_slow_disk": ("Store update on an emulated slow disk (one budget for reads and writes)",
                               "python bench/store_update.py --quick --slow-disk 0.47,0.67 "
                               "--json bench/results/store_update_slow_disk.json", render_store_update),
    "topk": ("Top-K compression: nsp methods vs jax.lax.top_k and a one-pass roofline", "python bench/topk.py",
             render_topk),
    "topk_gpu_67108864": ("Top-K compression on a GPU (an NVIDIA H200, 64M entries): nsp methods vs jax.lax.top_k",
                          "python bench/topk.py --size 67108864 --json bench/results/topk_gpu_67108864.json",
                          render_topk_gpu),
    "smartcomp_topk": ("Smart-Infinity's Top-K selection on a GPU (what the CSD model charges SU+O+C)",
                       "python bench/smartcomp_topk.py", render_smartcomp_topk),
    "train_step": ("GPT train step: optax in RAM vs nsp tiers", "python bench/train_step.py", render_train_step),
    "train_step_split": ("GPT train step, the update on a CPU of its own (an accelerator host's split)",
                         "python bench/train_step.py --engine-cpus 1", render_train_step),
    "checkpoint": ("Checkpoint save: nsp snapshot vs orbax and the raw-write roofline", "python bench/checkpoint.py",
                   render_checkpoint),
    "max_model": ("Largest model under a memory cap", "python bench/max_model.py", render_max_model),
    "fault_campaign": ("Fault campaign: kill, resume, compare bit for bit", "python bench/fault_campaign.py",
                       render_fault_campaign),
    "fault_campaign_oneslot": ("Fault campaign on one-slot stores (one copy of the state and a redo journal)",
                               "python bench/fault_campaign.py --slots 1 --trials 100 --steps 8 "
                               "--json bench/results/fault_campaign_oneslot.json", render_fault_campaign),
    "csd_scaling": ("N computational-storage devices vs a host updater (the shape of Smart-Infinity Fig. 11(a)), "
                    "on nsp's model clock", "python bench/csd_scaling.py --calibrate", render_csd_scaling),
}


def read_records(results_dir: Path) -> dict[str, dict]:
    """The benchmarks' records found in ``results_dir``, by name (an unreadable file is left to render_benches)."""
    records = {}
    for name in BENCHES:
        path = results_dir / f"{name}.json"
        try:
            records[name] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return records


def render_benches(results_dir: Path, out: Path, ran: dict[str, dict], verdicts: dict[str, dict],
                   allow_stale: bool) -> str:
    """Section 3: every benchmark's record in ``results_dir`` rendered (its charts written to ``out``), or why it is
    not: missing, unreadable, or stale and ``allow_stale`` not given. ``ran`` holds the exact commands of
    ``--run-benches``, ``verdicts`` each record's freshness."""
    where = results_dir.relative_to(REPO) if results_dir.is_relative_to(REPO) else results_dir
    parts = [f"## 3. Kernel and tier throughput\n\nFrom the JSON records in `{where}/`, each with the benchmark's "
             "own timestamp, commit and machine; rooflines are grey (hatched) bars measured in the same run. A record "
             "whose command reads \"Produced by\" names the command line that wrote it (recorded by the "
             "benchmark, or by this script's `--run-benches`), less the options that only place files ("
             + ", ".join(f"`{o}`" for o in PLACEMENT_OPTIONS)
             + "); for older records the command is rebuilt from the parameters they record.\n"]
    records = read_records(results_dir)
    for name, (title, default_command, render) in BENCHES.items():
        path = results_dir / f"{name}.json"
        if name in records and not verdicts[name]["fresh"] and not allow_stale:
            record = records[name]
            parts.append(left_out(f"### {title}", verdicts[name], shown_command(record.get("command")
                                                                                 or default_command)))
            continue
        parts.append(f"### {title}\n")
        if not path.exists():
            parts.append(f"**Missing**: `{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` does not "
                         f"exist. Produce it with `{default_command}`, commit it, then rerun this report.\n")
            continue
        if name not in records:
            parts.append(f"**Unreadable**: `{path.name}` is not JSON. Regenerate it with `{default_command}`.\n")
            continue
        record = records[name]
        try:
            command, body = render(record, out)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # an older or foreign record layout
            parts.append(f"**Unreadable**: `{path.name}` does not have the fields this report expects ({e!r}). "
                         f"Regenerate it with `{default_command}`.\n")
            continue
        run = ran.get(name)
        if run is not None and run.get("time") == record.get("time"):
            command, exact_command = run["command"], True
        elif record.get("command"):  # benchmarks record their own command line
            command, exact_command = record["command"], True
        else:
            exact_command = False
        parts.append(bench_header(record, command, exact_command, verdicts[name])
                     + "\n\n" + body + "\n")
    return "\n".join(parts)
