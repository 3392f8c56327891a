"""The async batching core with a tiny model: vectors equal offline encoding whatever else is in flight,
batches shared across requests, cancellation, limits, failures and shutdown."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from dice_fast.serve import AsyncDiceEncoder, Embeddings
from dice_fast.serve.errors import Overloaded, RequestTooLarge, ShuttingDown
from helpers import assert_close
from serve_testing import ProxyEncoder, word_texts


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_concurrent_requests_equal_offline_and_share_batches(tiny_encoder):
    texts = word_texts(40, 1, 90, seed=1)  # up to 6 chunks of 16 tokens: documents span batches
    ref = tiny_encoder.encode_documents(texts)
    proxy = ProxyEncoder(tiny_encoder)
    rng = random.Random(0)
    picks = [[rng.randrange(len(texts)) for _ in range(rng.randint(1, 6))] for _ in range(60)]
    total = sum(int(tiny_encoder.plan([texts[i] for i in p]).document_tokens.sum()) for p in picks)
    shared = []

    async def main():
        core = AsyncDiceEncoder(proxy, max_queue_tokens=10**6)
        core.add_batch_listener(lambda s: shared.append(s.requests))
        proxy.gate.clear()  # let all requests queue up behind the first forward
        tasks = [asyncio.create_task(core.embed_documents([texts[i] for i in p])) for p in picks]
        for _ in range(500):  # at most 5 s
            if core.tokens_waiting + tiny_encoder.max_batch_tokens >= total:
                break
            await asyncio.sleep(0.01)
        proxy.gate.set()
        outs = await asyncio.gather(*tasks)
        await core.aclose()
        return outs

    outs = run(main())
    for p, out in zip(picks, outs):
        assert isinstance(out, Embeddings) and out.vectors.dtype == np.float32
        assert_close(out.vectors, ref[p], atol=1e-5, what=f"request {p}")
        np.testing.assert_array_equal(out.tokens, tiny_encoder.plan([texts[i] for i in p]).document_tokens)
    assert max(shared) > 1, "no batch held chunks of more than one request"
    # identical chunks queued at once run once (dice_fast.reuse.manager): every distinct chunk ran exactly once
    plan = tiny_encoder.plan([texts[i] for p in picks for i in p])
    distinct = {plan.chunk_ids(c).tobytes() for c in range(plan.n_chunks)}
    assert sum(proxy.batches) == sum(len(b) // 8 for b in distinct), "a chunk ran twice or not at all"


def test_queries_equal_offline(tiny_encoder):
    texts = word_texts(12, 1, 40, seed=2)

    async def main():
        async with AsyncDiceEncoder(tiny_encoder) as core:
            return await asyncio.gather(core.embed_queries(texts[:5]), core.embed_documents(texts),
                                        core.embed_queries(texts[5:]))

    q1, d, q2 = run(main())
    assert_close(np.concatenate([q1.vectors, q2.vectors]), tiny_encoder.encode_queries(texts), atol=1e-5)
    assert_close(d.vectors, tiny_encoder.encode_documents(texts), atol=1e-5)


def test_worker_hands_memory_back_after_a_quiet_period(tiny_encoder, monkeypatch):
    """On the CPU the worker trims the heap once its queue has been empty for ``idle_trim_s``: not
    after every batch, not between requests that follow each other closely, not again while idle.
    Each burst is one request of several documents spanning several batches."""
    from dice_fast.serve import worker

    trims = []
    monkeypatch.setattr(worker, "release_freed_memory", lambda: trims.append(1))
    texts = word_texts(6, 20, 120, seed=3)

    async def main():
        async with AsyncDiceEncoder(tiny_encoder, cache_memory_mb=0) as core:  # repeats run again
            core.idle_trim_s = 0.5
            batches = []
            core.add_batch_listener(batches.append)
            counts = []
            for _ in range(2):
                await core.embed_documents(texts)
                await core.embed_documents(texts[:2])  # right after: within the quiet period
                counts.append(len(trims))
                await asyncio.sleep(1.5)  # quiet: one trim, then none while idle
                counts.append(len(trims))
            return len(batches), counts

    n_batches, counts = run(main())
    assert n_batches > 4 and counts == [0, 1, 1, 2]


def test_worker_hands_memory_back_under_steady_load(tiny_encoder, monkeypatch):
    """A CPU worker that never idles still trims, once ``busy_trim_s`` has passed since the last trim
    (0 here: after every batch); the vectors are unchanged."""
    from dice_fast.serve import worker

    trims = []
    monkeypatch.setattr(worker, "release_freed_memory", lambda: trims.append(1))
    texts = word_texts(6, 20, 120, seed=3)

    batches = []

    async def main():
        async with AsyncDiceEncoder(tiny_encoder, cache_memory_mb=0) as core:
            core.idle_trim_s, core.busy_trim_s = 3600.0, 0.0
            core.add_batch_listener(batches.append)
            return await core.embed_documents(texts)

    out = run(main())  # batches are counted once the worker has stopped: the request is answered
    n_batches = len(batches)  # before its last batch's listener and trim have run
    assert n_batches > 2 and len(trims) == n_batches
    assert_close(out.vectors, tiny_encoder.encode_documents(texts), atol=1e-5)


def test_admission_does_not_hold_the_lock_the_event_loop_needs(tiny_encoder):
    """`ChunkQueue.submit` (chunk-cache lookups on disk) runs with the core's lock released: while one
    admission is held inside it, another thread takes the lock at once; the request is still answered
    exactly, and a request cancelled during its admission never runs: no forward after it holds any of
    its tokens (counted forwards: only the other requests' tokens ran)."""
    import threading

    texts = word_texts(3, 20, 60, seed=40)
    after = word_texts(2, 10, 20, seed=42)
    entered, release, took = threading.Event(), threading.Event(), []
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        async with AsyncDiceEncoder(proxy, cache_memory_mb=0) as core:
            real = core._queue.submit

            def held_submit(*args, **kwargs):
                entered.set()
                release.wait(30)
                return real(*args, **kwargs)

            core._queue.submit = held_submit
            task = asyncio.ensure_future(core.embed_documents(texts))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            took.append(core._cond.acquire(timeout=5))
            core._cond.release()
            release.set()
            out = await task
            ran_before = sum(proxy.batches)
            entered.clear(), release.clear()
            doomed = asyncio.ensure_future(core.embed_documents(word_texts(2, 200, 300, seed=41)))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed  # its cancellation reached the core while submit is still held
            release.set()
            core._queue.submit = real
            last = await core.embed_documents(after)  # queued behind the doomed job: the worker passed it
            return out, ran_before, last, core._queue.tokens_waiting, core.tokens_waiting

    out, ran_before, last, *waiting = run(main())
    assert took == [True] and waiting == [0, 0]
    assert ran_before == int(out.tokens.sum())
    assert sum(proxy.batches) == ran_before + int(last.tokens.sum()), "the request cancelled during admission ran"
    assert_close(out.vectors, tiny_encoder.encode_documents(texts), atol=1e-5)
    assert_close(last.vectors, tiny_encoder.encode_documents(after), atol=1e-5)


def test_without_cross_request_batching_each_batch_holds_one_request(tiny_encoder):
    texts = word_texts(10, 5, 80, seed=3)
    ref = tiny_encoder.encode_documents(texts)
    shared = []

    async def main():
        async with AsyncDiceEncoder(tiny_encoder, cross_request_batching=False) as core:
            core.add_batch_listener(lambda s: shared.append(s.requests))
            return await asyncio.gather(*(core.embed_documents(texts[i : i + 2]) for i in range(0, 10, 2)))

    outs = run(main())
    assert_close(np.concatenate([o.vectors for o in outs]), ref, atol=1e-5)
    assert set(shared) == {1}


def test_cancelled_request_stops_consuming_compute(tiny_encoder):
    long_doc = word_texts(1, 400, 400, seed=4)[0]  # 25 chunks of 18 tokens: 4 batches of 128
    short = word_texts(3, 5, 20, seed=5)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        core = AsyncDiceEncoder(proxy)
        proxy.gate.clear()
        doomed = asyncio.create_task(core.embed_documents([long_doc]))
        while not proxy.running.is_set():  # its first batch is in the model, held by the gate
            await asyncio.sleep(0.01)
        other = asyncio.create_task(core.embed_documents(short))
        await asyncio.sleep(0.05)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        proxy.gate.set()
        out = await other
        await core.aclose()
        return core, out

    core, out = run(main())
    full = int(tiny_encoder.plan([long_doc]).document_tokens.sum())
    ran_for_long = sum(proxy.batches) - int(out.tokens.sum())
    assert ran_for_long <= tiny_encoder.max_batch_tokens, f"{ran_for_long} of {full} tokens ran after the cancel"
    assert core.tokens_waiting == 0 and core.requests_in_flight == 0
    assert_close(out.vectors, tiny_encoder.encode_documents(short), atol=1e-5)


def test_cancel_while_still_waiting_for_admission(tiny_encoder):
    texts = word_texts(4, 30, 60, seed=6)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        core = AsyncDiceEncoder(proxy, cross_request_batching=False)
        proxy.gate.clear()
        first = asyncio.create_task(core.embed_documents(texts[:2]))
        second = asyncio.create_task(core.embed_documents(texts[2:]))  # waits behind `first`
        while core.requests_in_flight < 2 or not proxy.running.is_set():
            await asyncio.sleep(0.01)
        second.cancel()
        await asyncio.sleep(0.05)
        waiting = core.tokens_waiting
        proxy.gate.set()
        out = await first
        await core.aclose()
        return out, waiting

    out, waiting = run(main())
    assert sum(proxy.batches) == int(out.tokens.sum()), "the cancelled request ran"
    assert waiting < int(tiny_encoder.plan(texts[:2]).document_tokens.sum())
    assert_close(out.vectors, tiny_encoder.encode_documents(texts[:2]), atol=1e-5)


def test_size_limits_name_the_culprit(tiny_encoder):
    texts = word_texts(5, 2, 10, seed=7) + word_texts(1, 50, 50, seed=8)

    async def main():
        async with AsyncDiceEncoder(tiny_encoder, max_inputs_per_request=6, max_tokens_per_document=40,
                                    max_queue_tokens=200) as core:
            with pytest.raises(RequestTooLarge, match="7 inputs.*limit is 6") as e1:
                await core.embed_documents(texts + ["one"])
            with pytest.raises(RequestTooLarge, match=r"input\[5\] has 5[0-9] tokens.*40") as e2:
                await core.embed_documents(texts)
            with pytest.raises(RequestTooLarge, match="max_queue_tokens"):
                await core.embed_documents(word_texts(6, 30, 30))  # 6 x 34 tokens, each under 40
            return e1.value, e2.value, await core.embed_documents([])

    e1, e2, empty = run(main())
    assert e1.param == "input" and e2.param == "input[5]"
    assert empty.vectors.shape == (0, tiny_encoder.dim) and empty.tokens.shape == (0,)


def test_queue_limit_overloads_then_recovers(tiny_encoder):
    texts = word_texts(4, 20, 30, seed=9)  # 2 chunks, 40-50 tokens each
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        core = AsyncDiceEncoder(proxy, max_queue_tokens=300)
        proxy.gate.clear()  # the worker takes one batch (<= 128 tokens) and holds it
        accepted, full = [], None
        for _ in range(20):  # ~9 requests fill 128 + 300 tokens; the next one must be refused
            accepted.append(asyncio.create_task(core.embed_documents(texts[:1])))
            await asyncio.sleep(0.1)
            refused = [t for t in accepted if t.done() and isinstance(t.exception(), Overloaded)]
            if refused:
                full = refused[0].exception()
                break
        assert full is not None, "the queue limit never refused a request"
        assert core.tokens_waiting <= 300
        proxy.gate.set()
        outs = await asyncio.gather(*(t for t in accepted if not t.done() or not t.exception()))
        again = await core.embed_documents(texts)  # recovered
        await core.aclose()
        return full, outs, again

    full, outs, again = run(main())
    assert full.retry_after >= 1 and "max_queue_tokens" in str(full)
    assert len(outs) >= 5 and all(o.vectors.shape == (1, tiny_encoder.dim) for o in outs)
    assert_close(again.vectors, tiny_encoder.encode_documents(texts), atol=1e-5)


def test_concurrency_limit_overloads(tiny_encoder):
    texts = word_texts(3, 5, 10, seed=12)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        core = AsyncDiceEncoder(proxy, max_concurrent_requests=2)
        proxy.gate.clear()
        held = [asyncio.create_task(core.embed_documents([t])) for t in texts[:2]]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="max_concurrent_requests"):
            await core.embed_documents(texts[2:])
        proxy.gate.set()
        outs = await asyncio.gather(*held)
        last = await core.embed_documents(texts[2:])
        await core.aclose()
        return outs, last

    outs, last = run(main())
    got = np.concatenate([o.vectors for o in outs] + [last.vectors])
    assert_close(got, tiny_encoder.encode_documents(texts), atol=1e-5)


