"""How a job keeps what backward needs, as pure rules the engines and the planner share: the tokens
per chunk of the LM head and its loss (engine/chunkloss.py computes it; planning/ rates its bytes)."""
from __future__ import annotations

CHUNK_BYTES = 1 << 30  # auto: the most fp32 logits a chunk may hold


def loss_chunk_tokens(setting: int | None, tokens: int, vocab: int) -> int:
    """Tokens per chunk of the head and loss for a micro-batch of `tokens` tokens (per rank) over a
    vocabulary of `vocab`; 0 computes the whole logits at once. `setting`: --loss-chunk (None: auto,
    chunks of at most CHUNK_BYTES of fp32 logits where the whole would be more)."""
    if setting is not None:
        return 0 if setting == 0 or setting >= tokens else setting
    if 4 * tokens * vocab <= CHUNK_BYTES:
        return 0
    return max(1, CHUNK_BYTES // (4 * vocab))
