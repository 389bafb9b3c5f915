"""Pure-torch functional math, one request at a time: attention with LSE, MLA, the DSA indexer,
the causal conv and the gated delta rule (GDN, KDA), plus the Hugging Face layer glue.

The ground truth the reference backends are built from and the fast paths are checked against.
"""
