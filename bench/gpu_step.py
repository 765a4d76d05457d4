"""nsp's train step on an accelerator against optax with its state in HBM and optax with its state offloaded to
``pinned_host``: one command, under 5 minutes on one GPU, writing ``bench/results/gpu_step.json``.

    python bench/gpu_step.py                     # on the default JAX backend (a GPU where there is one)
    python bench/gpu_step.py --quick             # tiny model, few steps: a smoke run (CPU: under a minute)
    python bench/gpu_step.py --check-only        # only the params check (run it with NSP_KERNEL_ISA=portable too)

What it does, in order, writing the record after every part (a run cut short still leaves what it measured):

1. nsp: that ``import nsp`` works (the C++ extension built), the kernel ISA, the update threads.
2. The params check: 20 steps of the same small GPT with ``nsp.optim.adamw`` on a memory-tier store, once jitted on
   the benchmark's device (``--platform``, default the default JAX backend) and once on ``jax.devices("cpu")[0]``
   (the CPU path). Both runs feed the update the same gradients (those of the CPU run's forward/backward, step by
   step), so the comparison is of nsp's update path alone: bit for bit under ``NSP_KERNEL_ISA=portable``, else
   within 1e-6 relative. No gradient clipping in that chain (a global norm reduced on another device rounds
   differently). A second run with the forward/backward on the device too ("end to end") is reported beside it,
   not judged: an accelerator's fp32 dots (TF32 on a recent NVIDIA GPU) round differently from the CPU's.
   Where the default backend is the CPU, both runs are CPU runs: still a check of the code path, and the record
   says so.
3. A link probe: a gradient-sized fp32 buffer moved device -> ``pinned_host`` and back (``jax.device_put``), the
   roofline the link times are compared with.
4. At GPT-2 124M (``--size``) and then at the largest of ``--larger`` that fits what is left of
   ``--time-budget-s`` (estimated from the first size's own setup, compile and run times; when only part of the
   contenders fits, the file tier and Top-K ones are left out first, and the record says which and why), these
   contenders, timed interleaved (each round in a fresh seeded order), median of ``--repeats`` (>= 5) rounds
   after one warm-up call, each call ``--steps-per-call`` consecutive steps:

   - ``forward/backward``: ``jax.value_and_grad`` of the loss alone;
   - ``optax.adamw (HBM)``: ``nsp train``'s jitted step with ``optax.chain(clip_by_global_norm, adamw)``;
   - ``optax.adamw (pinned_host)``: MaxText's optimizer offload: the optax state placed with
     ``jax.device_put(x, NamedSharding(mesh, P(), memory_kind="pinned_host"))``, moved to device memory inside the
     jitted step for the update and back out to ``pinned_host`` as the step's output sharding;
   - ``nsp <tier>, s<staleness>, <dense|Top-K 1%>``: ``nsp.optim.adamw`` on a memory-tier and a file-tier store,
     staleness 0 and 1, dense and Top-K 1% (error feedback), after the same clipping. A call ends with
     ``store.barrier()`` (every update committed, the staleness-1 one too), timed as the drain; "steady" is a
     step between drains, as in a long run.

   Each contender's step is split into forward/backward (the forward/backward contender), link down (the gradient
   to the host), update, and link up (new params or state back): the update from the store's own counter
   (``update_ns``) for nsp, step - forward/backward for optax; link bytes from the store's counters
   (``shared_in_bytes``/``shared_out_bytes``) for nsp, the state's size for the pinned_host offload; link times
   from the store's counters where its handler keeps them, else the bytes at the link probe's GB/s (the record
   says which). The share of the update that staleness 1 hides is (t_fwd_bwd + t_update - t_step_stale1) /
   t_update, clipped to [0, 1], all from this run (t_update: the staleness-0 twin's update; t_step_stale1: its
   steady step).

Targets, judged at the batch x sequence the record names (``--batch``/``--seq``; by default batch 16 x 1024 tokens
at 124M, smaller batches at larger sizes where the attention's activations would not fit), for the headline
contender ``nsp memory, s1, dense``: staleness 1 hides >= 80% of the update (judged only where the
forward/backward takes at least as long as the update: the record says whether it does), its step <= 1.2x the
optax-in-HBM step, and faster than the pinned_host offload. A miss is written as MISSED.

Every contender runs inside its own try/except: an error becomes ``"status": "failed: <message>"`` and the run goes
on. Progress lines carry the time since start.

Where each part lives: this file holds the command line and the run's order (``main``, ``plan_larger``);
bench/gpu_step_common.py the names, settings, ``import nsp`` and the model; bench/gpu_step_checks.py the params
check and the link probe; bench/gpu_step_contenders.py the contenders and one size's run (``run_size``);
bench/gpu_step_summary.py the figures, targets and printed tables.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step_common import (CLIP, CONTENDERS, FWD_BWD, LR, NAME, NSP_IMPORT_ERROR, OPTAX_PINNED,  # noqa: E402
                             OPTIONAL_ORDER, REFERENCE, STATE_BYTES_PER_PARAM, T0, TOPK_RATIO, WEIGHT_DECAY,
                             device_memory, failed, log, memory_kinds, model_config, nsp_info, short_error)

import jax  # noqa: E402

from common import write_json  # noqa: E402
from gpu_step_checks import link_probe, params_check  # noqa: E402
from gpu_step_contenders import auto_shape, resource_problem, run_size  # noqa: E402
from gpu_step_summary import summary_lines  # noqa: E402

# The names tests and other scripts read from here.
__all__ = ["CONTENDERS", "FWD_BWD", "OPTAX_PINNED", "OPTIONAL_ORDER", "REFERENCE", "main", "plan_larger"]


# ---- main -----------------------------------------------------------------------------------------------------

def plan_larger(first: dict[str, Any], candidates: list[str], seq: int, batch_wanted: int, device, remaining: float,
                workdir_root: str) -> tuple[str | None, list[str], dict[str, Any]]:
    """The largest of ``candidates`` whose estimated time fits ``remaining`` seconds: with every contender, else
    with the core set. The estimate scales the first size's set-up and run by the params and its compile by the
    layers; returns (model, contenders to leave out, the estimates)."""
    timing, n1 = first.get("timing_s", {}), first["params"]
    layers1 = model_config(first["model"], first["seq"]).n_layer
    ran = [name for name, rec in first["contenders"].items() if "step_ms" in rec or rec.get("status") == "ok"]
    setup = {name: first["contenders"][name].get("setup_s", 0.0) for name in ran}
    run = {name: first["contenders"][name].get("warmup_s", 0.0) + sum(first["contenders"][name].get("times_s", []))
           for name in ran}
    compile_each = timing.get("compile", 0.0) / max(len(ran), 1)
    estimates: dict[str, Any] = {}
    for model in candidates:
        try:
            cfg = model_config(model, seq)
        except Exception as e:  # noqa: BLE001
            estimates[model] = {"error": short_error(e)}
            continue
        n = cfg.num_params()
        r_n, r_l = n / n1, cfg.n_layer / layers1
        b, t, _ = auto_shape(cfg, batch_wanted, seq, device)
        r_run = r_n * (b * t) / (first["batch"] * first["seq"])  # the forward/backward scales with the tokens too
        planned: dict[str, int] = {}
        fits = [name for name in ran if resource_problem(name, n, workdir_root, planned) is None]

        def store_init_s(name: str) -> float:  # writing the state into a store: ~1 GB/s to disk, ~4 GB/s in RAM
            rate = 1e9 if name.startswith("nsp file") else 4e9 if name.startswith("nsp") else math.inf
            return STATE_BYTES_PER_PARAM * (n - n1) / rate

        # Tracing and compiling grow with the layers, the steps with the params and tokens.
        cost = {name: setup[name] * r_l + store_init_s(name) + run[name] * r_run + compile_each * r_l
                for name in fits}
        whole = sum(cost.values()) + 10.0
        left_out: list[str] = [name for name in ran if name not in fits]
        total = whole
        for name in OPTIONAL_ORDER:
            if total <= remaining:
                break
            if name in cost:
                total -= cost[name]
                left_out.append(name)
        estimates[model] = {"params": n, "batch": b, "seq": t, "estimate_all_s": whole, "estimate_s": total,
                            "left_out_for_time": [x for x in left_out if x in fits], "left_out_for_resources":
                            [x for x in ran if x not in fits], "remaining_s": remaining}
        if total <= remaining:
            return model, left_out, estimates
    return None, [], estimates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    parser.add_argument("--platform", default=None,
                        help="the JAX platform to benchmark on (default: the default backend)")
    parser.add_argument("--out", "--json", dest="out", default=None,
                        help=f"where the record goes (default bench/results/{NAME}.json)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="the larger size runs only if its estimate fits what is left of this, and no round "
                             "starts after it (default 270; --quick: 120)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default=None, help="the first size (default gpt2-124m; --quick: tiny)")
    parser.add_argument("--larger", default=None,
                        help="comma-separated candidates for the larger size, largest first, or 'none' "
                             "(default gpt2-1.5b,gpt2-774m,gpt2-355m; --quick: small)")
    parser.add_argument("--batch", type=int, default=None, help="batch (default 16; --quick: 8); the sequence, "
                        "then the batch, is halved where the activations would not fit the device's memory")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --quick: 64)")
    parser.add_argument("--steps-per-call", type=int, default=None, help="steps per timed call (default 3; "
                        "--quick: 2)")
    parser.add_argument("--file-steps-per-call", type=int, default=2, help="steps per timed call, file tier")
    parser.add_argument("--check-steps", type=int, default=20)
    parser.add_argument("--check-model", default=None, help="the params check's model (default small; --quick: tiny)")
    parser.add_argument("--check-only", action="store_true", help="only the params check")
    parser.add_argument("--serial-compile", action="store_true", help="compile the contenders one at a time")
    parser.add_argument("--dir", default=None, help="where the file-tier stores go (default: a temp dir here)")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the benchmark protocol)")
    args.size = args.size or ("tiny" if args.quick else "gpt2-124m")
    larger = args.larger or ("small" if args.quick else "gpt2-1.5b,gpt2-774m,gpt2-355m")
    larger_candidates = [] if larger == "none" else [m.strip() for m in larger.split(",") if m.strip()]
    args.batch = args.batch or (8 if args.quick else 16)
    args.seq = args.seq or (64 if args.quick else 1024)
    args.steps_per_call = args.steps_per_call or (2 if args.quick else 3)
    check_model = args.check_model or ("tiny" if args.quick else "small")
    args.time_budget_s = args.time_budget_s or (120.0 if args.quick else 270.0)
    deadline = T0 + args.time_budget_s

    def on_term(signum, frame):  # a timeout's SIGTERM: leave through the finally blocks (record, temp files)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    platform = args.platform or jax.default_backend()
    record: dict[str, Any] = {"quick": args.quick, "status": "running", "nsp": nsp_info(), "sizes": {},
                              "skipped": {}, "config": {
                                  "time_budget_s": args.time_budget_s, "repeats": args.repeats,
                                  "steps_per_call": args.steps_per_call,
                                  "file_steps_per_call": args.file_steps_per_call, "batch": args.batch,
                                  "seq": args.seq, "first_size": args.size, "larger_candidates": larger_candidates,
                                  "check_model": check_model, "check_steps": args.check_steps, "lr": LR,
                                  "weight_decay": WEIGHT_DECAY, "clip": CLIP, "topk_ratio": TOPK_RATIO,
                                  "reference": REFERENCE}}
    out_path = {"path": None}

    def save() -> None:
        record["elapsed_s"] = time.perf_counter() - T0
        try:
            out_path["path"] = write_json(NAME, record, args.out)
        except Exception as e:  # noqa: BLE001
            log(f"could not write the record: {short_error(e)}")

    try:
        device = jax.devices(platform)[0]
        record["platform"] = device.platform
        record["device_kind"] = device.device_kind
        record["device"] = {"platform": device.platform, "device_kind": device.device_kind,
                            "count": len(jax.devices(platform)), "memory_kinds": memory_kinds(device),
                            "memory": device_memory(device), "default_backend": jax.default_backend()}
        if device.platform == "cpu":
            record["platform_note"] = (
                "the benchmark ran on the CPU: the params check compares CPU with CPU, and the pinned_host "
                "contender moves nothing (XLA:CPU's device memory and pinned_host are both host RAM)")
    except Exception as e:  # noqa: BLE001
        record["status"] = failed(e)
        save()
        log(f"no {platform} device: {short_error(e)}")
        return 2
    log(f"platform {device.platform} ({device.device_kind}), jax {jax.__version__}; nsp: {record['nsp']}")
    if NSP_IMPORT_ERROR is not None:
        record["status"] = "failed: import nsp: " + short_error(NSP_IMPORT_ERROR)
        save()
        return 2
    save()

    isa = record["nsp"].get("kernel_isa", "unknown")
    try:
        record["params_check"] = {"status": "running"}
        record["params_check"] = params_check(check_model, args.check_steps, 4, min(args.seq, 64), device, isa)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record["params_check"] = {"status": failed(e), "model": check_model, "steps": args.check_steps}
        log(f"params check: {record['params_check']['status']}")
    save()
    if args.check_only:
        record["status"] = "done (--check-only)"
        save()
        log(f"wrote {out_path['path']}")
        return 0

    workdir_root = tempfile.mkdtemp(prefix="nsp-gpu-step-", dir=args.dir or os.getcwd())
    try:
        try:
            cfg1 = model_config(args.size, args.seq)
            b1, t1, why1 = auto_shape(cfg1, args.batch, args.seq, device)
            record["probe"] = link_probe(device, cfg1.num_params(), 5)
            log(f"link probe: {record['probe']['bytes'] / 1e6:.0f} MB down {record['probe']['down_GBps']:.1f} GB/s, "
                f"up {record['probe']['up_GBps']:.1f} GB/s")
        except Exception as e:  # noqa: BLE001
            record["probe"] = {"status": failed(e)}
            b1, t1, why1 = args.batch, args.seq, "as given"
        save()
        first = None
        try:
            first = run_size(args.size, args.size, b1, t1, device, args, CONTENDERS, {}, deadline,
                             record.get("probe") if "bytes" in record.get("probe", {}) else None, record, save,
                             workdir_root)
            first["shape_choice"] = why1
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record["sizes"].setdefault(args.size, {})["status"] = failed(e)
        save()

        remaining = deadline - time.perf_counter()
        if not larger_candidates:
            record["skipped"]["larger size"] = "none asked for (--larger none)"
        elif first is None or not any("step_ms" in r for r in first.get("contenders", {}).values()):
            record["skipped"]["larger size"] = "the first size measured nothing to estimate from"
        else:
            model, left_out, estimates = plan_larger(first, larger_candidates, args.seq, args.batch, device,
                                                     remaining, workdir_root)
            record["larger_size_plan"] = estimates
            if model is None:
                record["skipped"]["larger size"] = (
                    f"no candidate fits the {remaining:.0f} s left of the {args.time_budget_s:.0f} s budget: "
                    + "; ".join(f"{m} ~{e.get('estimate_s', math.nan):.0f} s" for m, e in estimates.items()))
                log(f"larger size skipped: {record['skipped']['larger size']}")
            else:
                b, t, why = auto_shape(model_config(model, args.seq), args.batch, args.seq, device)
                skipped = {name: ("skipped: does not fit the time left at this size (its estimate)"
                                  if name in estimates[model]["left_out_for_time"] else
                                  "skipped: not enough disk or host RAM at this size")
                           for name in left_out}
                skipped.update({name: "skipped: it did not run at the first size" for name in CONTENDERS
                                if name not in skipped and "step_ms" not in first["contenders"].get(name, {})})
                log(f"larger size: {model} (estimate {estimates[model]['estimate_s']:.0f} s of {remaining:.0f} s "
                    f"left; {len(left_out)} contenders left out)")
                try:
                    size = run_size(model, model, b, t, device, args, CONTENDERS, skipped, deadline,
                                    record.get("probe") if "bytes" in record.get("probe", {}) else None, record,
                                    save, workdir_root)
                    size["shape_choice"] = why
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    record["sizes"].setdefault(model, {})["status"] = failed(e)
        record["status"] = "done"
    except BaseException as e:
        record["status"] = f"interrupted: {short_error(e)}"
        raise
    finally:
        shutil.rmtree(workdir_root, ignore_errors=True)
        record["summary"] = summary_lines(record)
        save()
        print()
        for line in record["summary"]:
            print(line)
        log(f"wrote {out_path['path']}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
