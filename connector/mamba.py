"""Hybrid Mamba models: the Mamba groups' state (conv and SSM) as plain data, without importing vllm.

vLLM's hybrid allocator gives a Mamba layer one block per request's running state, from the same block
pool as the attention layers: block `b` of a Mamba layer is a page holding every state of that layer (conv
state, then SSM state; padded to the attention page when the allocator pads). What a worker registers for
a Mamba layer is that page view, or (older layouts) one tensor per state; each becomes a region of its own,
moved by block id like an attention layer's KV. A Mamba block is indivisible: it holds the state after the
request's last computed token, not token-extent data, so it pairs with exactly one peer block.

Both sides must hold the same states in the same shapes: the handshake carries each side's
`MambaGroup`s and `check_compatible` refuses a peer whose groups differ, naming both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

PREFILL_BACKOFF_TOKENS = 1
"""The prompt tokens a Mamba model's producer leaves for the consumer to compute (as vLLM's NIXL connector):
a consumer always computes the prompt's last token itself (it needs its logits), and a Mamba state cannot
be rewound, so the producer stops one token short (state h(N-1)) and the consumer derives h(N)."""


class MambaMismatch(ValueError):
    """A peer's Mamba groups differ from this side's: its state cannot be moved into ours."""


class MambaGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One Mamba KV cache group as both sides must agree on it (from vLLM's `MambaSpec`)."""

    group: int
    """The group's index among the model's KV cache groups (the block lists' order)."""
    layers: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    """Each state's shape per block (conv, then SSM; Mamba1 and Mamba2 differ in count and shape)."""
    dtypes: tuple[str, ...]
    page_bytes: int
    """Bytes between one block's states and the next's (the allocator's page, padding included)."""
    mamba_type: str = ""
    speculative_blocks: int = 0
    """Scratch slots vLLM allocates after the running state for speculative decoding: never moved."""

    def describe(self) -> str:
        states = ", ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes, strict=True))
        kind = f" {self.mamba_type}" if self.mamba_type else ""
        return f"group {self.group}{kind}: {len(self.layers)} layers, states {states}, page {self.page_bytes} B"


def _describe(groups: Sequence[MambaGroup]) -> str:
    return "; ".join(g.describe() for g in groups) if groups else "no Mamba state"


def check_compatible(mine: Sequence[MambaGroup], theirs: Sequence[MambaGroup], me: str, peer: str) -> None:
    """Raise `MambaMismatch` naming both sides unless their Mamba groups hold the same states.

    Layer names must match too: a layer's state is read from the peer layer of the same name. The page
    may differ (each side's allocator pads to its own attention page); the states inside it may not."""

    def key(g: MambaGroup) -> tuple[Any, ...]:
        return (g.group, g.layers, g.shapes, g.dtypes, g.mamba_type)

    if [key(g) for g in mine] != [key(g) for g in theirs]:
        raise MambaMismatch(f"Mamba state differs: {me} has {_describe(mine)}; {peer} has {_describe(theirs)}")


def state_tensors(name: str, cache: Any) -> list[tuple[str, Any]]:
    """The regions of one Mamba layer's cache: its page view as one region named after the layer, or one
    region per state (`<layer>.state<i>`) where the runner gives a sequence of state tensors."""
    if isinstance(cache, list | tuple):
        return [(f"{name}.state{i}", tensor) for i, tensor in enumerate(cache)]
    return [(name, cache)]


def mamba_layer_groups(groups: Sequence[MambaGroup]) -> dict[str, MambaGroup]:
    return {layer: g for g in groups for layer in g.layers}


def clip_state_blocks(per_group: Sequence[Sequence[int]], speculative: Mapping[int, int]) -> list[Sequence[int]]:
    """Each Mamba group's block list cut to its running-state slot, as vLLM's NIXL connector exchanges it.

    vLLM lists, for a Mamba group, null placeholders (and the previous step's superseded state, under
    prefix caching) before the running state, and `speculative[group]` scratch slots after it. Only the
    running state is moved, held and paired. `speculative` names the Mamba groups (0 scratch slots allowed);
    other groups pass through unchanged."""
    if not speculative:
        return list(per_group)
    clipped: list[Sequence[int]] = []
    for index, blocks in enumerate(per_group):
        scratch = speculative.get(index)
        if scratch is None or not blocks:
            clipped.append(blocks)
            continue
        cut = min(scratch, len(blocks) - 1)  # keep the running state, even before scratch was allocated
        clipped.append(blocks[len(blocks) - cut - 1 : len(blocks) - cut])
    return clipped


def loadable_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """The prompt tokens a consumer loads: all but the producer's backoff (a prompt no longer than the
    backoff loads whole, as vLLM's NIXL connector does; the producer did not truncate it either)."""
    return num_prompt_tokens - backoff if backoff and num_prompt_tokens > backoff else num_prompt_tokens
