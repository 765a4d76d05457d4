"""bench/store_update.py's figures and record: from what the run measured (``Measured``), the derived figures
(the disk's roofline, each contender's share of it, the memory tier's share of the kernel), the printed table and
notes, the targets, and the JSON record (``report``). Also the protocol's numbers the run and its record share."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_backing  # noqa: E402
import wait_policy  # noqa: E402
from common import DeviceCounts, DeviceTraffic, median, peak_rss_bytes, print_table, write_json  # noqa: E402
from slow_disk import SlowDisk  # noqa: E402
from store_contenders import DiskProbe, Method, PerfectSerialSwap  # noqa: E402

from nsp.primitives import kernel_isa  # noqa: E402

TARGET_FILE_PCT = 85.0
CALIBRATION_CALLS = 3  # calls of every raw probe that pick the perfect serial swap's methods (and warm them up)
TARGET_MEMORY_PCT = 90.0
TARGET_STORE_UPDATE_PCT = 70.0  # store.update with numpy arrays in and out, against the kernel alone
# The file tier's 2nd update measures its read mode's first choice and its 3rd tries the other one
# (ffi/backends/read_mode.h): run untimed, as warm-up.
READ_MODE_CALIBRATION_UPDATES = 2
DISK_ORDER_SEED = 0  # the disk group's order is shuffled each round from this seed (recorded as disk_orders)


@dataclasses.dataclass
class Measured:
    """What bench/store_update.py's run measured and set up, by the names its figures use."""

    args: argparse.Namespace  # the command line
    work: Any  # the temporary directory (Workdir)
    disk: SlowDisk | None  # the emulated slow disk, with --slow-disk
    n: int  # params
    page_bytes: int
    state_bytes: int
    repeats: int
    warmup: int
    threads: int
    grad: np.ndarray  # the gradient every contender applies
    store: Any  # the nsp file tier's store
    read_bytes: int  # bytes one file-tier update reads
    write_bytes: int  # and writes
    first_update_growth: int | None  # the first file-tier update's RSS growth at its peak
    nsp_reads: list[str]  # how each file-tier call read its pages
    nsp_phases: dict[str, list[float]]  # the file tier's stream, sync and commit per call
    nsp1_phases: dict[str, list[float]]  # the same for the one-slot store
    ds_swaps: dict[str, Any]  # DeepSpeed's swappers, by row name
    ds_info: dict[str, Any]  # DeepSpeed's version and defaults, or why it is unavailable
    probe: DiskProbe
    writers: dict[str, Callable]  # the raw write probes, by name
    readers: dict[str, Callable]  # the raw read probes, by name
    both_name: str  # reads and writes at once
    both_read: Method
    both_write: Method
    footprint: dict[str, Callable]  # the footprint diagnostics, by name
    footprint_buffers: int
    perfect: PerfectSerialSwap
    perfect_kernel: str  # the perfect serial swap's Adam
    perfect_used: list[tuple[str, str]]  # its read and write methods, per call
    streamed: dict[str, Callable]  # what the kernel alone streams
    names: dict[str, str]  # the contenders' names, by key
    device: DeviceTraffic
    device_bytes: dict[str, list[DeviceCounts]]  # the block device's counts per call, by contender
    idle_cpu: dict[str, list[float]]  # CPU seconds in the pause after each call, by contender
    disk_orders: list[list[str]]  # the disk group's order in each round
    times: dict[str, list[float]]  # seconds per timed call, by contender
    med: dict[str, float]  # their medians
    setup_s: float
    timed_s: float
    agree: dict[str, float]  # each swapper's params' max |difference| from the file tier's
    moved_p: float  # how far the params moved


