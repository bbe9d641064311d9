"""Conversations (`messages` records) for decoder-only models: rendered with the chat template (the
tokenizer's, or --chat-template FILE), the loss on the assistant turns alone; each mistake one line."""
from __future__ import annotations

import json

import pytest
from transformers import ByT5Tokenizer

from bigfit.data import read_examples
from bigfit.data.chat import chat_sample
from bigfit.errors import BigfitError
from conftest import read_jsonl

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}</s>{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TALK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and three"},
        {"role": "assistant", "content": "7"}]


def _tok():
    tok = ByT5Tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_only_the_assistant_turns_carry_loss():
    tok = _tok()
    s = chat_sample(tok, TALK, 512)
    assert tok.decode(s["input_ids"]) == tok.apply_chat_template(TALK, tokenize=False)
    learned = [i for i, label in zip(s["input_ids"], s["labels"]) if label != -100]
    assert tok.decode(learned) == "4</s>7</s>"  # the answers and the template's end of turn
    assert [label for label in s["labels"] if label != -100] == learned
    assert len(chat_sample(tok, TALK, 10)["input_ids"]) == 10


def test_a_template_that_rewrites_earlier_turns_is_one_line():
    tok = ByT5Tokenizer()
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(BigfitError, match="does not render a conversation turn by turn"):
        chat_sample(tok, TALK, 512)


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "user", "content": "hi"}], "messages has no assistant turn"),
    ([{"role": "robot", "content": "hi"}], "turn 0 of messages is not {'role': one of system, user, assistant"),
    ("hello", "messages must be a list of"),
])
def test_bad_conversations_are_one_line_naming_the_line(tmp_path, messages, needle):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": TALK}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(BigfitError, match=f"line 2: {needle}"):
        read_examples(str(tmp_path / "c.jsonl"))


def _train(model_dir, data, out, *flags):
    from bigfit.cli import main

    return main(["train", "--model", str(model_dir), "--data", str(data), "--strategy", "single", "--batch-size", "4",
                 "--max-steps", "2", "--eval-samples", "4", "--save-every", "0", "--no-consolidate",
                 "--output-dir", str(out), *flags])


def test_train_on_conversations_with_a_template_file_and_without_one(model_dirs, tmp_path, capsys):
    rows = [{"conversation": [*TALK[:2], {"role": "assistant", "content": str(i)}]} for i in range(60)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert _train(model_dirs["llama"], data, tmp_path / "no-template", "--data-columns", "messages=conversation") == 2
    assert "has no chat template; give one with --chat-template FILE" in capsys.readouterr().err
    assert _train(model_dirs["t5"], data, tmp_path / "t5", "--data-columns", "messages=conversation",
                  "--chat-template", str(tmp_path / "t.jinja")) == 2
    assert "encoder-decoder and needs source/target data, but --data holds 'messages'" in capsys.readouterr().err
    out = tmp_path / "out"
    assert _train(model_dirs["llama"], data, out, "--data-columns", "messages=conversation",
                  "--chat-template", str(tmp_path / "t.jinja")) == 0, capsys.readouterr().err
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert read_jsonl(out / "eval.jsonl")[-1]["eval_loss"] > 0


def test_conversations_in_a_parquet_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": TALK, "id": 1}]).to_parquet(str(tmp_path / "chat.parquet"))
    assert read_examples(str(tmp_path / "chat.parquet")) == [{"messages": TALK}]
