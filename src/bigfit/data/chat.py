"""Conversations as training samples: records of `messages` ([{"role": ..., "content": ...}, ...], the
conversational format TRL and the chat templates use), for decoder-only models.

Each conversation is rendered with the tokenizer's chat template (or --chat-template FILE), and the
loss falls on the assistant turns alone: the template renders the conversation up to each assistant
turn with its generation prompt, then with the turn, and the text between the two is what the model
learns (with whatever end-of-turn marker the template writes after it); the system and user turns,
and the template's own cues, are context (label -100). Each piece is tokenized on its own, as the
conversation is cut at turn boundaries: a token never spans two turns.
"""
from __future__ import annotations

from ..errors import BigfitError

ROLES = ("system", "user", "assistant", "tool")
SHAPE = 'a list of {"role": ..., "content": ...} turns, roles among system, user, assistant, tool'


def checked_messages(value, where: str) -> list[dict]:
    """The turns of one record, or one line saying what is wrong with them."""
    if not isinstance(value, list) or not value:
        raise BigfitError(f"{where}: messages must be {SHAPE}; got {str(value)[:80]!r}")
    for n, turn in enumerate(value):
        if not (isinstance(turn, dict) and turn.get("role") in ROLES and isinstance(turn.get("content"), str)):
            raise BigfitError(f"{where}: turn {n} of messages is not {{'role': one of {', '.join(ROLES)}, "
                              f"'content': a string}}; got {str(turn)[:80]!r}")
    if not any(t["role"] == "assistant" for t in value):
        raise BigfitError(f"{where}: messages has no assistant turn, so nothing to learn; the loss falls on "
                          "assistant turns alone")
    return [{"role": t["role"], "content": t["content"]} for t in value]


def require_template(tok, model: str | None) -> None:
    if not getattr(tok, "chat_template", None):
        raise BigfitError(f"--data holds messages, but the tokenizer of --model {model or '(default)'!r} has no chat "
                          "template; give one with --chat-template FILE (a Jinja template, as tokenizer_config.json's "
                          "chat_template holds it)")


def chat_sample(tok, messages: list[dict], max_len: int) -> dict:
    """input_ids and labels of one conversation (module docstring), cut to `max_len` tokens."""
    ids, labels, done = [], [], ""
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before, upto = _render(tok, messages[:i], True), _render(tok, messages[:i + 1], False)
        for text, learn in ((_after(done, before), False), (_after(before, upto), True)):
            piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            labels += piece if learn else [-100] * len(piece)
        done = upto
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}


def _render(tok, messages: list[dict], prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _after(prefix: str, text: str) -> str:
    if not text.startswith(prefix):  # a template that rewrites earlier turns (a date, a system default)
        raise BigfitError("the chat template does not render a conversation turn by turn (the text up to a turn "
                          "is no prefix of the text up to the next), so the assistant turns cannot be told apart; "
                          "give another with --chat-template FILE")
    return text[len(prefix):]
