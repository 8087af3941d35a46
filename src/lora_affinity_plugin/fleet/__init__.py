"""The shared state every process meets in Redis, and a proxy's view of its pods.

Pod records (`store`), Redis's clock (`clock`), the scraper's lease (`lease`), requests in flight (`inflight`),
what the fleet serves (`discovery`), deployments as pods (`pods`), which adapter names are real (`adapters`),
which adapters an idle pod still holds (`residency`);
a proxy's view of the fleet (`view.FleetView`), kept current by its follower (`follower`), and the request the
rules are asked about (`request_builder`).

Imports `config`, `routing`, `kv` and `telemetry`; never the scraper or the host.
"""
