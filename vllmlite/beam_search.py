"""Beam search as vLLM runs it (vllm/beam_search.py): the beams of one prompt, their score, and how one
step's candidates become the next beams. Knows nothing of engines or HTTP: a driver (`LLM.beam_search`,
the completions API's `use_beam_search`) sends each live beam's tokens as a one-token request
(`step_sampling_params`) and hands the logprobs back to `BeamSearch.advance`.

Semantics, vLLM's: each live beam offers its 2 * beam_width most likely next tokens; a candidate ending
in EOS (unless ignore_eos) is finished at once, the best beam_width of the others live on; after
max_tokens steps (or when none live) the finished and live beams are ranked together by score and the
best beam_width returned, best first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllmlite.outputs import PositionLogprobs
from vllmlite.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam, vLLM's shape. `tokens` is the prompt followed by the beam's output; `logprobs` holds one
    position per step the beam took (its EOS step included, even when `tokens` leaves EOS out), and
    `cum_logprob` is the sum of the chosen tokens' logprobs over those steps."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None               # set by the driver on the beams it returns
    finish_reason: str | None = None      # "stop" (EOS) or "length"; None while the beam lives
    stop_reason: int | None = None        # the EOS token id when it stopped the beam


@dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the best (at most beam_width) sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (and Hugging Face's) score: cumulative logprob / length ** length_penalty, where the length
    counts the prompt and every output token but a final EOS.

    >>> get_beam_search_score([7, 8, 9, 2], -3.0, eos_token_id=2)   # 3 tokens count
    -1.0
    >>> get_beam_search_score([7, 8, 9, 2], -3.0, eos_token_id=2, length_penalty=0.0)
    -3.0
    """
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (length ** length_penalty)


def step_sampling_params(params: BeamSearchParams, num_logprobs: int = 0) -> SamplingParams:
    """The one-token request a live beam sends each step: its prompt is the beam's tokens, and its
    logprobs hold the 2 * beam_width candidates (or `num_logprobs`, if more are to be shown). The token
    it samples is not used, so it samples greedily; EOS must not end it before its logprobs are read."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                          logprobs=max(2 * params.beam_width, num_logprobs))


class BeamSearch:
    """One prompt's search, stepped by a driver:

        search = BeamSearch(prompt_token_ids, params, eos_token_id, max_model_len)
        while not search.is_done:
            positions = [run_one_token(beam.tokens) for beam in search.live]  # logprobs[0] of each
            search.advance(positions)
        best = search.best()

    A beam that reaches `max_model_len` tokens cannot be sent again: it finishes with "length".
    """

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.live: list[BeamSearchSequence] = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def is_done(self) -> bool:
        return not self.live or self.num_steps >= self.params.max_tokens

    def advance(self, positions: Sequence[PositionLogprobs]) -> None:
        """Take one step: `positions[i]` is the next-token logprobs of `live[i]` (a step request's
        `outputs[0].logprobs[0]`, best first). Candidates are ranked by score (every live beam has the
        same length, so this is their cumulative logprob's order); ties keep beam, then candidate, order."""
        if len(positions) != len(self.live):
            raise ValueError(f"{len(positions)} positions for {len(self.live)} live beams")
        num_candidates = 2 * self.params.beam_width
        candidates: list[BeamSearchSequence] = []
        for beam, position in zip(self.live, positions):
            for token_id, logprob in list(position.items())[:num_candidates]:
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [position],
                                           beam.cum_logprob + logprob.logprob)
                if token_id == self.eos_token_id and not self.params.ignore_eos:
                    self.finished.append(self._stopped(child))
                else:
                    candidates.append(child)
        candidates.sort(key=self.score, reverse=True)
        self.live = candidates[:self.params.beam_width]
        self.num_steps += 1
        for beam in [b for b in self.live if len(b.tokens) >= self.max_model_len]:
            self.live.remove(beam)
            self.finished.append(beam)
            beam.finish_reason = "length"

    def best(self) -> list[BeamSearchSequence]:
        """The finished and live beams (live ones finish with "length"), best score first; at most
        beam_width. Ties keep finished beams before live ones."""
        ended = [dataclasses.replace(beam, finish_reason="length") for beam in self.live]
        ranked = sorted(self.finished + ended, key=self.score, reverse=True)
        return ranked[:self.params.beam_width]

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def _stopped(self, beam: BeamSearchSequence) -> BeamSearchSequence:
        """A candidate ended by EOS: it keeps the EOS token only with include_stop_str_in_output (its
        score is the same either way: a final EOS does not count toward the length)."""
        if not self.params.include_stop_str_in_output:
            beam.tokens.pop()
        beam.finish_reason = "stop"
        beam.stop_reason = self.eos_token_id
        return beam
