"""Streaming DiLoCo fragments: split a model's parameters into P groups synced at different times.

Streaming DiLoCo (arXiv 2501.18512) syncs one fragment every H/P inner steps instead of the whole
model every H steps, which spreads the bandwidth peak over the round. The paper's *strided*
assignment puts transformer block i into fragment ``i mod P`` so every fragment spans the depth of
the network (block 0, P, 2P, ... in fragment 0), which it found better than contiguous chunks.

Parameters outside the repeated blocks (token embeddings, final norm, output head) have no block
index; embeddings go with fragment 0 and everything after the blocks with the fragment of the
last block, so each fragment still holds a complete "slice" of the network.

A fragment here is a small `nn.Module` that *references* the model's own `nn.Parameter` objects
(nothing is copied), which is all `torchft.local_sgd.DiLoCo` needs: it reads
``fragment.named_parameters()`` and writes ``p.data`` / ``p.grad``. A tied parameter (for example
an output head sharing the embedding matrix) is placed in exactly one fragment.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["ParameterFragment", "find_block_list", "strided_fragments", "whole_model_fragment"]


class ParameterFragment(nn.Module):
    """A module holding references to some of another module's parameters.

    ``names[i]`` is the original dotted name of the i-th parameter (for messages and tests); the
    registered names replace "." by "/" because `nn.Module` forbids dots in parameter names.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.names: list[str] = []
        for name, p in named_params:
            self.register_parameter(name.replace(".", "/"), p)
            self.names.append(name)


def whole_model_fragment(params: list[torch.Tensor] | nn.Module) -> nn.Module:
    """One fragment covering everything: the module itself, or a wrapper over a parameter list.

    A parameter list (for example an optimizer's params when no model was given) is wrapped as
    ``p0, p1, ...``; the tensors must be `nn.Parameter`s (leaf tensors that the optimizer steps).
    """
    if isinstance(params, nn.Module):
        return params
    named: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for i, p in enumerate(params):
        if not isinstance(p, nn.Parameter):
            raise ValueError(
                f"optimizer parameter {i} is a plain tensor, not an nn.Parameter; pass model= "
                "to make_diloco_outer_loop"
            )
        if id(p) not in seen:
            seen.add(id(p))
            named.append((f"p{i}", p))
    if not named:
        raise ValueError("the inner optimizer has no parameters to synchronise")
    return ParameterFragment(named)


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated-block list: the longest `nn.ModuleList` (ties: the first found).

    For Hugging Face decoder models this is ``model.layers`` (Qwen2, Llama) or
    ``transformer.h`` (GPT-2). Raises ValueError when the model has no ModuleList.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(
            "cannot split the model into strided fragments: it has no nn.ModuleList of blocks; "
            "pass model_fragments= explicitly"
        )
    return best


def strided_fragments(model: nn.Module, num_fragments: int) -> list[nn.Module]:
    """Split `model` into `num_fragments` strided fragments (see the module docstring).

    Raises ValueError if num_fragments < 1, exceeds the number of blocks, or a fragment would be
    empty.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments == 1:
        return [model]
    prefix, blocks = find_block_list(model)
    n_blocks = len(blocks)
    if num_fragments > n_blocks:
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the {n_blocks} blocks in {prefix!r}; "
            "each fragment needs at least one block"
        )
    block_re = re.compile(rf"^{re.escape(prefix)}\.(\d+)\." if prefix else r"^(\d+)\.")
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(num_fragments)]
    seen: set[int] = set()
    seen_block = False
    last_fragment = (n_blocks - 1) % num_fragments
    # named_parameters() yields in registration order and skips tied duplicates, so each tensor
    # lands in exactly one fragment; the order tells "before the blocks" from "after".
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        match = block_re.match(name)
        if match is not None:
            seen_block = True
            groups[int(match.group(1)) % num_fragments].append((name, p))
        else:
            groups[last_fragment if seen_block else 0].append((name, p))
    for i, g in enumerate(groups):
        if not g:
            raise ValueError(f"fragment {i} of {num_fragments} would be empty")
    return [ParameterFragment(g) for g in groups]