def report(m: Measured) -> None:
    """Prints the figures, tables and targets of ``m`` and writes its JSON record (``--json``)."""
    args, work, disk, n, page_bytes, state_bytes = m.args, m.work, m.disk, m.n, m.page_bytes, m.state_bytes
    repeats, warmup, threads, grad, store = m.repeats, m.warmup, m.threads, m.grad, m.store
    read_bytes, write_bytes, first_update_growth = m.read_bytes, m.write_bytes, m.first_update_growth
    nsp_reads, nsp_phases, ds_swaps, ds_info, probe = m.nsp_reads, m.nsp_phases, m.ds_swaps, m.ds_info, m.probe
    writers, readers, both_name, both_read = m.writers, m.readers, m.both_name, m.both_read
    both_write, footprint, footprint_buffers, perfect = m.both_write, m.footprint, m.footprint_buffers, m.perfect
    perfect_kernel, perfect_used, streamed, names = m.perfect_kernel, m.perfect_used, m.streamed, m.names
    device, device_bytes, idle_cpu, disk_orders = m.device, m.device_bytes, m.idle_cpu, m.disk_orders
    times, med, setup_s, timed_s, agree, moved_p = m.times, m.med, m.setup_s, m.timed_s, m.agree, m.moved_p

    # -- derived figures
    # The disk's roofline: its fastest write and its fastest read of the probe's bytes.
    best_write = min(writers, key=lambda k: med[k])
    best_read = min(readers, key=lambda k: med[k])
    t_write, t_read = med[best_write], med[best_read]
    write_bw, read_bw = probe.size / t_write, probe.size / t_read
    probes_s = read_bytes / read_bw + write_bytes / write_bw
    # On the emulated disk the floor is its nominal one (exact: its timeline serves nothing faster); the probes pay
    # the FUSE layer's round trips on top, so their roofline is only context there.
    perfect_s = disk.nominal_s(read_bytes, write_bytes) if disk else probes_s
    floor_label = ("perfect update (the emulated disk's nominal rates: bytes read/read rate + bytes written/write "
                   "rate)" if disk else "perfect update (derived: bytes read/read bw + bytes written/write bw)")
    t_nsp, t_perfect = med[names["nsp"]], med[names["perfect"]]
    # Reads and writes at once against the same read and write one after the other (the same methods): what
    # overlapping them can win on this disk at best.
    t_both = med[both_name]
    t_both_serial = med[f"raw disk read: {both_read.label}"] + med[f"raw disk write: {both_write.label}"]
    overlap_speedup = t_both_serial / t_both
    # The same read and write into the file tier's footprint of buffers: the floor they give (not the target's).
    footprint_record = None
    if footprint:
        (fp_read, t_fp_read), (fp_write, t_fp_write) = sorted(((k, med[k]) for k in footprint),
                                                              key=lambda kv: "write" in kv[0])
        t_one_read = med["raw disk read: " + Method(False, True).label]
        t_one_write = med["raw disk write: " + Method(True, True).label]
        fp_floor = read_bytes * t_fp_read / probe.size + write_bytes * t_fp_write / probe.size
        footprint_record = {
            "buffers": footprint_buffers, "read": fp_read, "write": fp_write,
            "read_s": t_fp_read, "write_s": t_fp_write, "one_buffer_read_s": t_one_read,
            "one_buffer_write_s": t_one_write, "floor_s": fp_floor, "file_tier_pct": fp_floor / t_nsp * 100,
            "note": "diagnostic, not the target's floor: the roofline's read and write (one request in flight, "
                    "O_DIRECT) landing in as many page buffers in turn as the file tier holds, not in one reused "
                    "buffer"}
    file_pct = perfect_s / t_nsp * 100
    # One slot (a redo journal) against two: the same update on each kind of store.
    t_nsp1 = med[names["nsp1"]]
    one_slot = {"s": t_nsp1, "two_slot_s": t_nsp, "ratio_to_two_slot": t_nsp1 / t_nsp,
                "pct_of_disk": perfect_s / t_nsp1 * 100,
                "ratio_per_round": [a / b for a, b in zip(times[names["nsp1"]], times[names["nsp"]])],
                "median_ratio_per_round": median([a / b for a, b in zip(times[names["nsp1"]], times[names["nsp"]])]),
                "phases_s": m.nsp1_phases, "state_equal_to_two_slot": True}
    perfect_speedup = t_perfect / t_nsp
    # Per-round figures (each round's own probe), to show the spread.
    round_pct = [
        (perfect_s if disk else read_bytes * tr / probe.size + write_bytes * tw / probe.size) / tn * 100
        for tr, tw, tn in zip(times[best_read], times[best_write], times[names["nsp"]])
    ]
    # The best a swapper that does not overlap I/O with compute could do on the emulated disk: its floor plus the
    # perfect serial swap's measured Adam in RAM.
    nominal_swap = None
    if disk:
        t_swap = perfect_s + median(perfect.phases["compute"])
        nominal_swap = {"s": t_swap, "nsp_speedup": t_swap / t_nsp, "adam_s": t_swap - perfect_s,
                        "probes_floor_s": probes_s}
    ds_rows = {}
    for name in ds_swaps:
        t = med[name]
        ds_rows[name] = {"s": t, "pct_of_disk": perfect_s / t * 100, "nsp_speedup": t / t_nsp}
    best_ds = min(ds_swaps, key=lambda k: med[k]) if ds_swaps else None
    t_kernel, t_mem, t_mem_jit = med[names["kernel"]], med[names["mem"]], med[names["mem_jit"]]
    t_mem_in_place = med[names["mem_in_place"]]
    mem_bf16_pct = {key: t_kernel / med[names[key]] * 100 for key in ("mem_jit_bf16", "mem_in_place_bf16")
                    if names.get(key) in med}
    mem_pct = t_kernel / t_mem_jit * 100  # the transforms' path is the memory tier users run
    mem_in_place_pct = t_kernel / t_mem_in_place * 100
    mem_api_pct = t_kernel / t_mem * 100
    mem_pct_adj = mem_pct * 32 / 28  # the memory tier moves 32 B/param (the params out too), the kernel 28

    disk_bpp = (read_bytes + write_bytes) / n
    ds_bpp = 24.0  # p, m, v each way (padded to 1 KiB per tensor: nothing at these sizes)
    rows = [
        {"contender": k, "ms": med[k] * 1e3, "gbs": probe.size / med[k] / 1e9,
         "bpp": f"{probe.size / n:.0f} {'w' if k in writers else 'r'}",
         "vs": "fastest: the roofline's" if k in (best_write, best_read) else "-"}
        for k in (*writers, *readers)
    ] + [
        {"contender": both_name, "ms": t_both * 1e3, "gbs": 2 * probe.size / t_both / 1e9,
         "bpp": f"{2 * probe.size / n:.0f}", "vs": f"{overlap_speedup:.2f}x one after the other"},
        {"contender": floor_label, "ms": perfect_s * 1e3,
         "gbs": (read_bytes + write_bytes) / perfect_s / 1e9, "bpp": f"{disk_bpp:.0f}", "vs": "100% of disk"},
        {"contender": names["nsp"], "ms": t_nsp * 1e3, "gbs": (read_bytes + write_bytes) / t_nsp / 1e9,
         "bpp": f"{disk_bpp:.0f}", "mps": n / t_nsp / 1e6, "vs": f"{file_pct:.1f}% of disk"},
        {"contender": names["nsp1"], "ms": t_nsp1 * 1e3, "gbs": (read_bytes + write_bytes) / t_nsp1 / 1e9,
         "bpp": f"{disk_bpp:.0f}+4", "mps": n / t_nsp1 / 1e6,
         "vs": f"{perfect_s / t_nsp1 * 100:.1f}% of disk; {t_nsp1 / t_nsp:.2f}x two slots' time"},
        {"contender": names["perfect"], "ms": t_perfect * 1e3, "gbs": n * 24 / t_perfect / 1e9, "bpp": "24",
         "mps": n / t_perfect / 1e6, "vs": f"{perfect_s / t_perfect * 100:.1f}% of disk; nsp {perfect_speedup:.2f}x"},
    ]
    if nominal_swap:
        rows.append({"contender": "serial swap at the nominal rates (derived: the floor + the perfect swap's Adam)",
                     "ms": nominal_swap["s"] * 1e3, "bpp": "24", "mps": n / nominal_swap["s"] / 1e6,
                     "vs": f"nsp {nominal_swap['nsp_speedup']:.3f}x"})
    for name, r in ds_rows.items():
        rows.append({"contender": name, "ms": r["s"] * 1e3, "gbs": n * ds_bpp / r["s"] / 1e9, "bpp": "24",
                     "mps": n / r["s"] / 1e6, "vs": f"{r['pct_of_disk']:.1f}% of disk; nsp {r['nsp_speedup']:.2f}x"})
    if not ds_swaps:
        rows.append({"contender": "DeepSpeed (ZeRO-Infinity optimizer swap): unavailable, see below",
                     "vs": "not measured"})
    rows += [
        {"contender": names["kernel"], "ms": t_kernel * 1e3, "gbs": n * 28 / t_kernel / 1e9, "bpp": "28",
         "mps": n / t_kernel / 1e6, "vs": "100% of kernel"},
        {"contender": names["mem_jit"], "ms": t_mem_jit * 1e3, "gbs": n * 32 / t_mem_jit / 1e9, "bpp": "32",
         "mps": n / t_mem_jit / 1e6, "vs": f"{mem_pct:.1f}% of kernel"},
        {"contender": names["mem_in_place"], "ms": t_mem_in_place * 1e3, "gbs": n * 32 / t_mem_in_place / 1e9,
         "bpp": "32", "mps": n / t_mem_in_place / 1e6, "vs": f"{mem_in_place_pct:.1f}% of kernel"},
        {"contender": names["mem"], "ms": t_mem * 1e3, "gbs": n * 32 / t_mem / 1e9, "bpp": "32",
         "mps": n / t_mem / 1e6, "vs": f"{mem_api_pct:.1f}% of kernel"},
    ]
    for key, bpp in (("diag_out", 32), ("diag_none", 28)):
        t = med[names[key]]
        rows.append({"contender": names[key], "ms": t * 1e3, "gbs": n * bpp / t / 1e9, "bpp": str(bpp),
                     "mps": n / t / 1e6, "vs": f"{t_kernel / t * 100:.1f}% of kernel"})
    for row in rows:
        spent = idle_cpu.get(row["contender"])
        if spent:
            row["idle"] = median(spent) * 1e3
    print_table(
        "Store update (median of interleaved rounds; nsp Nx: the contender's time / the nsp file tier's)",
        rows,
        [("contender", "contender", ""), ("ms", "median ms", ".1f"), ("gbs", "GB/s moved", ".3f"),
         ("bpp", "B/param", ""), ("mps", "Mparam/s", ".0f"), ("vs", "ratio", ""), ("idle", "CPU ms in pause", ".0f")],
    )

    def phase_line(label: str, phases: dict[str, list[float]]) -> str:
        return f"{label}: " + ", ".join(f"{k} {median(v) * 1e3:.0f} ms" for k, v in phases.items())

    del perfect_used[: len(perfect_used) - repeats]  # the timed rounds' choices
    del nsp_reads[: len(nsp_reads) - repeats]
    used = {f"read {r}; write {w}": perfect_used.count((r, w)) for r, w in dict.fromkeys(perfect_used)}
    print(f"\n  perfect serial swap (methods: the probes' fastest so far, chosen before each call): "
          f"{'; '.join(f'{k} in {c} of {repeats} rounds' for k, c in used.items())}; Adam: {perfect_kernel}")
    print(f"  nsp file tier reads per round: {', '.join(nsp_reads)}")
    # The rounds in which the perfect swap read the way nsp did: the same I/O methods, overlapped or not.
    same = [i for i, (r, _) in enumerate(perfect_used) if r.split(",")[0] == nsp_reads[i]]
    same_io = None
    if same:
        t_n = median([times[names["nsp"]][i] for i in same])
        t_p = median([times[names["perfect"]][i] for i in same])
        same_io = {"rounds": same, "nsp_s": t_n, "perfect_s": t_p, "nsp_speedup": t_p / t_n}
        print(f"  rounds where the perfect swap read pages the way nsp did ({len(same)} of {repeats}): nsp "
              f"{t_n * 1e3:.0f} ms vs perfect serial swap {t_p * 1e3:.0f} ms: nsp {t_p / t_n:.2f}x")
    if not ds_swaps:
        print(f"  DeepSpeed: unavailable -- {ds_info['reason']}")
    device_mib = {}
    if device.available:
        print(f"  device traffic per call (median over the timed rounds; {device.path}, whole machine): MiB read, MiB "
              f"written, ms the device was busy of the call's ms, requests the device completed (after merging)")
        for name, counts in device_bytes.items():
            timed = counts[len(counts) - repeats:]
            device_mib[name] = {"read_bytes": median([c.read_bytes for c in timed]),
                                "written_bytes": median([c.written_bytes for c in timed]),
                                "busy_s": median([c.busy_ms / 1e3 for c in timed]),
                                "read_requests": median([c.reads for c in timed]),
                                "write_requests": median([c.writes for c in timed])}
            c = device_mib[name]
            print(f"    {name[:60]:60s} r {c['read_bytes'] / 2**20:4.0f}  w {c['written_bytes'] / 2**20:4.0f}  busy "
                  f"{c['busy_s'] * 1e3:4.0f} of {med[name] * 1e3:4.0f} ms  requests r {c['read_requests']:5.0f} "
                  f"w {c['write_requests']:5.0f}")
    print("  " + phase_line("nsp file tier phases (median; the engine's clocks)", nsp_phases))
    print("  " + phase_line("nsp file tier, one slot, phases (median; the journal's write is in the stream)",
                            m.nsp1_phases))
    print(f"  one slot vs two: {t_nsp1 * 1e3:.0f} ms vs {t_nsp * 1e3:.0f} ms per update, "
          f"{one_slot['ratio_to_two_slot']:.2f}x (per round: "
          f"{', '.join(f'{r:.2f}' for r in one_slot['ratio_per_round'])}; median "
          f"{one_slot['median_ratio_per_round']:.2f}); the same state after the same updates")
    print("  " + phase_line("perfect serial swap phases (median)", perfect.phases))
    print(f"  reads and writes at once: {t_both * 1e3:.0f} ms against {t_both_serial * 1e3:.0f} ms one after the "
          f"other (same methods): overlapping them wins {overlap_speedup:.2f}x on this disk at best; a pipelined "
          f"updater beats a serial swap by no more than that and the compute it hides")
    if footprint_record:
        f = footprint_record
        print(f"  the probes' one reused buffer (diagnostic): reads of the probe's bytes took "
              f"{f['one_buffer_read_s'] * 1e3:.0f} ms into one buffer, {f['read_s'] * 1e3:.0f} ms into "
              f"{f['buffers']} in turn (the file tier's page buffers); writes {f['one_buffer_write_s'] * 1e3:.0f} "
              f"and {f['write_s'] * 1e3:.0f} ms. Against the floor those give ({f['floor_s'] * 1e3:.0f} ms) the file "
              f"tier is at {f['file_tier_pct']:.1f}%; the target's floor stays the fastest probe's")
    for name, swap in ds_swaps.items():
        print("  " + phase_line(f"{name.split(':')[0]} phases (median, summed over sub-groups)", swap.phases))
    if ds_swaps:
        print(f"  DeepSpeed {ds_info['version']}: aio {ds_info['aio_defaults']} (its defaults), one page-locked "
              f"buffer set per sub-group in flight, DeepSpeedCPUAdam; no fsync (its swapper does not sync)")
    steps = len(times[names["nsp"]]) + warmup + READ_MODE_CALIBRATION_UPDATES
    print(f"  params after every swapper's {steps} steps agree with the nsp file tier's "
          f"(max |diff|: {', '.join(f'{v:.1e}' for v in agree.values())}; params moved by up to {moved_p:.1e})")
    print(f"  bytes per update: read {read_bytes / 2**20:.0f} MiB, written {write_bytes / 2**20:.0f} MiB "
          f"(p, m, v; gradient from RAM); raw probe: {probe.size / 2**20:.0f} MiB in "
          f"{page_bytes / 2**20:g} MiB requests; roofline from the fastest write ({best_write.split(': ')[1]}) "
          f"and read ({best_read.split(': ')[1]})")
    per_round_floor = "the nominal floor" if disk else "that round's own disk probe"
    print(f"  file tier per round (% of {per_round_floor}): {', '.join(f'{p:.0f}' for p in round_pct)} "
          f"(median {median(round_pct):.1f}%)")
    if disk:
        print(f"  the raw probes' roofline on the emulated disk: {probes_s * 1e3:.0f} ms, {perfect_s / probes_s:.0%} "
              f"of the nominal rates (FUSE's per-request round trips; a single file's O_DIRECT writes are "
              f"serialised by FUSE, the file tier's page files are not)")
    print(f"  memory tier, roofline-adjusted (moves 32 B/param incl. the params out, the kernel 28): "
          f"{mem_pct_adj:.1f}% of the kernel's bandwidth; through store.update (numpy arrays in and out): "
          f"{mem_api_pct:.1f}% of the kernel")
    print(f"  CPU ms in pause: CPU time this process used in the {args.pause:g} s after the call (threads still "
          f"running, or the disk's write-back); {wait_policy.NSP_POOL_NOTE}")

    # -- memory
    buffer_bytes = store.stats()["buffer_bytes"]
    bound = args.pages_in_flight * 3 * page_bytes
    peak = peak_rss_bytes()
    print(f"\n  pages in flight: {args.pages_in_flight}; file-tier buffers: {buffer_bytes / 2**20:.0f} MiB "
          f"(bound pages_in_flight x 3 x page = {bound / 2**20:.0f} MiB, whatever the model size)")
    if first_update_growth is not None:
        print(f"  first file-tier update grew RSS by {first_update_growth / 2**20:.0f} MiB at peak = buffers "
              f"{buffer_bytes / 2**20:.0f} MiB + returned params {n * 4 / 2**20:.0f} MiB (4 B/param, the output) "
              f"+ {(first_update_growth - buffer_bytes - n * 4) / 2**20:.0f} MiB other")
    print(f"  peak RSS of the whole run (ru_maxrss, all contenders' state in RAM): {peak / 2**30:.2f} GiB")

    # -- targets
    checks = [
        {"check": "file tier >= 85% of " + ("the emulated disk's nominal floor" if disk else "raw disk bandwidth"),
         "value": file_pct, "met": file_pct >= TARGET_FILE_PCT},
        {"check": "memory tier >= 90% of the kernel", "value": mem_pct, "met": mem_pct >= TARGET_MEMORY_PCT},
        {"check": "memory tier in place >= 90% of the kernel", "value": mem_in_place_pct,
         "met": mem_in_place_pct >= TARGET_MEMORY_PCT},
        *({"check": f"{label} >= 90% of the kernel", "value": mem_bf16_pct[key],
           "met": mem_bf16_pct[key] >= TARGET_MEMORY_PCT}
          for key, label in (("mem_jit_bf16", "memory tier, bf16 gradient and params,"),
                             ("mem_in_place_bf16", "memory tier in place, bf16 gradient and params,"))
          if key in mem_bf16_pct),
        {"check": "store.update (numpy in and out) >= 70% of the kernel", "value": mem_api_pct,
         "met": mem_api_pct >= TARGET_STORE_UPDATE_PCT},
        {"check": "nsp file tier beats the perfect serial swap", "value": perfect_speedup,
         "met": perfect_speedup > 1.0},
    ]
    if nominal_swap:
        checks.append({"check": "nsp file tier beats a serial swap at the emulated disk's nominal rates",
                       "value": nominal_swap["nsp_speedup"], "met": nominal_swap["nsp_speedup"] > 1.0})
    for name, r in ds_rows.items():
        checks.append({"check": f"nsp file tier beats {name.split(':')[0]}", "value": r["nsp_speedup"],
                       "met": r["nsp_speedup"] > 1.0})
    print("\nTargets")
    print(f"  file tier {file_pct:.1f}% of {'the nominal floor' if disk else 'raw disk'} (target >= {TARGET_FILE_PCT:.0f}%): "
          f"{'ok' if checks[0]['met'] else 'MISSED'}")
    print(f"  memory tier {mem_pct:.1f}% of the kernel (target >= {TARGET_MEMORY_PCT:.0f}%): "
          f"{'ok' if checks[1]['met'] else 'MISSED'}")
    print(f"  memory tier in place {mem_in_place_pct:.1f}% of the kernel (target >= {TARGET_MEMORY_PCT:.0f}%): "
          f"{'ok' if checks[2]['met'] else 'MISSED'}")
    for c in checks[3:]:
        if "% of the kernel" in c["check"]:
            print(f"  {c['check']}: {c['value']:.1f}%: {'ok' if c['met'] else 'MISSED'}")
        else:
            print(f"  {c['check']}: nsp {c['value']:.2f}x as fast (target > 1): {'ok' if c['met'] else 'MISSED'}")
    if not ds_swaps:
        print(f"  DeepSpeed: not measured -- {ds_info['reason']}")

    ds_record = dict(ds_info)
    ds_calls = repeats + warmup + READ_MODE_CALIBRATION_UPDATES
    ds_record["rows"] = {name: {**r, "phases_s": ds_swaps[name].phases,
                                "bytes_read_per_update": ds_swaps[name].bytes_read // ds_calls,
                                "bytes_written_per_update": ds_swaps[name].bytes_written // ds_calls}
                         for name, r in ds_rows.items()}
    path = write_json(
        "store_update",
        {"params": n, "state_bytes": state_bytes, "threads": threads, "isa": kernel_isa(), "repeats": repeats,
         "warmup": warmup, "page_bytes": page_bytes, "pages_in_flight": args.pages_in_flight,
         "disk_order_seed": DISK_ORDER_SEED, "disk_orders": disk_orders,
         "device_traffic_per_call": {"source": device.path, "by_contender": device_mib} if device.available else None,
         "directory": os.path.dirname(work.path),
         "slow_disk": {**disk.describe(), "nominal_floor_s": perfect_s, "serial_swap_at_nominal_rates": nominal_swap}
         if disk else None,
         "probe_write": best_write, "probe_read": best_read,
         "probe_bytes": probe.size,
         "bytes_read_per_update": read_bytes, "bytes_written_per_update": write_bytes,
         "write_gbs": write_bw / 1e9, "read_gbs": read_bw / 1e9, "perfect_update_s": perfect_s,
         "side_by_side": {"name": both_name, "s": t_both, "one_after_the_other_s": t_both_serial,
                          "overlap_speedup": overlap_speedup},
         "buffer_footprint": footprint_record,
         "nsp_phases_s": nsp_phases,
         "one_slot": one_slot,
         "file_tier_pct_of_disk": file_pct, "file_tier_pct_per_round": round_pct,
         "baseline": best_ds,
         "baseline_pct_of_disk": ds_rows[best_ds]["pct_of_disk"] if best_ds else None,
         "nsp_vs_baseline_speedup": ds_rows[best_ds]["nsp_speedup"] if best_ds else None,
         "baseline_adam": "DeepSpeedCPUAdam" if best_ds else None,
         "baseline_phases_s": ds_swaps[best_ds].phases if best_ds else None,
         "deepspeed": ds_record,
         "perfect_serial_swap": {
             "s": t_perfect, "pct_of_disk": perfect_s / t_perfect * 100, "nsp_speedup": perfect_speedup,
             "methods_per_round": [{"read": r, "write": w} for r, w in perfect_used],
             "nsp_reads_per_round": nsp_reads, "same_read_method": same_io,
             "calibration_calls": CALIBRATION_CALLS,
             "probe_calibration_s": {k: v[:CALIBRATION_CALLS] for k, v in probe.times.items()},
             "adam": perfect_kernel, "phases_s": perfect.phases},
         "nsp_vs_perfect_serial_swap_speedup": perfect_speedup,
         "params_max_abs_diff_vs_nsp": agree,
         "memory_tier_pct_of_kernel": mem_pct,
         "memory_tier_store_update_pct_of_kernel": mem_api_pct, "memory_tier_in_place_pct_of_kernel": mem_in_place_pct,
         "memory_tier_pct_of_kernel_roofline_adjusted": mem_pct_adj,
         "memory_tier_bf16_pct_of_kernel": mem_bf16_pct, "buffer_bytes": buffer_bytes,
         "buffer_bound_bytes": bound, "first_update_rss_growth_bytes": first_update_growth,
         "peak_rss_bytes": peak, "setup_s": setup_s, "timed_s": timed_s,
         "times_s": times, "median_s": med, "checks": checks,
         **wait_policy.record(args.omp_wait_policy, args.pause, idle_cpu),
         **page_backing.record(args.memory_pages, {"kernel alone": page_backing.huge_share(streamed["kernel"]()),
                                            "gradient": page_backing.huge_share([grad])})},
        args.json,
    )
    print(f"\nwrote {path}")
    floor_name = "the emulated disk's nominal floor" if disk else "raw disk bandwidth"
    print(f"file tier: {file_pct:.1f}% of {floor_name}; nsp {perfect_speedup:.2f}x the perfect serial swap"
          + "".join(f"; {r['nsp_speedup']:.2f}x {k.split(':')[0]}" for k, r in ds_rows.items()))
