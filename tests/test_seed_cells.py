"""What the seed notebooks' cells do, under the kit: their calls work as written, their defects are caught.

- Every config's `tokenizer_path` loads with `AutoTokenizer.from_pretrained(config.tokenizer_path)`, as the seeds
  and AReaL's recipes load it (on the CPU profile the kit's model alias becomes the prepared local folder).
- Seed 000's search workflow appends the generated tokens to `input_ids` twice, so `input_ids` grows longer than
  `logprobs`/`loss_mask`. `rollout_batch` refuses such an episode with the keys and their lengths (the engine stays
  usable), and `check_trajectory` lists every problem of a batch at once, not the first.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.io_struct import ModelRequest
from areal_lite.utils.trajectory import TrajectoryError, check_trajectory

PROMPT = [11, 12, 13, 14]
CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_configs_tokenizer_path_loads_as_written(path, smollm_path):
    from transformers import AutoTokenizer

    from areal_lite.api.cli_args import GRPOConfig, load_expr_config
    from areal_lite.kit.trainer.train import TrainConfig

    @dataclasses.dataclass
    class AgentRLConfig(GRPOConfig):  # notebook 05's (and seed 000's) extra key
        max_turns: int = 8

    cls = TrainConfig if "demo" in path else AgentRLConfig if "search" in path else GRPOConfig
    config, _ = load_expr_config(["--config", path, "profile=cpu"], cls, verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)  # the seeds' line, unchanged
    assert tokenizer.decode(tokenizer.encode("12 + 30 = 42")) == "12 + 30 = 42"
    assert config.rollout.tokenizer_path == config.tokenizer_path


class DoubleAppend:
    """Seed 000's episode, the defect kept: the output tokens go into input_ids twice."""

    def __init__(self, twice: bool = True):
        self.twice = twice
        self.gconfig = GenerationHyperparameters(max_new_tokens=5, ignore_eos=True)

    async def arun_episode(self, engine, data):
        input_ids, logprobs, loss_mask = list(PROMPT), [0.0] * len(PROMPT), [0] * len(PROMPT)
        resp = await engine.agenerate(ModelRequest(input_ids=list(input_ids), gconfig=self.gconfig))
        input_ids += resp.output_tokens
        logprobs += resp.output_logprobs
        loss_mask += [1] * resp.output_len
        if self.twice:
            input_ids += resp.output_tokens  # the seed's line, written a second time
        n = len(input_ids)
        return {
            "input_ids": torch.tensor([input_ids], dtype=torch.int32),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "logprobs": torch.tensor([logprobs], dtype=torch.float32),
            "loss_mask": torch.tensor([loss_mask], dtype=torch.int32),
            "versions": torch.tensor([[-1] * len(PROMPT) + resp.output_versions], dtype=torch.int32),
            "rewards": torch.tensor([1.0]),
        }


def test_the_double_append_is_refused_at_rollout_and_the_engine_goes_on(engine):
    with pytest.raises(ValueError) as info:
        engine.rollout_batch([{"q": 0}], DoubleAppend())
    msg = str(info.value)
    assert "DoubleAppend.arun_episode" in msg and "input_ids is [1, 14]" in msg, msg
    for key in ("logprobs [1, 9]", "loss_mask [1, 9]", "versions [1, 9]"):
        assert key in msg, msg
    assert "rows [0]" in msg
    (row,) = engine.rollout_batch([{"q": 0}], DoubleAppend(twice=False))  # the same server, the defect fixed
    assert check_trajectory(row)


def test_check_trajectory_lists_every_problem():
    bad = {
        "input_ids": torch.zeros(2, 7, dtype=torch.int32),
        "attention_mask": torch.ones(2, 7, dtype=torch.bool),
        "logprobs": torch.zeros(2, 5),
        "loss_mask": torch.zeros(2, 5, dtype=torch.int32),
        "rewards": torch.zeros(3),
    }
    with pytest.raises(TrajectoryError) as info:
        check_trajectory(bad)
    msg = str(info.value)
    assert msg.startswith("4 problems:"), msg
    for fragment in ("missing keys ['versions']", "'logprobs' has shape (2, 5)", "'loss_mask' has shape (2, 5)",
                     "'rewards' has shape (3,)"):  # fmt: skip
        assert fragment in msg, msg
