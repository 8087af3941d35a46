"""Prompts that share long prefixes, for the KV-reuse benchmarks; the same for fast and live mode.

- ``shared-prefix``: the shape of the Kubernetes `inference-perf` tool's shared_prefix generator:
  groups of requests share a system prompt, each request asks its own question; groups on adapters
  and on the base model; more system prompts than one replica's cache holds.
- ``overload``: unique prompts (nothing to reuse) on adapters, a share of them sheddable, at
  multiples of the rate the fleet sustains.
- ``mixed``: what a shared LoRA fleet gets: adapters by Zipf popularity, each request one of the LoRA
  prompt shapes (a unique text of 0.5-8 KB, the adapter's instruction plus a question, a short question),
  and a share of arrivals starting multi-turn chats on the base model.
- ``kv-pressure``: many tenants, each with a long system prompt and a few long documents its requests ask
  about; the distinct prefixes are several times what the fleet's caches hold, so caches evict all the time
  and where a prompt was sent says less and less about where it still is.
- ``multi-turn``: chat sessions of a few apps (each an adapter, or the base model, with its own
  system prompt); every turn resends the whole history (the app's system prompt, the earlier
  questions and the replies received) after a think time. An app's sessions outnumber what one
  replica serves, so adapter affinity alone scatters a session's turns over the app's replicas.

Arrivals are open-loop (Poisson at the scenario's rate): a slow fleet does not slow the client
down. In multi-turn the first turns arrive that way; a session's next turn follows its reply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .prompt_shapes import lora_prompt
from .scenarios import SEED_PROMPT, Scenario

MIXED_SHAPES = (("unique", 500), ("unique", 1500), ("unique", 4000), ("unique", 8000), ("instruction", 1500),
                ("seed", 0))
"""mixed: the adapter requests' prompt shapes and sizes (characters), drawn uniformly."""
_ADAPTER_GROUP = 1_000_000
"""mixed: an adapter request's group (what prefix-partition pins) is this plus the adapter's index."""
CHARS_PER_TOKEN = 3
"""Text is generated at the simulator's tokenization, so `system_tokens` are the replica's tokens."""
BASE_MODEL = "meta-llama/Llama-2-7b-hf"
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
_LENGTHS = tuple(len(word) + 1 for word in _WORDS)  # a word and the space after it


@dataclass
class PromptRequest:
    index: int
    arrival: float
    adapter: str | None
    """None: the base model."""
    messages: list[dict]
    group: int
    """System prompt (shared-prefix) or session (multi-turn): what prefix-partition pins."""
    max_tokens: int
    turn: int = 0
    stream: bool = True
    sheddable: bool = False
    """Sent with `metadata: {"criticality": "sheddable"}` (the overload scenario)."""

    @property
    def model(self) -> str:
        return self.adapter or BASE_MODEL


def text(rng: random.Random, tokens: int) -> str:
    """Words drawn as `rng.choice(_WORDS)` draws them, one `getrandbits` at a time: the same words in a third of
    the time (documents' texts were a quarter of a fast run's work)."""
    draw, count = rng.getrandbits, len(_WORDS)
    bits = count.bit_length()
    words, size, limit = [], 0, tokens * CHARS_PER_TOKEN
    while size < limit:
        i = draw(bits)
        while i >= count:
            i = draw(bits)
        words.append(_WORDS[i])
        size += _LENGTHS[i]
    return " ".join(words)


def background_text(seed: int, turn: int, tokens: int) -> str:
    """Another client's unique long prompt (kv-pressure-shared)."""
    return text(random.Random(f"{seed}-background-{turn}"), tokens)


BACKGROUND_OUTPUT_TOKENS = 20


def background_arrivals(scenario, seed: int) -> list[tuple[float, int, int]]:
    """Another client's requests (kv-pressure-shared and -foreign), straight to the replicas in turn, past the
    gateways: (arrival in simulated seconds, replica, turn), Poisson at `background_rate`."""
    if not scenario.background_rate:
        return []
    rng = random.Random(f"{seed}-background")
    out, at, turn = [], 0.0, 0
    while at < scenario.duration_s:
        at += rng.expovariate(scenario.background_rate)
        out.append((at, turn % scenario.replicas, turn))
        turn += 1
    return out


