"""Draft sources for speculative decoding: they propose tokens, the target decides.

`base` is the contract every source implements; `engine/speculative.py` is the
one verifier that accepts or rejects proposals so output is unchanged.
"""
