"""What a client can put in front of the server, against a real uvicorn on 127.0.0.1: no error quotes
more than a few dozen characters of any field it was sent, a Host the server is not bound to is
refused (no browser open proxy), and every ``dice-fast serve`` flag can come from the environment."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from dice_fast.serve import create_app
from dice_fast.serve.guards import allowed_hosts, host_name
from serve_testing import ServerThread

HUGE = "x" * (1 << 20)  # 1 MB of one letter: no message may carry 50 of them
JSON = {"Content-Type": "application/json"}
EMBEDDING_FIELDS = ["model", "encoding_format", "input_type", "dimensions", "user", "return_chunks"]
EVIDENCE_FIELDS = ["query", "documents", "scoring", "alpha"]


@pytest.fixture(scope="module")
def server(tiny_encoder):
    app = create_app(tiny_encoder, allowed_hosts=allowed_hosts("127.0.0.1", ["embed.example.com"]),
                     max_body_bytes=8 << 20, max_input_chars=16)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        s.wait_ready()
        yield http


def check_short(r: httpx.Response, what: str, ok: bool = False) -> dict | None:
    """The answer quotes none of a huge value; a 4xx error, or with ``ok`` maybe a 200 (a field taken
    as sent but never echoed: model, user)."""
    assert "x" * 50 not in r.text, f"{what}: the answer echoes the value sent: {r.text[:300]}"
    if ok and r.status_code == 200:
        return None
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert len(error["message"]) < 400 and (error["param"] is None or len(error["param"]) <= 50), what
    return error


@pytest.mark.parametrize("value", [HUGE, [HUGE], {HUGE: HUGE}, [[HUGE]]], ids=["string", "list", "object", "nested"])
def test_no_error_quotes_more_than_a_few_dozen_characters_of_any_field(server, value):
    for field in EMBEDDING_FIELDS:
        check_short(server.post("/v1/embeddings", json={"input": "word", field: value}), f"embeddings {field}",
                    ok=field in ("model", "user"))
    check_short(server.post("/v1/embeddings", json={"input": value}), "embeddings input")
    for field in EVIDENCE_FIELDS:
        body = {"query": "word", "documents": ["word"], field: value}
        check_short(server.post("/v1/evidence", json=body), f"evidence {field}")


def test_no_error_quotes_a_huge_key_header_path_or_text(server):
    dup = ('{"input": "a", "%s": 1, "%s": 2}' % (HUGE, HUGE)).encode()
    check_short(server.post("/v1/embeddings", content=dup, headers=JSON), "a key twice")
    check_short(server.post("/v1/embeddings", json={"input": ["word", "y" + HUGE[:5000]]}), "input over the chars")
    check_short(server.post("/v1/embeddings", content=b'{"input": "a"}', headers={"Content-Type": "text/" + HUGE[:8000]}),
                "content type")
    check_short(server.get("/v1/" + HUGE[:8000]), "path")
    check_short(server.post("/v1/embeddings", content=b'{"input": "a", "n": ' + b"1" * 5000 + b"}", headers=JSON),
                "an integer too long to read")


def test_a_host_the_server_is_not_bound_to_is_refused(server):
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example", HUGE[:4000]):
        r = server.post("/v1/embeddings", json={"input": "word"}, headers={"Host": host})
        error = check_short(r, f"Host {host[:20]}")
        assert r.status_code == 400 and error["code"] == "host_not_allowed" and r.headers["connection"] == "close"
        assert server.get("/health", headers={"Host": host}).status_code == 400
    for host in ("127.0.0.1", "localhost:1234", "[::1]:80", "EMBED.example.com:443"):
        r = server.post("/v1/embeddings", json={"input": "word"}, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    assert "dice_fast_wrong_host_total 10.0" in server.get("/metrics").text


def test_allowed_hosts_for_a_bound_address():
    assert allowed_hosts("127.0.0.1") == ["127.0.0.1", "::1", "localhost"]
    assert allowed_hosts("0.0.0.0", ["a.example"]) == ["<ip>", "a.example", "localhost"]
    assert allowed_hosts("192.0.2.10") == ["192.0.2.10"] and allowed_hosts("192.0.2.10", ["*"]) == ["*", "192.0.2.10"]
    assert [host_name(h) for h in ("A.example:80", "[::1]:8080", "::1", "192.0.2.20")] == ["a.example", "::1", "::1",
                                                                                           "192.0.2.20"]


def serve_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from dice_fast.serve.cli import register_cli

    top = argparse.ArgumentParser()
    sub = top.add_subparsers()
    register_cli(sub)
    return top, sub.choices["serve"]


def test_every_serve_flag_can_come_from_the_environment(monkeypatch):
    _, serve = serve_parser()
    flags = [a for a in serve._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    text = serve.format_help()
    for action in flags:
        env = "DICE_FAST_" + next(o for o in action.option_strings if o.startswith("--"))[2:].replace("-", "_").upper()
        assert env in text, f"--help does not name {env}"
    assert len(flags) > 30
    for name, value in {"MAX_QUEUE_TOKENS": "1234", "WRITE_TIMEOUT": "2.5", "NO_ACCESS_LOG": "yes",
                        "AUTO_TRUNCATE": "1", "NO_CROSS_REQUEST_BATCHING": "true", "HOST": "127.0.0.2",
                        "POSITIONS": "global", "NORMALIZE_CHUNKS": "off", "ALLOWED_HOSTS": "a.example"}.items():
        monkeypatch.setenv("DICE_FAST_" + name, value)
    top, _ = serve_parser()
    args = top.parse_args(["serve"])
    assert (args.max_queue_tokens, args.write_timeout, args.no_access_log, args.auto_truncate) == (1234, 2.5, True, True)
    assert (args.cross_request_batching, args.host, args.positions, args.normalize_chunks) == (False, "127.0.0.2",
                                                                                               "global", False)
    assert args.allowed_hosts == "a.example" and args.environment_errors == []
    args = top.parse_args(["serve", "--max-queue-tokens", "99", "--host", "127.0.0.1"])  # the flag wins
    assert (args.max_queue_tokens, args.host) == (99, "127.0.0.1")
    monkeypatch.setenv("DICE_FAST_POSITIONS", "sideways")
    monkeypatch.setenv("DICE_FAST_AUTO_TRUNCATE", "maybe")
    args = serve_parser()[0].parse_args(["serve"])
    assert any("DICE_FAST_POSITIONS" in e for e in args.environment_errors)
    assert any("DICE_FAST_AUTO_TRUNCATE" in e for e in args.environment_errors)
    from dice_fast.serve.cli import cmd_serve

    with pytest.raises(ValueError, match="DICE_FAST_POSITIONS='sideways'"):
        cmd_serve(args)  # refused before any model is loaded
    monkeypatch.setenv("DICE_FAST_PORT", "not-a-port")  # converted by the flag's type, named by the variable
    monkeypatch.setenv("DICE_FAST_GRACEFUL_TIMEOUT", "nan")  # (argparse named --port / --graceful-timeout)
    args = serve_parser()[0].parse_args(["serve"])
    with pytest.raises(ValueError, match=r"\$DICE_FAST_PORT='not-a-port': invalid literal .*"
                                         r"\$DICE_FAST_GRACEFUL_TIMEOUT='nan': must be >= 0"):
        cmd_serve(args)


@pytest.mark.parametrize("flags, culprit", [
    (["--max-queue-tokens", "0"], "max_queue_tokens must be an integer >= 1"),
    (["--max-inputs-per-request", "0"], "max_inputs_per_request must be an integer >= 1"),
    (["--max-tokens-per-document", "-1"], "max_tokens_per_document must be an integer >= 0"),
    (["--request-timeout", "-1"], "request_timeout must be a number of seconds >= 0"),
    (["--cache-memory-mb", "-1"], "cache_memory_mb must be an integer >= 0"),
    (["--max-body-bytes", "0"], "max_body_bytes must be an integer >= 1"),
    (["--read-timeout", "0"], "read_timeout must be a number"),
    (["--keep-alive-timeout", "0"], "keep_alive_timeout must be a number > 0"),
    (["--write-timeout", "-2"], "write_timeout must be a number > 0"),
    (["--max-connections", "0"], "max_connections must be a number > 0"),
])
def test_a_limit_out_of_range_is_refused_before_the_model_loads(monkeypatch, flags, culprit):
    import dice_fast.serve.cli as serve_cli

    def no_model(args):
        raise AssertionError("the model was loaded before the limits were checked")

    monkeypatch.setattr(serve_cli, "make_encoder", no_model)
    args = serve_parser()[0].parse_args(["serve", *flags])
    with pytest.raises(ValueError, match=culprit):
        serve_cli.cmd_serve(args)


def test_an_address_that_cannot_be_listened_on_is_refused_before_the_model_loads(monkeypatch):
    """A port in use or a host not of this machine: uvicorn found out after the model load (exit 3, its log)."""
    import socket

    import dice_fast.serve.cli as serve_cli

    def no_model(args):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(serve_cli, "make_encoder", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, culprit in ((["--port", str(port)], f"cannot listen on --host 127.0.0.1 --port {port}: "),
                               (["--host", "999.1.1.1"], "cannot listen on --host 999.1.1.1")):
            args = serve_parser()[0].parse_args(["serve", *flags])
            with pytest.raises(ValueError, match=culprit):
                serve_cli.cmd_serve(args)


def test_unknown_limit_names_are_programming_errors():
    from dice_fast.serve.limits import check_limits
    from dice_fast.serve.server import check_server_limits

    with pytest.raises(TypeError, match="max_queue_tokenz"):
        check_limits(max_queue_tokenz=5)
    with pytest.raises(TypeError, match="max_conections"):
        check_server_limits(max_conections=5)
    check_limits(max_queue_tokens=None, read_timeout=None, request_timeout=0)  # defaults / none pass


def test_bodies_must_be_declared_json(server):
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = server.post("/v1/embeddings", content=json.dumps({"input": "word"}).encode(), headers=headers)
        assert r.status_code == 415 and r.headers["connection"] == "close", (headers, r.text)


def test_a_variable_that_names_no_flag_is_warned_about_and_an_empty_one_is_unset(monkeypatch, capsys):
    """``DICE_FAST_NORMALIZE=false`` (the flag is ``--no-normalize``) was silently ignored, vectors kept
    normalised; an empty ``DICE_FAST_CHUNK_SIZE=`` was an error while an empty switch turned it off."""
    from dice_fast.serve.cli import OTHER_VARIABLES, cmd_serve

    for name, value in {"NORMALIZE": "false", "CHUNKSIZE": "64", "CPU_HEAP": "x", "CACHE_DIR": "/tmp/c",
                        "CHUNK_SIZE": "", "NO_CROSS_REQUEST_BATCHING": "", "PORT": "not-a-port"}.items():
        monkeypatch.setenv("DICE_FAST_" + name, value)
    args = serve_parser()[0].parse_args(["serve"])
    assert args.chunk_size is None and args.cross_request_batching is True  # empty: the defaults
    assert args.environment_warnings == [
        "$DICE_FAST_CHUNKSIZE is not a variable of dice-fast serve; ignored (did you mean $DICE_FAST_CHUNK_SIZE?)",
        "$DICE_FAST_NORMALIZE is not a variable of dice-fast serve; ignored (did you mean $DICE_FAST_NO_NORMALIZE?)"]
    with pytest.raises(ValueError, match="DICE_FAST_PORT"):
        cmd_serve(args)  # the warnings come first, then the refusal
    assert "warning: $DICE_FAST_CHUNKSIZE" in capsys.readouterr().err
    # every DICE_FAST_ variable the package reads is a serve flag's or one of OTHER_VARIABLES
    import pathlib
    import re

    import dice_fast

    read = {m for f in pathlib.Path(dice_fast.__file__).parent.rglob("*.py")
            for m in re.findall(r"[\"'](DICE_FAST_[A-Z0-9_]*)", f.read_text(encoding="utf-8"))}
    flags = {"DICE_FAST_" + next(o for o in a.option_strings if o.startswith("--"))[2:].replace("-", "_").upper()
             for a in serve_parser()[1]._actions if a.option_strings and a.dest != "help"}
    assert {v for v in read if v not in flags and not v.startswith(OTHER_VARIABLES)} <= {"DICE_FAST_"}, read


def test_an_empty_prefix_variable_is_the_empty_prefix(monkeypatch):
    """A prefix's empty text is a value ("none"), not "unset": with the folder's saved prompt as the
    default, an empty ``DICE_FAST_DOCUMENT_PREFIX=`` (how a deployment turns the prompt off) was read as
    unset and the prompt applied. Other empty variables stay unset."""
    monkeypatch.setenv("DICE_FAST_DOCUMENT_PREFIX", "")
    monkeypatch.setenv("DICE_FAST_QUERY_PREFIX", "")
    monkeypatch.setenv("DICE_FAST_DEVICE", "")
    args = serve_parser()[0].parse_args(["serve"])
    assert (args.document_prefix, args.query_prefix, args.device) == ("", "", None)
    assert args.environment_errors == []
    monkeypatch.delenv("DICE_FAST_QUERY_PREFIX")
    assert serve_parser()[0].parse_args(["serve"]).query_prefix is None


def test_serve_without_its_extra_names_the_extra(monkeypatch, capsys):
    """A base install said only "No module named 'fastapi'"."""
    import importlib.util

    from dice_fast.cli import main

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find(name, *a))
    for command in (["serve"], ["bench-serve"]):
        assert main(command) == 2
        assert capsys.readouterr().err.strip() == ("dice-fast: error: the server needs fastapi: pip install "
                                                   "'dice-fast[serve]'")


def test_the_open_file_limit_is_raised_for_max_connections_or_the_flag_refused():
    """With the usual soft limit (1,024) and the default 1,024 connections the server ran out of file
    descriptors first: no 503 ever, and asyncio's accept loop spun at full CPU logging each failure."""
    import resource
    import subprocess
    import sys

    code = ("import resource; from dice_fast.serve.server import ensure_open_files; ensure_open_files(1024); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")

    def run(soft, hard, command):
        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return subprocess.run(command, capture_output=True, text=True, timeout=120, preexec_fn=limit)

    raised = run(1024, 4096, [sys.executable, "-c", code])
    assert raised.returncode == 0 and 1024 + 128 < int(raised.stdout) <= 4096, raised.stderr
    refused = run(512, 512, [sys.executable, "-m", "dice_fast.cli", "serve", "--max-connections", "1024"])
    assert refused.returncode == 2, refused.stderr
    assert "--max-connections 1024 needs" in refused.stderr and "ulimit -Hn" in refused.stderr
    assert "lower it to at most" in refused.stderr and "Traceback" not in refused.stderr
