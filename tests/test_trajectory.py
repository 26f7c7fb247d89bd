"""The tensor contract: concat_padded_tensors, check_trajectory, TrajectoryBuilder and the viewer.

These are pure tensor tests (no server). The viewer tests use the tiny model's real tokenizer.
"""

from __future__ import annotations

import html
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_lite.api.io_struct import ModelResponse
from areal_lite.kit.notebook.viewer import show_trajectory, trajectory_segments, trajectory_to_html, trajectory_to_text
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.utils.trajectory import TrajectoryBuilder, TrajectoryError, check_trajectory, iter_rows


def _resp(context, out, version=0, lp=-0.5):
    return ModelResponse(
        input_tokens=list(context),
        output_tokens=list(out),
        output_logprobs=[lp] * len(out),
        output_versions=[version] * len(out),
        stop_reason="stop",
    )


def _row(prompt=(5, 6, 7), outs=((8, 9),), obs=((10,),), reward=1.0, version=0):
    """A trajectory built through the builder: prompt, then output/observation alternating."""
    b = TrajectoryBuilder().add_prompt(prompt)
    for k, out in enumerate(outs):
        b.add_output(_resp(b.context(), out, version=version))
        if k < len(obs):
            b.add_observation(obs[k])
    return b


# ---------------------------------------------------------------------------------------------- builder


