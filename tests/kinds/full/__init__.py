"""Tests of fnattn.kinds.full."""
