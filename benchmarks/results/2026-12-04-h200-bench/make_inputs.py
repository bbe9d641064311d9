"""The H200 bench's inputs: a T5-large config (config only: random init) and translation-like pairs of
about 120 bytes a side (the byte-level tokenizer: a token a byte), the target the source's words
reversed letter by letter, so the 128/128-token lengths the seed discussion used are filled.

  python make_inputs.py OUT_DIR [--tiny]
"""
import json
import random
import sys
from pathlib import Path

from transformers import T5Config

out, tiny = Path(sys.argv[1]), "--tiny" in sys.argv
out.mkdir(parents=True, exist_ok=True)
shape = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2) if tiny else dict(
    d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24)
T5Config(**shape, vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
         tie_word_embeddings=True).save_pretrained(out / "t5")
r = random.Random(0)
words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(2000)]
with open(out / "pairs.jsonl", "w") as f:
    for _ in range(600 if tiny else 4200):
        src = []
        while sum(len(w) + 1 for w in src) < 115:
            src.append(r.choice(words))
        f.write(json.dumps({"source": " ".join(src), "target": " ".join(w[::-1] for w in src)}) + "\n")