def test_builder_keeps_all_lists_aligned_and_dtypes():
    b = _row(outs=((8, 9), (11, 12, 13)), obs=((10,),))
    t = b.to_tensors(0.5)
    assert t["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1, 1, 1]]
    assert t["versions"].tolist() == [[-1, -1, -1, 0, 0, -1, 0, 0, 0]]
    assert t["logprobs"][0, 3].item() == pytest.approx(-0.5) and t["logprobs"][0, 5].item() == 0.0
    assert t["attention_mask"].dtype == torch.bool and t["attention_mask"].all()
    # AReaL 1.0.4's dtypes: a batch moves between the two unchanged
    assert t["input_ids"].dtype == torch.int32 and t["versions"].dtype == torch.int32
    assert t["loss_mask"].dtype == torch.int32
    assert t["logprobs"].dtype == torch.float32 and t["rewards"].dtype == torch.float32
    assert t["rewards"].shape == (1,) and t["rewards"].item() == 0.5
    assert [(s.kind, s.start, s.end, s.turn) for s in b.segments] == [
        ("prompt", 0, 3, 0),
        ("output", 3, 5, 0),
        ("observation", 5, 6, 0),
        ("output", 6, 9, 1),
    ]
    assert b.num_turns == 2
    assert check_trajectory(t)


def test_builder_rejects_response_from_another_context():
    # Appending an output twice makes the context sent to the server differ from the trajectory; the builder
    # refuses such a response instead of silently misaligning tensors.
    b = TrajectoryBuilder().add_prompt([1, 2, 3])
    doubled = [1, 2, 3, 4, 4]
    with pytest.raises(ValueError, match="differs from"):
        b.add_output(_resp(doubled, [7]))


def test_builder_rejects_misaligned_response_and_order_errors():
    b = TrajectoryBuilder()
    with pytest.raises(ValueError, match="add_prompt"):
        b.add_observation([1])
    b.add_prompt([1])
    with pytest.raises(ValueError, match="first"):
        b.add_prompt([2])
    bad = ModelResponse(input_tokens=[1], output_tokens=[5, 6], output_logprobs=[-1.0], output_versions=[0, 0])
    with pytest.raises(ValueError, match="logprobs"):
        b.add_output(bad)
    bad = ModelResponse(input_tokens=[1], output_tokens=[5, 6], output_logprobs=[-1.0, -1.0], output_versions=[0])
    with pytest.raises(ValueError, match="versions"):
        b.add_output(bad)
    assert len(b) == 1  # nothing half-appended


def test_builder_per_turn_values_and_extra_keys():
    b = _row(outs=((8, 9), (11,)), obs=((10, 10),))
    vals = b.per_turn_values([2.0, -1.0])
    assert vals == [0, 0, 0, 2.0, 2.0, 0, 0, -1.0]
    t = b.to_tensors(2.0, token_returns=vals)
    assert t["token_returns"].shape == (1, 8) and t["token_returns"].dtype == torch.float32
    assert check_trajectory(t)
    with pytest.raises(ValueError, match="one value per turn"):
        b.per_turn_values([1.0])
    with pytest.raises(ValueError, match="clashes"):
        b.to_tensors(0.0, loss_mask=[0] * 8)
    with pytest.raises(ValueError, match="finite"):
        b.to_tensors(float("nan"))


# ---------------------------------------------------------------------------------------------- concat


def test_concat_pads_right_like_areal():
    """AReaL's padding: every key with pad_value, attention_mask with False (so padded versions are 0, not -1)."""
    a = _row(outs=((8, 9),), obs=()).to_tensors(1.0)  # L = 5
    b = _row(outs=((8, 9), (11, 12)), obs=((10,),)).to_tensors(0.0)  # L = 8
    a["extra"] = torch.ones(1, 5)
    b["extra"] = torch.ones(1, 8)
    out = concat_padded_tensors([a, b])
    assert out["input_ids"].shape == (2, 8)
    assert out["input_ids"][0, 5:].tolist() == [0, 0, 0]
    assert out["attention_mask"][0].tolist() == [True] * 5 + [False] * 3
    assert out["loss_mask"][0, 5:].tolist() == [0, 0, 0]
    assert out["logprobs"][0, 5:].tolist() == [0.0, 0.0, 0.0]
    assert out["versions"][0, 5:].tolist() == [0, 0, 0]
    assert out["extra"][0, 5:].tolist() == [0.0] * 3
    assert concat_padded_tensors([a, b], pad_value=-7.0)["extra"][0, 5:].tolist() == [-7.0] * 3
    assert out["rewards"].tolist() == [1.0, 0.0]
    for k in a:
        assert out[k].dtype == a[k].dtype
    assert check_trajectory(out)
    # pad_token_id only changes input_ids' padding
    out2 = concat_padded_tensors([a, b], pad_token_id=3)
    assert out2["input_ids"][0, 5:].tolist() == [3, 3, 3]
    assert torch.equal(out2["attention_mask"], out["attention_mask"])


def test_concat_edge_cases():
    assert concat_padded_tensors([]) == {}
    a = _row().to_tensors(1.0)
    one = concat_padded_tensors([a])
    assert all(torch.equal(one[k], a[k]) for k in a)
    b = dict(a)
    b.pop("versions")
    with pytest.raises(ValueError, match="missing \\['versions'\\]"):
        concat_padded_tensors([a, b])
    with pytest.raises(TypeError, match="None"):
        concat_padded_tensors([a, None])
    c = dict(a)
    c["rewards"] = torch.tensor(1.0)  # 0-d: no batch dimension
    with pytest.raises(ValueError, match="batch dimension"):
        concat_padded_tensors([c])


def test_concat_keeps_groups_contiguous():
    rows = [_row(outs=((8,) * (i + 1),), obs=()).to_tensors(float(i)) for i in range(4)]
    group1 = concat_padded_tensors(rows[:2])
    group2 = concat_padded_tensors(rows[2:])
    batch = concat_padded_tensors([group1, group2])
    assert batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert batch["attention_mask"].sum(1).tolist() == [4, 5, 6, 7]
    assert check_trajectory(batch)


_ids = st.lists(st.integers(0, 4000), min_size=0, max_size=6)


@st.composite
def _trajectories(draw):
    b = TrajectoryBuilder().add_prompt(draw(st.lists(st.integers(0, 4000), min_size=1, max_size=6)))
    for k in range(draw(st.integers(1, 4))):
        if k:
            b.add_observation(draw(_ids))
        out = draw(st.lists(st.integers(0, 4000), min_size=1, max_size=6))
        b.add_output(_resp(b.context(), out, version=draw(st.integers(0, 3)), lp=-draw(st.floats(0, 20))))
    return b


@settings(max_examples=60, deadline=None)
@given(st.lists(_trajectories(), min_size=1, max_size=5), st.floats(-3, 3))
def test_concat_roundtrip_property(builders, reward):
    rows = [b.to_tensors(reward, token_returns=b.per_turn_values([reward] * b.num_turns)) for b in builders]
    batch = concat_padded_tensors(rows)
    assert check_trajectory(batch)
    assert batch["input_ids"].shape == (len(rows), max(len(b) for b in builders))
    for got, want in zip(iter_rows(batch), rows):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------- checker


def _good():
    return concat_padded_tensors([_row().to_tensors(1.0), _row(outs=((8, 9), (4,)), obs=((10,),)).to_tensors(0.0)])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.update(reward=b.pop("rewards")), "'reward': the key is 'rewards'"),
        (lambda b: b.update(input_ids=b["input_ids"].float()), "input_ids dtype"),
        (lambda b: b.update(attention_mask=b["attention_mask"].long()), "attention_mask dtype"),
        (lambda b: b.update(versions=b["versions"].short()), "versions dtype"),
        (lambda b: b.update(loss_mask=b["loss_mask"].float()), "loss_mask dtype"),
        (lambda b: b.update(rewards=torch.zeros(2, dtype=torch.long)), "rewards must be a float"),
        (lambda b: b.update(rewards=torch.zeros(3)), "expected \\[2\\]"),
        (lambda b: b.update(rewards=torch.tensor([float("nan"), 0.0])), "non-finite"),
        (lambda b: b["logprobs"].__setitem__((1, 0), -0.3), "row 1 position 0"),
        (
            lambda b: b["versions"].__setitem__((0, 1), 0),
            "versions must be -1 on prompt and observation tokens; row 0 position 1",
        ),
        (lambda b: b["versions"].__setitem__((1, 4), -1), "versions must be >= 0 on generated tokens; row 1 pos"),
        (lambda b: b["logprobs"].__setitem__((0, 3), 0.7), "finite and <= 0; row 0 position 3"),
        (lambda b: b["loss_mask"].__setitem__((0, 6), 1), "outside attention_mask at row 0 position 6"),
        (lambda b: b["loss_mask"].__setitem__((0, 0), 2), "must be 0/1"),
        (lambda b: b["attention_mask"].__setitem__((1, 0), False), "row 1 is not a prefix of ones"),
        (lambda b: b.update(logprobs=b["logprobs"][:, :-1]), "'logprobs' has shape"),
        (lambda b: b.update(token_returns=torch.ones(2, 7)), "token_returns must be 0 where loss_mask is 0"),
    ],
)
def test_check_trajectory_catches_each_violation(mutate, match):
    batch = _good()
    assert check_trajectory(batch)
    mutate(batch)
    with pytest.raises(TrajectoryError, match=match):
        check_trajectory(batch)


