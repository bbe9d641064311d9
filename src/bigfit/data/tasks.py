"""The embedded translation-like task: English number words to digits.

"seven zero four one" -> "7 0 4 1". It is generated from a seed, needs no download, and a tiny T5
learns it within the default run, so the evaluation metric visibly climbs from ~0. The digits are
space-separated so that BLEU sees one token per digit.
"""
from __future__ import annotations

import random

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digits_task(n: int, seed: int, min_len: int = 2, max_len: int = 5) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_len, max_len))]
        out.append({"source": " ".join(WORDS[d] for d in digits), "target": " ".join(map(str, digits))})
    return out
