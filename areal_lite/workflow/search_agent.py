"""`SearchAgentWorkflow`: think, `<search>` a retrieval server, read `<information>`, `<answer>` (notebook 05).

Design decision: a failing or slow search server becomes an `<information>search failed: ...</information>`
observation the model can read, not an exception: one flaky tool call must not kill a batch. It is counted on the
row (`search_errors`), so a dead server shows in the batch, not only in the log. Observation tokens are context
(loss_mask 0), never trained on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any, List, Optional

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest
from areal_lite.api.workflow_api import RolloutWorkflow
from areal_lite.reward.search_qa import f1_score
from areal_lite.utils.hf_utils import _as_id_list
from areal_lite.utils.search_tool import (
    SearchToolError,
    call_search_tool,
    format_search_results,
    parse_answer,
    parse_search_query,
)
from areal_lite.utils.trajectory import TrajectoryBuilder
from areal_lite.workflow.rlvr import TensorDict, _answer_of, _single

__all__ = ["PROMPT_TEMPLATE", "SearchAgentWorkflow"]

# The search agent's prompt, in the Search-R1 / ASearcher style: it names the tags the parsers look for and ends
# inside the assistant's first `<think>`, so the first generated token already continues a thought.
PROMPT_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant answers it. The "
    "Assistant analyzes the given question and information in the mind, retains important relevant information, "
    "calls a search engine to find necessary information, and provides the user with the answer. The Assistant "
    "conducts search by <search> query </search> and the top search results will be returned between <information> "
    "and </information>. The reasoning processes are enclosed within <think> </think>. Finally, the Assistant "
    "provides answer inside <answer> and </answer>, i.e. <answer> answer here </answer>. If there are multiple "
    "queries, ensure all answers are enclosed within <answer> </answer>, separated with comma.\n\n"
    "User:\n{question}\n\nAssistant:\n<think>"
)


logger = logging.getLogger(__name__)


class SearchAgentWorkflow(RolloutWorkflow):
    """A search agent: think, `<search>` the RAG server, read `<information>`, then `<answer>`.

    Each turn generates until `</search>`, `</answer>` or EOS. A search query is sent to the RAG server
    (`POST /retrieve`) and its passages are appended as an `<information>` block (loss 0). An answer ends the episode
    with reward = token F1 against the best of `data["answer"]` (a str or list of str); no answer scores 0.
    The episode also ends on EOS, after `max_turns` generations, or when the context would exceed `max_tokens`
    (generation budgets are capped so the trajectory never does). A generation cut by `max_new_tokens` is continued
    by the next one, and tags are parsed in all text generated since the last observation, so a
    `<search>` opened in one generation and closed in the next still counts. Besides the contract's tensors, a row
    holds `searches` [1] and `search_errors` [1] (the searches that failed, read by the model as an error).
    """

    STOP = ("</search>", "</answer>")

    def __init__(
        self,
        tokenizer,
        gconfig: GenerationHyperparameters,
        rag_addr: Optional[str] = None,
        max_turns: int = 16,
        max_tokens: int = 4096,
        topk: int = 3,
        reward_mode: str = "set",
        search_timeout: float = 30.0,
        prompt_template: str = PROMPT_TEMPLATE,
        verbose: bool = False,
    ):
        if reward_mode not in ("set", "multiset"):
            raise ValueError(f"reward_mode must be 'set' or 'multiset', got {reward_mode!r}")
        if max_turns < 1 or max_tokens < 1 or topk < 1:
            raise ValueError("max_turns, max_tokens and topk must be >= 1")
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template needs a {question} placeholder")
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.rag_addr = rag_addr
        self.max_turns = int(max_turns)
        self.max_tokens = int(max_tokens)
        self.topk = int(topk)
        self.reward_mode = reward_mode
        self.search_timeout = float(search_timeout)
        self.prompt_template = prompt_template
        self.verbose = verbose

    def _encode(self, text: str) -> List[int]:
        return _as_id_list(self.tokenizer(text, add_special_tokens=False))

    def _request_gconfig(self, budget: int) -> GenerationHyperparameters:
        g = _single(self.gconfig)
        stop = list(g.stop or [])
        stop += [s for s in self.STOP if s not in stop]
        return g.new(stop=stop, max_new_tokens=max(1, min(g.max_new_tokens, budget)))

    async def _search(self, query: str) -> tuple[str, bool]:
        """(the `<information>` block for `query`, whether the search failed); a failure becomes an error block the
        model can read."""
        if not query:
            return "\n\n<information>\nsearch failed: empty query\n</information>", True
        try:
            docs = (await call_search_tool([query], topk=self.topk, addr=self.rag_addr, timeout=self.search_timeout))[0]
            return format_search_results(docs), False
        except Exception as e:  # a failing tool never ends the episode: the model reads why, as from any failure
            why = str(e) if isinstance(e, SearchToolError) else f"{type(e).__name__}: {e}"
            logger.warning("search for %r failed: %s", query, why)
            return f"\n\n<information>\nsearch failed: {why}\n</information>", True

    def _is_eos(self, token: int) -> bool:
        ends = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        return token in ends

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        if "question" not in data:
            raise KeyError(f"SearchAgentWorkflow needs data['question']; it has keys {sorted(data)}")
        golds = _answer_of(data)
        builder = TrajectoryBuilder().add_prompt(self._encode(self.prompt_template.format(question=data["question"])))
        if len(builder) >= self.max_tokens:
            raise ValueError(f"the prompt alone has {len(builder)} tokens, max_tokens is {self.max_tokens}")
        rid = uuid.uuid4().hex
        reward, answer, searches, failed = 0.0, None, 0, 0
        # Text generated since the last observation: a tag cut by a length stop is completed by the next turn.
        pending = ""
        while builder.num_turns < self.max_turns and len(builder) < self.max_tokens:
            g = self._request_gconfig(self.max_tokens - len(builder))
            req = ModelRequest(
                rid=rid,
                input_ids=builder.context(),
                gconfig=g,
                metadata={"turn": builder.num_turns},
                tokenizer=self.tokenizer,
            )
            resp = await engine.agenerate(req)
            builder.add_output(resp)
            pending += self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            answer = parse_answer(pending)
            if answer is not None:
                reward = f1_score(answer, golds, mode=self.reward_mode)
                break
            query = parse_search_query(pending)
            if query is not None:
                text, error = await self._search(query)
                obs = self._encode(text)
                searches, failed = searches + 1, failed + error
                if len(builder) + len(obs) >= self.max_tokens:
                    break  # no room left to read the results and still generate
                builder.add_observation(obs, kind="tool")
                pending = ""
                continue
            if not resp.output_tokens or self._is_eos(resp.output_tokens[-1]):
                break  # EOS (or nothing generated) without an answer: the episode is over
        if self.verbose:
            print(
                f"[SearchAgent] turns={builder.num_turns} searches={searches} (failed {failed}) tokens={len(builder)} "
                f"answer={answer!r} reward={reward:.3f}"
            )
        return builder.to_tensors(reward, searches=searches, search_errors=failed)
