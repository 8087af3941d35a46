"""What matching a prompt exactly costs a proxy per request: `RequestBuilder.build` with and without the exact
index, 64 pods reporting, 16 shared 16 KB documents each with its own question (new strings every time), a
byte-level BPE tokenizer trained here and the simulator's chat template. Two prompt shapes: a chat (the document
as its system message, the question as the user's) and one message (the document, a blank line, the question:
a text completion as LiteLLM hands it to routing, or a RAG app's single user message).

    .venv/bin/python bench-tools/exact_match_cost.py     # median / p99 in us, inferred only and with exact
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kv_subscriber import _train_tokenizer  # noqa: E402

from lora_affinity_lab.bench.tokenizer_files import CHAT_TEMPLATE  # noqa: E402
from lora_affinity_plugin.kv.exact_share import PodChange  # noqa: E402
from lora_affinity_plugin.fleet.view import FleetView  # noqa: E402
from lora_affinity_plugin.fleet.request_builder import RequestBuilder  # noqa: E402
from lora_affinity_plugin.config.settings import build_settings  # noqa: E402


def measure(exact: bool, tokenizer: Path, template: Path, one_message: bool, requests: int = 2_000
            ) -> tuple[float, float]:
    pods = [f"http://10.0.0.{i}:8000" for i in range(64)]
    words = "billing rules answer question weather travel system user assistant".split()
    systems = [" ".join(random.Random(k).choice(words) for _ in range(2600))[:16_000] for k in range(16)]
    settings = build_settings({"kv_events": exact, "tokenizers": {"*": {"tokenizer": str(tokenizer),
                                                                        "chat_template": str(template)}}}, environ={})
    fleet = FleetView(settings)
    fleet.held.load({pod: PodChange(True, 16, set(range(i * 1000, i * 1000 + 500))) for i, pod in enumerate(pods)}, 0)
    times = []
    for n in range(requests):
        document, question = systems[n % 16][:1] + systems[n % 16][1:], f"question {n} about things?"
        messages = ([{"role": "user", "content": f"{document}\n\n{question}"}] if one_message else
                    [{"role": "system", "content": document}, {"role": "user", "content": question}])
        started = time.perf_counter()
        RequestBuilder().build(fleet, "adapter-1", "adapter-1", messages, {}, pods, settings, model="adapter-1")
        times.append(time.perf_counter() - started)
    times = sorted(times[requests // 5:])  # after every head was seen once
    return statistics.median(times) * 1e6, times[int(len(times) * 0.99)] * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, template = Path(tmp) / "tokenizer.json", Path(tmp) / "chat.jinja"
        _train_tokenizer(tokenizer)
        template.write_text(CHAT_TEMPLATE)
        for one_message in (False, True):
            for exact in (False, True):
                median, p99 = measure(exact, tokenizer, template, one_message)
                print(f"{'one message' if one_message else 'chat'}, "
                      f"{'with the exact index' if exact else 'inferred index only'}: {median:.1f} / {p99:.1f} us")


if __name__ == "__main__":
    main()