def test_model_failure_fails_its_requests_and_the_worker_keeps_serving(tiny_encoder):
    texts = word_texts(3, 5, 10, seed=10)
    proxy = ProxyEncoder(tiny_encoder, fail=1)

    async def main():
        async with AsyncDiceEncoder(proxy) as core:
            with pytest.raises(RuntimeError, match="injected"):
                await core.embed_documents(texts)
            return await core.embed_documents(texts), core

    out, core = run(main())
    assert_close(out.vectors, tiny_encoder.encode_documents(texts), atol=1e-5)
    assert core.tokens_waiting == 0


def test_close_drains_queued_requests_then_refuses(tiny_encoder):
    texts = word_texts(6, 10, 60, seed=11)
    proxy = ProxyEncoder(tiny_encoder)

    async def main():
        core = AsyncDiceEncoder(proxy)
        proxy.gate.clear()
        tasks = [asyncio.create_task(core.embed_documents([t])) for t in texts]
        while core.requests_in_flight < len(texts) or core.tokens_waiting == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(core.aclose())
        await asyncio.sleep(0.05)
        with pytest.raises(ShuttingDown):
            await core.embed_documents(texts[:1])
        proxy.gate.set()
        outs = await asyncio.gather(*tasks)
        await closing
        return outs

    outs = run(main())
    assert_close(np.concatenate([o.vectors for o in outs]), tiny_encoder.encode_documents(texts), atol=1e-5)


