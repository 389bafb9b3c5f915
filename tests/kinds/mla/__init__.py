"""Tests of fnattn.kinds.mla."""
