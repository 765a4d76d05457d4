"""The update kernel over sizes, thread counts, instruction sets and page sizes, several runs each, in one record.

    python bench/kernel_sweep.py              # every configuration below, 5 runs of the headline ones, 3 of the rest
    python bench/kernel_sweep.py --quick      # 64M only: the headline configurations, 3 runs
    python bench/kernel_sweep.py --hypotheses --runs 3   # the tuning knobs one at a time (prefetch, task size)

Each run of a configuration is a fresh process of bench/update_kernel.py (its contenders interleaved in a shuffled
order, 7 rounds; each timed call after a cache reset and a warm-up call, see its docstring); the runs of all
configurations are interleaved too (run 1 of every configuration, then run 2, ...), so that a slow spell of the
machine lands on every configuration rather than on one. A run's ratio against a contender is the median over its
rounds of that round's ratio (paired: the two calls ran seconds apart); the record keeps it beside the ratio of the
two medians. For each configuration the record keeps every run's ratios and the median over runs, the lowest and
the highest: a target is met when the median over runs reaches it, and the record also says whether every run
reached it.

Configurations:
  headline   64M params (1.8 GB moved per update, far beyond the last-level cache), every core, each instruction
             set the CPU has (NSP_KERNEL_ISA: avx512, avx2-fma), 2 MiB pages: nsp dense fp32 against
             DeepSpeedCPUAdam, torch fused Adam and the pure streaming probes
  threads    the same at 1 thread and at 2 (when the machine has more cores than 2), avx512 or the best ISA
  sizes      1M, 16M, 64M and 512M params on the best ISA, every core: 2 MiB pages and 4 KiB pages (at 512M,
             DeepSpeed is left out: its moments would not fit beside the others in 24 GiB)

Targets (from the headline and thread configurations): nsp dense >= 1.05x DeepSpeedCPUAdam and >= 1.05x torch
fused Adam, and >= 95% of the best pure streaming probe (nsp's stream loop or numpy in place: loops with no Adam
in them), on the median over runs. The size table shows nsp's GB/s and its share of the best probe at each size,
so that a size where the kernel falls off is visible.

Hardware counters (bytes moved per nanosecond from the memory controller) would cut the spread further; where the
kernel exposes no CPU PMU (a virtual machine, as here: /sys/bus/event_source/devices has no "cpu"), the record
says so and relies on wall time over many rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
NSP = "nsp dense fp32"
DS = "DeepSpeedCPUAdam"
TORCH = "torch fused Adam"
PURE_PROBES = ("roofline probe: nsp stream (28 B/param)", "roofline probe: numpy in place (28 B/param)")
TARGETS = {DS: 1.05, TORCH: 1.05, "best pure probe": 0.95}
SIZES = ("1M", "16M", "64M", "512M")


def cpu_isas() -> list[str]:
    """The vector ISAs nsp's kernels have that this CPU runs, best first (from /proc/cpuinfo's flags)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    isas = []
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")):
        isas.append("avx512")
    if all(f in flags for f in ("avx2", "fma")):
        isas.append("avx2-fma")
    return isas


def hardware_counters() -> str:
    """Whether this kernel exposes a CPU PMU (memory-traffic counters); a sentence either way."""
    devices = Path("/sys/bus/event_source/devices")
    names = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    if "cpu" in names or any(n.startswith(("uncore_imc", "amd_df")) for n in names):
        return f"available ({', '.join(names)}), not used: wall time only"
    return f"none exposed (event sources: {', '.join(names) or 'none'}): wall time only"


def configurations(quick: bool, runs: int) -> list[dict]:
    cores = os.cpu_count() or 1
    isas = cpu_isas() or ["portable"]
    best = isas[0]
    headline_runs, other_runs = (3, 3) if quick else (runs, max(3, runs - 2))
    out = []
    for isa in isas:  # every core, each ISA: the headline
        out.append({"name": f"64M, {cores} threads, {isa}, 2 MiB pages", "size": "64M", "threads": cores,
                    "isa": isa, "pages": "huge", "contenders": "nsp,torch,deepspeed,probes",
                    "runs": headline_runs, "targets": True})
    for threads in sorted({1, 2} - {cores}):
        out.append({"name": f"64M, {threads} threads, {best}, 2 MiB pages", "size": "64M", "threads": threads,
                    "isa": best, "pages": "huge", "contenders": "nsp,torch,deepspeed,probes",
                    "runs": headline_runs if threads == 2 else other_runs, "targets": threads == 2})
    if quick:
        return out
    for pages, label in (("huge", "2 MiB pages"), ("small", "4 KiB pages")):
        for size in SIZES:
            if size == "64M" and pages == "huge":
                continue  # the headline
            groups = "nsp,torch,probes" if size == "512M" else "nsp,torch,deepspeed,probes"
            out.append({"name": f"{size}, {cores} threads, {best}, {label}", "size": size, "threads": cores,
                        "isa": best, "pages": pages, "contenders": groups, "runs": other_runs, "targets": False})
    return out