def test_close_lets_calls_still_tokenizing_finish(tiny_encoder, monkeypatch):
    """Calls accepted and still tokenizing when aclose() began were refused (ShuttingDown) once planned,
    while /health said requests in flight finish; a closing worker now waits for them."""
    import threading

    from dice_fast.serve import admission

    texts = word_texts(3, 10, 60, seed=12)
    entered, gate = [], threading.Event()
    plan = admission.plan_request

    def held_plan(*args, **kwargs):
        entered.append(1)
        gate.wait(30)
        return plan(*args, **kwargs)

    monkeypatch.setattr(admission, "plan_request", held_plan)

    async def main():
        core = AsyncDiceEncoder(tiny_encoder)
        tasks = [asyncio.create_task(core.embed_documents([t])) for t in texts]
        while len(entered) < len(texts):
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(core.aclose())
        await asyncio.sleep(0.2)
        assert not closing.done()  # the worker waits for the calls still planning
        with pytest.raises(ShuttingDown):
            await core.embed_documents(texts[:1])  # a new call is refused
        gate.set()
        outs = await asyncio.gather(*tasks)
        return outs, await closing

    outs, stopped = run(main())
    assert stopped is True
    assert_close(np.concatenate([o.vectors for o in outs]), tiny_encoder.encode_documents(texts), atol=1e-5)


