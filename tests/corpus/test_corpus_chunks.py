"""``dice-fast encode --chunks``: chunk vectors, spans and token counts beside the document vectors, in a
.parquet and a shard folder, equal to ``encode_documents(return_chunks=True)``; indexed by
``DiceIndex.from_corpus`` / ``dice-fast index``; refused with .npy and --queries."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_util import corpus_docs, encoder, write_jsonl
from dice_fast import DiceIndex
from dice_fast.cli import main


@pytest.mark.parametrize("out_name", ["out.parquet", "shards/"])
def test_chunks_are_written_and_indexed(tmp_path, cached_encoders, capsys, out_name):
    docs = corpus_docs(7, seed=5, words=(3, 90))
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    out = tmp_path / out_name
    args = ["encode", str(src), "-o", str(out), "--chunks", "--chunk-size", "32", "--quiet", "--id-field", "id"]
    assert main(args + (["--shard-rows", "3"] if out_name.endswith("/") else [])) == 0
    want = encoder(chunk_size=32).encode_documents(docs, return_chunks=True)
    index = DiceIndex.from_corpus(out)
    assert index.ids == [f"doc{i:04d}" for i in range(7)] and index.texts is None
    np.testing.assert_allclose(index.documents, want.documents, atol=1e-5)
    np.testing.assert_allclose(index.chunks, want.chunks, atol=1e-5)
    assert index.chunk_start_char.tolist() == want.chunk_start_char.tolist()
    assert index.chunk_end_char.tolist() == want.chunk_end_char.tolist()
    assert index.chunk_tokens.tolist() == (want.chunk_end - want.chunk_start).tolist()
    assert np.diff(index.cu_doc_chunks).tolist() == np.bincount(want.chunk_document).tolist()
    assert index.encoder_options["chunk_size"] == 32
    assert main(["index", str(out), "-o", str(tmp_path / "ix")]) == 0
    capsys.readouterr()
    assert main(["search", str(tmp_path / "ix"), docs[3][:60], "-k", "1", "--scoring", "maxsim"]) == 0
    top = capsys.readouterr().out.splitlines()[1]  # after "query: ..."
    assert top.split()[1] == "doc0003" and "[characters 0:" in top


def test_chunks_refused_where_they_cannot_go(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", corpus_docs(2))
    assert main(["encode", str(src), "-o", str(tmp_path / "out.npy"), "--chunks", "--quiet"]) == 2
    assert "--chunks needs documents written to a .parquet or a folder output" in capsys.readouterr().err
    assert main(["encode", str(src), "-o", str(tmp_path / "q.parquet"), "--chunks", "--queries", "--quiet"]) == 2
    assert "--queries" in capsys.readouterr().err
    assert main(["encode", str(src), "-o", str(tmp_path / "plain.parquet"), "--quiet"]) == 0
    with pytest.raises(ValueError, match="encode with --chunks to index the output"):
        DiceIndex.from_corpus(tmp_path / "plain.parquet")
