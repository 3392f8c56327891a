"""Integrations with other stacks (optional extras): Ray Data, MTEB, a sentence-transformers-shaped encode,
LangChain and LlamaIndex.

* `dice_fast.integrations.ray`: ``encode_dataset(ds, model, ...)`` and the ``DiceEmbedder`` callable
  class for ``Dataset.map_batches`` (``pip install dice-fast[ray]``);
* `dice_fast.integrations.mteb`: ``DiceMTEBModel``, the MTEB 2.x encoder protocol (``pip install dice-fast[mteb]``);
* `dice_fast.integrations.sentence_transformers`: ``DiceSentenceEncoder``, ``encode`` / ``encode_query`` /
  ``encode_document`` shaped like ``SentenceTransformer``'s (no extra needed);
* `dice_fast.integrations.langchain`: ``DiceEmbeddings`` (langchain-core ``Embeddings``) and ``DiceRetriever``
  (a ``BaseRetriever`` over a ``DiceIndex`` returning evidence passages) (``pip install dice-fast[langchain]``);
* `dice_fast.integrations.llama_index`: ``DiceEmbedding`` (llama-index-core ``BaseEmbedding``)
  (``pip install dice-fast[llama-index]``).

The LangChain and LlamaIndex adapters run the engine in-process or call a running ``dice-fast serve``.
Importing this package imports none of them; each module imports its extra when used.
"""