#: --hypotheses: one knob changed at a time from the defaults (ffi/kernels/update_kernel.cc: prefetch 512 elements
#: ahead into L1, tasks of 1M elements), 64M, every core.
HYPOTHESES = {
    "defaults": {},
    "no software prefetch": {"NSP_KERNEL_PREFETCH": "0"},
    "prefetch 1 KiB ahead": {"NSP_KERNEL_PREFETCH": "256"},
    "prefetch 4 KiB ahead": {"NSP_KERNEL_PREFETCH": "1024"},
    "prefetch into L2": {"NSP_KERNEL_PREFETCH_LEVEL": "2"},
    "prefetch into the last level": {"NSP_KERNEL_PREFETCH_LEVEL": "3"},
    "one task per thread": {"NSP_KERNEL_TASK_ELEMS": "0"},
    "tasks of 4M elements": {"NSP_KERNEL_TASK_ELEMS": str(4 << 20)},
    "tasks of 256K elements": {"NSP_KERNEL_TASK_ELEMS": str(256 << 10)},
}


def hypothesis_configurations(runs: int) -> list[dict]:
    cores = os.cpu_count() or 1
    best = (cpu_isas() or ["portable"])[0]
    return [{"name": f"hypothesis: {label}", "size": "64M", "threads": cores, "isa": best, "pages": "huge",
             "contenders": "nsp,torch,deepspeed,probes", "runs": runs, "targets": False, "env": env}
            for label, env in HYPOTHESES.items()]


def run_one(cfg: dict, out: Path, repeats: int) -> dict:
    cmd = [sys.executable, str(HERE / "update_kernel.py"), "--size", cfg["size"], "--threads", str(cfg["threads"]),
           "--repeats", str(repeats), "--memory-pages", cfg["pages"], "--contenders", cfg["contenders"],
           "--no-crc", "--json", str(out)]
    env = {**os.environ, "NSP_KERNEL_ISA": cfg["isa"], **cfg.get("env", {})}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg['name']}: update_kernel.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def ratios(med: dict) -> dict[str, float]:
    """nsp dense's speed against each contender present (their time / nsp's: > 1 means nsp is faster)."""
    nsp = med[NSP]
    out = {name: med[name] / nsp for name in (DS, TORCH) if name in med}
    pure = [med[p] for p in PURE_PROBES if p in med]
    if pure:
        out["best pure probe"] = min(pure) / nsp
    return out


def paired_ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """The same ratios, each the median over rounds of that round's ratio: a contender and nsp timed in the same
    round (seconds apart) share the machine's state then, so a slow spell that spans a round moves both and
    cancels, where the ratio of two medians keeps it."""
    rounds = range(len(times[NSP]))
    per_round = [ratios({name: ts[i] for name, ts in times.items()}) for i in rounds]
    return {key: median([r[key] for r in per_round]) for key in per_round[0]}