def test_check_trajectory_catches_a_double_append():
    # `input_ids += resp.output_tokens` twice, logprobs/loss_mask once -> lengths disagree.
    prompt, out = [1, 2, 3], [7, 8]
    input_ids = prompt + out + out
    logprobs = [0.0] * 3 + [-0.1, -0.2]
    loss_mask = [0] * 3 + [1, 1]
    batch = {
        "input_ids": torch.tensor([input_ids]),
        "attention_mask": torch.ones(1, len(input_ids), dtype=torch.bool),
        "loss_mask": torch.tensor([loss_mask]),
        "logprobs": torch.tensor([logprobs]),
        "versions": torch.tensor([[-1] * 3 + [0, 0]]),
        "rewards": torch.tensor([1.0]),
    }
    with pytest.raises(TrajectoryError, match="'loss_mask' has shape \\(1, 5\\), expected \\[1, 7\\]"):
        check_trajectory(batch)


def test_check_trajectory_all_prompt_rows():
    b = TrajectoryBuilder().add_prompt([1, 2]).to_tensors(0.0)
    with pytest.raises(TrajectoryError, match="no generated token"):
        check_trajectory(b)
    assert check_trajectory(b, allow_all_prompt=True)


def test_check_trajectory_is_an_assertion_error():
    assert issubclass(TrajectoryError, AssertionError)
    with pytest.raises(AssertionError):
        check_trajectory({"input_ids": torch.zeros(1, 2, dtype=torch.long)})


