"""The conversations of the live trace (``scripts/live_trace.py``) and the order they go in.

Each conversation opens with one of a few shared system prompts, so that a first turn may
find a prefix already cached; each later turn is the conversation so far plus a short new
message, so that it extends what the server cached for the earlier turn. Every turn is sent
in its own shuffled order, so that by its next turn a conversation's KV has left the GPU's
small cache and comes back from the CPU tier. Token ids are drawn from a seeded generator:
two runs with one seed send the same prompts, and a mode's outputs can be compared with
another's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

FIRST_TURN_TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32000)
SYSTEM_PROMPT_TOKENS = (256, 384, 512)
NEW_USER_TOKENS = 64
# Token ids drawn below Llama 3's special tokens (128000 on).
TOKEN_RANGE = (1000, 120000)


@dataclass
class Conversation:
    index: int
    system: list[int]
    first_user: list[int]
    later_users: list[list[int]]
    history: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Tokens of the first turn."""
        return len(self.system) + len(self.first_user)

    def prompt(self, turn: int) -> list[int]:
        """Turn 0: system prompt and first message; later: all so far and a new message."""
        if turn == 0:
            return self.system + self.first_user
        return self.history + self.later_users[turn - 1]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


def check_first_turns(first_turns: Sequence[int]) -> None:
    """Raises ValueError unless every first turn holds the longest system prompt."""
    if not first_turns or min(first_turns) < max(SYSTEM_PROMPT_TOKENS):
        raise ValueError(
            f"first turns must be at least {max(SYSTEM_PROMPT_TOKENS)} tokens (the longest "
            f"system prompt), got {list(first_turns)}"
        )


def make_conversations(
    count: int, turns: int, seed: int, first_turns: Sequence[int] = FIRST_TURN_TOKENS
) -> list[Conversation]:
    """``count`` conversations whose first turns cycle through ``first_turns``."""
    check_first_turns(first_turns)
    rng = random.Random(seed)
    systems = [tokens(rng, n) for n in SYSTEM_PROMPT_TOKENS]
    conversations = []
    for index in range(count):
        system = systems[index % len(systems)]
        first = first_turns[index % len(first_turns)]
        conversations.append(
            Conversation(
                index,
                system,
                tokens(rng, first - len(system)),
                [tokens(rng, NEW_USER_TOKENS) for _ in range(turns - 1)],
            )
        )
    return conversations


def turn_orders(count: int, turns: int, seed: int) -> list[list[int]]:
    """Per turn, the order the conversations are sent in (each turn its own shuffle)."""
    rng = random.Random(seed + 1)
    orders = []
    for _ in range(turns):
        order = list(range(count))
        rng.shuffle(order)
        orders.append(order)
    return orders
