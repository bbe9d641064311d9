"""bigfit inside the user's own training code: `prepare` (the engine bigfit train's loop drives, for
any loop: prepare.py, engine.py, wrapped.py), its data helpers (data.py), `launch` (a function on N
new processes: launch.py, rank.py), Hugging Face Trainer and TRL on it (hf.py, hfparts.py)."""
