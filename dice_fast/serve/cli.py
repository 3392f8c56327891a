"""``dice-fast serve`` and ``dice-fast bench-serve``: their arguments and commands, registered by
`dice_fast.cli`. Registering imports neither fastapi, uvicorn nor httpx; the commands import them."""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from ..reuse.persistent import SERVE_MAX_GB
from ..cliargs import add_cache_arguments, add_encoder_arguments, bounded, make_encoder
from ..errors import OptionError, require
from .limits import DEFAULT_CACHE_MEMORY_MB, DEFAULT_LIMITS, HTTP_LIMITS, LIMITS, check_limits
from .server import SERVER_LIMITS

ENV_PREFIX = "DICE_FAST_"
API_KEY_ENV = ENV_PREFIX + "API_KEY"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# variables of dice_fast read elsewhere than a serve flag (the engine's CPU kernels and caches)
OTHER_VARIABLES = ("DICE_FAST_CACHE_DIR", "DICE_FAST_CPU_", "DICE_FAST_CSRC",
                   "DICE_FAST_INT8_ANY_CPU")


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """The server's limits (see `AsyncDiceEncoder`)."""
    g = p.add_argument_group("limits (over a limit: 413 for an oversize request, 429 + Retry-After when busy)")
    for name, (default, meaning) in {**HTTP_LIMITS, **LIMITS}.items():
        shown = "" if default is None else f" (default {default})"
        g.add_argument("--" + name.replace("_", "-"), type=float if isinstance(default, float) else int,
                       default=default, help=meaning + shown)
    g.add_argument("--auto-truncate", action="store_true",
                   help="cut a query longer than the model window to it and list it in the response's "
                        "usage.truncated_inputs (default: refuse it with 413 naming the input)")
    g.add_argument("--no-cross-request-batching", dest="cross_request_batching", action="store_false",
                   help="run one request at a time, alone in its batches (a baseline for benchmarks)")


def add_server_arguments(g) -> None:
    """The connection bounds (`dice_fast.serve.server.SERVER_LIMITS`) and the Host allow-list."""
    for name, (default, meaning) in SERVER_LIMITS.items():
        g.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=f"{meaning} (default {default:g})")
    g.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="comma-separated Host names answered besides the bound address (and loopback's names when "
                        "bound to loopback, every IP address when bound to 0.0.0.0); '*': any Host. Others get 400, "
                        "so a web page cannot reach the server through DNS rebinding")


def environment_defaults(p: argparse.ArgumentParser, environ=os.environ) -> None:
    """Let every long flag of ``p`` be set from ``$DICE_FAST_<FLAG>`` (``--max-queue-tokens``:
    ``DICE_FAST_MAX_QUEUE_TOKENS``; a switch takes 1/true/yes/on or 0/false/no/off; an empty variable is
    unset, but for an option whose values include the empty text: a prefix's "none"), as TEI does; the
    flag wins over the variable. Each flag's help names its variable. A bad value is an error when the
    command parses its arguments (``p.set_defaults(environment_errors=...)``); a ``DICE_FAST_`` variable
    that is neither a flag's nor in `OTHER_VARIABLES` (``DICE_FAST_NORMALIZE`` for
    ``DICE_FAST_NO_NORMALIZE``) a warning (``environment_warnings``)."""
    errors, names = [], []
    for action in p._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        env = ENV_PREFIX + longs[0][2:].replace("-", "_").upper()
        action.help = f"{action.help or ''} [env: {env}]".strip()
        names.append(env)
        value = environ.get(env)
        if action.dest == "api_key" or value is None or value == "" and not getattr(action, "empty_text", False):
            continue  # (the key: see api_key(), which reads it last)
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            if value.strip().lower() not in _TRUE + _FALSE:
                errors.append(f"${env}={value[:40]!r}: expected one of {', '.join(_TRUE)} or {', '.join(_FALSE)}")
                continue
            on = value.strip().lower() in _TRUE
            action.default = on if isinstance(action, argparse.BooleanOptionalAction) else (
                action.const if on else not action.const)
        elif action.choices is not None and value not in action.choices:
            errors.append(f"${env}={value[:40]!r}: expected one of {', '.join(map(str, action.choices))}")
        else:
            try:  # converted here, so that a bad value names the variable, not the flag
                action.default = action.type(value) if callable(action.type) else value
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                errors.append(f"${env}={value[:40]!r}: {exc}")
    unknown = sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in names
                     and not v.startswith(OTHER_VARIABLES))
    warnings = [f"${v} is not a variable of dice-fast serve; ignored"
                + "".join(f" (did you mean ${m}?)" for m in difflib.get_close_matches(v, names, 1, 0.8))
                for v in unknown]
    p.set_defaults(environment_errors=errors, environment_warnings=warnings)


