"""The `radixlm` command. Subcommands: `serve` (the HTTP server) and `router` (a cache-aware HTTP front over
several servers, server/router); more can be added to _COMMANDS.

`serve`'s flags are generated from the option dataclasses (ServerArgs and EngineOptions): each field's
help text, choices and aliases are its documentation, so the two cannot drift apart. SGLang's names
come first; vLLM's common spellings (positional MODEL, --model, --max-model-len, -tp, ...) are aliases.
Checks that need no model (port free, device present, files and model path there) run before the model
loads, and a user mistake is one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.metadata
import os
import socket
import sys
import typing
from typing import Any, Callable

from radixlm.core.runtime.launcher import launched_rank
from radixlm.core.runtime.options import EngineOptions
from radixlm.server.args import ServerArgs


class UsageError(Exception):
    """A mistake in the command line, found before the model loads."""


def _version() -> str:
    return f"radixlm {importlib.metadata.version('radixlm')}"


def _add_option_flags(group: Any, options_class: type) -> None:
    """One flag per field (plus its aliases), typed from its annotation. Flags left out are not passed,
    so the dataclass's own defaults apply."""
    hints = typing.get_type_hints(options_class)
    for f in dataclasses.fields(options_class):
        meta = f.metadata  # a field declared without option() still gets a flag (test_cli asks for its help)
        names = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        shown = f.default not in (None, "", False) and base is not bool
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                  "help": meta.get("help", "") + (f" (default: {f.default})" if shown else "")}
        if base is bool:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(base) is list:
            group.add_argument(*names, nargs="+", metavar="VALUE", **kwargs)
        elif meta.get("choices"):
            group.add_argument(*names, type=base, choices=meta["choices"], **kwargs)
        else:
            group.add_argument(*names, type=base, metavar=base.__name__.upper(), **kwargs)


def options_table() -> str:
    """The flags of `radixlm serve` as the Markdown table in docs/server.md (a test keeps them equal)."""
    rows = ["| flag | default | meaning |", "|---|---|---|",
            "| `MODEL`, `--model-path`, `--model` | SmolLM2-135M-Instruct | model directory, GGUF file or hub id |"]
    return "\n".join(rows + _option_rows(ServerArgs) + _option_rows(EngineOptions)) + "\n"


def router_options_table() -> str:
    """The flags of `radixlm router` as the Markdown table in docs/scale_out.md (a test keeps them equal)."""
    from radixlm.server.router.args import RouterArgs

    return "\n".join(["| flag | default | meaning |", "|---|---|---|", *_option_rows(RouterArgs)]) + "\n"


def _option_rows(cls: type) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        names = ", ".join(f"`{n}`" for n in ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())])
        default = "" if f.default is None else f"`{f.default}`" if f.default != "" else '`""`'
        choices = f" (one of {', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
        rows.append(f"| {names} | {default} | {f.metadata.get('help', '')}{choices} |")
    return rows


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and SGLang-native endpoints)",
                       description="Serve a model over HTTP: the OpenAI API under /v1 and SGLang's native "
                                   "endpoints (docs/server.md).")
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory, GGUF file or hub id (vLLM style; same as --model-path)")
    p.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="model directory, GGUF file or hub id (org/name); default: the embedded default "
                        "model, SmolLM2-135M-Instruct")
    _add_option_flags(p.add_argument_group("server options"), ServerArgs)
    _add_option_flags(p.add_argument_group("engine options (radixlm.Engine keyword arguments)"), EngineOptions)
    return p


def _split(ns: argparse.Namespace) -> tuple[str | None, ServerArgs, dict[str, Any]]:
    values = {k: v for k, v in vars(ns).items() if k != "command"}
    positional, flag = values.pop("model"), values.pop("model_path")
    if positional and flag and positional != flag:
        raise UsageError(f"two models given: {positional!r} and --model-path {flag!r}")
    server_fields = {f.name for f in dataclasses.fields(ServerArgs)}
    server = ServerArgs(**{k: v for k, v in values.items() if k in server_fields})
    return positional or flag, server, {k: v for k, v in values.items() if k not in server_fields}


def _check_port(host: str, port: int) -> None:
    """Fails at once if another process listens on (host, port), instead of after the model loaded."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is already in use (pick another with --port)") from None
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _check_device(device: str | None) -> None:
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is available (torch {torch.__version__}); use --device cpu")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) present")


def _preflight(model_path: str | None, server: ServerArgs, engine_options: dict[str, Any]) -> None:
    """The checks that need no model, cheapest first."""
    _check_port(server.host, server.port)
    if (server.ssl_keyfile is None) != (server.ssl_certfile is None):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together")
    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(server, name)
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"--{name.replace('_', '-')} {path!r}: no such file")
    _check_device(engine_options.get("device"))
    if model_path is not None:  # a hub id is looked up (cache first) here, before anything loads
        from radixlm.core.runtime.models.hub import resolve_model_path

        resolve_model_path(model_path)


def _run_serve(ns: argparse.Namespace) -> int:
    model_path, server, options = _split(ns)
    if launched_rank():  # under torchrun, ranks 1.. follow rank 0's engine (docs/scale_out.md)
        from radixlm.core.runtime.distributed.tp_worker import run_launched_rank

        run_launched_rank(model_path, **options)
        return 0
    if options.get("node_rank", 0) > 0:  # machines 1.. of --nnodes run their ranks only (docs/scale_out.md)
        from radixlm.core.runtime.distributed.tp_worker import run_node

        run_node(model_path, **options)
        return 0
    _preflight(model_path, server, options)
    from radixlm.server.launch import serve

    return serve(model_path, server, exit_process=True, **options)


def _router_parser(sub: Any) -> argparse.ArgumentParser:
    from radixlm.server.router.args import RouterArgs

    p = sub.add_parser("router", help="route requests over several `radixlm serve` replicas by cached prefix",
                       description="An HTTP front over `radixlm serve` replicas (the same endpoints): each "
                                   "request goes to the replica most likely to hold its prefix in cache, "
                                   "within a load bound; unhealthy replicas are taken out, replicas join and "
                                   "leave at run time (docs/scale_out.md).")
    p.add_argument("--version", action="version", version=_version())
    _add_option_flags(p.add_argument_group("router options"), RouterArgs)
    return p


def _run_router(ns: argparse.Namespace) -> int:
    from radixlm.server.router.args import RouterArgs
    from radixlm.server.router.replicas import normalize_url

    args = RouterArgs(**{k: v for k, v in vars(ns).items() if k != "command"})
    _check_port(args.host, args.port)
    try:
        args.worker_urls = [normalize_url(u) for u in args.worker_urls or []]
    except ValueError as exc:
        raise UsageError(f"--worker-urls: {exc}") from None
    if args.worker_urls_file is not None and not os.path.isfile(args.worker_urls_file):
        raise UsageError(f"--worker-urls-file {args.worker_urls_file!r}: no such file")
    if args.worker_dns is not None and not args.worker_dns.rpartition(":")[2].isdigit():
        raise UsageError(f"--worker-dns {args.worker_dns!r}: expected NAME:PORT")
    from radixlm.server.router.launch import serve_router

    serve_router(args)
    return 0


_COMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {
    "serve": (_serve_parser, _run_serve),
    "router": (_router_parser, _run_router),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm", description="radixlm: a fast runtime for LM programs")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    for build, _ in _COMMANDS.values():
        build(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return _COMMANDS[ns.command][1](ns)
    # ValueError: an invalid Engine option or model; FileNotFoundError: a model directory without its files.
    except (UsageError, ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"radixlm {ns.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
