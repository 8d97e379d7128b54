"""The tokens a Lightning worker trained on in an inner phase (the delta header's ``num_tokens``).

:func:`count_tokens` guesses a batch's tokens; :class:`PhaseTokens` adds them up over the phase's
batches (the user's ``token_counter``, or the guess, or none) and, at the boundary, sums them over
the DDP ranks of the worker (:func:`~diloco_lightning.adapters.shared.sum_tokens_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from diloco_lightning.adapters.shared import sum_tokens_over_ranks

__all__ = ["count_tokens", "PhaseTokens"]


def count_tokens(batch: Any) -> int | torch.Tensor | None:
    """Tokens in a batch, guessed: ``attention_mask`` summed, else ``input_ids`` (a mapping key,
    or the first element of a tuple/list) counted; an integer tensor counts its elements.
    None when the batch holds no token ids (the delta header then has no ``num_tokens``)."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return mask.sum()
        ids = batch.get("input_ids")
        return ids.numel() if isinstance(ids, torch.Tensor) else None
    if isinstance(batch, (tuple, list)) and batch:
        return count_tokens(batch[0])
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point() and not batch.is_complex():
        return batch.numel()
    return None


class PhaseTokens:
    """The tokens of the batches since the last boundary, counted by ``token_counter``: None (guess
    with :func:`count_tokens`), False (none: no ``num_tokens`` in the headers) or ``callable(batch) ->
    int | Tensor``. One batch of unknown size makes the phase's count unknown (None)."""

    def __init__(self, token_counter: Callable[[Any], Any] | bool | None) -> None:
        if not (token_counter is None or token_counter is False or callable(token_counter)):
            raise ValueError(f"DiLoCo: token_counter must be None, False or a callable, got {token_counter!r}")
        self.token_counter = token_counter
        self._tokens: int | torch.Tensor | None = 0

    def reset(self) -> None:
        self._tokens = 0

    def add(self, batch: Any) -> None:
        if self.token_counter is False or self._tokens is None:
            return
        n = self.token_counter(batch) if callable(self.token_counter) else count_tokens(batch)
        if n is None:
            self._tokens = None
        else:
            self._tokens = self._tokens + (n.detach() if isinstance(n, torch.Tensor) else int(n))

    def take(self, world_size: int, device: Any, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
        """The phase's tokens (summed over the ``world_size`` ranks with ``reduce_sum``, on ``device``),
        and start counting again."""
        tokens, self._tokens = self._tokens, 0
        if self.token_counter is False:
            return None
        if world_size > 1:
            return sum_tokens_over_ranks(tokens, device, reduce_sum)
        return None if tokens is None else int(tokens)
