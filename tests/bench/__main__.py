"""``make bench``: runs every ``tests/bench/bench_*.py`` (or the ones named on the command line),
prints each one's table and writes ``bench-results/<name>.json``.

A bench module exposes ``run(quick: bool) -> list[dict]``: rows of one table, every row measured
side by side in this same run (ratios, never absolute timings compared to a constant).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import tests.bench as bench_pkg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench")
    parser.add_argument("names", nargs="*", help="bench modules to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--size-mib", type=int,
                        help="state size of bench_checkpoint and bench_restore in MiB (default 1024; sets "
                             "BENCH_CHECKPOINT_MIB)")
    args = parser.parse_args(argv)
    if args.size_mib is not None:
        if args.size_mib < 1:
            parser.error(f"--size-mib {args.size_mib}: give a size of at least 1 MiB")
        os.environ["BENCH_CHECKPOINT_MIB"] = str(args.size_mib)
    names = args.names or sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name.startswith("bench_"))
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log keeps whole rows
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        module = importlib.import_module(f"tests.bench.{name if name.startswith('bench_') else 'bench_' + name}")
        console.rule(f"[bold]{module.__name__}")
        started = time.monotonic()
        try:
            rows = module.run(quick=args.quick)
        except Exception as err:  # a broken benchmark must not hide the others' results
            console.print(f"[red]{name} failed: {err!r}")
            failed += 1
            continue
        table = Table(title=(module.__doc__ or name).strip().splitlines()[0])
        for column in rows[0] if rows else []:
            table.add_column(str(column))
        for row in rows:
            table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
        console.print(table)
        (args.out / f"{module.__name__.rsplit('.', 1)[-1]}.json").write_text(
            json.dumps({"rows": rows, "seconds": time.monotonic() - started}, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
