"""The thin adapter to LiteLLM: the custom routing strategy (`host_strategy`), the proxy callback that installs
it (`proxy_callback`), what differs between LiteLLM releases (`compat`) and pooled upstream clients
(`pooling`).

Imports every layer below it; `strategy.py`, the entry point `config.yaml` names, is its only importer.
"""
