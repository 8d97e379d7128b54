"""A worker's options: one definition (:class:`WorkerOptions`), one validation.

The Lightning callback, the Accelerate adapter and :class:`~diloco_lightning.worker.DiLoCoWorker`
take them whole (``options=WorkerOptions(...)``) or as keywords (:meth:`WorkerOptions.given`, the
signature generated from the fields by :func:`takes_options`); ``train.py`` composes the same fields
into its ``diloco`` section (``diloco_lightning.app.config``) with the help text written here. The lists of choices
(:data:`SYNC_MODES`, :data:`DELTA_DTYPES`) live here and nowhere else.

``delta_dtype`` names the pseudo-gradient's encoding on the wire (``diloco_lightning/encoding/codec.py``,
``docs/encoding.md``): the float casts, blockwise ``int8``/``int4``, ``topk`` and the chunked top-k
``ctopk`` (with ``topk``, the fraction kept, ``topk_values``, how the kept values are stored, and for
ctopk ``topk_chunk``, the chunk). ``error_feedback`` adds what an encoding dropped to the next delta
(SparseLoCo, INTELLECT-1): on by default for the quantized encodings, off for the float casts (their
error is ~0.2 % per value, and the residual costs one FP32 copy of the model in the worker's memory and
checkpoints); ``error_feedback_decay`` is SparseLoCo's beta, the factor on the residual before it is
added (``e = beta * e + delta``; 1: nothing owed is forgotten).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from diloco_lightning.encoding import CHUNK_SIZES, DEFAULT_CHUNK_SIZE, EncodingSpec
from diloco_lightning.encoding.registry import encoding_class, encoding_names
from diloco_lightning.wire.fragments import FragmentError, fragment_count
from diloco_lightning.util.options import OptionError, check_choice, check_number, option
from diloco_lightning.worker.pacing import AUTO, Pacing, resolve_throttle

__all__ = ["SYNC_MODES", "DELTA_DTYPES", "TOPK_VALUES", "DEFAULTS", "WorkerOptions", "check_decay", "parse_delta_dtype",
           "resolve_encoding", "takes_options"]

#: ``async``: install the newest global at each boundary, never wait; ``lockstep``: install exactly
#: version ``r - delay`` at boundary r (controlled staleness, for experiments)
SYNC_MODES = ("async", "lockstep")
#: the names a pseudo-gradient's encoding on the wire may be given (aliases included) -> its encoding
DELTA_DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "int8": "int8",
    "int4": "int4",
    "topk": "topk",
    "ctopk": "ctopk",
}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _torch_dtype_name(value: Any) -> str | None:
    """``value``'s name when it is a torch dtype (``"float32"``), else None. Without torch imported
    nothing is a torch dtype: checking a configuration does not import it."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.dtype):
        return None
    return str(value).removeprefix("torch.")
#: how ``topk`` and ``ctopk`` store the values they keep (the first is the default)
TOPK_VALUES = {name: encoding_class(name).value_choices() for name in ("topk", "ctopk")}


def parse_delta_dtype(value: Any, argname: str = "delta_dtype") -> str:
    """An encoding name (or alias, or a float torch dtype) -> the encoding's name (``"int4"``)."""
    name = _torch_dtype_name(value)
    if name in _FLOAT_DTYPES:
        return name
    if isinstance(value, str) and value.lower().removeprefix("torch.") in DELTA_DTYPES:
        return DELTA_DTYPES[value.lower().removeprefix("torch.")]
    if isinstance(value, str) and value in encoding_names():  # one registered later (encoding/registry.py)
        return value
    names = sorted(set(DELTA_DTYPES.values()), key=list(DELTA_DTYPES.values()).index)
    names += [n for n in encoding_names() if n not in names]
    raise OptionError(argname, f"must be one of {names}, got {value!r}")


