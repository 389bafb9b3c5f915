"""Tests of each attention kind, one package per kind, mirroring fnattn/kinds/."""
