"""One pipeline stage as a module: the model's OWN forward, run with only this stage's blocks.

Calling the unmodified Hugging Face forward keeps everything model-specific where it belongs: the
causal / padding masks, position ids, Llama's rotary embeddings, T5's relative position bias and
its decoder input handling are computed by the model as always. Three things make one stage of it:
- a view: during the call each block stack holds only this stage's blocks (pruned ranks hold the
  blocks of all their stages; interleaved ranks have two or more);
- an injection: embeddings this rank does not own return zeros (split.Elsewhere), and a forward
  pre-hook on the stage's first block replaces its input with what the previous stage sent;
- a stop: a forward hook on the stage's last block captures its output and ends the call (the rest
  of the forward belongs to later stages). The last stage runs to the logits.

What travels between stages (all floating point, so gradients flow back through them):
- decoder-only: the hidden state;
- T5 inside a stack: the hidden state and the self-attention position bias, which only the stack's
  first block can compute (it owns the relative attention table) and every later block reuses;
  the cross-attention bias holds only the mask and is recomputed; after the encoder: its output,
  which every decoder stage needs and passes on.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..layout.split import Split, sparse_list


class _StageDone(Exception):
    """Raised by the capture hook: this stage's part of the forward is over."""


class StageModule(nn.Module):
    def __init__(self, model: nn.Module, split: Split, index: int, autocast: torch.dtype | None):
        super().__init__()
        self.model = model
        self.index, self.autocast = index, autocast
        self.start, self.stop = split.runs[index]
        self.n = split.n_blocks
        self.enc = len(split.stacks[0][1]) if len(split.stacks) == 2 else None  # encoder depth (T5)
        self._stacks, self._views = [], []  # (path, global index of its block 0, depth); this stage's blocks
        for (name, blocks), off in zip(split.stacks, split.offsets):
            self._stacks.append((name, off, len(blocks)))
            self._views.append(sparse_list({i: b for i, b in enumerate(blocks) if self.start <= off + i < self.stop}))

    @property
    def is_last(self) -> bool:
        return self.stop == self.n

    def forward(self, *received, attention_mask=None, position_ids=None, decoder_input_ids=None):
        """`attention_mask`, or a packed batch's `position_ids` (data/pack.py) in its place."""
        shaped = attention_mask if attention_mask is not None else position_ids
        ids = received[0] if self.start == 0 else torch.zeros_like(shaped)
        kw = dict(input_ids=ids, use_cache=False)
        kw.update({"attention_mask": attention_mask} if attention_mask is not None else {"position_ids": position_ids})
        if decoder_input_ids is not None:
            kw["decoder_input_ids"] = decoder_input_ids
        if self.enc is not None and self.start >= self.enc:  # the encoder ran on earlier stages
            kw["encoder_outputs"] = (received[-1],)
        out: dict = {}
        with self._viewing(), self._hooks(received, out), self._autocast(shaped.device.type):
            try:
                logits = self.model(**kw).logits
            except _StageDone:
                return self._message(received, out)
        return logits

    # -- what travels ------------------------------------------------------------------------
    def _message(self, received, out: dict) -> tuple[torch.Tensor, ...]:
        """Contiguous tensors (T5's position bias is a permuted view): point-to-point sends need them."""
        if self.enc is None:
            return out["block"][0].contiguous()
        if self.stop < self.enc:
            return out["block"][0].contiguous(), out["block"][1].contiguous()
        enc_out = out["encoder"] if "encoder" in out else received[-1]
        if self.stop == self.enc:
            return enc_out.contiguous()
        # a view, not the received tensor itself: an output must not be one of the stage's inputs
        return out["block"][0].contiguous(), out["block"][1].contiguous(), enc_out.contiguous().view_as(enc_out)

    # -- the three mechanisms ----------------------------------------------------------------
    @contextlib.contextmanager
    def _viewing(self):
        """Each stack holds only this stage's blocks during the call."""
        saved = []
        for (name, _, _), view in zip(self._stacks, self._views):
            parent, _, attr = name.rpartition(".")
            holder = self.model.get_submodule(parent)
            saved.append((holder, attr, holder._modules[attr]))
            holder._modules[attr] = view
        try:
            yield
        finally:
            for holder, attr, mods in saved:
                holder._modules[attr] = mods

    @contextlib.contextmanager
    def _hooks(self, received, out: dict):
        handles = []
        if self.start > 0 and self.start != self.enc:
            first = self._block(self.start)
            values = received[:2] if self.enc is not None else received[:1]
            handles.append(first.register_forward_pre_hook(_inject(values), with_kwargs=True))
        if self.enc is not None and self.start < self.enc <= self.stop:
            handles.append(self.model.get_encoder().register_forward_hook(_capture_encoder(out, self.stop == self.enc
                                                                                          and not self.is_last)))
        if not self.is_last and self.stop != self.enc:
            handles.append(self._block(self.stop - 1).register_forward_hook(_capture_block(out)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _block(self, g: int) -> nn.Module:
        for (_, off, size), view in zip(self._stacks, self._views):
            if off <= g < off + size:
                return view._modules[str(g - off)]
        raise IndexError(g)

    def _autocast(self, device_type: str):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)


def _inject(values: tuple[torch.Tensor, ...]):
    """The first block's hidden state (and T5's position bias, its third positional argument)
    become what the previous stage sent."""
    def hook(module, args, kwargs):
        args = list(args)
        if args:
            args[0] = values[0]
        else:
            kwargs["hidden_states"] = values[0]
        if len(values) > 1:
            args[2] = values[1]
        return tuple(args), kwargs
    return hook


def _capture_block(out: dict):
    def hook(module, args, output):
        out["block"] = output if isinstance(output, tuple) else (output,)
        raise _StageDone
    return hook


def _capture_encoder(out: dict, stop: bool):
    def hook(module, args, output):
        out["encoder"] = output[0]
        if stop:
            raise _StageDone
    return hook
