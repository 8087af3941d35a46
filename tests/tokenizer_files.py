"""A small trained `tokenizer.json`, for the tests of exact matching against a real tokenizer file."""


def train_tokenizer(path) -> None:
    """A byte-level BPE of 300 tokens trained on a fixed corpus, saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = ["billing", "weather", "question", "answer", "assistant", "rules", "travel", "system", "user"]
    corpus = [" ".join(words[(i + j) % len(words)] for j in range(30)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