def limits(args) -> dict:
    """The `AsyncDiceEncoder` keyword arguments named by `add_limit_arguments`."""
    out = {name: getattr(args, name) for name in DEFAULT_LIMITS}
    out["cross_request_batching"] = args.cross_request_batching
    out["auto_truncate"] = args.auto_truncate
    return out


def api_key(args, environ=os.environ) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` (its first line) or ``$DICE_FAST_API_KEY``, in that
    order; None when none is given. A source that is given but empty is an error, never an open server."""
    from .guards import check_api_key

    key_file = args.api_key_file
    if args.api_key is not None and key_file is not None:
        if key_file != environ.get(f"{API_KEY_ENV}_FILE"):
            raise ValueError("give --api-key or --api-key-file, not both")
        key_file = None  # the flag wins over the variable, as for every flag
    if key_file is not None:
        with open(key_file, encoding="utf-8") as f:
            key, source = f.readline().strip(), f"--api-key-file {key_file}"
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_ENV in environ:
        key, source = environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    try:
        return check_api_key(key)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def register_cli(subparsers) -> None:
    """Add the ``serve`` and ``bench-serve`` subcommands to ``subparsers``."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible embeddings server with cross-request batching",
        description="Serve POST /v1/embeddings (OpenAI-shaped; input_type document|query), POST /v1/evidence, "
        "GET /health, GET /v1/models and GET /metrics on uvicorn. Requests share packed batches under the token "
        "budget. SIGTERM or Ctrl-C stops accepting, finishes the requests in flight, then exits. Every flag can "
        f"also be set from the environment ({ENV_PREFIX}<FLAG>, named in each flag's help); the flag wins. "
        "See docs/serving.md.",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--served-model-name", default=None,
                   help="model name in responses and /v1/models (default: the model folder's name)")
    g.add_argument("--graceful-timeout", type=bounded(float, 0), default=30.0,
                   help="seconds to finish requests in flight after SIGTERM before cancelling them, and then as long for a "
                        "forward still running (default 30)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's and dice_fast's log level (default info)")
    g.add_argument("--no-access-log", action="store_true", help="do not log every request")
    add_server_arguments(p.add_argument_group("connections (what is left for a reverse proxy: docs/serving.md)"))
    a = p.add_argument_group("authentication (every route but /health; see docs/serving.md)")
    a.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (visible in ps: prefer ${API_KEY_ENV} or --api-key-file)")
    a.add_argument("--api-key-file", default=None, help="read the key from this file's first line")
    # testing aid for benchmarks/soak.py only: fail this fraction of forwards with torch.OutOfMemoryError
    g.add_argument("--testing-inject-oom", type=float, default=0.0, help=argparse.SUPPRESS)
    add_limit_arguments(p)
    add_encoder_arguments(p)
    add_cache_arguments(p, default_max_gb=SERVE_MAX_GB).add_argument(
        "--cache-memory-mb", type=int, default=DEFAULT_CACHE_MEMORY_MB, metavar="N",
        help=f"chunk vectors kept in memory across requests, in front of --cache (default {DEFAULT_CACHE_MEMORY_MB}; "
        "0: none)")
    environment_defaults(p)
    p.set_defaults(func=cmd_serve)

    b = subparsers.add_parser(
        "bench-serve", help="closed-loop load against the server vs offline encode_documents",
        description="Start `dice-fast serve` twice (cross-request batching on and off) in subprocesses on "
        "127.0.0.1, drive each with closed-loop clients at several concurrencies over one corpus, and report "
        "documents/s, tokens/s, p50/p99 latency and the ratio to offline encode_documents in this process.",
    )
    g = b.add_argument_group("benchmark")
    g.add_argument("--concurrency", default="1,8,64", help="client counts, comma-separated (default 1,8,64)")
    g.add_argument("--docs", type=int, default=256, help="documents in the corpus (default 256)")
    g.add_argument("--min-tokens", type=int, default=32, help="shortest document in tokens (default 32)")
    g.add_argument("--max-tokens", type=int, default=2048, help="longest document in tokens (default 2048)")
    g.add_argument("--docs-per-request", type=int, default=1, help="documents in each request (default 1)")
    g.add_argument("--encoding-format", choices=("float", "base64"), default="base64",
                   help="the vectors' encoding the clients ask for (default base64)")
    g.add_argument("--passes", type=int, default=1, help="times the clients go through the corpus (default 1)")
    g.add_argument("--offline-repeats", type=int, default=3,
                   help="timed offline runs; their median is the reference (default 3)")
    g.add_argument("--timeout", type=bounded(float, 0, above=True), default=600.0,
                   help="give up on a run after this many seconds (default 600)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpus (default 0)")
    g.add_argument("--csv", default=None, help="append the rows to this CSV")
    g.add_argument("--no-baseline", action="store_true", help="skip the server without cross-request batching")
    add_encoder_arguments(b)
    b.set_defaults(func=cmd_bench_serve)


def _need_serve_extra() -> None:
    """`MissingDependency` naming the extra unless the server's packages are installed (it said only
    "No module named 'fastapi'"); nothing imported yet."""
    require(*_SERVE_MODULES, extra="serve", needed_by="the server", load=False)


_SERVE_MODULES = ("fastapi", "uvicorn", "httpx", "orjson", "prometheus_client")


def cmd_serve(args) -> int:
    import warnings

    _need_serve_extra()
    from .app import create_app
    from .guards import allowed_hosts
    from .server import (SERVER_DEFAULTS, check_server_limits, draining_server, ensure_open_files, log_config,
                         server_config)

    # a query over the window is cut to it, as offline; one warning per such request would flood the log
    warnings.filterwarnings("ignore", message=r".*longer than the model window", category=UserWarning)

    for said in getattr(args, "environment_warnings", ()):  # a misnamed variable may explain the refusal below
        print(f"dice-fast serve: warning: {said}", file=sys.stderr)
    if getattr(args, "environment_errors", None):
        raise ValueError("; ".join(args.environment_errors))
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    # every limit's range, before the model loads (the constructors check them again)
    check_limits(**{name: getattr(args, name) for name in DEFAULT_LIMITS}, cache_memory_mb=args.cache_memory_mb,
                 max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout)
    check_server_limits(**{name: getattr(args, name) for name in SERVER_DEFAULTS})
    ensure_open_files(args.max_connections)  # before the model loads
    key = api_key(args)
    _check_listenable(args.host, args.port)
    encoder = make_encoder(args)
    if args.testing_inject_oom:
        from .fault_injection import inject_oom

        inject_oom(encoder.model, args.testing_inject_oom)
    hosts = allowed_hosts(args.host, args.allowed_hosts.split(","))
    app = create_app(encoder, model_name=args.served_model_name, api_key=key, max_body_bytes=args.max_body_bytes,
                     allowed_hosts=hosts, read_timeout=args.read_timeout, cache_memory_mb=args.cache_memory_mb,
                     shutdown_timeout=args.graceful_timeout, **limits(args))
    if encoder.cache is not None:
        print(f"dice-fast serve: chunk cache {encoder.cache.cache!r}", flush=True)
    print(f"dice-fast serve: {encoder!r}", flush=True)
    print(f"dice-fast serve: {app.state.core!r}, max_body_bytes={app.state.max_body_bytes}", flush=True)
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dice-fast serve: WARNING: listening on {args.host} without an API key; anyone who can reach it "
              f"can use the model (set ${API_KEY_ENV} or --api-key-file)", file=sys.stderr, flush=True)
    print(f"dice-fast serve: answering Host {', '.join(hosts)}", flush=True)
    config = server_config(app, host=args.host, port=args.port, log_level=args.log_level,
                           log_config=log_config(args.log_level),
                           access_log=not args.no_access_log, timeout_graceful_shutdown=args.graceful_timeout,
                           lifespan="on", **{name: getattr(args, name) for name in SERVER_DEFAULTS})
    draining_server(app.state.core)(config).run()
    state, why = app.state.core.health
    status = 0
    if state == "unhealthy":  # a status for the supervisor (systemd Restart=on-failure, a container's policy)
        print(f"dice-fast serve: error: the encoder stopped ({why}); exit status 3", file=sys.stderr)
        status = 3
    if getattr(app.state, "worker_left", False):  # a thread still inside a forward: interpreter shutdown
        sys.stdout.flush()  # could abort in C++ ("terminate called without an active exception")
        sys.stderr.flush()
        os._exit(status)
    return status


def _check_listenable(host: str, port: int) -> None:
    """Refuse, before the model loads, an address this process cannot listen on (a port in use, a host
    that is not this machine's): uvicorn found out after the load and exited 3 with its own log."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:  # socket.gaierror too
        raise OptionError(f"cannot listen on --host {host} --port {port}: {exc.strerror or exc}") from None


def cmd_bench_serve(args) -> int:
    _need_serve_extra()
    from .bench import run_bench_serve

    return run_bench_serve(args)
