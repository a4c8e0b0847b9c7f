"""What a request becomes before it runs (LilyServer.prepare_chat / prepare_completion, in a thread pool): the
prompt's token ids, the sampling, and what answering it needs. The routes, the streaming code and the worker's
job read these fields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sampling import SamplingParams
from .grammar import GrammarConstraint
from .protocol import ChatCompletionRequest

# (token id, its logprob or None for the first token, {id: logprob} of the best or None): lily.server.scoring
PromptLogprob = tuple[int, "float | None", "dict[int, float] | None"]


@dataclass(kw_only=True)
class Prepared:
    """What every prepared request has: the worker's Job is made of these."""

    ids: list[int]                             # the prompt's tokens
    sampling: SamplingParams
    constraint: GrammarConstraint | None = None  # a token mask applied before each draw (a grammar)


@dataclass(kw_only=True)
class PreparedChat(Prepared):
    """A chat completion (also a /v1/responses request, which becomes one)."""

    request: ChatCompletionRequest
    in_reasoning: bool                 # the prompt opens <think>: the reply starts in its reasoning
    tools: list[dict[str, Any]] | None  # the request's tools, validated
    parse_tools: bool                  # tool calls in the reply are parsed out (tools given, tool_choice not none)


@dataclass(kw_only=True)
class PreparedCompletion(Prepared):
    """A text completion (/v1/completions)."""

    prompt_text: str       # the prompt as text (token ids decoded), for echo and for remembering
    raw: bool              # the prompt came as text: prompt + completion -> exact tokens are remembered
    score_prompt: bool     # echo with logprobs: the prompt's own logprobs are wanted
    n_top: int             # logprobs: alternatives per token
    max_tokens: int        # 0: nothing is generated (prompt scoring, or usage only)
    prompt_logprobs: list[PromptLogprob] | None = None  # the prompt's, filled in by the route when score_prompt
