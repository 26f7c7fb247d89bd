"""`EnvironmentWorkflow`: a TRL/OpenEnv-shaped environment class trained as a workflow.

The environment's contract (tools from public methods, their schema from signatures and docstrings, the reward from
`get_reward` or a `reward` attribute, clear errors for a class that is not an environment), how tool calls run
(arguments typed by the signature, a raising tool answered with an error the model reads), and the episode's token
layout: the row's tokens are exactly the chat template of the whole conversation, trained only where the model wrote.
`ScriptedPolicy` (tests/test_multi_turn.py) replays chosen completions in place of the model; the last test runs
the real engine and server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest

from areal_lite.api.cli_args import GenerationHyperparameters
from tests.test_multi_turn import ScriptedPolicy

PROMPT = [{"role": "user", "content": "Question: "}]


class Warehouse:
    """Three kinds of fruit in stock; the task is to report how many there are of one kind."""

    def reset(self, seed, **kwargs):
        rng = random.Random(seed)
        self.stock = {fruit: rng.randint(10, 99) for fruit in ("apples", "pears", "figs")}
        self.asked, self.reported, self.done = "pears", None, False
        return f"How many {self.asked} are there?"

    def count(self, fruit: str) -> str:
        """Count one kind of fruit.

        Args:
            fruit: the kind of fruit, e.g. apples
        """
        if fruit not in self.stock:
            raise ValueError(f"there are no {fruit} here")
        return str(self.stock[fruit])

    def report(self, number: int) -> str:
        """Report the final answer.

        Args:
            number: how many there are
        """
        self.reported, self.done = number, True
        return "reported"

    def get_reward(self) -> float:
        return 1.0 if self.reported == self.stock[self.asked] else 0.0

    def _helper(self):  # private: never a tool
        return None

    @property
    def stock_size(self):  # a property is read by nobody while listing tools
        raise AssertionError("listing the tools evaluated a property")


def gconfig():
    return GenerationHyperparameters(greedy=True, max_new_tokens=16)


def workflow(tok, factory=Warehouse, **kw):
    from areal_lite.experimental.workflow.environment import EnvironmentWorkflow

    return EnvironmentWorkflow(factory, gconfig(), tok, **kw)


def run(wf, outputs, data=None, tok=None):
    """One episode on scripted completions (texts, each ended by EOS); the policy, to read its requests."""
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in outputs]
    policy = ScriptedPolicy(ids)
    row = asyncio.run(wf.arun_episode(policy, data or {"prompt": PROMPT, "seed": 3}))
    return row, policy


# ---- the environment's contract -------------------------------------------------------------------------------


def test_tools_are_the_public_methods_described_by_their_signatures():
    from areal_lite.experimental.workflow.environment import inspect_environment

    spec = inspect_environment(Warehouse())
    assert spec.name == "Warehouse" and spec.reward_source == "get_reward"
    by_name = {t["function"]["name"]: t["function"] for t in spec.tools}
    assert sorted(by_name) == ["count", "report"]  # not reset, get_reward, _helper or the property
    assert by_name["count"]["description"] == "Count one kind of fruit."
    assert by_name["count"]["parameters"] == {
        "type": "object",
        "properties": {"fruit": {"type": "string", "description": "the kind of fruit, e.g. apples"}},
        "required": ["fruit"],
    }
    assert by_name["report"]["parameters"]["properties"]["number"]["type"] == "integer"
    assert spec.parameter_types == {"count": {"fruit": "string"}, "report": {"number": "integer"}}


def test_a_tool_is_offered_under_the_name_the_model_calls():
    """An alias (or a decorator without functools.wraps) gives the function another `__name__`: the schema must
    name the attribute, the name a call reaches, or the tool is offered and can never be called."""
    from areal_lite.experimental.workflow.environment import call_tool, inspect_environment

    class Aliased(Warehouse):
        tally = Warehouse.count  # __name__ "count"

    spec = inspect_environment(Aliased())
    assert sorted(t["function"]["name"] for t in spec.tools) == ["count", "report", "tally"]
    env = Aliased()
    env.reset(seed=1)
    assert asyncio.run(call_tool(env, spec, "tally", {"fruit": "apples"})) == asyncio.run(
        call_tool(env, spec, "count", {"fruit": "apples"})
    )


def test_a_reward_attribute_is_a_reward_source_too():
    from areal_lite.experimental.workflow.environment import inspect_environment

    class Counter:
        def reset(self, **row):
            self.reward = 0.0

        def press(self) -> str:
            """Press the button."""
            self.reward += 1.0
            return "pressed"

    env = Counter()
    env.reset()
    assert inspect_environment(env).reward_source == "reward"


@pytest.mark.parametrize(
    "body, message",
    [
        ("def get_reward(self): return 0.0\n    def tool(self) -> str:\n        'A tool.'\n        return ''",
         "Broken is no environment: it has no reset"),
        ("def reset(self, **row): return None\n    def tool(self) -> str:\n        'A tool.'\n        return ''",
         "Broken has no reward: define get_reward"),
        ("def reset(self, **row): return None\n    def get_reward(self): return 0.0\n    def tool(self, x: int):\n"
         "        return ''", "Broken.tool cannot be offered as a tool"),
        ("def reset(self, **row): return None\n    def get_reward(self): return 0.0", "Broken has no tools"),
    ],
)  # fmt: skip
def test_a_class_that_is_no_environment_is_a_type_error_naming_it(tok, body, message):
    scope = {}
    exec(f"class Broken:\n    {body}\n", scope)
    with pytest.raises(TypeError, match=message):
        workflow(tok, scope["Broken"])


def test_tool_calls_are_typed_by_the_signature_and_never_raise():
    from areal_lite.experimental.workflow.environment import call_tool, inspect_environment

    env = Warehouse()
    env.reset(seed=3)
    spec = inspect_environment(env)

    def call(name, **args):
        return asyncio.run(call_tool(env, spec, name, args))

    assert call("count", fruit="figs") == (str(env.stock["figs"]), False)
    assert call("count", fruit="kiwis") == ("error: ValueError: there are no kiwis here", True)
    assert call("count", fruit="figs", colour="red")[0].startswith("error: TypeError:")
    assert call("report", number=" 42 ") == ("reported", False) and env.reported == 42  # "42" from text is an int
    assert call("report", number="forty")[0].startswith("error: ValueError: invalid literal for int()")
    assert call("open_door") == ("error: there is no tool 'open_door'", True)


def test_an_async_tool_is_awaited_and_a_non_text_result_is_json():
    from areal_lite.experimental.workflow.environment import call_tool, inspect_environment

    class Shelf:
        def reset(self, **row):
            return None

        async def items(self, shelf: int) -> dict:
            """List a shelf.

            Args:
                shelf: the shelf's number
            """
            await asyncio.sleep(0)
            return {"shelf": shelf, "items": ["jam"]}

        def get_reward(self):
            return 0.0

    env = Shelf()
    assert asyncio.run(call_tool(env, inspect_environment(env), "items", {"shelf": "2"})) == (
        json.dumps({"shelf": 2, "items": ["jam"]}),
        False,
    )


# ---- the episode ---------------------------------------------------------------------------------------------


def test_an_episode_is_the_chat_template_of_the_whole_conversation(tok):
    """count -> result -> report -> done: the row's tokens are the template's rendering of the conversation with
    its tool calls and results (as `ChatTemplate` renders it for the endpoint of notebook 09), loss 1 only on what
    the model wrote, the environment's reward on the row."""
    from areal_lite.utils.trajectory import check_trajectory

    log = []
    wf = workflow(tok, max_turns=4, log=log)
    env = Warehouse()
    env.reset(seed=3)
    n = env.stock["pears"]
    row, policy = run(wf, ["<count>pears</count>", f"<report>{n}</report>"], tok=tok)
    check_trajectory(row)
    assert len(policy.requests) == 2  # report set done: no third completion
    assert row["rewards"].tolist() == [1.0] and row["env_reward"].tolist() == [1.0]
    assert row["turns"].tolist() == [2.0] and row["tool_calls"].tolist() == [2.0] and row["tool_errors"].tolist() == [0]
    assert "token_returns" not in row  # gamma = 1 and one final reward: every turn trains with it
    messages = [
        {"role": "user", "content": "Question: How many pears are there?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("count", {"fruit": "pears"})]},
        {"role": "tool", "content": str(n)},
    ]
    assert policy.requests[1].input_ids == wf.template.render(messages, wf.spec.tools)
    ids, mask = row["input_ids"][0].tolist(), row["loss_mask"][0].tolist()
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == f"<count>pears</count><|im_end|><report>{n}</report><|im_end|>"
    assert [c["name"] for c in log[0]["calls"]] == ["count", "report"] and log[0]["reward"] == 1.0


def _call(name, args):
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_a_failing_tool_is_an_observation_and_the_episode_goes_on(tok):
    log = []
    wf = workflow(tok, log=log)
    row, policy = run(wf, ["<count>kiwis</count>", "<count>pears</count>", "<report>0</report>"], tok=tok)
    assert "<result>error: ValueError: there are no kiwis here</result>" in tok.decode(policy.requests[1].input_ids)
    assert row["tool_errors"].tolist() == [1.0] and row["tool_calls"].tolist() == [3.0]
    assert row["env_reward"].tolist() == [0.0]  # reported 0, not the stock
    assert [c["error"] for c in log[0]["calls"]] == [True, False, False]


def test_an_answer_without_a_call_ends_the_episode_and_max_turns_caps_it(tok):
    row, policy = run(workflow(tok), ["I think 40."], tok=tok)
    assert len(policy.requests) == 1 and row["turns"].tolist() == [1.0] and row["env_reward"].tolist() == [0.0]
    row, policy = run(workflow(tok, max_turns=2), ["<count>figs</count>"] * 3, tok=tok)
    assert len(policy.requests) == 2 and row["turns"].tolist() == [2.0]
    # a call cut by the token budget is no call: the parse error is counted, the episode ends
    log = []
    row, policy = run(workflow(tok, log=log), ["<count>pea"], tok=tok)
    assert len(policy.requests) == 1 and log[0]["parse_errors"] == 1


def _warnings(monkeypatch):
    """The messages the environment module logs from now on, on a logger of its own (global set-ups cannot mute it)."""
    from areal_lite.experimental.workflow import environment

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    own = logging.Logger("environment-test")
    own.addHandler(handler)
    monkeypatch.setattr(environment, "logger", own)
    return records


def test_a_failing_reward_scores_zero_and_a_failing_reset_rejects_one_episode(tok, monkeypatch):
    class BadReward(Warehouse):
        def get_reward(self):
            raise KeyError("stock")

    class NaNReward(Warehouse):
        def get_reward(self):
            return float("nan")

    class BadReset(Warehouse):
        def reset(self, seed, **kwargs):
            raise RuntimeError("no such warehouse")

    records = _warnings(monkeypatch)
    for cls in (BadReward, NaNReward):
        log = []
        row, _ = run(workflow(tok, cls, log=log), ["<report>1</report>"], tok=tok)
        assert row["env_reward"].tolist() == [0.0] and log[0]["reward_error"]
    row, policy = run(workflow(tok, BadReset), ["<count>figs</count>"], tok=tok)
    assert row is None and not policy.requests
    said = [r.getMessage() for r in records]
    assert "BadReward's reward failed, scored 0.0: KeyError: 'stock'" in said
    assert "NaNReward's reward failed, scored 0.0: ValueError: reward is nan" in said
    assert "BadReset.reset failed; episode rejected: RuntimeError: no such warehouse" in said


def test_a_result_json_cannot_hold_is_sent_as_its_text():
    """Tuple keys (TypeError) and a cycle (ValueError) are the tool's answer as `str()`, not a dead episode; a result
    that has no text either is a tool error."""
    from areal_lite.experimental.workflow.environment import call_tool, inspect_environment

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text")

    class Odd:
        def reset(self, **row):
            return None

        def pairs(self) -> dict:
            """Pairs."""
            return {(1, 2): "x"}

        def cycle(self) -> list:
            """A list that holds itself."""
            items = []
            items.append(items)
            return items

        def opaque(self) -> list:
            """Something without text."""
            return [Unprintable()]

        def get_reward(self):
            return 0.0

    env = Odd()
    spec = inspect_environment(env)
    said = {name: asyncio.run(call_tool(env, spec, name, {})) for name in ("pairs", "cycle", "opaque")}
    assert said == {
        "pairs": ("{(1, 2): 'x'}", False),
        "cycle": ("[[...]]", False),
        "opaque": ("error: RuntimeError: no text", True),
    }


def test_a_hanging_tool_times_out_as_a_tool_error_and_the_episode_goes_on(tok, monkeypatch):
    class Stuck(Warehouse):
        async def wait(self) -> str:
            """Wait for a delivery."""
            await asyncio.Event().wait()  # never set
            return "delivered"

    with pytest.raises(ValueError, match="tool_timeout"):
        workflow(tok, Stuck, tool_timeout=0)
    said = _warnings(monkeypatch)
    log = []
    row, policy = run(workflow(tok, Stuck, log=log, tool_timeout=0.05), ["<wait></wait>", "No call."], tok=tok)
    assert "<result>error: tool wait timed out after 0.05 s</result>" in tok.decode(policy.requests[1].input_ids)
    assert row["tool_calls"].tolist() == [1.0] and row["tool_errors"].tolist() == [1.0] and len(policy.requests) == 2
    assert log[0]["calls"][0]["error"] and [r.getMessage() for r in said] == ["Stuck.wait timed out after 0.05 s"]


def test_a_sync_tool_runs_on_the_event_loop(tok):
    """Not in a thread: a thread finishes at a time of its own, and the order in which a group's episodes then ask
    the server again decides which sampling stream each gets, so the same seed would stop giving the same rewards."""
    import threading

    threads = []

    class Where(Warehouse):
        def where(self) -> str:
            """Say where you are."""
            threads.append(threading.get_ident())
            return "here"

    log = []
    run(workflow(tok, Where, log=log), ["<where></where>", "Ok."], tok=tok)
    assert log[0]["calls"][0]["result"] == "here" and threads == [threading.get_ident()]  # asyncio.run's thread


def test_a_failing_done_flag_ends_the_episode_visibly(tok, monkeypatch):
    class BrokenFlag(Warehouse):
        @property
        def done(self):
            if self.reported is not None:
                raise RuntimeError("flag broken")
            return False

        @done.setter
        def done(self, value):
            pass

    said = _warnings(monkeypatch)
    log, n = [], Warehouse()
    n.reset(seed=3)
    outputs = ["<count>pears</count>", f"<report>{n.stock['pears']}</report>", "<count>figs</count>"]
    row, policy = run(workflow(tok, BrokenFlag, log=log), outputs, tok=tok)
    assert len(policy.requests) == 2 and row["tool_calls"].tolist() == [2.0] and row["env_reward"].tolist() == [1.0]
    assert log[0]["env_error"] == "done: RuntimeError: flag broken" and log[0]["reward_error"] is None
    assert [r.getMessage() for r in said] == ["BrokenFlag.done failed; episode ended: RuntimeError: flag broken"]


def test_per_turn_rewards_and_the_turn_discount_reach_the_tokens(tok):
    """With `reward_per_turn`, turn k earns the change of the reward; returns G_k = r_k + gamma G_{k+1}."""

    class Steps(Warehouse):
        def count(self, fruit: str) -> str:
            """Count one kind of fruit.

            Args:
                fruit: the kind of fruit
            """
            self.counted = True
            return super().count(fruit)

        async def get_reward(self) -> float:  # TRL allows an async reward (a judge, say)
            return 0.25 * bool(getattr(self, "counted", False)) + 0.75 * (self.reported == self.stock[self.asked])

    env = Steps()
    env.reset(seed=3)
    wf = workflow(tok, Steps, reward_per_turn=True, turn_discount=0.5)
    row, _ = run(wf, ["<count>pears</count>", f"<report>{env.stock['pears']}</report>"], tok=tok)
    # turn rewards [0.25, 0.75] -> returns [0.25 + 0.5 * 0.75, 0.75]
    assert row["rewards"].tolist() == [0.625] and row["env_reward"].tolist() == [1.0]
    returns = row["token_returns"][0][row["loss_mask"][0].bool()].unique().tolist()
    assert sorted(returns) == [0.625, 0.75]


def test_the_prompt_follows_trl_the_observation_joins_the_last_user_message(tok):
    wf = workflow(tok)
    assert wf.messages({"prompt": PROMPT}, "How many?")[-1]["content"] == "Question: How many?"
    assert wf.messages({"prompt": "Hi."}, None) == [{"role": "user", "content": "Hi."}]
    assert wf.messages({}, "How many?") == [{"role": "user", "content": "How many?"}]
    assert PROMPT[0]["content"] == "Question: "  # the row is left as it was


def test_grouped_episodes_on_the_real_engine(engine, tok):
    """The real server and executor: G episodes per row, one environment each, rows in the tensor contract."""
    from areal_lite.utils.trajectory import check_trajectory

    log = []
    wf = workflow(tok, max_turns=2, log=log)
    rows = [{"prompt": PROMPT, "seed": s} for s in (1, 2)]
    batch = engine.rollout_batch(rows, workflow=wf, group_size=3)
    assert len(batch) == 2 and len(log) == 6  # one [G, L] group per row
    for group in batch:
        check_trajectory(group)
        # the tiny model is random: it reports nothing, so every reward is 0
        assert group["input_ids"].shape[0] == 3 and group["env_reward"].tolist() == [0.0] * 3
    assert sorted(e["data"]["seed"] for e in log) == [1, 1, 1, 2, 2, 2]
