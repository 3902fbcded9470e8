"""shipyard train and launch: one training process, or several as one JAX cluster."""

from __future__ import annotations

from pathlib import Path

from shipyard.cli.args import CONFIG_HELP, load_config_arg, whole_number
from shipyard.errors import ConfigError
from shipyard.storage import is_url

CACHE_ENV = "SHIPYARD_RUN_CACHE"  # run/remote.py's (not imported here: the CLI starts fast)


def path_or_url(value: str) -> Path | str:
    """A run directory argument: a URL stays a string (Path would fold s3:// into s3:/)."""
    return value if is_url(value) else Path(value)


def _cmd_train(args) -> int:

    cfg = load_config_arg(args.config, args.overrides, "train")
    from shipyard.train.trainer import train

    profile = None
    if args.profile_steps is not None:
        a, sep, b = args.profile_steps.partition(":")
        if not (sep and a.isdigit() and b.isdigit() and int(a) <= int(b) < cfg.train.steps):
            raise ConfigError(
                f"--profile-steps: {args.profile_steps!r}; expected A:B with 0 <= A <= B < train.steps={cfg.train.steps}"
            )
        profile = (int(a), int(b))
    train(
        cfg,
        run_dir=args.run_dir,
        overwrite=args.overwrite,
        resume=args.resume,
        debug_nans=args.debug_nans,
        profile_steps=profile,
    )
    return 0


def _cmd_launch(args) -> int:
    from shipyard.parallel.launch import launch_local, launch_ray

    load_config_arg(
        args.config, args.overrides, "launch"
    )  # a bad config fails here, once, not in every process
    train_args = [args.config, *args.overrides]
    if args.run_dir is not None:
        train_args += ["--run-dir", str(args.run_dir)]
    train_args += [flag for flag, on in (("--resume", args.resume), ("--overwrite", args.overwrite)) if on]
    if args.ray:
        return launch_ray(args.ray, args.processes, train_args, args.devices_per_process)
    if args.processes is None:
        raise ConfigError("launch: give --processes N (local) or --ray ADDRESS")
    return launch_local(args.processes, train_args, args.devices_per_process)


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    tr = sub.add_parser("train", help="train a model")
    tr.add_argument("config", help=CONFIG_HELP)
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    tr.add_argument(
        "--run-dir",
        type=path_or_url,
        default=None,
        help="run directory (default: run.out_dir/run.name); a URL (s3://bucket/runs/x) trains in a local "
        f"working copy (under the user cache, or ${CACHE_ENV}) published to the bucket as it goes",
    )
    tr.add_argument("--overwrite", action="store_true", help="replace an existing run in the run directory")
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run directory from its newest usable checkpoint (start it if there is none)",
    )
    tr.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="record a JAX profiler trace of steps A..B (inclusive) into <run>/profile",
    )
    tr.add_argument(
        "--debug-nans",
        action="store_true",
        help="turn on JAX NaN and Inf checking (slow): the first operation producing one raises, with its traceback",
    )
    tr.set_defaults(func=_cmd_train)

    la = sub.add_parser("launch", help="run `train` as one JAX cluster of several processes (local or Ray)")
    la.add_argument("config", help=CONFIG_HELP)
    la.add_argument("overrides", nargs="*", help="dotted overrides, passed to every process")
    la.add_argument("--processes", type=int, default=None, help="number of processes (local: required)")
    la.add_argument(
        "--ray", default=None, metavar="ADDRESS", help="Ray cluster address (e.g. auto or host:6379)"
    )
    la.add_argument(
        "--devices-per-process",
        type=whole_number(1),
        default=None,
        help="CPU testing: host devices each process exposes",
    )
    la.add_argument(
        "--run-dir", type=path_or_url, default=None, help="run directory (shared by all processes)"
    )
    la.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint")
    la.add_argument("--overwrite", action="store_true", help="replace an existing run")
    la.set_defaults(func=_cmd_launch)
