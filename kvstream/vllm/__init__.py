"""What runs inside a vLLM server: the general plugin (:mod:`.plugin`), the tap that reads vLLM's scheduler and
block pool into pool views (:mod:`.tap`), and vLLM's block-hash conventions (:mod:`.hash`).

An adapter that lives in another program's process, not a wire format: it only *produces* the pool stream
(:mod:`kvstream.poolstream`). Importing this package imports nothing of vLLM; :mod:`.plugin` does so lazily.
"""