def resolve_encoding(delta_dtype: Any = "float32", topk: Any = 0.01, topk_values: Any = None,
                     error_feedback: Any = None, topk_chunk: Any = DEFAULT_CHUNK_SIZE) -> tuple[EncodingSpec, bool]:
    """``(EncodingSpec, error feedback on?)`` of these options; :class:`OptionError` naming a bad one.

    ``topk_values=None`` means the encoding's default (``int8`` for topk, ``int2`` for ctopk).
    ``error_feedback=None`` means on for the lossy encodings that need it (int8, int4, topk, ctopk),
    off for the float casts (see the module docstring); it is always off for float32 (nothing is lost).
    """
    name = parse_delta_dtype(delta_dtype)
    if isinstance(topk, bool) or not isinstance(topk, (int, float)) or not 0.0 < topk <= 1.0:
        raise OptionError("topk", f"must be a fraction in (0, 1] (0.01 keeps 1 % of each tensor), got {topk!r}")
    values = encoding_class(name).value_choices()
    if topk_values is not None and topk_values not in values:
        raise OptionError("topk_values", f"must be one of {list(values)} for delta_dtype={name}, got {topk_values!r}")
    if isinstance(topk_chunk, bool) or topk_chunk not in CHUNK_SIZES:
        raise OptionError("topk_chunk", f"must be a power of two from 16 to 65536, got {topk_chunk!r}")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise OptionError("error_feedback", f"must be True, False or None (automatic), got {error_feedback!r}")
    spec = EncodingSpec(name, topk=float(topk), topk_values=topk_values or values[0], chunk=int(topk_chunk))
    return spec, feedback_of(spec, error_feedback)


