"""The ``nsp`` command: ``nsp train``, ``nsp features``, ``nsp launch``, ``nsp sample``, ``nsp ckpt list|show|export|reshard|delta|apply``,
``nsp store verify|copy|reidentify``, ``nsp plan``.

``nsp train`` with no arguments trains the ``small`` GPT on the Python standard library's source files with
its optimizer state on disk (RUN_DIR/store), printing progress and writing metrics and checkpoints to
``runs/default``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from nsp.train.config import TrainConfig


def _add_train_args(parser: argparse.ArgumentParser) -> None:
    helps = TrainConfig.fields_help()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        text = helps.get(field.name, "")
        if field.type in ("bool", bool):
            if field.default:
                parser.add_argument("--no-" + field.name.replace("_", "-"), dest=field.name, action="store_false",
                                    help=f"turn off: {text}")
            else:
                parser.add_argument(flag, dest=field.name, action="store_true", help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(field.type)]
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default,
                                help=f"{text} (default: {field.default!r})")


def _train(args: argparse.Namespace) -> int:
    import jax

    import nsp.distributed
    import nsp.storage
    from nsp.distributed import DistributedError
    from nsp.distributed.watchdog import exit_peer_lost
    from nsp.train.config import RunStopped
    from nsp.train.trainer import TrainError, train_and_evaluate

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    if values["bf16_params"]:
        from nsp.train.process import lean_malloc

        lean_malloc()

    def failed(message: str, status: int) -> int:
        # In a multi-process run the others learn this message and stop with it at once (they would otherwise
        # wait for this process, then say only that it stopped answering); this process leaves at once too.
        if nsp.distributed.stop.leaving():  # the watchdog stops this process, and has said why
            nsp.distributed.stop.leave(None, status)
        print(f"nsp train: error: {message}", file=sys.stderr)
        nsp.distributed.stop.stop_run(message, status)
        return status

    try:
        config = TrainConfig(**values)
        summary = train_and_evaluate(config)
    except RunStopped as e:  # stopped partway: what failed, what was kept, how to go on
        return failed(str(e), 1)
    except (TrainError, ValueError, DistributedError, nsp.storage.StoreError) as e:
        return failed(str(e), 2)
    except OSError as e:  # a directory of the run that cannot be made or written at set-up (a full disk, say)
        return failed(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}", 2)
    except jax.errors.JaxRuntimeError as e:
        # A collective of a run over several processes fails at once when a peer dies (its connections reset),
        # before the heartbeat would tell: the same stop as the watchdog's.
        if not nsp.distributed.is_multiprocess():
            raise
        exit_peer_lost(jax.process_index(), "a peer stopped answering in a collective (died, or the network "
                       f"broke): {str(e).splitlines()[0]}")
    return 130 if summary.get("interrupted") else 0


def _features(args: argparse.Namespace) -> int:
    """``nsp features``: a frozen backbone's features for ``nsp train --features`` (``nsp.train.features``)."""
    import nsp.storage
    from nsp.train.features import extract
    from nsp.train.trainer import TrainError

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    try:
        extract(TrainConfig(**values).resolved(), args.features_out, dtype=args.features_dtype,
                runs=args.features_runs)
    except (TrainError, ValueError, nsp.storage.StoreError) as e:
        print(f"nsp features: error: {e}", file=sys.stderr)
        return 2
    return 0


def _launch(args: argparse.Namespace) -> int:
    from nsp.distributed.launch import launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("nsp launch: give the command after --, e.g. nsp launch -n 2 -- nsp train --model tiny",
              file=sys.stderr)
        return 2
    return launch(command, args.n, args.devices_per_process, grace_s=args.grace)


