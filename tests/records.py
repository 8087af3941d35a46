"""Test helper: pods' records as an asyncio Redis client reads them (the proxies read them in their refresh script,
`ops` with a sync client)."""

from lora_affinity_plugin.fleet.store import decode_records, pod_key


async def read_records(client, settings, pods):
    """Every pod's record in one MGET; pods with no (or an unreadable) record are left out."""
    if not pods:
        return {}
    return decode_records(pods, await client.mget([pod_key(settings, pod) for pod in pods]))
