"""Faults stay small in the server: an out-of-memory chunk fails only its own request (503 naming the
input) while the requests batched with it get exact vectors; an error while packing or pooling fails
only the requests it touches; a worker that stops makes /health 503 and refuses new requests at once;
/health is not ready before the warm-up forward and says "draining" on SIGTERM; a request past its
deadline gets 504 and its unstarted chunks are dropped. Interleavings are forced with gates."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dice_fast import aggregation, chunk_queue
from dice_fast.serve import AsyncDiceEncoder, create_app
from dice_fast.serve.errors import DeadlineExceeded
from fault_injection import failing_forward, has_poison, poisoned
from helpers import assert_close
from serve_testing import ProxyEncoder, ServerThread, embeddings_of, metric, wait_until, word_texts


def run(coro, timeout: float = 100):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def held(proxy, core, first, rest):
    """Run ``first()`` until its forward is held at the gate, then start the calls of ``rest``, a list
    of (coroutine factory, tokens it queues), one after the other in that queue order, and open the
    gate once all are queued: they share the next batches. Returns (first's result, rest's results)."""
    proxy.running.clear()
    proxy.gate.clear()
    head = asyncio.create_task(first())
    while not proxy.running.is_set():
        await asyncio.sleep(0.01)
    tasks, queued = [], 0
    for call, tokens in rest:
        tasks.append(asyncio.create_task(call()))
        queued += tokens
        while core.tokens_waiting < queued:
            await asyncio.sleep(0.01)
    proxy.gate.set()
    return await head, await asyncio.gather(*tasks)


def tokens_of(encoder, texts) -> int:
    return int(encoder.plan(texts).document_tokens.sum())


def test_out_of_memory_fails_only_the_request_of_the_chunk(tiny_encoder):
    texts = word_texts(8, 5, 40, seed=30)
    bad = [texts[0], poisoned(texts[1]), texts[2]]
    ref = tiny_encoder.encode_documents(texts)
    groups = [[0, 3], [4, 5], [6], [7, 2]]
    proxy = ProxyEncoder(tiny_encoder)
    with ServerThread(create_app(proxy)) as server, failing_forward(tiny_encoder.model, has_poison) as seen:
        core = server.server.config.app.state.core
        wait_until(lambda: core.health[0] == "ok", what="the warm-up")

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                def post(inputs):
                    return lambda: http.post("/v1/embeddings", json={"input": inputs})
                rest = [[texts[i] for i in g] for g in groups[:2]] + [bad] + [[texts[i] for i in g] for g in groups[2:]]
                return await held(proxy, core, post([texts[5]]), [(post(t), tokens_of(tiny_encoder, t)) for t in rest])

        first, good = run(main())
        failed = good.pop(2)
        backed_off = core.batch_budget
        after = httpx.post(server.url + "/v1/embeddings", json={"input": texts[:3]}, timeout=60)
        health = httpx.get(server.url + "/health")
        m = httpx.get(server.url + "/metrics").text
    assert first.status_code == 200
    assert failed.status_code == 503, failed.text
    err = failed.json()["error"]
    assert err["code"] == "out_of_memory" and err["type"] == "server_error" and err["param"] == "input[1]"
    assert "out of memory" in err["message"] and "input[1]" in err["message"]
    assert max(n for n, raised in seen if raised) > 20, "the poisoned chunk never shared a batch"
    assert backed_off < core.max_batch_tokens, "the batch budget did not back off"
    for g, r in zip(groups, good):
        assert r.status_code == 200, r.text
        assert_close(embeddings_of(r.json()), ref[g], atol=1e-5, what=f"request {g}")
    assert after.status_code == 200 and health.status_code == 200
    assert_close(embeddings_of(after.json()), ref[:3], atol=1e-5)
    assert metric(m, "dice_fast_requests_total", input_type="document", status="503") == 1
    assert 'status="500"' not in m


def test_packing_error_fails_only_the_request_it_was_packing(tiny_encoder, monkeypatch):
    pack = chunk_queue.pack_plan
    packs = []  # per pack call: whether it raised

    def flaky_pack(plan, *args, **kwargs):
        packs.append(has_poison(plan.tokens.ids))
        if packs[-1]:
            raise RuntimeError("injected packing failure")
        return pack(plan, *args, **kwargs)

    texts = word_texts(6, 5, 12, seed=31)  # one chunk each: the three requests fit one batch
    ref = tiny_encoder.encode_documents(texts)
    monkeypatch.setattr(chunk_queue, "pack_plan", flaky_pack)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        async with AsyncDiceEncoder(proxy) as core:
            rest = [texts[1:3], [texts[3], poisoned(texts[4])], texts[4:]]
            first, outs = await held(proxy, core, lambda: core.embed_documents(texts[:1]), [
                (_catching(lambda t=t: core.embed_documents(t)), tokens_of(tiny_encoder, t)) for t in rest])
            return first, outs, await core.embed_documents(texts), core.tokens_waiting

    first, (a, p, b), again, waiting = run(main())
    assert isinstance(p, RuntimeError) and "injected packing failure" in str(p)
    # the first request; then the next batch: the second packed, the third raised; the second again, the fourth
    assert packs[:5] == [False, False, True, False, False], packs
    assert_close(first.vectors, ref[:1], atol=1e-5)
    assert_close(a.vectors, ref[1:3], atol=1e-5)
    assert_close(b.vectors, ref[4:], atol=1e-5)
    assert_close(again.vectors, ref, atol=1e-5)
    assert waiting == 0


def _catching(factory):
    async def call():
        try:
            return await factory()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return call


def test_pooling_error_fails_its_request_and_the_next_succeeds(tiny_encoder, monkeypatch):
    aggregate = aggregation.aggregate_documents
    calls = []

    def flaky_aggregate(vectors, cu_doc_chunks, *args, **kwargs):
        calls.append(len(cu_doc_chunks) - 1)
        if calls.count(2) == 1 and calls[-1] == 2:  # pooling the documents of the 2-document request, once
            raise RuntimeError("injected pooling failure")
        return aggregate(vectors, cu_doc_chunks, *args, **kwargs)

    texts = word_texts(4, 5, 30, seed=32)
    long_doc = word_texts(1, 300, 300, seed=33)[0]  # 19 chunks: spans three batches
    ref = tiny_encoder.encode_documents(texts + [long_doc])
    monkeypatch.setattr(aggregation, "aggregate_documents", flaky_aggregate)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():  # one request per batch: the failing one shares none
        async with AsyncDiceEncoder(proxy, cross_request_batching=False) as core:
            first, (failed, long) = await held(proxy, core, lambda: core.embed_documents(texts[:1]), [
                (_catching(lambda t=t: core.embed_documents(t)), tokens_of(tiny_encoder, t)) for t in (texts[1:3], [long_doc])])
            return first, failed, long, await core.embed_documents(texts), core.health

    first, failed, long, again, health = run(main())
    assert isinstance(failed, RuntimeError) and "injected pooling failure" in str(failed)
    assert_close(first.vectors, ref[:1], atol=1e-5)
    assert_close(long.vectors, ref[4:], atol=1e-5)
    assert_close(again.vectors, ref[:4], atol=1e-5)
    assert health == ("ok", None)


class Fatal(BaseException):
    """Not an Exception: nothing in the worker's steps catches it, so the worker stops."""