@dataclass
class PrefixWorkload:
    """The requests of one run; `follow_up` yields a session's next turn once a reply arrives."""

    scenario: Scenario
    seed: int
    _next_index: int = 0
    _sessions: dict[int, list[dict]] = field(default_factory=dict)
    _systems: dict[int, str] = field(default_factory=dict)

    def initial(self) -> list[PromptRequest]:
        s = self.scenario
        rng = random.Random(f"{self.seed}-prefix-workload")
        out, t = [], 0.0
        sessions = s.kind == "multi-turn"
        count = max(1, round(s.requests / max(1, s.turns))) if sessions else s.requests
        rate = (s.arrival_rate or 1.0) / max(1, s.turns) if sessions else (s.arrival_rate or 1.0)
        weights = [1 / (rank + 1) ** s.zipf_s for rank in range(len(s.adapters))] if s.zipf_s else None
        tenant_weights = [1 / (rank + 1) ** s.zipf_s for rank in range(s.groups)] if s.zipf_s and s.groups else None
        for i in range(count):
            t += rng.expovariate(rate)
            if s.kind == "mixed":
                if rng.random() < s.chat_share:  # a chat on the base model: its next turns follow its replies
                    self._sessions[i] = [{"role": "system", "content": self._system(rng.randrange(s.base_groups))}]
                    out.append(self._turn(i, t, None, 0))
                    continue
                pick = rng.choices(range(len(s.adapters)), weights)[0]
                shape, chars = MIXED_SHAPES[rng.randrange(len(MIXED_SHAPES))]
                content = lora_prompt(shape, chars, self.seed, i, s.adapters[pick], SEED_PROMPT)
                out.append(self._request(t, s.adapters[pick], [{"role": "user", "content": content}],
                                         _ADAPTER_GROUP + pick, 0))
            elif s.kind == "overload":  # unique prompts: nothing to reuse, every request costs its prefill
                adapter = rng.choice(s.adapters)
                request = self._request(t, adapter, [{"role": "user", "content": f"{i}: " + text(rng, s.question_tokens)}],
                                        i, 0)
                request.sheddable = rng.random() < s.sheddable_share
                out.append(request)
            elif s.kind == "kv-pressure":  # many tenants' long prompts: more distinct prefixes than the caches hold
                tenant = rng.choices(range(s.groups), tenant_weights)[0]
                doc = rng.randrange(s.documents)
                content = self._document(tenant, doc) + f"\n\nQuestion {i}: " + text(rng, s.question_tokens)
                messages = [{"role": "system", "content": self._system(tenant)}, {"role": "user", "content": content}]
                out.append(self._request(t, s.adapters[tenant % len(s.adapters)], messages,
                                         tenant * s.documents + doc, 0))
            elif s.kind == "shared-prefix":
                group = rng.randrange(s.groups)
                adapter = None if group >= s.groups - s.base_groups else s.adapters[group % len(s.adapters)]
                question = f"Question {i}: " + text(rng, s.question_tokens)
                messages = [{"role": "system", "content": self._system(group)},
                            {"role": "user", "content": question}]
                out.append(self._request(t, adapter, messages, group, 0))
            else:
                app = rng.randrange(len(s.adapters) + s.base_groups)  # the last base_groups apps use the base model
                history = [{"role": "system", "content": self._system(app)}]
                self._sessions[i] = history
                out.append(self._turn(i, t, s.adapters[app] if app < len(s.adapters) else None, 0))
        return out

    def foreign(self, turn: int) -> tuple[str | None, list[dict]]:
        """Another client's question about one of the tenants' documents (kv-pressure-foreign): its adapter and
        messages, the tenant drawn by the same popularity as the gateways' traffic."""
        s = self.scenario
        rng = random.Random(f"{self.seed}-foreign-{turn}")
        tenant = rng.choices(range(s.groups), [1 / (rank + 1) ** (s.zipf_s or 0.0) for rank in range(s.groups)])[0]
        content = self._document(tenant, rng.randrange(s.documents)) + f"\n\nBatch question {turn}: " + text(
            rng, s.question_tokens)
        messages = [{"role": "system", "content": self._system(tenant)}, {"role": "user", "content": content}]
        return s.adapters[tenant % len(s.adapters)], messages

    def background(self, turn: int) -> tuple[str | None, list[dict] | None, str | None]:
        """Another client's request `turn` (see `background_arrivals`): (adapter, chat messages, or a bare prompt).
        A question about a tenant's document (kv-pressure-foreign), else a unique long prompt (-shared)."""
        s = self.scenario
        if s.background_documents:
            adapter, messages = self.foreign(turn)
            return adapter, messages, None
        return None, None, f"Batch job {self.seed}-{turn}: " + background_text(self.seed, turn, s.background_tokens)

    def follow_up(self, request: PromptRequest, reply: str, now: float) -> PromptRequest | None:
        """The session's next turn, after the reply and a think time; None when the session is over."""
        s = self.scenario
        if request.group not in self._sessions or request.turn + 1 >= s.turns:
            return None
        history = self._sessions[request.group]
        history.append({"role": "assistant", "content": reply})
        think = random.Random(f"{self.seed}-think-{request.group}-{request.turn}").expovariate(1 / s.think_s)
        return self._turn(request.group, now + think, request.adapter, request.turn + 1)

    def expected(self, initial: list[PromptRequest]) -> int:
        """How many requests the run will send: every session's turns, one for each other request."""
        return sum(max(1, self.scenario.turns) if r.group in self._sessions else 1 for r in initial)

    def _turn(self, session: int, at: float, adapter: str | None, turn: int) -> PromptRequest:
        rng = random.Random(f"{self.seed}-session-{session}-{turn}")
        history = self._sessions[session]
        history.append({"role": "user", "content": f"Turn {turn}: " + text(rng, self.scenario.question_tokens)})
        return self._request(at, adapter, [dict(m) for m in history], session, turn)

    def _request(self, at: float, adapter: str | None, messages: list[dict], group: int, turn: int) -> PromptRequest:
        index, self._next_index = self._next_index, self._next_index + 1
        return PromptRequest(index, at, adapter, messages, group, self.scenario.max_tokens, turn)

    def _document(self, tenant: int, doc: int) -> str:
        rng = random.Random(f"document-{tenant}-{doc}")
        return f"Document {doc} of tenant {tenant}:\n" + text(rng, self.scenario.document_tokens)

    def _system(self, key: int) -> str:
        if key not in self._systems:
            rng = random.Random(f"system-{key}")
            self._systems[key] = f"You are assistant number {key}. " + text(rng, self.scenario.system_tokens)
        return self._systems[key]
