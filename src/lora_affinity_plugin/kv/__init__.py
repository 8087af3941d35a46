"""Prompt keys and what each pod's KV cache holds.

A prompt named in chained block keys (`prefixes`, `token_blocks`, `tokenization`); the inferred index of what
the gateways sent where (`prefix_index`); vLLM's KV events on the wire (`kv_events`), the exact index they build
(`exact_index`), its subscriber (`kv_subscriber`), checkpoints (`kv_checkpoint`) and how the index is shared
with every proxy (`exact_share`).

Imports nothing of the plugin's: the rules read these keys, and the layers above read the indexes.
"""
