"""Request parsing (every malformed body names its culprit), response serialisation, the metrics text
format, and the lazy imports of the serve package."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

from dice_fast.serve.errors import InvalidRequest
from dice_fast.serve.schemas import embedding_response, parse_embedding_request

BAD_BODIES = [
    (b"", None, "empty"),
    (b"{", None, "not valid JSON"),
    (b"\xff\xfe{}", None, "not valid UTF-8"),
    (b'"text"', None, "must be a JSON object, got a string"),
    (b"[1, 2]", None, "must be a JSON object, got an array"),
    (b"{}", "input", "'input' is required"),
    (b'{"input": null}', "input", "got null"),
    (b'{"input": 3}', "input", "got a number"),
    (b'{"input": {"text": "x"}}', "input", "got an object"),
    (b'{"input": []}', "input", "empty list"),
    (b'{"input": ""}', "input", "empty"),
    (b'{"input": ["ok", "   "]}', "input[1]", "empty or only whitespace"),
    (b'{"input": ["ok", 7]}', "input[1]", "token ids"),
    (b'{"input": [[1, 2, 3]]}', "input[0]", "token ids"),
    (b'{"input": ["ok", null]}', "input[1]", "must be a string, got null"),
    (b'{"input": ["ok", true]}', "input[1]", "must be a string, got a boolean"),
    (b'{"input": "x", "model": 5}', "model", "'model' must be a string"),
    (b'{"input": "x", "encoding_format": "int8"}', "encoding_format", "'float', 'base64'"),
    (b'{"input": "x", "input_type": "passage"}', "input_type", "'document', 'query'"),
    (b'{"input": "x", "input_type": 1}', "input_type", "got 1"),
    (b'{"input": [1, 2, 3]}', "input", "'input' is a list of token ids"),
    (b'{"input": [[1, 2], [3]]}', "input[0]", "check_embedding_ctx_length=False"),
    (b'{"input": "x", "dimensions": 9}', "dimensions", "from 1 to 8"),
    (b'{"input": "x", "dimensions": 0}', "dimensions", "from 1 to 8"),
    (b'{"input": "x", "dimensions": 4.5}', "dimensions", "from 1 to 8"),
    (b'{"input": "x", "dimensions": true}', "dimensions", "from 1 to 8"),
    (b'{"input": "x", "user": 5}', "user", "'user' must be a string"),
]


@pytest.mark.parametrize("body, param, message", BAD_BODIES, ids=[repr(b[0])[:40] for b in BAD_BODIES])
def test_malformed_bodies_name_the_culprit(body, param, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        parse_embedding_request(body, dim=8)
    assert info.value.param == param
    err = info.value.body()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and message.split()[0] in err["message"]


def test_valid_bodies():
    r = parse_embedding_request(b'{"input": "one", "model": "m"}', dim=8)
    assert (r.input, r.input_type, r.encoding_format, r.model) == (["one"], "document", "float", "m")
    r = parse_embedding_request(json.dumps({"input": ["a", "b"], "input_type": "search_query",
                                            "encoding_format": "base64", "dimensions": 8, "user": "u",
                                            "unknown": 1}).encode(), dim=8)
    assert (r.input, r.input_type, r.encoding_format, r.dimensions) == (["a", "b"], "query", "base64", 8)
    assert parse_embedding_request(b'{"input": "x", "dimensions": 1}', dim=8).dimensions == 1
    assert parse_embedding_request(b'{"input": "x", "dimensions": 4.0}', dim=8).dimensions == 4  # JSON Schema's integer
    assert parse_embedding_request(b'{"input": "x"}', dim=8).dimensions is None
    r = parse_embedding_request('{"input": ["héllo ✓"], "encoding_format": null}'.encode(), dim=8)
    assert r.input == ["héllo ✓"] and r.encoding_format == "float"
    r = parse_embedding_request(b'{"input": "x", "return_chunks": null, "input_type": "query"}', dim=8)
    assert r.return_chunks is False  # null takes the default, like every other field


def test_response_float_and_base64_are_exact():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 5)).astype(np.float32)
    tokens = np.array([4, 7, 1])
    for fmt in ("float", "base64"):
        body = json.loads(embedding_response(vectors, tokens, "m", fmt))
        assert body["object"] == "list" and body["model"] == "m"
        assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        if fmt == "float":
            got = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
        else:
            got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]])
        np.testing.assert_array_equal(got, vectors)  # bit-exact: JSON floats round-trip float32


def test_float_json_is_what_json_dumps_wrote_and_exact_float32():
    """orjson writes each float32 widened to a double, as ``json.dumps(vectors.tolist())`` did: the same
    numbers (only an exponent's spelling differs: 1e-5 for 1e-05), each exactly the float32 read back."""
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((64, 384)).astype(np.float32)
    vectors[0, :6] = [1e-5, 1.0, 0.0, -0.0, 3e-8, np.finfo(np.float32).max]
    vectors[1, :3] = [np.finfo(np.float32).tiny, 2.0 ** -149, -123456.789]  # a subnormal too
    tokens = np.ones(64, np.int64)
    old = json.dumps({"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row}
                                                  for i, row in enumerate(vectors.tolist())],
                      "model": "m", "usage": {"prompt_tokens": 64, "total_tokens": 64}}, separators=(",", ":"))
    new = embedding_response(vectors, tokens, "m", "float")
    assert json.loads(new) == json.loads(old)  # every double equal, not just close
    got = np.asarray([d["embedding"] for d in json.loads(new)["data"]], dtype=np.float32)
    assert got.tobytes() == vectors.tobytes()


