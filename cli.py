"""The `radixlm` command. Subcommands: `serve` (the HTTP server); more can be added to _COMMANDS."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable

from radixlm.core.engine.options import EngineOptions

# Server flags; everything else `serve` accepts is an Engine option.
_SERVER_FLAGS = ("model_path", "host", "port", "api_key")


def _engine_option_flags(parser: argparse.ArgumentParser) -> None:
    """One --kebab-case flag per EngineOptions field, typed from its annotation. Flags left out are not
    passed, so the Engine's own defaults apply."""
    group = parser.add_argument_group("engine options (see radixlm.Engine)")
    hints = typing.get_type_hints(EngineOptions)
    for f in dataclasses.fields(EngineOptions):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        default = f" (default: {f.default})"
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help="flag" + default)
        else:
            group.add_argument(flag, type=base, default=argparse.SUPPRESS, metavar=base.__name__.upper(),
                               help=base.__name__ + default)


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and SGLang-native endpoints)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="HF-format checkpoint folder, .gguf file or hub id (org/name); omitted: the "
                        "embedded default model, SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint "
                                                   "but /health and /metrics")
    _engine_option_flags(p)
    return p


def _run_serve(ns: argparse.Namespace) -> int:
    from radixlm.core.engine.tp_worker import launched_rank, run_launched_rank
    from radixlm.server.app import ServerArgs
    from radixlm.server.launch import serve

    options = {k: v for k, v in vars(ns).items() if k not in _SERVER_FLAGS and k != "command"}
    if launched_rank():  # under torchrun, ranks 1.. follow rank 0's engine (docs/scale_out.md)
        run_launched_rank(ns.model_path, **options)
        return 0
    serve(ns.model_path, ServerArgs(host=ns.host, port=ns.port, api_key=ns.api_key), **options)
    return 0


_COMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {
    "serve": (_serve_parser, _run_serve),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixlm", description="radixlm: a fast runtime for LM programs")
    sub = parser.add_subparsers(dest="command", required=True)
    for build, _ in _COMMANDS.values():
        build(sub)
    ns = parser.parse_args(argv)
    try:
        return _COMMANDS[ns.command][1](ns)
    except ValueError as exc:  # an invalid Engine option: report it like a bad flag
        parser.exit(2, f"radixlm {ns.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