def die(stats):
    raise Fatal("injected: the worker thread dies")


def test_a_stopped_worker_makes_health_503_and_refuses_at_once(tiny_encoder):
    long_doc = word_texts(1, 300, 300, seed=34)[0]  # 19 chunks: more than one batch
    proxy = ProxyEncoder(tiny_encoder)
    with ServerThread(create_app(proxy)) as server:
        core = server.server.config.app.state.core
        wait_until(lambda: core.health[0] == "ok", what="the warm-up")
        core.add_batch_listener(die)
        r = httpx.post(server.url + "/v1/embeddings", json={"input": [long_doc]}, timeout=60)  # waits: no hang
        health = httpx.get(server.url + "/health")
        refused = httpx.post(server.url + "/v1/embeddings", json={"input": ["the cat"]}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "Fatal" in health.json()["detail"] and "worker" in health.json()["detail"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unhealthy"
    assert not core._worker.is_alive()


def test_the_warm_up_runs_a_forward_even_with_a_warm_cache(tiny_encoder, tmp_path):
    """The warm-up is a forward, never a cache hit: a second start over the same chunk cache runs it too."""
    from dice_fast import DiceEncoder

    cached = DiceEncoder(tiny_encoder.model, tiny_encoder.tokenizer, config=tiny_encoder.config, cache=tmp_path)
    for _ in range(2):
        proxy = ProxyEncoder(cached)
        core = AsyncDiceEncoder(proxy)
        core.start()
        wait_until(lambda: core.health[0] == "ok", what="the warm-up")
        core.close()
        assert len(proxy.batches) == 1


def test_health_is_starting_until_the_warm_up_and_draining_on_sigterm(tiny_encoder):
    import uvicorn

    from dice_fast.serve.server import draining_server

    proxy = ProxyEncoder(tiny_encoder)
    proxy.gate.clear()  # hold the warm-up forward
    with ServerThread(create_app(proxy)) as server:
        core = server.server.config.app.state.core
        proxy.running.wait(60)
        starting = httpx.get(server.url + "/health")
        proxy.gate.set()
        server.wait_ready()
        ok = httpx.get(server.url + "/health").json()
        draining_server(core)(uvicorn.Config(server.server.config.app)).handle_exit(signal.SIGTERM, None)
        draining = httpx.get(server.url + "/health")
        served = httpx.post(server.url + "/v1/embeddings", json={"input": ["the cat"]}, timeout=60)  # in flight
    assert starting.status_code == 503 and starting.json()["status"] == "starting"
    assert ok["status"] == "ok" and proxy.batches, "no warm-up forward ran"
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    assert served.status_code == 200


def test_deadline_gives_504_and_drops_the_unstarted_chunks(tiny_encoder):
    long_doc = word_texts(1, 400, 400, seed=35)[0]  # 25 chunks: 4 forwards of <= 128 tokens
    short = word_texts(2, 5, 10, seed=36)
    proxy = ProxyEncoder(tiny_encoder)
    with ServerThread(create_app(proxy, request_timeout=0.5)) as server:
        core = server.server.config.app.state.core
        wait_until(lambda: core.health[0] == "ok", what="the warm-up")
        warm_up = sum(proxy.batches)
        proxy.gate.clear()  # the long document's first forward is held past its deadline
        late = httpx.post(server.url + "/v1/embeddings", json={"input": [long_doc]}, timeout=60)
        waiting = core.tokens_waiting
        core.request_timeout = 0  # no deadline for the rest, however loaded the machine
        proxy.gate.set()
        r = httpx.post(server.url + "/v1/embeddings", json={"input": short}, timeout=60)
    assert late.status_code == 504, late.text
    err = late.json()["error"]
    assert err["code"] == "timeout" and "request_timeout" in err["message"]
    assert waiting == 0
    assert r.status_code == 200
    assert_close(embeddings_of(r.json()), tiny_encoder.encode_documents(short), atol=1e-5)
    ran = sum(proxy.batches) - warm_up - int(tiny_encoder.plan(short).document_tokens.sum())
    assert ran <= tiny_encoder.max_batch_tokens < int(tiny_encoder.plan([long_doc]).document_tokens.sum())


def test_request_timeout_option_and_flag(tiny_encoder):
    from dice_fast.serve.cli import add_limit_arguments, limits

    p = argparse.ArgumentParser()
    add_limit_arguments(p)
    assert limits(p.parse_args(["--request-timeout", "2.5"]))["request_timeout"] == 2.5
    assert limits(p.parse_args([]))["request_timeout"] == 120.0
    for bad in (-1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="request_timeout"):
            AsyncDiceEncoder(tiny_encoder, request_timeout=bad)

    async def main():  # 0 = no deadline
        async with AsyncDiceEncoder(tiny_encoder, request_timeout=0) as core:
            return await core.embed_documents(["the cat"])

    assert run(main()).vectors.shape == (1, tiny_encoder.dim)
    assert issubclass(DeadlineExceeded, Exception)


def test_out_of_memory_names_the_text_as_the_route_does(tiny_encoder):
    """On /v1/evidence a text whose chunk runs out of memory alone is named as that route names it:
    ``documents[i]``, or ``query`` (one string, no index); on /v1/embeddings ``input[i]``."""
    texts = word_texts(3, 5, 30, seed=37)
    with ServerThread(create_app(tiny_encoder)) as server, failing_forward(tiny_encoder.model, has_poison), \
            httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready()
        answers = [http.post("/v1/evidence", json={"query": "the cat", "documents": [texts[0], poisoned(texts[1])]}),
                   http.post("/v1/evidence", json={"query": poisoned("the cat sat on"), "documents": texts}),
                   http.post("/v1/embeddings", json={"input": [texts[2], poisoned(texts[1])]})]
        fine = http.post("/v1/evidence", json={"query": "the cat sat", "documents": texts})
    for r, name in zip(answers, ["documents[1]", "query", "input[1]"]):
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "out_of_memory" and err["param"] == name, r.text
        assert err["message"].startswith(f"out of memory encoding {name}: "), r.text
    assert fine.status_code == 200, fine.text


def test_a_failed_batch_is_one_traceback_and_a_line_per_request(tiny_encoder):
    """The worker logged the batch's traceback, then every request it failed logged it again."""
    texts = word_texts(3, 5, 30, seed=38)
    records = _Records()
    logging.getLogger("dice_fast.serve").addHandler(records)
    try:
        with ServerThread(create_app(tiny_encoder)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            server.wait_ready()
            with failing_forward(tiny_encoder.model, has_poison, error=lambda: RuntimeError("injected failure")), \
                    ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda t: http.post("/v1/embeddings", json={"input": [poisoned(t)]}), texts))
    finally:
        logging.getLogger("dice_fast.serve").removeHandler(records)
    assert [r.status_code for r in answers] == [500] * 3
    batches = [r for r in records.records if "tokens failed" in r.getMessage()]
    requests = [r for r in records.records if "request failed" in r.getMessage()]
    assert batches and all(r.exc_info for r in batches)
    assert len(requests) == 3 and not any(r.exc_info for r in requests), [r.getMessage() for r in requests]
    assert all(r.getMessage().endswith("request failed: injected failure") for r in requests)


def test_serve_logs_at_its_log_level_in_uvicorns_format():
    """dice_fast's own lines (a failed batch, the out-of-memory back-off) went to Python's last-resort
    handler: bare messages, printed even under --log-level critical."""
    import logging.config

    from dice_fast.serve.server import log_config

    before = logging.getLogger("dice_fast").level
    try:
        logging.config.dictConfig(log_config("critical"))
        served = logging.getLogger("dice_fast.serve")
        assert not served.isEnabledFor(logging.ERROR) and served.isEnabledFor(logging.CRITICAL)
        assert any(h.formatter is not None and "levelprefix" in h.formatter._fmt
                   for h in logging.getLogger("dice_fast").handlers)
    finally:
        logging.config.dictConfig(log_config("info"))
        logging.getLogger("dice_fast").handlers.clear()
        logging.getLogger("dice_fast").setLevel(before)
        logging.getLogger("dice_fast").propagate = True


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_requests_in_flight_past_the_graceful_timeout_get_503_shutting_down(tiny_encoder):
    """Shut down while forwards are held past uvicorn's graceful timeout: the requests still waiting get
    OpenAI's 503 ``shutting_down`` with ``Connection: close`` (not uvicorn's plain-text 500), their share
    is released, and nothing is logged with a traceback."""
    import uvicorn

    from dice_fast.serve.server import draining_server

    proxy = ProxyEncoder(tiny_encoder)
    app = create_app(proxy, cache_memory_mb=0)
    server, records = ServerThread(app, graceful_timeout=1.0), _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "dice_fast.serve")]
    for logger in loggers:  # after uvicorn's Config has set up its logging
        logger.addHandler(records)
    try:
        with server, ThreadPoolExecutor(2) as pool:
            core = app.state.core
            wait_until(lambda: core.health[0] == "ok", what="the warm-up")
            proxy.running.clear()
            proxy.gate.clear()  # the forwards are held past the graceful timeout
            sent = [pool.submit(httpx.post, server.url + "/v1/embeddings", json={"input": [t]}, timeout=30)
                    for t in word_texts(2, 30, 60, seed=38)]
            wait_until(lambda: proxy.running.is_set() and core.requests_in_flight == 2, what="both requests held")
            draining_server(core)(uvicorn.Config(app)).handle_exit(signal.SIGTERM, None)  # marks the core draining
            server.server.should_exit = True
            try:
                answers = [f.result(timeout=30) for f in sent]
            finally:
                proxy.gate.set()  # let the worker finish, so that the core closes
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    for r in answers:
        assert r.status_code == 503 and r.headers["connection"] == "close", r.text
        assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "server_error"
    assert core.requests_in_flight == 0 and core.tokens_held == 0
    assert not [r for r in records.records if r.exc_info], [r.getMessage() for r in records.records]
    assert not any("Exception in ASGI application" in r.getMessage() for r in records.records)


def test_a_non_finite_output_is_a_500_naming_the_input(caplog):
    """A model's NaN for one input went out as JSON nulls with 200; the others' vectors are served, and
    the failure is logged as other 500s are."""
    from test_non_finite import TEXTS, encoder, poison

    enc = encoder()
    poison(enc, "river")
    with ServerThread(create_app(enc)) as server:
        bad = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        good = httpx.post(server.url + "/v1/embeddings", json={"input": [TEXTS[0]]}, timeout=60)
        evidence = httpx.post(server.url + "/v1/evidence", json={"query": "cat", "documents": TEXTS}, timeout=60)
    err = bad.json()["error"]
    assert bad.status_code == 500 and err["code"] == "non_finite_output" and err["param"] == "input[1]", bad.text
    assert "input[1] is not finite" in err["message"] and good.status_code == 200
    assert evidence.status_code == 500 and evidence.json()["error"]["param"] == "documents[1]", evidence.text
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("input[1] is not finite" in m for m in logged) == 1, logged
