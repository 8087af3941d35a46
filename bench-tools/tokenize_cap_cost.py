"""What tokenizing an unseen 1 MB prompt costs a proxy's event loop, with and without the cap at `prefix_max_chars`.

    .venv/bin/python bench-tools/tokenize_cap_cost.py [ROUNDS]

Both readings in one run, rounds interleaved, each prompt unseen (its head not cached); medians. The tokenizer is
the small BPE the tests train (`tests/kv/test_kv_subscriber.py`); a model's own tokenizer.json is slower per
character, so the ratio is what carries over.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kv_subscriber import _train_tokenizer  # noqa: E402

from lora_affinity_plugin.config.settings import build_settings  # noqa: E402
from lora_affinity_plugin.kv.tokenization import PromptTokenizer  # noqa: E402


def main(rounds: int = 5) -> None:
    path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    _train_tokenizer(path)
    tokenizer = PromptTokenizer(str(path))
    cap = build_settings({}, environ={}).prefix_max_chars
    timings: dict[str, list[float]] = {"uncapped": [], "capped": []}
    for i in range(rounds):
        for name, limit in (("uncapped", None), ("capped", cap)):
            prompt = f"{name} {i} " + "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 18_000
            started = time.perf_counter()
            tokenizer.chains(7, [{"role": "user", "content": prompt}], 16, limit)
            timings[name].append(time.perf_counter() - started)
    uncapped, capped = (statistics.median(timings[k]) * 1000 for k in ("uncapped", "capped"))
    print(f"an unseen ~1 MB prompt, median of {rounds}: uncapped {uncapped:.1f} ms, capped at {cap:,} characters "
          f"{capped:.1f} ms ({capped / uncapped:.3f}x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
