"""Pure-torch kind math, one request at a time: attention with LSE, MLA, the DSA indexer's
selection, the causal conv, the q/k l2 norm and the gated delta rule (GDN, KDA).

The ground truth the reference backends are built from and the fast paths are
checked against. What a checkpoint's weights are called and how a Hugging Face
layer turns hidden states into these inputs is model knowledge and lives in
``fnattn.models``.
"""
