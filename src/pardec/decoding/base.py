"""The decoder seam: a registry of methods sharing one call and one result type.

``decoder.generate(prompt_ids, max_new_tokens, stop, sampling) -> GenerationResult``
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pardec.config import ConfigError, ModelConfig, SamplingConfig, check_types, type_name
from pardec.config import check_range as config_check_range
from pardec.decoding.sampling import make_generator, select
from pardec.decoding.tree import Tree
from pardec.decoding.verify import TreeVerdict, verify_chain_reading, verify_tree
from pardec.models.cached import CachedModel, to_device
from pardec.registry import Registry


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only (an EOS that stopped generation is included)
    stop_reason: str  # "eos" | "stop_string" | "length"
    target_forwards: int  # forwards of the target model, prefill included
    draft_forwards: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens committed by each target forward
    prefill_s: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0  # wall time spent in draft-model forwards (part of total_s)
    drafted: int = 0  # draft tokens proposed to the target (draft methods; 0 otherwise)
    draft_accepted: int = 0  # of those, accepted by verification
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.target_forwards)


class Stopper:
    """Stop conditions: EOS ids and stop strings, checked token by token so every method stops at the
    same position of the same token sequence."""

    WINDOW = 48  # tokens decoded around a new token when looking for stop strings

    def __init__(self, tokenizer=None, eos_ids: set[int] | list[int] = (), stop_strings: list[str] = ()):
        self.tokenizer = tokenizer
        self.eos_ids = set(int(e) for e in eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def first_stop(self, prev: list[int], new: list[int]) -> tuple[int, str] | None:
        """(index into ``new`` of the token that ends generation, reason) or None."""
        for j, t in enumerate(new):
            if t in self.eos_ids:
                return j, "eos"
            if self.stop_strings:
                seq = prev + new[: j + 1]
                text = self._decode(seq[-self.WINDOW :])
                if any(s in text for s in self.stop_strings):
                    return j, "stop_string"
        return None

    def final_text(self, tokens: list[int]) -> str:
        """Decoded completion without special tokens, cut before the first stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text


class Output:
    """Accumulates committed tokens, enforcing max_new_tokens and the stop conditions."""

    def __init__(self, max_new_tokens: int, stop: Stopper):
        self.max_new = max_new_tokens
        self.stop = stop
        self.tokens: list[int] = []
        self.accepted: list[int] = []
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def room(self) -> int:
        return self.max_new - len(self.tokens)

    def commit(self, new: list[int]) -> list[int]:
        """Append tokens produced by one target forward; returns those actually kept."""
        new = list(new[: self.room])
        hit = self.stop.first_stop(self.tokens, new)
        if hit is not None:
            new = new[: hit[0] + 1]
            self.reason = hit[1]
        self.tokens.extend(new)
        self.accepted.append(len(new))
        if self.reason is None and self.room <= 0:
            self.reason = "length"
        return new


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall time of a whole generation: the device is synchronized at its start and when it is read (the ends of
    the timed region), never in between."""

    def __init__(self, device: torch.device):
        self.device = device
        sync(device)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        sync(self.device)
        return time.perf_counter() - self.t0


class Clock:
    """Summed time of sub-regions (a draft's proposals, a model's forwards) on ``device`` with no host sync inside
    the run: CUDA events on a GPU, read (one sync) by :attr:`seconds` once the run is over; ``perf_counter`` on the
    CPU, where work is synchronous."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._cpu_s = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        end = self._mark()
        if self.cuda:
            self._events.append((self._start, end))
        else:
            self._cpu_s += end - self._start
        self._start = None

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()  # every earlier event is done too (one stream)
        return self._cpu_s + sum(a.elapsed_time(b) for a, b in self._events) / 1e3


#: ``tokens``: greedy output equals greedy ``ar`` token for token (fp32), and sampling draws from the target's
#: distribution; ``distribution``: samples exactly from the target's (warped) distribution, greedy included;
#: ``approximate``: lossy on purpose (reported with perplexity and the task metric beside its speed).
EXACTNESS = ("tokens", "distribution", "approximate")


