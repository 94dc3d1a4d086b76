"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import RequestError

# below this temperature sampling is greedy: dividing logits by a tinier one overflows to inf and the
# softmax to NaN (found by fuzzing the server with temperature 3.7e-160)
GREEDY_BELOW = 1e-5
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Reject values of the wrong type or range here: past this point they would fail inside the
        engine's step, which fails every request of the batch."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for name in ("max_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise RequestError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise RequestError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def _scaled(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """``row / temperature`` as logits that a softmax turns into finite probabilities.

    A 16-bit output head overflows to +inf (fp16 saturates at 65504), and a finite logit divided by a
    small temperature overflows float32 too; the softmax of a row holding +inf is NaN everywhere and
    ``torch.multinomial`` then raises, failing every request of the step. So: a NaN logit is never
    drawn; +inf logits are the limit where they take all the mass, shared evenly (as greedy decoding
    picks one of them); the row is shifted to a maximum of 0 before the division, which cannot
    overflow then (what underflows to -inf had a probability below float32's range anyway); and a row
    with nothing drawable (every logit NaN or -inf) keeps only its argmax, as greedy decoding would.
    Each case is chosen on the device (``torch.where``): deciding on the host cost two read-backs of
    the GPU per sampled row and step."""
    clean = torch.where(torch.isnan(row), float("-inf"), row)
    top = clean.max()
    shifted = (clean - top) / temperature  # NaN where top is +-inf: those rows take another branch
    tie_at_inf = torch.where(clean == top, 0.0, float("-inf"))
    argmax_only = torch.where(torch.arange(row.shape[-1], device=row.device) == row.argmax(), 0.0, float("-inf"))
    return torch.where(top == float("inf"), tie_at_inf, torch.where(top == float("-inf"), argmax_only, shifted))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None, default: torch.Generator | None = None,
) -> list[int]:
    """One token per row of ``logits`` [num_seqs, vocab] (float32). ``greedy``: the rows' argmax when
    the caller has it already (a decode graph computes it on the device, beside the logits).
    ``default``: the generator of rows whose request gave no seed (the engine's, seeded from
    ``EngineConfig.seed``), so that their draws do not hang on torch's process-wide generator, which
    anything in the process may advance or reseed."""
    out = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _scaled(logits[i], p.temperature)
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            drop[0] = False  # also when top_p is below float32's range (5e-324 compares as 0)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        gen = generators[i] if generators[i] is not None else default
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
