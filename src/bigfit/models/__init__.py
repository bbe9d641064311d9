"""Finding, building and describing the model (source.py) and its tokenizer (tokenizer.py)."""
