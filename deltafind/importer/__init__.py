"""Writes expert stores: setup from HF folders, GGUF files and hubs (streamed installs too), the tensor
plan and spine writer, placement and rebalance, DSpark import and synthetic stores.

It may import `deltafind.store`, whose format it writes; the store never imports it.
"""
