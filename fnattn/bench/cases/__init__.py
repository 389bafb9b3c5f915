"""The standard cases of ``fnattn bench``, one module per attention kind: each times fnattn's backends on one
shape next to the peer a user would otherwise run (FlashInfer, FlashMLA, fla-core, torch SDPA).

A kind's own package holds its story (config, storage, reference, fast paths); how it is timed lives here, and
sweeps and switch A/B comparisons live in the repository's ``benchmarks/`` scripts, which import these modules.
"""
