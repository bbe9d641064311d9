"""OffloadAdamW's state as torch's optimizers lay it out (`state_dict()["state"][index]`), and back.

Each stepped parameter's entry holds its live host tensors (views, no copy: a state_dict of a model
whose states fill the host RAM must not need that RAM twice; torch's own optimizers hand out their
live tensors too), shaped like the parameter:
- "step": a float32 scalar tensor, as torch's;
- "master": the fp32 master weights, so a resume is exact where the parameters are bf16;
- fp32 states: "exp_avg", "exp_avg_sq" in fp32, torch.optim.AdamW's very format;
- bf16 states: "exp_avg", "exp_avg_sq" in bf16 as kept (exact; torch's AdamW loads them too, widening);
- int8 states: "exp_avg_codes", "exp_avg_sq_codes" (uint8) and their fp32 block scales "exp_avg_scale",
  "exp_avg_sq_scale" (statefmt.py) as kept: exact, and a quarter of fp32's bytes. Not "exp_avg": torch
  would read the codes as values.
Loading takes any of these into any format: the same format is copied as it is (exact), another is
converted through fp32 (rounded to nearest); a torch.optim.AdamW state (no "master") loads too, its
master then the parameter's current value.
"""
from __future__ import annotations

import torch

from ..errors import BigfitError
from ..offload import statefmt
from .checks import check_hyper
from .hostparam import HostParam

# torch.optim.AdamW's group keys for what OffloadAdamW does not do or decides itself: not loaded
TORCH_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "param_names")
CODES = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}


def exposed(hp: HostParam) -> dict:
    """The parameter's entry of state_dict()["state"]: its live tensors."""
    shape, st = hp.param.shape, hp.state
    out = {"step": st["step"], "master": hp.master.view(shape)}
    if statefmt.format_of(st) == "int8":
        for k in statefmt.MOMENTS:
            out[CODES[k]], out[f"{k}_scale"] = st[k].view(shape), st[f"{k}_scale"]
    else:
        out.update({k: st[k].view(shape) for k in statefmt.MOMENTS})
    return out


def _flat(t, what: str, numel: int) -> torch.Tensor:
    if not torch.is_tensor(t) or t.numel() != numel:
        got = f"{t.numel()} elements" if torch.is_tensor(t) else type(t).__name__
        raise BigfitError(f"OffloadAdamW.load_state_dict: {what} has {got} where this parameter needs {numel}; "
                          "load the state saved for this model's parameters, in the same order")
    return t.detach().to("cpu").reshape(-1)


def _moments(saved: dict, hp: HostParam, i: int) -> dict:
    """The saved moments in statefmt's flat layout (codes under statefmt's keys)."""
    n = hp.param.numel()
    if CODES["exp_avg"] in saved:
        blocks = sum(seg.rows * seg.blocks for seg in statefmt.segments(hp.bucket))
        out = {k: _flat(saved.get(CODES[k]), f"parameter {i}'s {CODES[k]}", n) for k in statefmt.MOMENTS}
        out.update({f"{k}_scale": _flat(saved.get(f"{k}_scale"), f"parameter {i}'s {k}_scale", blocks)
                    for k in statefmt.MOMENTS})
        return out
    if not all(k in saved for k in statefmt.MOMENTS):
        raise BigfitError(f"OffloadAdamW.load_state_dict: parameter {i}'s state has keys {sorted(saved)}; it loads "
                          "Adam's (step, exp_avg, exp_avg_sq, and master or int8 codes from OffloadAdamW)")
    return {k: _flat(saved[k], f"parameter {i}'s {k}", n) for k in statefmt.MOMENTS}


@torch.no_grad()
def load(hp: HostParam, saved: dict, i: int) -> None:
    """Parameter `i`'s saved entry into its host state, converted where its format differs; the parameter
    then takes the master's value (what the step after a resume starts from)."""
    src = _moments(saved, hp, i)
    n = hp.param.numel()
    master = saved.get("master")
    hp.master.copy_(_flat(master, f"parameter {i}'s master", n) if master is not None else hp.param.reshape(-1))
    hp.state["step"].copy_(torch.as_tensor(saved.get("step", 0), dtype=torch.float32).reshape(()))
    if statefmt.format_of(src) == statefmt.format_of(hp.state):
        for k, v in src.items():
            hp.state[k].copy_(v)
    else:
        m, v = statefmt.to_fp32(src, hp.bucket)
        statefmt.from_fp32(m, v, hp.state, hp.bucket)
    hp.upload()


def pack(param_groups: list[dict], state: dict) -> dict:
    """state_dict(): `state` (parameter -> `exposed` entry) by each parameter's index over the groups."""
    index, groups = {}, []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(len(index), len(index) + len(g["params"])))
        index.update({id(p): i for i, p in zip(packed["params"], g["params"])})
        groups.append(packed)
    return {"state": {index[id(p)]: st for p, st in state.items() if st}, "param_groups": groups}


def unpack(param_groups: list[dict], host: dict[int, HostParam], state_dict: dict) -> list[HostParam]:
    """load_state_dict(): the saved groups' hyperparameters into `param_groups`, each saved entry into its
    parameter's host state (`host`: by the parameter's id); the host parameters loaded."""
    saved = state_dict["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in param_groups]:
        raise BigfitError(f"OffloadAdamW.load_state_dict: the state has groups of {[len(g['params']) for g in saved]} "
                          f"parameters, this optimizer {[len(g['params']) for g in param_groups]}; load the state "
                          "saved with the same parameter groups")
    for g, s in zip(param_groups, saved):
        if s.get("amsgrad") or s.get("maximize"):
            raise BigfitError("OffloadAdamW.load_state_dict: the state is of an AdamW with amsgrad or maximize, "
                              "which OffloadAdamW does not do; load a plain AdamW's state")
        g.update({k: v for k, v in s.items() if k not in ("params", *TORCH_ONLY)})
        check_hyper(g)
    at = {int(i): p for g, s in zip(param_groups, saved) for i, p in zip(s["params"], g["params"])}
    loaded = []
    for i, entry in state_dict["state"].items():
        hp = host.get(id(at.get(int(i))))
        if hp is None:
            raise BigfitError(f"OffloadAdamW.load_state_dict: the state has an entry for parameter {i}, which does "
                              "not require grad here; load the state saved for the same trainable parameters")
        load(hp, entry, int(i))
        loaded.append(hp)
    return loaded
