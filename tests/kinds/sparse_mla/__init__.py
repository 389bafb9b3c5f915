"""Tests of fnattn.kinds.sparse_mla."""
