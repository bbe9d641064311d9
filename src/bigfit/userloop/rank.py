"""One rank of `bigfit.launch` (launch.py): `python -m bigfit.userloop.rank DIR RANK` runs the call in
DIR/call.pkl and leaves its return value (DIR/rank-RANK.result.pkl) or its error (DIR/rank-RANK.error.json)
for the launching process. The torchrun environment is already set by the launcher."""
from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import traceback
import types
from pathlib import Path

PARENT_POLL_S = 1.0


def _exit_with_parent() -> None:
    """End this rank when the process that launched it is gone (a notebook's kernel restarted or
    killed), instead of living on holding a GPU."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _in_file(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` (and the functions defined in it) back in its file: cloudpickle sends a function of
    `__main__` by value, its file name "<dynamic-code>", which leaves a traceback without its lines."""
    if code.co_filename != "<dynamic-code>":
        return code
    consts = tuple(_in_file(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _error(exc: BaseException, rank: int) -> dict:
    """The error the launcher raises and prints, the user's frames only (not this module's `main`)."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return {"rank": rank, "time": time.time(), "message": traceback.format_exception_only(exc)[-1].strip(),
            "traceback": "".join(traceback.format_exception(type(exc), exc, tb))}


def main(tmp: Path, rank: int) -> int:
    _exit_with_parent()
    try:
        payload = pickle.loads((tmp / "call.pkl").read_bytes())
        # the launching process's imports: its script's folder, a notebook's sys.path.insert, ...
        sys.path[:] = payload["path"] + [p for p in sys.path if p not in payload["path"]]
        fn, args, kwargs = pickle.loads(payload["call"])
        if payload["file"] and hasattr(fn, "__code__"):
            fn.__code__ = _in_file(fn.__code__, payload["file"])
        value = fn(*args, **kwargs)
    except BaseException as e:  # SystemExit and Ctrl-C too: the launcher reports every way a rank ends
        (tmp / f"rank-{rank}.error.json").write_text(json.dumps(_error(e, rank)))
        return 1
    try:
        import cloudpickle

        out = cloudpickle.dumps(value)
    except Exception as e:
        error = _error(e, rank) | {"message": f"its return value, a {type(value).__name__}, cannot be sent back "
                                              f"({traceback.format_exception_only(e)[-1].strip()}); return "
                                              "numbers, strings or CPU tensors"}
        (tmp / f"rank-{rank}.error.json").write_text(json.dumps(error))
        return 1
    (tmp / f"rank-{rank}.result.tmp").write_bytes(out)
    os.replace(tmp / f"rank-{rank}.result.tmp", tmp / f"rank-{rank}.result.pkl")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
