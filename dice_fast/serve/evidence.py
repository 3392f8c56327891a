"""``POST /v1/evidence``: given a query and documents (retrieved elsewhere), each document's score
and the passage that matched (localisation here, retrieval elsewhere).

The query and the documents are encoded by the shared core as one call
(`AsyncDiceEncoder.embed_query_and_documents`: one share, one admission, the query tokenized first, the
first error cancelling the rest; the documents keep their chunk vectors for the scoring), so the route
obeys the same limits as ``/v1/embeddings``, its response counted as `ROW_NUMBERS` numbers per document
(no vectors); scoring is `dice_fast.scoring`.
"""

from __future__ import annotations

from fastapi import Request

from .. import scoring as sc
from .schemas import evidence_response, parse_evidence_request
from .transport import unless_disconnected

# The numbers of one row (index, score, chunk, start_char, end_char, chunk_score): what a document costs
# against max_response_floats here. The response holds no vectors; the chunk vectors only feed the scoring.
ROW_NUMBERS = 6


def evidence_rows(req, query_vector, out) -> list[dict]:
    """One row per document of ``out`` (a `DiceOutput`), in input order: its score under
    ``req.scoring`` and the evidence chunk's index, span, score and text (chunks as unit vectors, as
    `DiceIndex` stores them: ``maxsim`` is a cosine)."""
    cu = sc.cu_from_chunk_document(out.chunk_document, len(req.documents))
    alpha = sc.DEFAULT_ALPHA if req.alpha is None else req.alpha
    chunks = sc.unit_rows(out.chunks)
    score, evidence = sc.score(req.scoring, query_vector, out.documents, chunks, cu, alpha)
    per_chunk = sc.chunk_scores(query_vector, chunks)[0]
    rows = []
    for d, text in enumerate(req.documents):
        j = int(evidence[0, d])
        if j < 0:  # no chunk scored a number (a non-finite chunk vector): no evidence
            rows.append({"index": d, "score": float(score[0, d]), "chunk": -1, "start_char": 0, "end_char": 0,
                         "chunk_score": None, "text": ""})
            continue
        c = int(cu[d]) + j
        start, end = int(out.chunk_start_char[c]), int(out.chunk_end_char[c])
        rows.append({"index": d, "score": float(score[0, d]), "chunk": j, "start_char": start, "end_char": end,
                     "chunk_score": float(per_chunk[c]), "text": text[start:end]})
    return rows


def add_evidence_route(app, core, model_name: str, read_request, answer, serialise, schema: dict,
                       responses: dict) -> None:
    """Register ``POST /v1/evidence`` on ``app`` over the `AsyncDiceEncoder` ``core``; ``read_request``
    (content type, body limit, parsing), ``answer`` (the lease, errors, disconnects, metrics) and
    ``serialise`` are the app's own, shared with ``/v1/embeddings``; ``schema`` the body's JSON schema and
    ``responses`` the route's answers, for the OpenAPI document."""

    @app.post("/v1/evidence", summary="Score documents for a query and return each one's evidence passage",
              responses=responses,
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": schema}}}})
    async def evidence(request: Request):
        async def handle(_labels, lease):
            req = await read_request(request, parse_evidence_request)
            work = core.embed_query_and_documents(req.query, req.documents, return_chunks=True, lease=lease,
                                                  strategy=req.strategy, numbers_per_document=ROW_NUMBERS)
            done = await unless_disconnected(request, work)
            if done is None:
                return None
            query, docs = done
            rows = evidence_rows(req, query.vectors, docs.chunks)
            tokens = int(query.tokens.sum() + docs.tokens.sum())
            content = await serialise(evidence_response, len(rows) * ROW_NUMBERS, rows, req.scoring, tokens,
                                      model_name)
            return content, len(req.documents), tokens

        return await answer(request, "evidence", handle)