def test_check_trajectory_expected_texts(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok("Question: 2+2?", add_special_tokens=False)["input_ids"]
    out = tok(" It is 4.", add_special_tokens=False)["input_ids"]
    obs = tok("\n<information>x</information>", add_special_tokens=False)["input_ids"]
    b = TrajectoryBuilder().add_prompt(prompt)
    b.add_output(_resp(b.context(), out))
    b.add_observation(obs)
    t = b.to_tensors(1.0)
    assert check_trajectory(t, tok, [["Question: 2+2?", " It is 4.", "\n<information>x</information>"]])
    with pytest.raises(TrajectoryError, match="row 0: decoded text differs .* character 21"):
        check_trajectory(t, tok, [["Question: 2+2?", " It is 5.", "\n<information>x</information>"]])
    with pytest.raises(TrajectoryError, match="needs a tokenizer"):
        check_trajectory(t, None, [["x"]])


# ---------------------------------------------------------------------------------------------- viewer


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _viewer_batch(tok):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    b = TrajectoryBuilder().add_prompt(enc("Q: <b>bold</b> & 'quotes'?"))
    b.add_output(_resp(b.context(), enc(" <search>x & y</search>"), version=3, lp=-1.25))
    b.add_observation(enc("\n<information>doc</information>"), kind="tool")
    b.add_output(_resp(b.context(), enc(" <answer>z</answer>"), version=4, lp=-0.5))
    return b, concat_padded_tensors([b.to_tensors(0.75), _row().to_tensors(0.0)])


def test_segments_derived_from_loss_mask_match_builder(tiny_tokenizer):
    b, batch = _viewer_batch(tiny_tokenizer)
    derived = trajectory_segments(batch, 0)
    assert [
        (s.kind if s.kind == "output" or s.kind == "prompt" else "observation", s.start, s.end, s.turn) for s in derived
    ] == [(s.kind if s.kind in ("output", "prompt") else "observation", s.start, s.end, s.turn) for s in b.segments]


def test_html_view_colours_titles_and_escapes(tiny_tokenizer):
    _, batch = _viewer_batch(tiny_tokenizer)
    page = trajectory_to_html(batch, 0, tiny_tokenizer)
    assert "background:#c9f2c7" in page and "background:#e8eef7" in page and "background:#fde2c4" in page
    assert 'title="turn 0 | id' in page and "logprob -1.2500 | version 3" in page and "version 4" in page
    assert "turn 1" in page and "reward</b> 0.7500" in page
    # Escaped: no raw user markup survives, the angle brackets of tags and & are entities.
    # If any text were not escaped, stripping the markup would eat it and the round trip would fail.
    visible = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert "Q: <b>bold</b> & 'quotes'?" in visible and "<search>x & y</search>" in visible
    assert "<b>bold" not in page and "<search>" not in page and "&amp;" in page
    assert "&amp;" in page and "&#x27;" in page
    assert "<search>" not in page and "&lt;search&gt;" in page
    # max_tokens truncates
    short = trajectory_to_html(batch, 0, tiny_tokenizer, max_tokens=3)
    assert "more tokens" in short and short.count('<span style="background') < page.count('<span style="background')
    # the colour key lists the kinds shown, and only those: the first 3 tokens are prompt
    assert "tool / feedback (loss 0)" in page and "generated (loss 1)" in page
    assert "prompt</span>" in short and "tool / feedback" not in short and "generated (loss 1)" not in short


def test_text_view_and_show_fallback(tiny_tokenizer, capsys):
    _, batch = _viewer_batch(tiny_tokenizer)
    text = trajectory_to_text(batch, 0, tiny_tokenizer)
    assert text.startswith("=== trajectory 0 | reward 0.7500")
    assert "[prompt" in text and "[gen turn 0" in text and "[gen turn 1" in text and "[obs" in text
    assert "versions [3]" in text and "<search>x & y</search>" in text
    assert text.rstrip().endswith("[reward] 0.7500")
    show_trajectory(batch, 0, tiny_tokenizer)  # no IPython kernel here: plain text
    assert capsys.readouterr().out.strip() == text.strip()
    assert "more tokens" in trajectory_to_text(batch, 0, tiny_tokenizer, max_tokens=4)
    with pytest.raises(IndexError):
        show_trajectory(batch, 5, tiny_tokenizer)
    # Padding is not shown: row 1 is shorter than row 0
    assert "[reward] 0.0000" in trajectory_to_text(batch, 1, tiny_tokenizer)


def test_show_trajectory_html_in_ipython(tiny_tokenizer, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    _, batch = _viewer_batch(tiny_tokenizer)
    show_trajectory(batch, 0, tiny_tokenizer, fmt="html")
    assert len(shown) == 1
    bundle, raw = shown[0]
    assert raw and "areal-trajectory" in bundle["text/html"]
    # the plain-text form travels with it, for viewers that do not render HTML
    assert bundle["text/plain"] == trajectory_to_text(batch, 0, tiny_tokenizer)


def test_areal_built_batches_pass_and_match_ours():
    """Rows in AReaL's layout joined by AReaL's own concat_padded_tensors pass the check, and ours gives the same."""
    from areal.utils.data import concat_padded_tensors as areal_concat

    rows = [_row(outs=((8, 9),), obs=()).to_tensors(1.0), _row(outs=((8, 9), (11, 12)), obs=((10,),)).to_tensors(0.0)]
    theirs, ours = areal_concat(rows), concat_padded_tensors(rows)
    assert theirs.keys() == ours.keys()
    for key in ours:
        assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key
    assert check_trajectory(theirs)


def test_padding_is_ignored_but_real_tokens_are_checked():
    batch = concat_padded_tensors(
        [_row(outs=((8, 9),), obs=()).to_tensors(1.0), _row(outs=((8, 9), (11, 12)), obs=((10,),)).to_tensors(0.0)]
    )
    batch["versions"][0, 6] = 123  # padding: anything goes
    batch["logprobs"][0, 6] = 5.0
    assert check_trajectory(batch)
    batch["versions"][0, 1] = 0  # a prompt token: must stay -1
    with pytest.raises(TrajectoryError, match="versions must be -1 on prompt"):
        check_trajectory(batch)
