"""The token ids a KV cache holds, kept where they arrived (host or device chunks): :class:`TokenLog`."""

from __future__ import annotations

import torch

from pardec.models.cache import to_device


class TokenLog:
    """The token ids of the cached positions, ``[rows, length]``, as chunks left where they arrived (a forward's ids,
    on the host or on the device: no copy to the host per forward); :meth:`host` gathers them on the host."""

    def __init__(self, rows: int = 1, parts: list[torch.Tensor] | None = None):
        self.rows = rows
        self.parts = [p for p in parts or [] if p.shape[1]]  # [rows, t_i] each

    @property
    def length(self) -> int:
        return sum(p.shape[1] for p in self.parts)

    def append(self, ids: torch.Tensor) -> None:
        if ids.shape[0] != self.rows:  # the first forward after a reset sets the batch size
            self.parts = [p.expand(ids.shape[0], -1) for p in self.parts]
            self.rows = ids.shape[0]
        self.parts.append(ids)
        if len(self.parts) > 16:  # merge neighbours on the same device (host and device chunks stay apart)
            merged: list[torch.Tensor] = []
            for p in self.parts:
                if merged and merged[-1].device == p.device:
                    merged[-1] = torch.cat([merged[-1], p], dim=1)
                else:
                    merged.append(p)
            self.parts = merged

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """All of them as one tensor, on ``device`` (default: the last chunk's)."""
        if not self.parts:
            return torch.zeros(self.rows, 0, dtype=torch.long, device=device)
        dev = device or self.parts[-1].device
        parts = [to_device(p, dev) for p in self.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def host(self) -> torch.Tensor:
        out = self.dense(torch.device("cpu"))
        self.parts = [out] if out.shape[1] else []
        return out

    def _split(self, at: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        head, tail, seen = [], [], 0
        for p in self.parts:
            n = p.shape[1]
            if seen + n <= at:
                head.append(p)
            elif seen >= at:
                tail.append(p)
            else:
                head.append(p[:, : at - seen])
                tail.append(p[:, at - seen :])
            seen += n
        return head, tail

    def truncate(self, length: int) -> None:
        self.parts = self._split(length)[0]

    def host_prefix(self) -> int:
        """How many leading positions sit in chunks on the host (the rest arrived as device tensors)."""
        n = 0
        for p in self.parts:
            if p.device.type != "cpu":
                break
            n += p.shape[1]
        return n

    def settle(self, start: int, values: list[int]) -> None:
        """Positions ``start`` .. are ``values`` (batch 1; known on the host): keep them as a host chunk."""
        head = self._split(start)[0]
        self.parts = [*head, torch.tensor([values], dtype=torch.long)] if values else head

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions ``start + idx`` of those from ``start`` on (``idx`` on the host)."""
        head, tail = self._split(start)
        rest = TokenLog(self.rows, tail).dense()
        self.parts = [p for p in [*head, rest[:, to_device(idx, rest.device)]] if p.shape[1]]

    def select(self, rows: list[int]) -> TokenLog:
        index = torch.tensor(rows, dtype=torch.long)
        return TokenLog(len(rows), [p[index.to(p.device)] for p in self.parts])

    def join(self, other: TokenLog, pad_self: int, pad_other: int) -> TokenLog:
        """These rows then ``other``'s, each side left-padded with token 0."""
        a = self.dense()
        b = other.dense(a.device)
        pad = lambda t, n: torch.cat([t.new_zeros(t.shape[0], n), t], dim=1)  # noqa: E731
        return TokenLog(self.rows + other.rows, [torch.cat([pad(a, pad_self), pad(b, pad_other)], dim=0)])
