"""DeepSeek Sparse Attention's top-k key selection (the indexer of ``mixers.mla``'s DSA layers): ``topk.py`` the
blocked selection in one process and its dense reference; ``cp.py`` the selection over a context-parallel group."""
