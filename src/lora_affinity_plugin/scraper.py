"""The entry point of the scraper worker: `lora-affinity scrape --config config.yaml` runs it, and
`python -m lora_affinity_plugin.scraper --config config.yaml` does the same.

The worker itself is `scraping/worker.py` (`Scraper`): every pod's `/metrics` read and written to Redis once
per interval.
"""

from __future__ import annotations

import sys

from .scraping.worker import Scraper

__all__ = ["Scraper", "main"]


def main(argv: list[str] | None = None) -> int:
    """`lora-affinity scrape ARGS`."""
    from .ops.cli import main as cli_main

    return cli_main(["scrape", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
