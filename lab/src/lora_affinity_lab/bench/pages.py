"""Static `/metrics` pages on many ports from one process: the fleet for `bench --scenario scrape-scale`.

    python -m lora_affinity_lab.bench.pages --base-port 20000 --count 256 --page page.txt

A bare asyncio protocol answers every keep-alive GET with the same prebuilt response, so serving 256
replicas' pages costs the benchmark machine little next to the scraper it measures.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


class _PageProtocol(asyncio.Protocol):
    def __init__(self, response: bytes) -> None:
        self._response = response
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while b"\r\n\r\n" in self._buffer:  # one GET per header block; bodies never come
            _, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
            self._transport.write(self._response)


def http_response(body: bytes) -> bytes:
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n"
            "Connection: keep-alive\r\n\r\n")
    return head.encode() + body


async def serve(base_port: int, count: int, body: bytes) -> None:
    response = http_response(body)
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda: _PageProtocol(response), "127.0.0.1", base_port + i, backlog=64)
               for i in range(count)]
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-port", type=int, required=True)
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--page", type=Path, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.base_port, args.count, args.page.read_bytes()))


if __name__ == "__main__":
    main()
