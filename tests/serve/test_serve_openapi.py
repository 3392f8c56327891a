"""An honest OpenAPI document: both POST routes carry their body's schema (with the server's own
limits), every route lists every status it answers with the error shape, /metrics is text/plain; and
the real schemathesis, with every one of its checks on, finds nothing against a live server on
127.0.0.1 (bounded: a few examples per route, a time limit)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dice_fast.serve import create_app
from dice_fast.serve.guards import allowed_hosts
from dice_fast.serve.openapi import TEXT_PATTERN
from serve_testing import ServerThread

KEY = "fuzz-key"
CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def server(tiny_encoder):
    app = create_app(tiny_encoder, api_key=KEY, allowed_hosts=allowed_hosts("127.0.0.1"), max_inputs_per_request=8,
                     max_input_chars=2000, auto_truncate=True)
    with ServerThread(app) as s:
        yield s.wait_ready()


def test_the_openapi_document_lists_bodies_statuses_and_types(server):
    doc = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    paths = doc["paths"]
    for route in ("/v1/embeddings", "/v1/evidence"):
        op = paths[route]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert op["requestBody"]["required"] and body["type"] == "object" and body["required"]
        texts = body["properties"]["input" if route == "/v1/embeddings" else "documents"]["oneOf"]
        assert texts[1]["maxItems"] == 8 and texts[0]["maxLength"] == 2000
        codes = set(op["responses"])
        assert {"200", "400", "401", "408", "413", "415", "429", "500", "503", "504"} <= codes, (route, codes)
        for code in codes - {"200"}:
            error = op["responses"][code]["content"]["application/json"]["schema"]
            assert error["required"] == ["error"], (route, code)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["required"]
    assert paths["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["dimensions"]["maximum"] == 32
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert set(paths["/health"]["get"]["responses"]) == {"200", "400", "503"}  # never behind the key
    assert "401" in paths["/v1/models"]["get"]["responses"]
    assert set(paths["/v1/models/{model}"]["get"]["responses"]) == {"200", "400", "401", "404"}
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in json.dumps(doc)  # never sent


def test_the_text_pattern_keeps_exactly_what_str_strip_keeps():
    """A client checks the schema's pattern with ECMA-262 regexes, where \\s is not Python's: the set is
    spelled out (escapes both dialects read alike) and agrees with str.strip() on every code point."""
    assert "\\s" not in TEXT_PATTERN and "\\S" not in TEXT_PATTERN
    pattern = re.compile(TEXT_PATTERN)
    disagree = [hex(c) for c in range(sys.maxunicode + 1) if bool(pattern.search(chr(c))) != bool(chr(c).strip())]
    assert not disagree
    assert pattern.search("\ufeff") and not pattern.search("\x85\x1c\u3000 \t")


def test_schemathesis_with_every_check_finds_nothing(server, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", server.url + "/openapi.json",
           "--url", server.url, "--checks", "all", "--max-examples", "6", "--seed", "1",
           "--generation-database", "none", "--generation-codec", "utf-8", "--suppress-health-check", "too_slow",
           "--request-timeout", "30", "-H", f"Authorization: Bearer {KEY}"]
    # utf-8: a lone surrogate cannot be sent in a UTF-8 body (one escaped in JSON is refused, documented)
    env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": ""}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert "6 selected" in report and " passed" in report, report