def check_decay(value: Any) -> float:
    """``error_feedback_decay`` as a float in ``(0, 1]``, else :class:`OptionError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise OptionError("error_feedback_decay", f"must be a number in (0, 1] (1: no decay; SparseLoCo: 0.95), got "
                          f"{value!r}")
    return float(value)


def feedback_of(spec: EncodingSpec, error_feedback: bool | None = None) -> bool:
    """Whether error feedback is on for ``spec``: ``error_feedback``, or (None) on for the quantized
    encodings (int8, int4, topk, ctopk) and off for the float casts; always off for float32."""
    if error_feedback is None:
        return spec.feedback_by_default
    return bool(error_feedback) and not spec.lossless


@dataclass
class WorkerOptions:
    """What shapes a worker (keywords of ``DiLoCo``, the Accelerate adapter and ``DiLoCoWorker``)."""

    inner_steps: Any = option(
        8, "H: inner optimizer steps between two deltas, or auto (Dynamic Local Updates: H from this worker's speed)"
    )
    dylu_steps: int = option(100, "inner_steps=auto: H of the fastest live worker; slower ones take proportionally fewer")
    dylu_min_steps: int | None = option(None, "inner_steps=auto: the fewest inner steps of a phase (null: dylu_steps / 16, >= 1)")
    dylu_seconds: float | None = option(
        None, "inner_steps=auto: aim at this many seconds per inner phase instead of the fastest worker's H"
    )
    throttle: Any = option(0.0, "test knob: seconds slept after each inner step (a number, or a per-worker list)")
    sync: str = option("async", "async (install the newest global, never wait) | lockstep (install exactly version r - delay)")
    delay: Any = option(
        0, "lockstep staleness tau: an int, a per-worker list, or {distribution: uniform|choice|geometric|pareto, ...[, seed]}"
    )
    delta_dtype: str = option(
        "float32", "pseudo-gradient encoding on the wire: float32 | bfloat16 | float16 | int8 | int4 | topk | ctopk "
        "(chunked top-k, SparseLoCo's; docs/encoding.md)"
    )
    topk: float = option(0.01, "delta_dtype=topk: the fraction of each tensor's entries sent (the largest magnitudes); "
                         "ctopk: of each chunk's (k = round(topk * topk_chunk), at least 1)")
    topk_values: str | None = option(
        None, "how topk / ctopk store the kept values: topk: int8 | int4; ctopk: int2 | int8 | int4 | sign (1 bit); "
        "null: int8 for topk, int2 for ctopk"
    )
    topk_chunk: int = option(DEFAULT_CHUNK_SIZE, "delta_dtype=ctopk: values per chunk, each sending its k largest "
                             "(a power of two, 16 to 65536; offsets take log2 of it in bits)")
    error_feedback: bool | None = option(
        None, "add what the encoding dropped to the next delta (null: on for int8, int4, topk and ctopk, off for the "
        "float casts)"
    )
    error_feedback_decay: float = option(
        1.0, "beta: the error-feedback residual is multiplied by it before it is added to the next delta "
        "(SparseLoCo's e = beta * e + delta, 0.95 there; 1: nothing owed is forgotten)"
    )
    fragments: Any = option(
        None, "Streaming DiLoCo fragments: F (transformer block i syncs in fragment i mod F, a large embedding or "
        "head split by rows among them; one fragment every inner_steps/F steps), or a list of parameter-name "
        "pattern groups (whole tensors; null or 1: the whole model at once)"
    )
    rebase: bool = option(
        True, "sync=async: start each phase from the installed version minus this worker's own deltas it does not "
        "contain yet, each times the factor the master applies it with (the manifest's delta_scales; else 1/nodes), "
        "so the worker never relearns its last phase (lockstep and fragments: not used)"
    )
    lookahead: bool = option(
        False, "sync=async with rebase: each own delta the installed version lacks stands for one delta of every "
        "node of the ledger (its factor times the nodes): the phase starts where the global will be once the round "
        "in flight lands, if the others moved as this worker did (the eager update of arXiv 2502.12996; "
        "worker/rebase.py)"
    )
    reset_inner_optimizer: bool = option(False, "clear the inner optimizer state after each install")
    wait_timeout: float = option(1200.0, "seconds a worker waits for the master (bootstrap, lockstep) before giving up")
    poll_interval: float = option(1.0, "seconds between a worker's reads of the hub while waiting")
    claim_ttl: float | None = option(
        None, "seconds a worker's claim on its node id lives without a heartbeat (null: 60 on a folder, 900 on hf:// and s3://)"
    )
    final_install: bool = option(
        True, "at the end of training, install the newest global version that contains this worker's last delta "
        "(waiting at most final_wait), so the model in hand is the run's global one; false: keep the local weights"
    )
    final_wait: float | None = option(
        None, "seconds the end of training waits for the global version holding this worker's last delta (null: "
        "wait_timeout); a master that is gone, or a wait that ends, keeps the local weights"
    )
    wait_for_hub: bool = option(
        False, "a hub that does not exist yet is waited for (at most wait_timeout) instead of refused, so workers may "
        "start before the master creates it"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def given(cls, options: "WorkerOptions | None", values: Mapping[str, Any], who: str,
              required: tuple[str, ...] = ()) -> "WorkerOptions":
        """``options``, or the options the keywords ``values`` name (``who`` takes either, not both;
        without ``options``, each of ``required`` must be among ``values``). Unknown keywords are a
        ``TypeError`` listing the valid ones."""
        if options is not None and values:
            raise TypeError(f"{who}: give either options= or option keywords, not both (got options= and "
                            f"{sorted(values)})")
        if options is not None:
            if not isinstance(options, cls):
                raise TypeError(f"{who}: options must be a WorkerOptions, got {type(options).__name__}")
            return options
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise TypeError(f"{who} got unknown option(s) {unknown}; valid: {cls.names()}")
        missing = [name for name in required if name not in values]
        if missing:
            raise TypeError(f"{who} missing required argument(s) {missing} (or give options=WorkerOptions(...))")
        return cls(**values)

    def validate(self, node_id: str = "w0", node_index: int | None = None) -> "WorkerOptions":
        """Raise :class:`~diloco_lightning.util.options.OptionError` naming the first option out of
        range (``delay`` is checked by resolving it for ``node_id`` / ``node_index``)."""
        from diloco_lightning.worker.delays import resolve_delay

        check_choice(self, "sync", SYNC_MODES)
        if self.inner_steps != AUTO:
            try:
                check_number(self, "inner_steps", low=1, integer=True)
            except OptionError:
                raise OptionError("inner_steps", f"must be an integer >= 1 or 'auto', got {self.inner_steps!r}") from None
        check_number(self, "dylu_steps", low=1, integer=True)
        check_number(self, "dylu_min_steps", low=1, integer=True, optional=True)
        if self.dylu_min_steps is not None and self.dylu_min_steps > self.dylu_steps:
            raise OptionError("dylu_min_steps", f"must be at most dylu_steps ({self.dylu_steps}), got {self.dylu_min_steps}")
        check_number(self, "dylu_seconds", low=0.0, strict=True, optional=True)
        try:
            self.resolved_throttle(node_id, node_index if node_index is not None else (0 if _no_index(node_id) else None))
        except ValueError as e:
            msg = str(e)
            head, _, rest = msg.partition(" ")
            raise OptionError(head, rest, msg) from None
        if _torch_dtype_name(self.delta_dtype) is not None:
            parse_delta_dtype(self.delta_dtype)
        else:
            check_choice(self, "delta_dtype", (*DELTA_DTYPES, *(n for n in encoding_names() if n not in DELTA_DTYPES)))
        resolve_encoding(self.delta_dtype, self.topk, self.topk_values, self.error_feedback, self.topk_chunk)
        check_decay(self.error_feedback_decay)
        self._check_fragments()
        if not isinstance(self.rebase, bool):
            raise OptionError("rebase", f"must be True or False, got {self.rebase!r}")
        if not isinstance(self.lookahead, bool):
            raise OptionError("lookahead", f"must be True or False, got {self.lookahead!r}")
        if not isinstance(self.reset_inner_optimizer, bool):
            raise OptionError("reset_inner_optimizer", f"must be True or False, got {self.reset_inner_optimizer!r}")
        check_number(self, "wait_timeout", low=0.0, strict=True)
        check_number(self, "poll_interval", low=0.0, strict=True)
        check_number(self, "claim_ttl", low=0.0, strict=True, optional=True)
        for name in ("final_install", "wait_for_hub"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be True or False, got {getattr(self, name)!r}")
        check_number(self, "final_wait", low=0.0, optional=True)
        try:
            resolve_delay(self.delay, node_id, node_index if node_index is not None else (0 if _no_index(node_id) else None))
        except ValueError as e:  # "delay must be ...", "delay[1] must be ...", "delay: unknown ..."
            msg = str(e)
            head, _, rest = msg.partition(" ")
            name = head.rstrip(":") if head.startswith("delay") else "delay"
            raise OptionError(name, rest if head.startswith("delay") else msg, msg) from None
        return self

    def _check_fragments(self) -> None:
        try:
            count = fragment_count(self.fragments)
        except FragmentError as e:
            raise OptionError("fragments", str(e).removeprefix("fragments "), str(e)) from None
        if count == 1:
            return
        if self.inner_steps == AUTO:
            raise OptionError("fragments", f"= {count} cannot be combined with inner_steps=auto (Dynamic Local Updates) "
                              f"yet; give a fixed inner_steps, a multiple of {count}")
        if self.inner_steps % count:
            raise OptionError("fragments", f"= {count} needs inner_steps to be a multiple of {count} (a boundary every "
                              f"inner_steps/fragments steps), got inner_steps={self.inner_steps}")

    def resolved_delay(self, node_id: str, node_index: int | None = None) -> int:
        from diloco_lightning.worker.delays import resolve_delay

        return resolve_delay(self.delay, node_id, node_index)

    def resolved_throttle(self, node_id: str, node_index: int | None = None) -> float:
        """This worker's throttle (a per-worker list is indexed like ``delay``)."""
        from diloco_lightning.worker.delays import node_index_of

        if isinstance(self.throttle, (int, float)) or self.throttle is None or isinstance(self.throttle, (str, bytes)):
            return resolve_throttle(self.throttle)
        try:
            index = node_index_of(node_id, node_index)
        except ValueError:
            raise ValueError(f"throttle is a per-worker list, so each worker needs its index: pass node_index= "
                             f"(node_id {node_id!r} does not end with a number to take it from)") from None
        return resolve_throttle(self.throttle, index)

    def pacing(self, node_id: str, node_index: int | None = None) -> Pacing:
        """The :class:`~diloco_lightning.worker.pacing.Pacing` these options describe for this worker."""
        return Pacing(self.inner_steps, dylu_steps=self.dylu_steps, dylu_min_steps=self.dylu_min_steps,
                      dylu_seconds=self.dylu_seconds, throttle=self.resolved_throttle(node_id, node_index),
                      fragments=fragment_count(self.fragments))

    @property
    def encoding(self) -> EncodingSpec:
        """The pseudo-gradients' encoding (:class:`~diloco_lightning.encoding.EncodingSpec`)."""
        return resolve_encoding(self.delta_dtype, self.topk, self.topk_values, self.error_feedback, self.topk_chunk)[0]

    @property
    def feedback(self) -> bool:
        """Whether error feedback is on (``error_feedback`` resolved for this encoding)."""
        return resolve_encoding(self.delta_dtype, self.topk, self.topk_values, self.error_feedback, self.topk_chunk)[1]


#: every option at its default (read it, never change it): what the adapters' signatures show
DEFAULTS = WorkerOptions()

_Init = TypeVar("_Init", bound=Callable[..., Any])


def takes_options(init: _Init) -> _Init:
    """Show :class:`WorkerOptions` in ``init``'s signature: ``init`` (the worker's or an adapter's
    ``__init__``) takes ``options=None`` and ``**option_values`` (:meth:`WorkerOptions.given`); its
    signature (``help()``, IDEs, ``inspect.signature``) lists each field it does not name itself as a
    keyword at its default, generated from the dataclass, so the options are written down once."""
    sig = inspect.signature(init)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in own}
    shown = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, f.name),
                               annotation=f.type) for f in fields(WorkerOptions) if f.name not in names]
    init.__signature__ = sig.replace(parameters=[*own, *shown])  # type: ignore[attr-defined]
    return init


def _no_index(node_id: str) -> bool:
    return not node_id[-1:].isdigit()