def summarise(cfg: dict, records: list[dict]) -> dict:
    n = records[0]["size"]
    nsp_times = [r["median_s"][NSP] for r in records]
    per_run = [paired_ratios(r["times_s"]) for r in records]
    summary = {"config": cfg["name"], "size": n, "threads": cfg["threads"], "isa": cfg["isa"], "pages": cfg["pages"],
               "runs": len(records), "isa_reported": sorted({r["isa"] for r in records}),
               "nsp_ms": {"median": median(nsp_times) * 1e3, "min": min(nsp_times) * 1e3,
                          "max": max(nsp_times) * 1e3},
               "nsp_spread": (max(nsp_times) - min(nsp_times)) / median(nsp_times),
               "nsp_gbs": n * 28.0 / median(nsp_times) / 1e9,
               "huge_page_share": {k: median([r["huge_page_share"][k] for r in records])
                                   for k in records[0].get("huge_page_share", {})},
               "ratios": {}}
    for key in per_run[0]:
        values = [r[key] for r in per_run]
        of_medians = [ratios(r["median_s"])[key] for r in records]
        entry = {"median": median(values), "min": min(values), "max": max(values), "per_run": values,
                 "ratio_of_medians_per_run": of_medians}
        if cfg["targets"] and key in TARGETS:
            entry["target"] = TARGETS[key]
            entry["met"] = entry["median"] >= TARGETS[key]
            entry["met_in_every_run"] = entry["min"] >= TARGETS[key]
        summary["ratios"][key] = entry
    inside = [r.get("nsp_dense_inside_kernel_s") or [] for r in records]
    if all(inside):
        # nsp's time inside the kernel against the best pure probe, per round (bench/update_kernel.py): the kernel
        # alone, without its jitted call's dispatch.
        per_run_inside = [median([min(r["times_s"][p][i] for p in PURE_PROBES if p in r["times_s"]) / k
                                  for i, k in enumerate(ks)]) for r, ks in zip(records, inside)]
        summary["inside_kernel_vs_best_pure_probe"] = {"median": median(per_run_inside), "min": min(per_run_inside),
                                                       "max": max(per_run_inside), "per_run": per_run_inside}
    for other in (DS, TORCH):
        if other in records[0]["median_s"]:
            summary[f"{other}_ms"] = median([r["median_s"][other] for r in records]) * 1e3
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each headline configuration (others: runs - 2, "
                                                           "at least 3)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds inside each run")
    parser.add_argument("--quick", action="store_true", help="only the 64M configurations, 3 runs each")
    parser.add_argument("--hypotheses", action="store_true",
                        help="instead: the kernel's tuning knobs one at a time at 64M (record: "
                             "bench/results/update_kernel_hypotheses.json)")
    parser.add_argument("--only", default=None, help="run only configurations whose name contains one of these texts (comma-separated)")
    parser.add_argument("--json", default=None, help="where to write the record (default "
                                                     "bench/results/update_kernel_sweep.json)")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be >= 3")
    configs = hypothesis_configurations(args.runs) if args.hypotheses else configurations(args.quick, args.runs)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        configs = [c for c in configs if any(w in c["name"] for w in wanted)]
        if not configs:
            parser.error(f"--only {args.only!r} matches no configuration")
    counters = hardware_counters()
    total = sum(c["runs"] for c in configs)
    print(f"{len(configs)} configurations, {total} runs of bench/update_kernel.py, interleaved; hardware counters: "
          f"{counters}", flush=True)
    records: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    started, done = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="nsp-kernel-sweep-") as tmp:
        for run in range(max(c["runs"] for c in configs)):
            for cfg in configs:
                if run >= cfg["runs"]:
                    continue
                rec = run_one(cfg, Path(tmp) / "run.json", args.repeats)
                records[cfg["name"]].append(rec)
                done += 1
                r = paired_ratios(rec["times_s"])
                print(f"  [{done}/{total}, {time.monotonic() - started:.0f} s] run {run + 1} {cfg['name']}: nsp "
                      f"{rec['median_s'][NSP] * 1e3:.2f} ms; " + ", ".join(f"vs {k} {v:.3f}x" for k, v in r.items()),
                      flush=True)
    summaries = [summarise(c, records[c["name"]]) for c in configs]
    rows = []
    for s in summaries:
        row = {"config": s["config"], "runs": s["runs"], "ms": s["nsp_ms"]["median"], "gbs": s["nsp_gbs"],
               "spread": s["nsp_spread"] * 100}
        for key, col in ((DS, "ds"), (TORCH, "torch"), ("best pure probe", "probe")):
            e = s["ratios"].get(key)
            if e:
                mark = "" if "met" not in e else (" ok" if e["met"] else " MISSED")
                row[col] = f"{e['median']:.3f} ({e['min']:.2f}-{e['max']:.2f}){mark}"
        rows.append(row)
    print_table("nsp dense fp32 Adam: median over runs (lowest-highest run)", rows,
                [("config", "configuration", ""), ("runs", "runs", "d"), ("ms", "nsp ms", ".2f"),
                 ("gbs", "nsp GB/s", ".1f"), ("spread", "nsp spread %", ".1f"), ("ds", "vs DeepSpeedCPUAdam", ""),
                 ("torch", "vs torch fused", ""), ("probe", "vs best pure probe", "")])
    checks = [{"config": s["config"], "check": f"nsp dense vs {key}", **{k: v for k, v in e.items()
                                                                        if k != "per_run"}}
              for s in summaries for key, e in s["ratios"].items() if "target" in e]
    missed = [c for c in checks if not c["met"]]
    print(f"\nTargets on the median over runs: {len(checks) - len(missed)} of {len(checks)} met"
          + "".join(f"\n  MISSED {c['config']}: {c['check']} {c['median']:.3f}x < {c['target']}" for c in missed))
    shaky = [c for c in checks if c["met"] and not c["met_in_every_run"]]
    for c in shaky:
        print(f"  met on the median, not in every run: {c['config']}: {c['check']} lowest {c['min']:.3f}x")
    path = write_json("update_kernel_hypotheses" if args.hypotheses else "update_kernel_sweep", {
        "runs": args.runs, "repeats": args.repeats, "quick": args.quick, "hypotheses": args.hypotheses,
        "hardware_counters": counters,
        "targets": TARGETS, "configurations": configs, "summaries": summaries, "checks": checks,
        "all_met": not missed,
        "runs_detail": {name: [{"median_s": r["median_s"], "times_s": r["times_s"], "isa": r["isa"],
                                "calls_per_sample": r.get("calls_per_sample"),
                                "huge_page_share": r.get("huge_page_share")} for r in recs]
                        for name, recs in records.items()},
    }, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
