"""Inputs of micro-batch auto's two GPU probe cases (config-only models: random init; the byte-level
tokenizer, a token a byte):
- t5-3b's public shape (2.85B) with translation-like pairs of about 120 bytes a side (128/128 tokens);
- gpt-neo-1.3B's public shape with texts of 1,100 bytes (1,024 tokens once cut to --max-source-len).

  python benchmarks/probe_cases.py OUT_DIR [--tiny]     # --tiny: the same files with tiny shapes (CPU dry run)
"""
import json
import random
import sys
from pathlib import Path

from transformers import GPTNeoConfig, T5Config

out, tiny = Path(sys.argv[1]), "--tiny" in sys.argv
out.mkdir(parents=True, exist_ok=True)
t5 = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2) if tiny else dict(
    d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, num_decoder_layers=24)  # t5-3b
T5Config(**t5, vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
         tie_word_embeddings=True).save_pretrained(out / "t5-3b")
neo = dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]) if tiny else dict(
    hidden_size=2048, num_layers=24, num_heads=16, attention_types=[[["global", "local"], 12]])  # gpt-neo-1.3B
GPTNeoConfig(**neo, vocab_size=50257, max_position_embeddings=2048, window_size=256, embed_dropout=0.0,
             attention_dropout=0.0, resid_dropout=0.0).save_pretrained(out / "gpt-neo-1.3b")
r = random.Random(0)
words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(2000)]


def sentence(nbytes: int) -> list[str]:
    got = []
    while sum(len(w) + 1 for w in got) < nbytes:
        got.append(r.choice(words))
    return got


with open(out / "pairs.jsonl", "w") as f:
    for _ in range(300 if tiny else 2000):
        src = sentence(115)
        f.write(json.dumps({"source": " ".join(src), "target": " ".join(w[::-1] for w in src)}) + "\n")
with open(out / "texts.jsonl", "w") as f:
    for _ in range(300 if tiny else 1000):
        f.write(json.dumps({"text": " ".join(sentence(1100))}) + "\n")