def _a_call_left_by_its_closed_loop(encoder, **limits):
    """(core, texts): a core over ``encoder`` with a call of ``texts`` queued from a loop that was then
    closed with the call still waiting (its batch held at a gate until the loop was gone)."""
    proxy = ProxyEncoder(encoder)
    core = AsyncDiceEncoder(proxy, **limits)
    texts = word_texts(2, 20, 60, seed=13)
    proxy.running.clear()
    proxy.gate.clear()
    loop = asyncio.new_event_loop()
    loop.create_task(core.embed_documents(texts))
    while not proxy.running.is_set():
        loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()  # its task still waiting for the batch held at the gate
    del loop
    proxy.gate.set()
    return core, texts


def test_a_call_whose_event_loop_closed_gives_its_slot_back(tiny_encoder):
    """A loop closed with a call still waiting (not cancelled: a loop torn down in a thread): the worker
    kept the last job, and through it the call's task, for good, so its max_concurrent_requests slot
    never came back (every later call: Overloaded)."""
    import gc

    core, texts = _a_call_left_by_its_closed_loop(tiny_encoder, max_concurrent_requests=1)
    deadline = time.monotonic() + 30
    while core.requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()  # the abandoned task, once nothing holds it, ends and releases its slot
    assert core.requests_in_flight == 0
    assert_close(run(core.embed_documents(texts)).vectors, tiny_encoder.encode_documents(texts), atol=1e-5)
    core.close()


