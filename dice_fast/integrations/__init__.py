"""Integrations with other stacks (optional extras): Ray Data, MTEB, a sentence-transformers-shaped encode.

* `dice_fast.integrations.ray`: ``encode_dataset(ds, model, ...)`` and the ``DiceEmbedder`` callable
  class for ``Dataset.map_batches`` (``pip install dice-fast[ray]``);
* `dice_fast.integrations.mteb`: ``DiceMTEBModel``, the MTEB 2.x encoder protocol (``pip install dice-fast[mteb]``);
* `dice_fast.integrations.sentence_transformers`: ``DiceSentenceEncoder``, ``encode`` / ``encode_query`` /
  ``encode_document`` shaped like ``SentenceTransformer``'s (no extra needed).

Importing this package imports none of them; each module imports its extra when used.
"""