def _checkpoint_step(manager, run_dir: Path, step: int | None) -> int:
    steps = sorted(manager.all_steps())
    if not steps:
        raise SystemExit(f"nsp: {run_dir / 'ckpt'} holds no checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise SystemExit(f"nsp: no checkpoint at step {step}; have {steps}")
    return step


def _restore_params(run_dir: Path, step: int | None, abstract_params):
    """The model params saved with a checkpoint (the train state's ``params``), shaped like ``abstract_params``."""
    import jax

    from nsp.storage import checkpoint as ckpt

    manager = ckpt.make_checkpoint_manager(run_dir / "ckpt", max_to_keep=None)
    step = _checkpoint_step(manager, run_dir, step)
    saved = ckpt.load_train_state(run_dir / "ckpt" / str(step))["params"]
    leaves = jax.tree_util.tree_leaves(saved)
    treedef = jax.tree_util.tree_structure(abstract_params)
    if len(leaves) != treedef.num_leaves:
        raise SystemExit(f"nsp: the checkpoint's params do not match the model in {run_dir / 'config.json'}")
    manager.close()
    return jax.tree_util.tree_unflatten(treedef, leaves), step


def _sample(args: argparse.Namespace) -> int:
    import jax
    from flax import nnx

    from nsp.models import GPT, generate, get_config
    from nsp.train.data import ByteTokenizer

    run_dir = Path(args.run_dir)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else None
    if config is None:
        raise SystemExit(f"nsp sample: {run_dir} holds no run (no config.json)")
    tokenizer = ByteTokenizer()
    # A classifier's run (--task classify) keeps the language model's head too (tied to the token embedding): it
    # samples text as any run does, its classifier's leaves restored beside.
    classes = config.get("classes", 0) if config.get("task") == "classify" else 0
    model_cfg = get_config(config["model"], vocab_size=tokenizer.vocab_size, num_classes=classes)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
    params, step = _restore_params(run_dir, args.step, abstract_params)
    model = nnx.merge(graphdef, params)
    prompt = tokenizer.encode(args.prompt).astype("int32")
    out = generate(model, prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, rng=args.seed)
    print(f"# {config['model']} at step {step}", file=sys.stderr)
    print(tokenizer.decode(jax.device_get(out)))
    return 0


def _ckpt_delta(args: argparse.Namespace) -> int:
    """``nsp ckpt delta OLD NEW OUT`` and ``nsp ckpt apply BASE DELTA OUT`` (``nsp.storage.delta``)."""
    from nsp.storage import StoreError, delta

    names = {"delta": "OLD NEW OUT", "apply": "BASE DELTA OUT"}[args.action]
    if len(args.paths) != 3:
        print(f"nsp ckpt {args.action}: give {names} (got {len(args.paths)} paths)", file=sys.stderr)
        return 2
    try:
        if args.action == "delta":
            manifest = delta.make_delta(*args.paths)
            print(f"{manifest.old.describe()} -> {manifest.new.describe()}: wrote {args.paths[2]}")
        else:
            manifest = delta.apply_delta(*args.paths, mode=args.mode)
            print(f"rebuilt {manifest.new.describe()} at {args.paths[2]} (checksums verified)")
    except StoreError as e:
        print(f"nsp ckpt {args.action}: {e}", file=sys.stderr)
        return 1
    print(manifest.stats.summary())
    return 0


def _ckpt_reshard(args: argparse.Namespace) -> int:
    """``nsp ckpt reshard CKPT OUT --shards M [--processes P]`` (``nsp.storage.reshard_checkpoint``)."""
    from nsp.storage import StoreError
    from nsp.storage.reshard_checkpoint import reshard_checkpoint

    if len(args.paths) != 2 or args.shards is None:
        print("nsp ckpt reshard: give CKPT OUT and --shards M (got "
              f"{len(args.paths)} paths{'' if args.shards else ', no --shards'})", file=sys.stderr)
        return 2
    try:
        done = reshard_checkpoint(args.paths[0], args.paths[1], args.shards, processes=args.processes)
    except StoreError as e:
        print(f"nsp ckpt reshard: {e}", file=sys.stderr)
        return 1
    print(f"step {done['step']} (store version {done['version']}): {done['from_shards']} shards on "
          f"{done['from_processes']} process(es) -> {done['num_shards']} on {done['processes']}, written to "
          f"{done['path']} ({done['written_bytes'] / 2**20:.1f} MiB in {done['seconds']:.1f} s)")
    return 0


def _ckpt_show(step_dir: Path, step: int) -> int:
    """``nsp ckpt show``: the step's store item as JSON, each part with the process that wrote it and whether it
    is there; exit status 1, naming the part, when one is missing or unfinished."""
    from nsp.storage import StoreError
    from nsp.storage import checkpoint as ckpt
    from nsp.storage.reshard import ItemSource
    from nsp.storage.reshard_checkpoint import read_step_meta

    item = step_dir / "store"
    try:
        parts = ItemSource(item, processes=read_step_meta(step_dir).get("process_count")).describe_parts()
    except StoreError as e:
        print(f"nsp ckpt show: {e}", file=sys.stderr)
        return 1
    missing = [p for p in parts if not p["present"]]
    if missing:
        print(json.dumps({"step": step, "path": str(step_dir), "parts": parts}, indent=1))
        for p in missing:
            print(f"nsp ckpt show: process {p['process']}'s part {p['path']} (shards {p['shards']}): "
                  f"{p.get('problem', 'missing')}", file=sys.stderr)
        return 1
    try:
        info = ckpt.load_store_item_info(item)
    except StoreError as e:
        print(f"nsp ckpt show: {e}", file=sys.stderr)
        return 1
    files = info.pop("files", [])
    info["files"] = len(files)
    info["bytes"] = sum(f["bytes"] for f in files)
    print(json.dumps({"step": step, "path": str(step_dir), "store": info, "parts": parts}, indent=1))
    return 0


def _ckpt(args: argparse.Namespace) -> int:
    from nsp.storage import StoreError
    from nsp.storage import checkpoint as ckpt

    if args.action in ("delta", "apply"):
        return _ckpt_delta(args)
    if args.action == "reshard":
        return _ckpt_reshard(args)
    if args.paths:
        print(f"nsp ckpt {args.action}: takes no paths (use --run-dir, --step, --out)", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    if not (run_dir / "ckpt").is_dir():
        raise SystemExit(f"nsp ckpt: {run_dir} holds no checkpoints (no {run_dir / 'ckpt'})")
    manager = ckpt.make_checkpoint_manager(run_dir / "ckpt", max_to_keep=None)
    steps = sorted(manager.all_steps())
    if args.action == "list":
        if not steps:
            print(f"no checkpoints in {run_dir / 'ckpt'}")
        for step in steps:
            info = ckpt.load_store_item_info(run_dir / "ckpt" / str(step) / "store")
            parts = f", {len(info['processes'])} processes" if "processes" in info else ""
            print(f"step {step}: store version {info['version']}{parts}, {run_dir / 'ckpt' / str(step)}")
        return 0
    step = _checkpoint_step(manager, run_dir, args.step)
    if args.action == "show":
        return _ckpt_show(run_dir / "ckpt" / str(step), step)
    if not args.out:
        raise SystemExit("nsp ckpt export: --out DIR is required")
    try:
        ckpt.export_checkpoint(run_dir / "ckpt" / str(step), Path(args.out))
    except StoreError as e:
        print(f"nsp ckpt export: {e}", file=sys.stderr)
        return 1
    print(f"exported step {step} to {args.out}")
    return 0


def _store(args: argparse.Namespace) -> int:
    import nsp.storage
    from nsp.storage import identity

    try:
        if args.action == "copy":
            if args.dest is None:
                raise SystemExit("nsp store copy: give SRC and DST")
            print(f"copied {args.path} to {identity.copy_store(args.path, args.dest)} (a new store id)")
            return 0
        if args.action == "reidentify":
            print(f"{args.path}: new store id {identity.reidentify(args.path)}")
            return 0
    except nsp.storage.StoreError as e:
        print(f"nsp store {args.action}: {e}", file=sys.stderr)
        return 1
    shards = None
    if args.shards:
        try:
            shards = sorted({int(i) for i in args.shards.split(",")})
        except ValueError:
            print(f"nsp store verify: --shards takes shard indices, as 2,3: got {args.shards!r}", file=sys.stderr)
            return 2
    try:
        with nsp.storage.open(args.path, shards=shards) as store:
            if not store.initialized:
                print(f"nsp store verify: {args.path} holds no state yet", file=sys.stderr)
                return 1
            report = store.verify()
    except nsp.storage.StoreError as e:
        print(f"nsp store verify: {e}", file=sys.stderr)
        return 1
    for problem in report["problems"]:
        print(f"CORRUPT: {problem}")
    status = "OK" if not report["problems"] else f"{len(report['problems'])} corrupt page(s)"
    which = f" (shards {','.join(map(str, shards))} of {store.num_shards})" if shards else ""
    print(f"{args.path}{which}: version {report['version']}, {report['pages']} pages, "
          f"{report['bytes'] / 1e6:.1f} MB checked: {status}")
    return 0 if not report["problems"] else 1


def _plan(args: argparse.Namespace) -> int:
    if args.activations:
        return _plan_activations(args)
    if args.model is None and args.params is None:
        print("nsp plan: error: give --model or --params (or --activations --run-dir RUN)", file=sys.stderr)
        return 2
    from nsp.csd import LinkFigures, Setting, paper
    from nsp.csd.plan import format_plan, plan

    try:
        if args.params is not None:
            try:
                params = int(float(args.params))
            except ValueError:
                raise ValueError(f"--params must be a number of parameters (e.g. 4e9), got {args.params!r}") from None
        else:
            from nsp.models import get_config

            params = get_config(args.model).num_params()
        figures = LinkFigures().with_overrides(**LinkFigures.parse_overrides(args.figure))
        compute = args.compute_s if args.compute_s is not None else (
            paper.compute_s(args.gpu, params) if args.gpu else 0.0)
        compress = args.compress_s if args.compress_s is not None else (
            paper.default_compress_s(args.gpu, params, args.dataflow, args.density) if args.gpu else 0.0)
        setting = Setting(params=params, compute_s=compute, density=args.density, dataflow=args.dataflow,
                          compress_s=compress)
        result = plan(setting, args.devices, figures, max_devices=args.max_devices)
    except ValueError as e:
        print(f"nsp plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result))
    return 0 if args.check is None else _plan_check(args, setting, figures)


def _plan_activations(args: argparse.Namespace) -> int:
    """``nsp plan --activations``: a run's offload plan (``RUN_DIR/offload_plan.json``) and, once it trained, its
    measured peak resident memory and median forward/backward time (of the steps after the first) beside it."""
    import json
    import statistics
    from pathlib import Path

    from nsp.offload.planner import describe, read_plan
    from nsp.train.activations import PLAN_FILE

    run_dir = Path(args.run_dir or "runs/default")
    path = run_dir / PLAN_FILE
    if not path.is_file():
        print(f"nsp plan: error: {path} does not exist: a run makes it with nsp train --offload-activations "
              "auto or a budget (e.g. 6GiB)", file=sys.stderr)
        return 2
    profile, plan = read_plan(path)
    measured = None
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [r for r in rows if "fwd_bwd_s" in r]
        if steps:
            later = [r["fwd_bwd_s"] for r in steps[1:]] or [steps[0]["fwd_bwd_s"]]
            measured = {"peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in steps),
                        "fwd_bwd_s": statistics.median(later)}
    print(describe(plan, profile, measured))
    if measured is None:
        print("  (no steps measured yet)")
    return 0


def _plan_check(args: argparse.Namespace, setting, figures) -> int:
    """``nsp plan --check DIR``: the prediction for a smaller state beside one real update of it on emulated
    devices (nsp.emulate). Times scale with the bytes, so a few pages per device tell whether the formulas
    describe the engine; exit status 1 when a scheme differs by more than the tolerance."""
    import dataclasses

    from nsp.emulate import EMULATED, PLAN_TOLERANCE, check_plan
    from nsp.csd.model import LABELS

    small = dataclasses.replace(setting, params=args.check_params_per_device * args.devices)
    print(f"\ncheck: {small.params:.3g} params ({args.check_params_per_device:.3g} per device) on {args.devices} "
          f"emulated csd devices in {args.check}, one update, nsp's dataflow")
    print(f"{'scheme':<8} {'plan s':>9} {'emulated s':>11} {'plan/emu':>9}")
    ok = True
    for scheme in EMULATED:
        row = check_plan(scheme, small, args.devices, figures, args.check)
        ok &= row["holds"]
        print(f"{LABELS[scheme]:<8} {row['predicted_s']:>9.4f} {row['emulated_s']:>11.4f} {row['ratio']:>9.3f}")
    print(f"plan within {PLAN_TOLERANCE:.0%} of the emulator: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nsp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT with its optimizer state in a storage tier")
    _add_train_args(train)
    train.set_defaults(func=_train)

    fe = sub.add_parser("features", help="write a frozen backbone's features for a Tuner (nsp train --features)",
                        description="Runs the embeddings and the first --freeze-layers blocks of the --init-from "
                        "model over the batches of steps 0 .. --steps - 1 (as nsp train would draw them: --data, "
                        "--batch, --seq, --seed) and writes their output and tokens to --features-out, one part per "
                        "process (nsp launch -n P -- nsp features ...: process p takes steps p, p + P, ...).")
    _add_train_args(fe)
    fe.add_argument("--features-out", required=True, help="the directory the features go to (new)")
    fe.add_argument("--features-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="bfloat16: half the bytes, lossy; float32: as an fp32 model computes them")
    fe.add_argument("--features-runs", type=int, default=1,
                    help="extract in this many sub-datasets of consecutive steps, each marked done as it is "
                    "written: nsp train --features run beside it trains on one while the next is extracted")
    fe.set_defaults(func=_features)

    la = sub.add_parser("launch", help="run a command as N local processes of one multi-process run",
                        description="Starts N processes of COMMAND with the JAX coordinator set (loopback, a free "
                        "port) and the CPU devices split, prefixes their output with [i], forwards Ctrl-C, and "
                        "exits non-zero if any process failed. Example: nsp launch -n 2 -- nsp train --model tiny")
    la.add_argument("-n", type=int, required=True, help="number of processes")
    la.add_argument("--devices-per-process", type=int, default=1,
                    help="CPU devices each process sees (default 1)")
    la.add_argument("--grace", type=float, default=30.0,
                    help="seconds the others get to stop after one fails, before they are killed (default 30)")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    la.set_defaults(func=_launch)

    sample = sub.add_parser("sample", help="generate text from a run's latest (or given) checkpoint")
    sample.add_argument("--run-dir", default="runs/default")
    sample.add_argument("--step", type=int, default=None)
    sample.add_argument("--prompt", default="def ")
    sample.add_argument("--tokens", type=int, default=200)
    sample.add_argument("--temperature", type=float, default=0.8)
    sample.add_argument("--top-k", type=int, default=40)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=_sample)

    ck = sub.add_parser("ckpt", help="list, show, export or reshard a run's checkpoints; make or apply a delta "
                        "between two",
                        description="list, show, export: a run's checkpoints (--run-dir, --step, --out); show tells "
                        "for each part of the store which process wrote it and whether it is there (exit status 1 "
                        "naming a missing part); export writes one directory that plain orbax opens on one process, "
                        "whatever number of processes wrote the step. "
                        "reshard CKPT OUT --shards M [--processes P]: checkpoint step CKPT (or a checkpoint "
                        "directory: its newest step) written again as OUT/STEP for a run of P processes with M store "
                        "shards in all (one a device): store pages re-cut, Top-K residual re-cut, bit for bit "
                        "(nsp train --resume on another layout does this itself). "
                        "delta OLD NEW OUT: the files and pages of checkpoint NEW that checkpoint OLD does not hold "
                        "(two step directories or snapshots, any two versions), with a manifest, into OUT. "
                        "apply BASE DELTA OUT: rebuilds NEW bit for bit into OUT from BASE (the delta's OLD) and "
                        "DELTA, checking every checksum.")
    ck.add_argument("action", choices=["list", "show", "export", "reshard", "delta", "apply"])
    ck.add_argument("paths", nargs="*", help="reshard: CKPT OUT; delta: OLD NEW OUT; apply: BASE DELTA OUT")
    ck.add_argument("--run-dir", default="runs/default")
    ck.add_argument("--step", type=int, default=None)
    ck.add_argument("--out", default=None, help="export: directory of the plain orbax checkpoint")
    ck.add_argument("--mode", choices=["auto", "copy"], default="auto",
                    help="apply: hard-link BASE's and DELTA's files into OUT where possible (auto), or copy them")
    ck.add_argument("--shards", type=int, default=None,
                    help="reshard: store shards of the new layout in all (processes x devices per process)")
    ck.add_argument("--processes", type=int, default=1,
                    help="reshard: processes of the new layout (default 1): the store is split into their parts")
    ck.set_defaults(func=_ckpt)

    st = sub.add_parser("store", help="check, copy or re-identify a state store")
    st.add_argument("action", choices=["verify", "copy", "reidentify"],
                    help="verify: read every page of the committed version and check its checksum and place; "
                    "copy PATH DEST: an independent copy under a new store id, every shard inside DEST; "
                    "reidentify: a new store id for a store copied with cp -a, or moved with shards outside it")
    st.add_argument("path", help="the store directory")
    st.add_argument("dest", nargs="?", default=None, help="copy: the new store's directory")
    st.add_argument("--shards", default=None,
                    help="verify: only these shards (comma-separated indices): one process's part of a "
                    "multi-process run's store, STORE_DIR/process-NNNNN, holds only that process's shards")
    st.set_defaults(func=_store)

    pl = sub.add_parser("plan", help="predict step time and traffic on N computational-storage devices (nsp.csd)")
    size = pl.add_mutually_exclusive_group()
    size.add_argument("--model", help="a model config name (as nsp train --model), sized with its own vocabulary")
    size.add_argument("--params", help="a parameter count, e.g. 4e9")
    pl.add_argument("--devices", type=int, default=1, help="storage devices, one store shard each (default 1)")
    pl.add_argument("--max-devices", type=int, default=None,
                    help="search the best scheme over 1..this many devices (default: --devices)")
    pl.add_argument("--compute-s", type=float, default=None, help="forward + backward seconds per step")
    pl.add_argument("--gpu", choices=["a5000", "a100"], default=None,
                    help="forward + backward as derived for Smart-Infinity's GPUs (nsp.csd.paper); with "
                    "--dataflow paper, also SU+O+C's Top-K selection on them")
    pl.add_argument("--compress-s", type=float, default=None,
                    help="seconds per step the accelerator spends selecting SU+O+C's Top-K (default 0, or as "
                    "derived with --gpu and --dataflow paper)")
    pl.add_argument("--density", type=float, default=0.01, help="Top-K kept fraction of SU+O+C (default 0.01)")
    pl.add_argument("--dataflow", choices=["nsp", "paper"], default="nsp",
                    help="nsp: gradients into the devices' buffers, params out of them, I/O and updates "
                    "overlapped; paper: both through the SSDs, and each device's transfers and updates in turn (one "
                    "buffer set), as Smart-Infinity (default nsp)")
    pl.add_argument("--figure", action="append", default=[], metavar="NAME=GBPS",
                    help="override a link figure of nsp.csd.LinkFigures, e.g. shared_gbps=16 (repeatable)")
    pl.add_argument("--check", metavar="DIR", default=None,
                    help="also run one update of a smaller state on --devices emulated csd devices in DIR and "
                    "print the plan beside it (exit status 1 when they differ by more than 10%%)")
    pl.add_argument("--check-params-per-device", type=int, default=1 << 23,
                    help="params per emulated device for --check (default 8388608: 8 pages of 4 MiB per state)")
    pl.add_argument("--activations", action="store_true",
                    help="instead: the activation offload plan a run made (nsp train --offload-activations "
                    "auto|BUDGET: FlashNeuron's planner, run at set-up) beside what the run measured")
    pl.add_argument("--run-dir", default=None, help="--activations: the run's directory (default runs/default)")
    pl.set_defaults(func=_plan)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
