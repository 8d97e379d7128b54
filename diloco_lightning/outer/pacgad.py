"""PA-CGAD: CGAD gated per fragment (Shah & Sun 2026, arXiv 2605.09126).

The parameters are split into named fragments, as in Streaming DiLoCo (Douillard et al. 2025,
arXiv 2501.18512), each synced on its own schedule. A pseudo-gradient for fragment ``f`` of
staleness ``tau`` is gated on ``max(tau, age_f)``, ``age_f`` being the outer steps since ``f`` was
last updated, then fed to Adam exactly as in :class:`~diloco_lightning.outer.adam.CGAD`. Adam
step counts are per key, so a fragment's moments and bias correction only move when it is
updated; ``step`` counts the outer steps this optimizer applied (the clock of the ages) and
``fragment_updated_at`` the clock value after each fragment's last update.

Fragments are given as ``{name: [entry, ...]}`` (or a list of entry lists, named ``"0"``, ``"1"``,
...). An entry names a key exactly, or is a prefix of key names: ``"layers.1"`` takes
``layers.1`` and ``layers.1.*`` but not ``layers.10.*``; an entry ending in ``"."`` takes every key
starting with it. Every floating key of the state must fall in exactly one fragment. Without
``fragments`` the whole state is one fragment (``"all"``) and PA-CGAD is CGAD.

Note: a fragment whose age reaches ``tau_cut`` gates every later delta to 0, so it is never
updated again; schedule each fragment more often than every ``tau_cut`` outer steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from diloco_lightning.outer.adam import AdamBase, check_cgad_gate_args
from diloco_lightning.outer.base import check_int
from diloco_lightning.outer.gates import cgad_gate, check_staleness
from diloco_lightning.outer.work import Item

__all__ = ["PACGAD"]

logger = logging.getLogger(__name__)

_ALL = "all"


def _normalise_fragments(fragments: Any) -> dict[str, list[str]]:
    if fragments is None:
        return {}
    if isinstance(fragments, Mapping):
        pairs = list(fragments.items())
    elif isinstance(fragments, Sequence) and not isinstance(fragments, str):
        pairs = [(str(i), entries) for i, entries in enumerate(fragments)]
    else:
        raise ValueError(f"fragments must be a dict of name -> list of key names/prefixes, got {fragments!r}")  # noqa: TRY004
    if not pairs:
        raise ValueError("fragments must name at least one fragment")
    out: dict[str, list[str]] = {}
    for name, entries in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"fragment names must be non-empty str, got {name!r}")
        if isinstance(entries, str) or not isinstance(entries, Sequence) or not entries:
            raise ValueError(f"fragments[{name!r}] must be a non-empty list of key names or prefixes, got {entries!r}")
        for entry in entries:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"fragments[{name!r}] holds an invalid entry {entry!r}")
        out[name] = list(entries)
    return out


def _matches(entry: str, key: str) -> bool:
    if entry.endswith("."):
        return key.startswith(entry)
    return key == entry or key.startswith(entry + ".")


class PACGAD(AdamBase):
    """Per-fragment CGAD: fragment ``f`` is gated on ``max(tau, age_f)`` (arXiv 2605.09126).

    Args:
        state: the global state.
        lr, betas, eps, alpha, tau_cut: as :class:`~diloco_lightning.outer.adam.CGAD`.
        fragments: ``{name: [key name or prefix, ...]}``; ``None`` makes one fragment, ``"all"``.

    ``step(state, delta, tau, fragment=f)`` updates fragment ``f`` (every delta key must be in it);
    ``fragment=None`` updates every fragment the delta has keys of, each on its own gate. Fragments
    whose gate is 0 are left untouched; a step where all are gated to 0 returns ``False`` and
    changes nothing. With ``gated=True`` the delta already carries ``gate(tau)``; only the extra
    age factor ``gate(max(tau, age_f)) / gate(tau)`` is applied.
    """

    name = "pa_cgad"
    STATE_KINDS = ("pa_cgad",)
    GATES_PER_FRAGMENT = True

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        alpha: float = 0.2,
        tau_cut: float = 32,
        fragments: Mapping[str, Sequence[str]] | Sequence[Sequence[str]] | None = None,
    ) -> None:
        alpha, tau_cut = check_cgad_gate_args(alpha, tau_cut)
        spec = _normalise_fragments(fragments)
        self._fragment_entries = spec
        self._names = list(spec) if spec else [_ALL]
        self._key_fragment: dict[str, str] = {}
        super().__init__(state, lr, betas, eps, {"alpha": alpha, "tau_cut": tau_cut, "fragments": spec or None})
        self.alpha = alpha
        self.tau_cut = tau_cut
        self._clock = 0
        self._updated_at = {name: 0 for name in self._names}
        self._pregated = False

    # ------------------------------------------------------------------ fragments
    @property
    def fragments(self) -> list[str]:
        """The fragment names, in order."""
        return list(self._names)

    def fragment_of(self, key: str) -> str:
        """The fragment ``key`` belongs to.

        Raises:
            ValueError: when ``key`` matches no fragment or more than one.
        """
        name = self._key_fragment.get(key)
        if name is not None:
            return name
        if not self._fragment_entries:
            name = _ALL
        else:
            found = [f for f, entries in self._fragment_entries.items() if any(_matches(e, key) for e in entries)]
            if not found:
                raise ValueError(f"key {key!r} is in no fragment (fragments: {self._names})")
            if len(found) > 1:
                raise ValueError(f"key {key!r} is in more than one fragment: {found}")
            name = found[0]
        self._key_fragment[key] = name
        return name

    def age(self, fragment: str) -> int:
        """Outer steps since ``fragment`` was last updated (since construction if never)."""
        self._check_fragment_name(fragment)
        return self._clock - self._updated_at[fragment]

    def gate(self, staleness: float) -> float:
        """The CGAD gate of ``staleness`` alone (see :meth:`fragment_gate` for a fragment's)."""
        return cgad_gate(staleness, self.alpha, self.tau_cut)

    def fragment_gate(self, fragment: str, staleness: float) -> float:
        """The gate a delta of ``staleness`` for ``fragment`` gets now: ``gate(max(tau, age_f))``."""
        tau = check_staleness(staleness)
        return self.gate(max(tau, float(self.age(fragment))))

    def step_pregated(self, state: dict[str, Tensor], delta: Mapping[str, Tensor]) -> bool:
        """One outer step with a delta whose every contribution was already gated on
        ``max(tau_i, age_f)`` (the master's round: each delta gated by :meth:`fragment_gate` before
        it is averaged, as the paper defines PA-CGAD): no gate is applied again; each fragment the
        delta has keys of is updated, and its age restarts."""
        self._pregated = True
        try:
            return self.step(state, delta, 0, gated=True)
        finally:
            self._pregated = False

    def _check_fragment_name(self, fragment: str) -> None:
        if fragment not in self._updated_at:
            raise ValueError(f"unknown fragment {fragment!r}; fragments are {self._names}")

    def _register(self, key: str, tensor: Tensor) -> None:
        self.fragment_of(key)  # every floating key must fall in exactly one fragment
        super()._register(key, tensor)

    # ------------------------------------------------------------------ step
    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        if fragment is not None:
            self._check_fragment_name(fragment)
        groups: dict[str, list[Item]] = {}
        for item in items:
            name = self.fragment_of(item.key)
            if fragment is not None and name != fragment:
                raise ValueError(f"delta key {item.key!r} belongs to fragment {name!r}, not {fragment!r}")
            groups.setdefault(name, []).append(item)
        if fragment is not None:
            groups.setdefault(fragment, [])
        base_gate = self.gate(tau)
        if base_gate == 0.0:
            return False
        if self._pregated:
            present = [name for name in self._names if name in groups and groups[name]]
            if not present:
                return False
            self._clock += 1
            for name in present:
                self._adam_update(groups[name], 1.0)
                self._updated_at[name] = self._clock
            return True
        plan = []
        for name in self._names:
            if name not in groups:
                continue
            gate = self.gate(max(tau, float(self._clock - self._updated_at[name])))
            if gate == 0.0:
                logger.warning(
                    "pa_cgad: fragment %r is %d outer steps old, gated to 0 (tau_cut=%s); skipped",
                    name,
                    self._clock - self._updated_at[name],
                    self.tau_cut,
                )
                continue
            plan.append((name, gate / base_gate if gated else gate))
        if not plan:
            return False
        self._clock += 1
        for name, gate in plan:
            self._adam_update(groups[name], gate)
            self._updated_at[name] = self._clock
        return True

    @property
    def steps_taken(self) -> int:
        """The outer steps this optimizer applied (the clock of the fragment ages)."""
        return self._clock

    # ------------------------------------------------------------------ state
    def _scalar_state(self) -> dict[str, Any]:
        return {
            "step": self._clock,
            "fragments": list(self._names),
            "fragment_updated_at": [self._updated_at[n] for n in self._names],
        }

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        unexpected = sorted(set(scalars) - {"step", "fragments", "fragment_updated_at"})
        if unexpected:
            raise ValueError(f"unexpected entries in pa_cgad state_dict: {unexpected}")
        names = scalars.get("fragments", self._names)
        if not isinstance(names, (list, tuple)) or list(names) != self._names:
            raise ValueError(f"state_dict fragments {names!r} differ from this optimizer's {self._names}")
        clock = check_int("step", scalars.get("step", 0), low=0)
        updated = scalars.get("fragment_updated_at", [0] * len(names))
        if not isinstance(updated, (list, tuple)) or len(updated) != len(names):
            raise ValueError(f"state_dict 'fragment_updated_at' must be a list of {len(names)} integers")
        updated = [check_int(f"fragment_updated_at[{i}]", v, low=0) for i, v in enumerate(updated)]
        for i, value in enumerate(updated):
            if value > clock:
                raise ValueError(f"state_dict fragment_updated_at[{i}] = {value} is after step = {clock}")
        return {"step": clock, "fragment_updated_at": updated}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        self._clock = scalars["step"]
        self._updated_at = dict(zip(self._names, scalars["fragment_updated_at"]))
