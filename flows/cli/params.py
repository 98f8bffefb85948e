"""``nvrx-pipeline params``: every run parameter with its default and description."""

from __future__ import annotations

import argparse
from typing import Any

from flows.cli.common import EXIT_USAGE, command, emit, fail


def cmd_params(args: argparse.Namespace) -> int:
    from flows.param_docs import did_you_mean, format_table, params_docs

    docs = params_docs()
    if args.names:
        picked = [
            d for d in docs if any(d.name == n or d.name.startswith(f"{n}.") for n in args.names)
        ]
        if not picked:
            near = [m for n in args.names if (m := did_you_mean(n, docs))]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            return fail(f"no parameter named {' '.join(args.names)}{hint}", EXIT_USAGE)
        docs = picked
    return emit(args.json, [d.__dict__ for d in docs], format_table(docs))


def add(sub: Any) -> None:
    par = command(
        sub,
        "params",
        cmd_params,
        help="list every run parameter with its default and description",
        description="Every run parameter: its dotted name (what --set and a --config file's "
        "nesting take), type, default and description.",
    )
    par.add_argument("names", nargs="*", metavar="NAME", help="only these (a group: dataset)")
    par.add_argument("--json", action="store_true", help="a JSON list instead of text")