def test_a_synchronous_close_on_the_loop_with_a_call_in_flight_returns(tiny_encoder):
    """close() on the event loop's thread (a synchronous shutdown hook) while a call tokenizes: the loop
    is blocked in close, so the call can never queue its work; the worker must not wait for it (a review
    found close() hanging there once the worker waited for calls still tokenizing)."""
    texts = word_texts(3, 10, 60, seed=12)

    async def main():
        core = AsyncDiceEncoder(tiny_encoder)
        core.start()
        task = asyncio.create_task(core.embed_documents(texts))
        await asyncio.sleep(0)  # the call is accepted (_planning = 1) and awaits its tokenizing
        t = time.monotonic()
        stopped = core.close(5)  # synchronous, on the loop thread
        waited = time.monotonic() - t
        try:
            await task
        except ShuttingDown:
            pass
        return stopped, waited

    stopped, waited = asyncio.run(main())
    assert stopped and waited < 4, (stopped, waited)


def test_close_does_not_wait_for_a_call_whose_loop_closed(tiny_encoder):
    """A loop closed with a call queued and waiting: close() returns once the queue is done, without
    waiting for the abandoned call's garbage collection."""
    import gc

    core, _ = _a_call_left_by_its_closed_loop(tiny_encoder)
    gc.disable()
    try:
        t = time.monotonic()
        stopped = core.close(5)
    finally:
        gc.enable()
    assert stopped, time.monotonic() - t


@pytest.mark.parametrize("bad", [{"max_inputs_per_request": 0}, {"max_queue_tokens": -1},
                                 {"max_concurrent_requests": 1.5}, {"max_tokens_per_document": True}])
def test_bad_limits_raise(tiny_encoder, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AsyncDiceEncoder(tiny_encoder, **bad)


def test_non_string_input_raises_type_error(tiny_encoder):
    async def main():
        async with AsyncDiceEncoder(tiny_encoder) as core:
            await core.embed_documents(["ok", 3])

    with pytest.raises(TypeError, match=r"input\[1\]"):
        run(main())
