"""Command line: ``python -m cuattn info``, ``python -m cuattn build --arch sm_80,sm_90a``,
``python -m cuattn cache [--prune | --clear]`` and ``python -m cuattn bench
[forward|backward|decode|paged|overhead|all] [--dtype bf16|fp16] [--json FILE] [--from-json FILE]
[--plot FILE.png] [--quick]``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import _tools
from .bench import cli as bench_cli


def main(argv=None) -> int:
    # the console script `cuattn` and `python -m cuattn` take the same commands
    parser = argparse.ArgumentParser(prog="cuattn" if Path(sys.argv[0]).name == "cuattn" else "python -m cuattn",
                                     description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, device, arch, cache directory, cached kernels")
    build = commands.add_parser(
        "build",
        help="compile every kernel variant (no GPU needed); exit 1 on a compile error, a spill or serialised wgmma",
    )
    build.add_argument("--arch", default=",".join(_tools.DEFAULT_ARCHS),
                       help="comma-separated targets, e.g. sm_80,sm_90a (default: %(default)s)")
    build.add_argument("--kernels", action="append", default=None,
                       help="only variants whose name contains this (repeatable)")
    build.add_argument("--no-cache", action="store_true", help="recompile even when the cache has the cubin")
    build.add_argument("-v", "--verbose", action="store_true", help="log each compile")
    cache = commands.add_parser(
        "cache", help="the kernel cache: current and stale kernels per NVRTC version; --prune or --clear them")
    upkeep = cache.add_mutually_exclusive_group()
    upkeep.add_argument("--prune", action="store_true",
                        help="remove this NVRTC version's cached kernels that no current kernel variant has")
    upkeep.add_argument("--clear", action="store_true", help="remove the whole cache (every NVRTC version)")
    bench = bench_cli.add_parser(commands)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)

    if args.command == "bench":
        return bench_cli.main(bench, args, argv)

    if args.command == "info":
        print(_tools.format_info(_tools.info()))
        return 0
    if args.command == "cache":
        try:
            report = (_tools.clear_cache() if args.clear else _tools.prune_cache() if args.prune
                      else _tools.cache_report())
        except ImportError as exc:  # no CuPy / NVRTC: the current kernels' keys need its version
            print(f"python -m cuattn cache: {exc}", file=sys.stderr)
            return 1
        print(_tools.format_cache_report(report))
        return 0
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        rows = _tools.build(args.arch, args.kernels, use_cache=not args.no_cache)
    except ValueError as exc:
        parser.error(str(exc))
    except (ImportError, OSError) as exc:  # no CuPy / NVRTC, no kernel sources, a cache it cannot write: one line
        print(f"python -m cuattn build: {exc}", file=sys.stderr)
        return 1
    print(_tools.format_build_table(rows))
    failed = [r for r in rows if not r.ok]
    for row in failed:
        if row.error:
            print(f"\n{row.error}", file=sys.stderr)
    print(f"\n{len(rows)} kernel builds, {len(failed)} failed or spilled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
