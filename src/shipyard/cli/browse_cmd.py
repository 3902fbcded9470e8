"""shipyard browse: the open lab as a local web app (or a static site) over a pipeline root or a run."""

from __future__ import annotations

import sys
from pathlib import Path

from shipyard.errors import ConfigError


def _cmd_browse(args) -> int:
    from shipyard import storage
    from shipyard.browse.site import open_site

    for flag, value in (("ROOT", args.root), ("--static", args.static)):
        if value is not None and "\x00" in str(value):
            raise ConfigError(f"{flag}: {str(value)!r} holds a NUL byte; expected a directory path")

    if args.static is None and not 0 < args.port < 65536:
        raise ConfigError(f"--port: {args.port} is not a port number; expected 1..65535")
    url = storage.is_url(str(args.root))
    if args.static is not None:
        from shipyard.browse.static import check_output

        check_output(None if url else Path(args.root), args.static)  # (before any slow work)
    root = str(args.root) if url else Path(args.root)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    site = open_site(root, verify=not args.no_verify, live=args.static is None, say=say)
    bad = [n.key for n in site.nodes if n.status in ("differs", "upstream")]
    print(
        f"browse: {len(site.nodes)} steps of {storage.redact(str(args.root))} re-hashed in {site.verify_seconds:.1f} s"
        + (f"; {len(bad)} differ: {', '.join(bad)}" if bad else ""),
        file=sys.stderr,
    )
    if args.static is not None:
        from shipyard.browse.static import write_static

        paths = write_static(site, args.static)
        print(
            f"browse: wrote {len(paths)} pages to {args.static} (open {args.static / 'index.html'})",
            file=sys.stderr,
        )
        return 0
    from shipyard.browse.server import serve

    where = f"http://{args.host}:{args.port}/" + (f"?token={args.token}" if args.token else "")
    print(f"browse: serving {storage.redact(str(args.root))} at {where}", file=sys.stderr)
    serve(site, args.host, args.port, args.token)
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    p = sub.add_parser(
        "browse",
        help="a local web app over a pipeline root or run directory: artifact graph, data, batches, runs, model, trace",
        description="Serve ROOT's pages on 127.0.0.1 (or write them as a static site with --static OUT). "
        "Every step's artifacts are re-hashed at start-up, and the server re-checks them before each page "
        "(a file is read again only when its size, mtime, ctime or inode changed); nothing is written to ROOT.",
    )
    p.add_argument(
        "root",
        metavar="ROOT",
        help="a pipeline root (shipyard run / quickstart) or a run directory",
    )
    p.add_argument(
        "--static",
        type=Path,
        metavar="OUT",
        help="write the pages as a static site into the new directory OUT",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--token", help="an access token every request must carry (?token=...; then a cookie)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip re-hashing and re-checking the artifacts (statuses show as not verified)",
    )
    p.set_defaults(func=_cmd_browse)
