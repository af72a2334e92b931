"""The config schema: the dataclasses a Hydra section becomes (:func:`pardec.config.checks.to_dataclass`: OmegaConf
checks the types, ``__post_init__`` the ranges and choices), the choice tuples they check against, and
:func:`settings_diff`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pardec.config.checks import ConfigError, check_at_least, check_choice, is_int

INT8_WEIGHTS = ("weight_only", "per_channel", "per_tensor", "per_token")  # int8 weight schemes (pardec.models.quant.int8)
INT8_FIELDS = ("int8_weights", "int8_smooth", "int8_skip")
DTYPES = ("fp32", "bf16", "fp16", "int8")  # int8: int8 linears on the CPU (pardec.models.quant.int8), inference only
KV_CACHES = ("preallocated", "dynamic")  # CachedModel's KV caches (pardec.models.cache.preallocated / transformers' DynamicCache)
FORWARD_IMPLS = ("hf", "lean", "compiled", "cudagraph")  # CachedModel.forward: transformers' model(...) |
# pardec.models.forward.lean (Llama family) | pardec.models.forward.compiled (lean + the one-token decode step and the multi-row
# forwards as torch.compile graphs) | cudagraph: compiled, its one-token step and its multi-row forwards (padded to a
# power of two rows) captured once and replayed as CUDA graphs (CUDA devices only)
#: what the ``forward_impl`` keys take: a forward, or ``auto``: the fastest exact one for the model where it runs
#: (:func:`pardec.models.forward.auto`)
FORWARD_CHOICES = ("auto", *FORWARD_IMPLS)
MODEL_SOURCES = ("hub", "local", "gguf_package", "gguf", "tiny_random")
DEVICES = ("auto", "cpu", "cuda")
#: accelerate's placements for a model larger than one device (``model.device_map``); None = all on ``model.device``
DEVICE_MAPS = (None, "auto", "balanced", "balanced_low_0", "sequential")
#: attention kernels: flash_attention_2 only where no custom (tree / Jacobi) mask is needed, see decoding.METHODS
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "invariant")  # invariant: pardec.models.forward.invariant
PROMPT_STYLES = ("auto", "chat", "base")


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    source: str = "gguf_package"  # hub | local | gguf_package | gguf | tiny_random
    path: str | None = None  # hub id, local dir, or GGUF file / package name
    gguf_file: str | None = None  # file name inside ``path`` (GGUF sources)
    revision: str | None = None
    dtype: str = "fp32"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    device_map: str | None = None  # auto | balanced | sequential: split a model over the visible GPUs (accelerate)
    chat: bool | None = None  # use the chat template; None = when the tokenizer has one
    cache_dir: str | None = None  # where dequantized GGUF weights are cached (default data/models/<name>)
    adapter: str | None = None  # a peft (LoRA) adapter dir applied on top of the base weights
    # dtype=int8 (pardec.models.quant.int8; docs/cpu_speed.md "int8 that keeps the model's quality"). int8_weights: per_channel | per_tensor
    # (fbgemm's dynamic int8: activations quantized with one scale per forward, weight scales per row | per matrix;
    # nearly flat cost from 1 to 5 rows, the regime where drafting pays) | per_token (fbgemm's integer GEMM with one
    # activation scale per token: batch-invariant) | weight_only (int8 weights, bf16 activations: closest to fp32
    # and fastest at one row, but 2-4 rows cost 1.3x one and 5-8 rows 2.2x). For the schemes that quantize
    # activations: SmoothQuant alpha in (0, 1) (None: off) and the linears (name suffixes) kept fp32. The default,
    # per_token with alpha 0.5 and every linear int8, keeps fp32's perplexity within ~2% (top-1 0.96) and is the
    # fastest with flat rows (docs/cpu_speed.md "Per-token int8"); fbgemm's per_channel needs alpha 0.8 and down_proj in fp32 for
    # +4% (top-1 0.91-0.93), and without them is far from fp32 (top-1 0.6)
    int8_weights: str = "per_token"
    int8_smooth: float | None = 0.5
    int8_skip: list[str] = field(default_factory=list)
    # dtype=bf16 on a CPU with AMX-bf16 (elsewhere it does nothing): the linears' weights prepacked once into
    # oneDNN's blocked layout (pardec.models.quant.packed): bitwise the same results, no per-call weight reorder (Xeon with
    # AMX: SmolLM2's linears 20.8 -> 13.7 ms per pass, flat from 1 to 16 rows). Inference only; training loads unpacked
    cpu_prepack: bool = True
    # tiny_random only
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seed: int = 0
    tokenizer: str | None = None  # tiny_random: model config name whose tokenizer to use
    # tiny_random: keep the tokenizer's first ``vocab`` ids (special tokens, byte alphabet and the earliest merges:
    # still a whole BPE that encodes any text) and size the model's embedding and head to them; null: the whole
    # vocabulary (SmolLM2's 49,152). A 64-wide model's head over 49k tokens is half of its forward
    vocab: int | None = 8192
    missing_hint: str | None = None  # local source: how to make ``path`` exist (named by the error when it does not)

    def __post_init__(self) -> None:
        check_choice("model.source", self.source, MODEL_SOURCES)
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.device", self.device, DEVICES)
        check_choice("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice("model.device_map", self.device_map, DEVICE_MAPS)
        check_choice("model.int8_weights", self.int8_weights, INT8_WEIGHTS)
        if self.int8_smooth is not None and not 0.0 < self.int8_smooth < 1.0:
            raise ConfigError(f"model.int8_smooth={self.int8_smooth!r} is out of range: SmoothQuant's alpha must be in "
                              "(0, 1), or null for no smoothing")
        if self.int8_smooth is not None and self.int8_weights == "weight_only":
            raise ConfigError(f"model.int8_smooth={self.int8_smooth} applies to the schemes that quantize activations "
                              "(int8_weights=per_channel | per_tensor | per_token); with int8_weights=weight_only set "
                              "model.int8_smooth=null")
        self.int8_skip = list(self.int8_skip or [])
        if self.dtype == "int8" and (self.device == "cuda" or self.device_map):
            where = "model.device=cuda" if self.device == "cuda" else f"model.device_map={self.device_map}"
            raise ConfigError(f"model {self.name!r}: dtype=int8 is a CPU mode (fbgemm int8 linears) and cannot run "
                              f"with {where}; use dtype=bf16 on GPUs, or dtype=int8 with model.device=cpu")
        check_at_least("model.layers", self.layers, 1)
        check_at_least("model.hidden", self.hidden, 8)
        check_at_least("model.vocab", self.vocab, 2, integer=True, or_null=True)

    def precision(self) -> str:
        """The dtype and, for int8, its recipe: what a forward-cost table is measured under (``fp32``,
        ``int8-per_channel-smooth0.8-skip_down_proj``, ``int8-weight_only``; ``bf16-unpacked`` without
        ``cpu_prepack``): int8 schemes cost differently by rows."""
        if self.dtype == "bf16" and not self.cpu_prepack:
            return "bf16-unpacked"  # (on a CPU, unpacked bf16 linears cost ~1.5x packed ones: pardec.models.quant.packed)
        if self.dtype != "int8":
            return self.dtype
        parts = ["int8", self.int8_weights]
        if self.int8_smooth is not None:
            parts.append(f"smooth{self.int8_smooth:g}")
        if self.int8_skip:
            parts.append("skip_" + "+".join(self.int8_skip))
        return "-".join(parts)

    def identity(self) -> dict[str, Any]:
        """Every field that changes what the model computes (where its weights come from, their dtype, adapter,
        device, the tiny_random shape and seed, the chat template choice): runs that differ in one are not
        resumable into each other. ``cache_dir``, ``missing_hint`` and ``cpu_prepack`` (bitwise the same logits: tested)
        are left out: they change no output; so are the ``int8_*`` fields unless ``dtype`` is int8, and ``vocab`` unless
        the model is a tiny_random one."""
        drop = ("cache_dir", "missing_hint", "cpu_prepack") + (() if self.dtype == "int8" else INT8_FIELDS) + (
            () if self.source == "tiny_random" else ("vocab",))
        return {k: v for k, v in asdict(self).items() if k not in drop}


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_at_least("sampling.temperature", self.temperature, 0.0)
        check_at_least("sampling.top_k", self.top_k, 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p={self.top_p!r} is out of range: it must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DatasetConfig:
    name: str = "humaneval"
    path: str | None = None  # local file overriding the hub
    hub_id: str | None = None
    hub_config: str | None = None
    split: str = "test"
    prompt_style: str = "auto"  # auto | chat | base
    extra: dict = field(default_factory=dict)  # task-specific options

    def __post_init__(self) -> None:
        check_choice("dataset.prompt_style", self.prompt_style, PROMPT_STYLES)

    def use_chat(self, model_chat: bool) -> bool:
        """Whether prompts are built with the chat template: ``prompt_style`` (``auto`` follows the model)."""
        return {"auto": bool(model_chat), "chat": True, "base": False}[self.prompt_style]


@dataclass
class BenchConfig:
    baseline: str = "ar"
    include_hf: bool = False
    # more methods run as roles on the same prompts in the same run: "name" or "name:key=value:key=value"
    # (e.g. "sps:adaptive=true"); they are summarised beside the peers under ``peers.<name[:...]>``
    also: list[str] = field(default_factory=list)
    warmup: int = 1  # warm-up generations per method before timing
    warmup_tokens: int = 16

    def __post_init__(self) -> None:
        check_at_least("bench.warmup", self.warmup, 0)
        check_at_least("bench.warmup_tokens", self.warmup_tokens, 1)


@dataclass
class RunConfig:
    """Top-level keys of ``conf/evaluate.yaml``."""

    n_samples: int | None = None  # None = the whole dataset
    max_new_tokens: int = 256
    threads: int | str = "auto"  # torch intra-op threads; auto: the cores no other process uses at the start
    seed: int = 0
    resume: bool = False
    timeout_s: float = 10.0  # sandbox wall-clock limit per program
    stop_at_eos: bool = True
    repeats: int = 1
    dtype: str = "fp32"
    tf32: bool = True  # fp32 matmuls on Ampere+ GPUs in TF32 (no effect on CPU or in bf16/fp16)
    forward_padding: bool = True  # pad the target's multi-row forwards by this machine's cost table, if measured
    kv_cache: str = "preallocated"  # CachedModel's KV cache (KV_CACHES)
    forward_impl: str = "auto"  # the target's CachedModel forward (FORWARD_CHOICES); auto: the fastest exact one
    draft_forward_impl: str | None = None  # the draft's (FORWARD_CHOICES); None: as forward_impl
    batch_size: int = 1  # prompts decoded at once (> 1: pardec.evaluation.batched, continuous batching)

    def __post_init__(self) -> None:
        check_at_least("repeats", self.repeats, 1)
        check_at_least("batch_size", self.batch_size, 1, integer=True)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_cache", self.kv_cache, KV_CACHES)
        check_choice("forward_impl", self.forward_impl, FORWARD_CHOICES)
        check_choice("draft_forward_impl", self.draft_forward_impl, (None, *FORWARD_CHOICES))
        if self.n_samples is not None:
            check_at_least("n_samples", self.n_samples, 1)
        check_at_least("max_new_tokens", self.max_new_tokens, 1)
        if self.threads != "auto":
            if not is_int(self.threads):
                raise ConfigError(f"threads={self.threads!r} is not valid: give an integer >= 1 or auto (the cores no "
                                  f"other process uses when the run starts)")
            check_at_least("threads", self.threads, 1)
        check_at_least("timeout_s", self.timeout_s, 0.1)


def settings_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Where two settings dicts (nested) differ, one ``key was <old>, now <new>`` per differing leaf, dotted keys
    (``model.seed was 0, now 1``); a key missing on one side reads as None."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += settings_diff(a, b, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k} was {a!r}, now {b!r}")
    return out