def test_metrics_render_in_the_text_format_with_process_metrics(tiny_encoder):
    from prometheus_client import parser  # in the serve extra: this test must run, never skip

    from dice_fast.serve import AsyncDiceEncoder
    from dice_fast.serve.metrics import ServerMetrics
    from dice_fast.serve.worker import BatchStats

    m = ServerMetrics(AsyncDiceEncoder(tiny_encoder))
    m.observe_request('a"b\\c', 200, 0.05, inputs=3, tokens=30)
    m.observe_request("query", 429)
    m.observe_unauthorized("missing")
    m.observe_wrong_host()
    m.observe_unrouted(404)
    m.observe_batch(BatchStats(tokens=64, chunks=4, requests=2, budget=128, seconds=0.5))
    families = {f.name: f for f in parser.text_string_to_metric_families(m.render())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("dice_fast_requests_total", (("input_type", 'a"b\\c'), ("status", "200")))] == 1
    assert samples[("dice_fast_requests_total", (("input_type", "query"), ("status", "429")))] == 1
    assert samples[("dice_fast_inputs_total", (("input_type", 'a"b\\c'),))] == 3
    assert samples[("dice_fast_request_duration_seconds_bucket", (("input_type", 'a"b\\c'), ("le", "0.05")))] == 1
    assert samples[("dice_fast_unauthorized_total", (("reason", "missing"),))] == 1
    assert samples[("dice_fast_wrong_host_total", ())] == 1
    assert samples[("dice_fast_unrouted_total", (("status", "404"),))] == 1
    assert samples[("dice_fast_batch_fill_ratio_bucket", (("le", "0.5"),))] == 1
    assert samples[("dice_fast_batch_tokens_total", ())] == 64
    assert samples[("dice_fast_chunks_total", (("source", "computed"),))] == 0
    assert samples[("dice_fast_queue_tokens", ())] == 0 and samples[("dice_fast_requests_in_flight", ())] == 0
    assert samples[("process_resident_memory_bytes", ())] > 10 << 20 and samples[("process_open_fds", ())] > 2


def test_importing_the_package_and_registering_the_cli_loads_no_web_stack():
    code = (
        "import sys, argparse\n"
        "import dice_fast, dice_fast.serve, dice_fast.serve.cli\n"
        "p = argparse.ArgumentParser(); dice_fast.serve.cli.register_cli(p.add_subparsers())\n"
        "dice_fast.serve.__all__\n"
        "web = ('fastapi', 'starlette', 'uvicorn', 'httpx', 'prometheus_client', 'orjson')\n"
        "print(sorted(m for m in web if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
