"""On the H200 machine (torch 2.11, gloo): does a 2-rank gloo job work there at all, and does --pack?
(tests/test_pack.py's 2-rank fixture failed there with gloo's "writev ... Bad address".)"""
import sys
sys.path.insert(0, "tests"); sys.path.insert(0, "src")
from dist import run_ranks


def reduce_one():
    import torch, torch.distributed as dist
    t = torch.ones(1000); dist.all_reduce(t); return float(t[0])


def trained(model_dirs, data, root, strategy, pack):
    import dataclasses
    from test_parity import job
    from bigfit.training.loop import train
    cfg = dataclasses.replace(job(model_dirs["gpt2"], data, root / f"{strategy}-{pack}", strategy, "fp32"), pack=pack,
                              max_source_len=64)
    train(cfg)
    return "ok"


if __name__ == "__main__":
    from pathlib import Path
    import tempfile
    from tiny import write_model_dirs, write_pairs
    root = Path(tempfile.mkdtemp())
    dirs = write_model_dirs(root); data = write_pairs(root / "p.jsonl", 400)
    for name, fn, args in (("all_reduce", reduce_one, ()), ("unpacked ddp", trained, (dirs, data, root, "ddp", False)),
                           ("packed ddp", trained, (dirs, data, root, "ddp", True)),
                           ("packed zero3", trained, (dirs, data, root, "zero3", True))):
        try:
            print(name, run_ranks(fn, 2, *args, fresh=True), flush=True)
        except AssertionError as e:
            print(name, "FAILED", str(e)[-600:], flush=True)
