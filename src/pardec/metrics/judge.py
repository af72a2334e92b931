"""LLM-as-a-judge through an OpenAI-compatible chat-completions endpoint (urllib only, no SDK).

A :class:`Judge` sends a system + user message to ``{base_url}/chat/completions`` (temperature 0) and
parses a single-answer rating written ``[[8]]`` or ``[[8.5]]`` (FastChat's patterns, with its ``[8]``
fallback). A reply without a rating in [1, 10] counts as garbage and is retried, as are connection
errors, timeouts, HTTP 408/429/5xx and malformed JSON, with exponential backoff
(``backoff_s * 2**k`` before retry k). Other HTTP errors (401, 404, ...) stop at once. After
``max_retries`` retries the rating is None and the reason is kept: nothing is ever invented.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields

from pardec.config import ConfigError

_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
_RETRY_HTTP = {408, 429}


@dataclass
class JudgeConfig:
    """``dataset.extra.judge``; ``base_url: null`` means no judge (scores stay None)."""

    base_url: str | None = None  # e.g. https://api.openai.com/v1 or http://localhost:8000/v1
    model: str = "gpt-4"
    api_key_env: str = "OPENAI_API_KEY"  # env var holding the key; unset = no Authorization header
    max_retries: int = 4  # retries after the first attempt
    backoff_s: float = 2.0
    timeout_s: float = 60.0
    temperature: float = 0.0
    max_tokens: int = 2048

    @classmethod
    def from_dict(cls, d: dict | None) -> JudgeConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in dataset.extra.judge; valid keys: {', '.join(sorted(known))}")
        cfg = cls(**d)
        if cfg.max_retries < 0 or cfg.backoff_s < 0 or cfg.timeout_s <= 0:
            raise ConfigError(
                f"dataset.extra.judge: max_retries={cfg.max_retries!r} and backoff_s={cfg.backoff_s!r} must be >= 0, "
                f"timeout_s={cfg.timeout_s!r} > 0"
            )
        return cfg


@dataclass
class Judgment:
    rating: float | None
    text: str | None = None  # the judge's last reply
    error: str | None = None  # why rating is None
    attempts: int = 0


class _Retryable(Exception):
    """A failure worth another attempt (transport error, 5xx, 429, garbage reply)."""


class _Fatal(Exception):
    """A failure another attempt will not fix (401, 404, bad request)."""


def parse_rating(text: str) -> float | None:
    """The first ``[[r]]`` (else ``[r]``) rating in [1, 10], as FastChat parses it; None if there is none."""
    m = _RATING.search(text) or _RATING_BACKUP.search(text)
    if not m:
        return None
    r = float(m.group(1))
    return r if 1.0 <= r <= 10.0 else None


class Judge:
    def __init__(self, cfg: JudgeConfig):
        if not cfg.base_url:
            raise ConfigError("dataset.extra.judge.base_url is null: no judge is configured")
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"

    def _post(self, system: str, user: str) -> str:
        """One request; the reply's message content."""
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.cfg.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            msg = f"HTTP {e.code} from {self.url}: {e.read()[:200].decode(errors='replace')}"
            raise (_Retryable if e.code in _RETRY_HTTP or e.code >= 500 else _Fatal)(msg) from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, DNS
            raise _Retryable(f"{type(e).__name__} calling {self.url}: {e}") from None
        try:
            return json.loads(payload)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Retryable(f"malformed reply from {self.url} ({type(e).__name__}): {payload[:200]!r}") from None

    def rate(self, system: str, user: str) -> Judgment:
        """Ask for a rating, retrying with exponential backoff; never raises for endpoint trouble."""
        error, text = "", None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                text = self._post(system, user)
            except _Fatal as e:
                return Judgment(None, text, str(e), attempt + 1)
            except _Retryable as e:
                error = str(e)
                continue
            rating = parse_rating(text)
            if rating is not None:
                return Judgment(rating, text, None, attempt + 1)
            error = f"no [[rating]] in 1-10 in the judge's reply: {text[:120]!r}"
        return Judgment(None, text, f"after {self.cfg.max_retries + 1} attempts: {error}", self.cfg.max_retries + 1)
