"""The scraper worker: every pod's `/metrics` page read (`parsing`, with each engine's metric names in
`engines`) and written to Redis once per interval (`worker.Scraper`); the pods' KV events followed and shared
(`kv_follow`); its own HTTP port (`scraper_http`).

Imports `fleet` and below; the host and the operator tools sit above it.
"""
