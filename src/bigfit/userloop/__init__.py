"""bigfit inside the user's own training code: `prepare` (the engine bigfit train's loop drives, for
any loop: prepare.py, engine.py), its data helpers (data.py), `launch` (a function on N processes)."""