def lossless_under_greedy(cls: type[Decoder]) -> bool:
    """Whether greedy output must equal greedy ``ar`` token for token."""
    return cls.exactness in ("tokens", "distribution")


class Decoder:
    """Base class. Subclasses set ``exactness`` and implement :meth:`generate`."""

    name: ClassVar[str] = ""
    #: what the method guarantees (see :data:`EXACTNESS`); tests hold every method to it
    exactness: ClassVar[str] = "approximate"
    #: how far below the target's own task metric (absolute, on a 0-1 metric) the method's paper says its outputs may
    #: fall; 0 where the paper states none (a lossless method, or "without quality loss"). The table flags a loss
    #: beyond it (:func:`pardec.bench.table.quality`)
    quality_tolerance: ClassVar[float] = 0.0
    #: parameters of an earlier release -> their names now (refused in one line naming the new one)
    renamed: ClassVar[dict[str, str]] = {}
    needs_draft: ClassVar[bool] = False
    #: whether its forwards need a custom attention mask (trees, windows, branches): not with flash_attention_2
    custom_mask: ClassVar[bool] = False

    def __init__(self, target: CachedModel, tokenizer=None, draft: CachedModel | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft

    def carried(self) -> Any:
        """A copy of what this decoder carries from one generation to the next (Ouroboros's ``warm_start`` pool), or
        None when nothing. The evaluation restores it between repeats of one prompt (:meth:`restore`), so that a
        repeat does not profit from the same prompt's earlier run."""
        return None

    def restore(self, carried: Any) -> None:
        """Go back to a state :meth:`carried` returned."""

    @classmethod
    def check_model(cls, model: ModelConfig, params: dict[str, Any]) -> None:
        """What the method needs of the model (``params``: its ``method.*`` settings), checked before the model
        loads where the model's files are at hand; raises one line. Default: nothing."""

    def generate(
        self,
        prompt_ids: torch.Tensor | list[int],
        max_new_tokens: int,
        stop: Stopper | None = None,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        raise NotImplementedError

    # shared steps ----------------------------------------------------------------------------
    def begin(self, prompt_ids, max_new_tokens: int, stop: Stopper | None, sampling: SamplingConfig | None,
              prefill: Callable[[torch.Tensor], torch.Tensor] | None = None,
              extra: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """Begin a generation (every decoder's ``generate`` calls it first; a seam tests and subclasses may wrap):
        prefill the target with the prompt and commit its first token. ``prefill(ids) -> [1, V]`` replaces
        ``target.prefill`` (a method that wants more than the last logits from that forward). ``extra(token)``:
        1-D ids made from the first token [1], still on the device, and read back with it in the one host read
        (left in ``state.extra``).

        Returns (state, last committed token); ``state.prefill_s`` is set, the clock keeps running."""
        s = sampling or SamplingConfig()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        ids = ids.to(self.target.device)
        st = _Run(s, Output(max_new_tokens, stop or Stopper()), ids, make_generator(s, ids.device), Timer(ids.device))
        first = select((prefill or self.target.prefill)(ids), s, st.gen).reshape(1)
        if extra is None:
            last = int(first)
        else:
            last, *st.extra = torch.cat([first, extra(first).reshape(-1).to(first.device, torch.long)]).tolist()
        st.out.commit([last])
        st.prefill_s = st.timer.elapsed()
        st.target_forwards = 1
        return st, last

    def _verify_chain(self, st: _Run, last: int, draft: torch.Tensor, q: torch.Tensor | None = None,
                      extra: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, list[int], list[int]]:
        """One target forward over ``[last, *draft]``; commit the accepted prefix + one target token and keep
        only their positions in the cache. ``q`` [k, V]: the draft's distributions (None: a deterministic
        draft). ``extra(logits)``: 1-D ids read back in the verification's one host read, left in
        ``st.extra``. Returns (logits [k+1, V], committed tokens, kept by the output)."""
        base = self.target.length
        dev = st.ids.device
        draft = to_device(torch.as_tensor(draft, dtype=torch.long), dev)  # a draft made on the device stays there
        inp = torch.cat([torch.full((1,), int(last), dtype=torch.long, device=dev), draft])[None]
        logits = self.target.forward(inp).logits[0]
        st.target_forwards += 1
        acc, st.extra = verify_chain_reading(draft, logits, st.s, st.gen, q, None if extra is None else extra(logits))
        kept = st.out.commit(acc)
        self.target.truncate(base + len(acc))  # `last` + the accepted draft tokens
        return logits, acc, kept

    def _verify_tree(self, st: _Run, last: int, tree: Tree, q: dict[int, torch.Tensor] | None = None,
                     rule: Callable[[torch.Tensor], TreeVerdict] | None = None,
                     extra: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, TreeVerdict, list[int]]:
        """One target forward over the tree (root = ``last``) under its ancestor mask; commit the accepted path
        + one target token and compact the cache to exactly that path. ``rule(logits)`` replaces the shared
        :func:`verify_tree` (a method's own acceptance rule). ``extra(logits)``: 1-D ids read back in the
        verification's one host read (``TreeVerdict.extra``; shared rule only). Returns (logits [N, V], the
        verdict (``tokens``: the committed tokens), kept by the output)."""
        base, dev = self.target.length, self.target.device
        logits = self.target.forward(tree.tokens(last, dev)[None], positions=tree.positions(base, dev),
                                     attend=tree.on(dev).attend).logits[0]
        st.target_forwards += 1
        if rule is not None and extra is not None:
            raise ValueError("_verify_tree: extra ids ride on the shared verify_tree only, not on a method's rule")
        verdict = rule(logits) if rule is not None else verify_tree(
            tree, logits, st.s, st.gen, q, extra=None if extra is None else extra(logits))
        kept = st.out.commit(verdict.tokens)
        self.target.keep(verdict.path)
        return logits, verdict, kept

    def _step_alone(self, st: _Run, last: int) -> int:
        """One target forward on ``last`` alone (no room left for a draft): commit its token and return it."""
        _, acc, _ = self._verify_chain(st, last, torch.zeros(0, dtype=torch.long, device=st.ids.device))
        return acc[-1]

    def _result(self, st: _Run, extras: dict | None = None, draft_forwards: int = 0, draft_s: float = 0.0,
                drafted: int = 0, draft_accepted: int = 0) -> GenerationResult:
        return GenerationResult(st.out.tokens, st.out.reason, st.target_forwards, draft_forwards, st.out.accepted,
                                st.prefill_s, st.timer.elapsed(), draft_s, drafted, draft_accepted, extras or {})


@dataclass
class _Run:
    """Per-call state shared by the steps of one generation."""

    s: SamplingConfig
    out: Output
    ids: torch.Tensor  # [1, T] prompt on the target's device
    gen: torch.Generator | None
    timer: Timer
    prefill_s: float = 0.0
    target_forwards: int = 0
    extra: list[int] = field(default_factory=list)  # the last verification's extra ids (``_verify_chain(extra=)``)


class DraftClock:
    """Wall time and forwards of a draft: ``clock.run(st, propose, *args)`` calls ``propose(*args)``, whose result
    ends with its number of draft forwards, and adds both up (timed by a :class:`Clock`: no host sync)."""

    def __init__(self) -> None:
        self.forwards = 0
        self._clock: Clock | None = None

    def run(self, st: _Run, propose: Callable[..., tuple], *args: Any) -> tuple:
        self._clock = self._clock or Clock(st.ids.device)
        self._clock.start()
        out = propose(*args)
        self._clock.stop()
        self.forwards += out[-1]
        return out

    @property
    def seconds(self) -> float:
        return self._clock.seconds if self._clock else 0.0


METHODS: Registry[type[Decoder]] = Registry("method")


def register_method(name: str, *, aliases: tuple[str, ...] = (), renamed_from: tuple[str, ...] = ()):
    def deco(cls: type[Decoder]) -> type[Decoder]:
        cls.name = name
        return METHODS.register(name, aliases=aliases, renamed_from=renamed_from)(cls)

    return deco


def method_params(cls: type[Decoder]) -> dict[str, inspect.Parameter]:
    sig = inspect.signature(cls.__init__)
    return {k: p for k, p in sig.parameters.items() if k not in ("self", "target", "tokenizer", "draft")}


def check_renamed(renamed: dict[str, str], params: dict[str, Any]) -> None:
    """Refuse a parameter of an earlier release (``renamed``: old -> new name) in one line naming the new one."""
    for old, new in renamed.items():
        if old in params:
            raise ConfigError(f"method.{old} is now method.{new} (the one key every method reads its trained drafter "
                              f"from): pass method.{new}={params[old]}")


def check_params(cls: type[Decoder], params: dict[str, Any]) -> None:
    """Names and types of ``method.*`` parameters against ``cls.__init__``'s signature, before any model loads:
    an unknown name or a value of the wrong type raises one line (``method.block_size='abc' must be int
    (jacobi(block_size: int = 16))``). Ranges are the method's own ``__init__`` checks."""
    valid = method_params(cls)
    check_renamed(cls.renamed, params)
    bad = sorted(set(params) - set(valid))
    if bad:
        raise ConfigError(f"method {cls.name!r} has no parameter(s) {bad}; valid: {', '.join(valid) or 'none'}")

    def declared(key: str, tp: Any) -> str:  # jacobi(block_size: int = 16)
        p = valid[key]
        decl = f"{key}: {p.annotation if isinstance(p.annotation, str) else type_name(tp)}"
        return f"{cls.name}({decl}{'' if p.default is inspect.Parameter.empty else f' = {p.default!r}'})"

    check_types(cls.__init__, params, "method", explain=declared)


def check_range(key: str, value: Any, lo: float, hi: float, integer: bool = True, open_lo: bool = False) -> None:
    """:func:`pardec.config.check_range` of ``method.<key>`` (a method's ``__init__`` checking its parameters)."""
    config_check_range(f"method.{key}", value, lo, hi, integer=integer, open_lo=open_lo)


def check_attention(name: str, model: ModelConfig, draft: ModelConfig | None = None) -> None:
    """Refuse, before anything loads, ``attn_implementation=flash_attention_2`` for a method whose forwards need a
    custom attention mask (flash-attention kernels take causal or padding masks only)."""
    cls = METHODS.get(name)
    for role, m in (("model", model), ("draft", draft if cls.needs_draft else None)):
        if m is not None and cls.custom_mask and m.attn_implementation == "flash_attention_2":
            raise ConfigError(
                f"{role}.attn_implementation=flash_attention_2 cannot run method {name!r}: its forwards verify a "
                f"token tree / window with a custom attention mask, which flash-attention kernels do not take; use "
                f"{role}.attn_implementation=sdpa (methods that can use it: "
                f"{', '.join(n for n in METHODS.names() if not METHODS.get(n).custom_mask)})")


def build_decoder(
    name: str, target: CachedModel, tokenizer=None, draft: CachedModel | None = None, **params: Any
) -> Decoder:
    """Instantiate a registered method; unknown parameters and values of the wrong type raise naming the valid
    ones. (Importing any module of :mod:`pardec.decoding` runs the package first, which registers the built-in
    methods.)"""
    cls = METHODS.get(name)
    check_params(cls, params)
    if cls.needs_draft and draft is None:
        raise ConfigError(f"method {name!r} needs a draft model: pass draft=<name>")
    return cls(target, tokenizer=tokenizer, draft=draft, **params)
