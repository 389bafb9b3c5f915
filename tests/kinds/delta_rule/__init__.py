"""Tests of fnattn.kinds.delta_rule."""
