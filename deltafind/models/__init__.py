"""Model families in pure torch, one module per HF `model_type`, plus shared ops.

Models see torch, `deltafind.config` and `deltafind.provider` only.
"""
