"""A tokenizer and chat template for runs where simulated replicas publish KV events and the plugin recomputes
their block keys: a small byte-level BPE `tokenizer.json` trained here, offline, on the benchmarks' word list,
and the simulator's own chat rendering (`sim.kv_cache.prompt_text`) as a Jinja template, as an engine's would be."""

from __future__ import annotations

from pathlib import Path

from .prefix_workloads import _WORDS

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_tokenizer_files(directory: Path, vocab_size: int = 600) -> dict[str, str]:
    """Writes `tokenizer.json` and `chat.jinja` into `directory`; the plugin's `tokenizers` entry for them.
    `vocab_size`: 600 gives about a token a word; a smaller vocabulary, shorter tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # a LiteLLM dependency

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = list(_WORDS) + ["question", "report", "what", "is", "in", "the", "system", "user", "assistant"]
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(400)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat.jinja").write_text(CHAT_TEMPLATE)
    return {"tokenizer": str(directory / "tokenizer.json"), "chat_template": str(directory / "chat.jinja")}
