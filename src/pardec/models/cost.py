"""What a forward costs on this machine, by the number of new rows: the measured table that decides whether a
verification forward is padded to a cheaper row count (``CachedModel.forward(..., pad_to=table)``) and that the
adaptive methods may choose their draft length from.

On small-M GEMMs the BLAS kernel chosen depends on M, so cost is not monotonic in the rows: on an AVX2 EPYC with
two threads (fp32, SmolLM2-135M) 3 new rows cost 1.84x one row and 5 rows 1.43x. Padding 3 rows to 5 then saves
time; the padding rows are masked (they see only themselves, nobody sees them), cut from the cache and never read.

Tables live in ``data/forward_cost/<machine key>/<model>-<precision>[-<forward>].json`` (``python -m pardec.bench cost``
writes them: :mod:`pardec.bench.cost`), keyed by the CPU model, its vector flags (AVX2 / AVX-512 / AMX), the thread count and torch's version,
since a table measured on one machine says nothing about another; and by the forward that was timed
(:func:`table_key`: nothing for transformers' forward with SDPA, ``-compiled``, ``-lean``, ``-invariant``, ...), since
a compiled forward's rows cost differently from an eager one's. A run uses its own forward's table only
(:meth:`CostTable.find`): one measured on another forward says nothing about this one's rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pardec import DATA_DIR
from pardec.models.host import machine, machine_key


def table_key(precision: str, forward_impl: str = "hf", attn_implementation: str = "sdpa") -> str:
    """The ``dtype`` key of a cost table: the model's precision (``ModelConfig.precision()``), then the forward
    and the attention when they are not transformers' forward with SDPA (``int8-per_token-smooth0.5-compiled``)."""
    parts = [precision]
    if forward_impl != "hf":
        parts.append(forward_impl)
    if attn_implementation != "sdpa":
        parts.append(attn_implementation)
    return "-".join(parts)


def best_draft_length(table: CostTable, accepted: int, rejections: int, draft_ms: float, lo: int, hi: int) -> int:
    """The draft length g in [lo, max(lo, hi)] with the most expected tokens per ms (Leviathan et al. 2023 §3.5):
    ``(1 - a^(g+1)) / (1 - a)`` tokens for a verification of g + 1 rows (its cost from ``table``, padded to the
    cheapest measured count >= g + 1) plus g draft forwards of ``draft_ms`` each. The acceptance rate ``a`` is
    (accepted + 1) / (accepted + rejections + 2): the ratio with one of each as a prior. Lengths whose forward the
    table does not cover are never chosen; ``lo`` when none is."""
    a = (accepted + 1) / (accepted + rejections + 2)
    best, best_rate = None, -1.0
    for g in range(lo, max(lo, hi) + 1):
        target_ms = table.ms_at_least(g + 1)
        if target_ms is None:
            break  # longer forwards were not measured
        rate = (1 - a ** (g + 1)) / (1 - a) / (target_ms + g * draft_ms)
        if rate > best_rate:
            best, best_rate = g, rate
    return best if best is not None else lo


@dataclass
class CostTable:
    """Median ms of one cached forward of T new rows (T = the keys of ``ms``) after ``context`` cached tokens."""

    model: str
    dtype: str
    context: int
    ms: dict[int, float]
    machine: dict = field(default_factory=machine)

    def relative(self, rows: int) -> float | None:
        """Cost of ``rows`` rows relative to one row (None: not measured)."""
        return self.ms[rows] / self.ms[1] if rows in self.ms and 1 in self.ms else None

    def cheapest_at_least(self, rows: int) -> int:
        """The row count >= ``rows`` with the lowest measured cost (``rows`` itself when no larger measured count
        is cheaper, or when ``rows`` was not measured)."""
        if rows not in self.ms:
            return rows
        return min((t for t in self.ms if t >= rows), key=lambda t: (self.ms[t], t))

    def ms_at_least(self, rows: int) -> float | None:
        """What a forward of ``rows`` new rows costs when it may be padded: the lowest measured ms over row counts
        >= ``rows`` (None: none measured that large)."""
        costs = [v for t, v in self.ms.items() if t >= rows]
        return min(costs) if costs else None

    # ------------------------------------------------------------------------------------------ storage
    @staticmethod
    def path(model: str, dtype: str, m: dict | None = None, root: Path | None = None) -> Path:
        return (root or DATA_DIR / "forward_cost") / machine_key(m) / f"{model}-{dtype}.json"

    def save(self, root: Path | None = None) -> Path:
        f = self.path(self.model, self.dtype, self.machine, root)
        f.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["ms"] = {str(k): v for k, v in self.ms.items()}
        f.write_text(json.dumps(data, indent=1))
        return f

    @classmethod
    def find(cls, model: str, precision: str, forward_impl: str = "hf", attn_implementation: str = "sdpa",
             root: Path | None = None) -> CostTable | None:
        """The table measured here for this forward (:func:`table_key`), or None."""
        return cls.load(model, table_key(precision, forward_impl, attn_implementation), root)

    @classmethod
    def load(cls, model: str, dtype: str, root: Path | None = None) -> CostTable | None:
        """This machine's table for ``model`` in ``dtype``, or None when none was measured here."""
        f = cls.path(model, dtype, None, root)
        if not f.is_file():
            return None
        data = json.loads(f.read_text())
        data["ms"] = {int(k): float(v) for k, v in data["ms"].items()}
        return cls(**data)
