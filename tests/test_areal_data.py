"""`areal_lite.utils.data` and `NormConfig` against AReaL 1.0.4's `areal.utils.data` and `areal.api.cli_args`.

The same inputs go to both sides: signatures and defaults, NormConfig's field order and checks, Normalization's
numbers for every level/option (masked, multi-dimensional, float32 sums), the padded-batch helpers, the
micro-batch split (same rows per micro-batch, same indices) and cycle_dataloader's set_epoch calls. Deliberate
kit differences are tested as such at the end.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch

from areal_lite.api.cli_args import MicroBatchSpec, NormConfig
from areal_lite.utils import data as kit
from areal_lite.utils.functional import normalize

NAMES = [
    "Normalization",
    "pack_tensor_dict",
    "pad_sequences_to_tensors",
    "split_padded_tensor_dict_into_mb_list",
    "unpack_sequence",
    "reorder_list",
    "pad_and_stack_tensors_along_first_dim",
    "tensor_container_to",
    "concat_padded_tensors",
    "cycle_dataloader",
    "allocate_balanced_mbs",
    "allocate_balanced_mbs_synced",
    "get_batch_size",
]


@pytest.fixture(scope="module")
def areal():
    from areal.api import cli_args
    from areal.utils import data

    return data, cli_args


def _params(fn):
    target = fn.__init__ if inspect.isclass(fn) else fn
    return [(p.name, p.default, p.kind) for p in inspect.signature(target).parameters.values()]


@pytest.mark.parametrize("name", NAMES)
def test_signatures_match(areal, name):
    """AReaL's parameters come first, in its order, with its defaults; the kit's extras are keyword-only."""
    ours, theirs = _params(getattr(kit, name)), _params(getattr(areal[0], name))
    assert ours[: len(theirs)] == theirs
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, _, kind in ours[len(theirs) :])
    if name == "Normalization":
        assert _params(kit.Normalization.__call__) == _params(areal[0].Normalization.__call__)


# ------------------------------------------------------------------------------------------------ NormConfig


def test_normconfig_fields_order_and_defaults(areal):
    ours, theirs = dataclasses.fields(NormConfig), dataclasses.fields(areal[1].NormConfig)
    assert [(f.name, f.default) for f in ours] == [(f.name, f.default) for f in theirs]
    args = ("group", True, "group", False, 1e-3, 4)  # positional arguments land in the same fields
    assert dataclasses.asdict(NormConfig(*args)) == dataclasses.asdict(areal[1].NormConfig(*args))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mean_level="invalid"),
        dict(std_level="invalid"),
        dict(mean_level="group", group_size=0),
        dict(std_level="group", mean_level=None, group_size=-1),
    ],
)
def test_normconfig_rejects_what_areal_rejects(areal, kwargs):
    with pytest.raises(ValueError) as theirs:
        areal[1].NormConfig(**kwargs)
    with pytest.raises(ValueError) as ours:
        NormConfig(**kwargs)
    assert str(ours.value).split(",")[0] == str(theirs.value).split(",")[0]  # e.g. "mean_level must be 'batch'"


def test_normconfig_accepts_none_and_the_kits_none_string(areal):
    assert NormConfig(mean_level=None, std_level=None, group_size=0).mean_level is None
    areal[1].NormConfig(mean_level=None, std_level=None, group_size=0)
    assert NormConfig(mean_level="none", std_level="none").std_level == "none"  # the kit's YAML spelling


# ------------------------------------------------------------------------------------------------ Normalization

LEVELS = ["batch", "group", None]
OPTIONS = list(itertools.product(LEVELS, LEVELS, [False, True], [True, False]))


def _norm_case(seed: int, shape: tuple):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, shape, generator=g).float() / 2 + torch.randn(shape, generator=g) * (seed % 2)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    return x, mask


@pytest.mark.parametrize("mean,std,loo,unbiased", OPTIONS)
def test_normalization_numbers(areal, mean, std, loo, unbiased):
    cfg = dict(mean_level=mean, std_level=std, mean_leave1out=loo, std_unbiased=unbiased, group_size=4)
    ours, theirs = kit.Normalization(NormConfig(**cfg)), areal[0].Normalization(areal[1].NormConfig(**cfg))
    for seed, shape in [(0, (8,)), (1, (8,)), (2, (8, 5)), (3, (12, 3))]:
        x, mask = _norm_case(seed, shape)
        for m in (None, mask):
            got, want = ours(x, m), theirs(x, m)
            assert got.dtype == want.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(x, mask, False), theirs(x, mask, False), atol=1e-4, rtol=1e-4)
        expected = torch.where(mask.bool(), want.double(), 0.0).to(x.dtype)
        torch.testing.assert_close(normalize(x, mask.bool(), NormConfig(**cfg)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_size", [1, 2])
def test_normalization_small_pools_and_empty_mask(areal, group_size):
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0], [5.0, 6.0], [8.0, 7.0]])
    masks = [torch.zeros_like(x), torch.tensor([[1.0, 0], [0, 0], [0, 0], [0, 1]]), torch.ones_like(x)]
    for mean, std, loo, unbiased in OPTIONS:
        cfg = dict(mean_level=mean, std_level=std, mean_leave1out=loo, std_unbiased=unbiased, group_size=group_size)
        ours, theirs = kit.Normalization(NormConfig(**cfg)), areal[0].Normalization(areal[1].NormConfig(**cfg))
        for m in masks:
            torch.testing.assert_close(ours(x, m), theirs(x, m), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ padded batches


def _assert_same(ours, theirs):
    assert type(ours) is type(theirs) or (isinstance(ours, list) and isinstance(theirs, (list, tuple)))
    if isinstance(ours, dict):
        assert list(ours) == list(theirs)
        for k in ours:
            _assert_same(ours[k], theirs[k])
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _assert_same(a, b)
    elif torch.is_tensor(ours):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    else:
        assert ours == theirs


def _rows():
    return [
        {"input_ids": [5, 6, 7], "logprobs": torch.tensor([-1.0, -2.0, -0.5]), "multi_modal_input": [{"a": [1, 2]}]},
        {"input_ids": [8], "logprobs": torch.tensor([-0.1]), "multi_modal_input": [{"a": [3]}]},
        {"input_ids": [1, 2, 3, 4, 5], "logprobs": torch.zeros(5), "multi_modal_input": []},
    ]


@pytest.mark.parametrize("pad_value", [0.0, -1.0])
def test_pad_sequences_to_tensors(areal, pad_value):
    theirs = areal[0].pad_sequences_to_tensors(_rows(), pad_value)
    _assert_same(kit.pad_sequences_to_tensors(_rows(), pad_value), theirs)
    assert kit.pad_sequences_to_tensors([]) == areal[0].pad_sequences_to_tensors([]) == {}


def _batches():
    g = torch.Generator().manual_seed(0)
    a = {
        "input_ids": torch.randint(0, 9, (2, 3), generator=g),
        "attention_mask": torch.ones(2, 3, dtype=torch.bool),
        "feat": torch.randn(2, 3, 2, generator=g),
        "rewards": torch.tensor([1.0, 0.0]),
        "names": ["a", "b"],
        "version": 3,
        "multi_modal_input": [{"x": 1}, {"x": 2}],
    }
    b = {
        "input_ids": torch.randint(0, 9, (1, 5), generator=g),
        "attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "feat": torch.randn(1, 5, 4, generator=g),
        "rewards": torch.tensor([0.5]),
        "names": ["c"],
        "version": 4,
        "multi_modal_input": [{"x": 3}],
    }
    return [a, b]


@pytest.mark.parametrize("pad_value", [0.0, -7.0])
def test_concat_padded_tensors(areal, pad_value):
    ours = kit.concat_padded_tensors(_batches(), pad_value)
    theirs = areal[0].concat_padded_tensors(_batches(), pad_value)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        _assert_same(ours[k], theirs[k])
    one = _batches()[:1]
    _assert_same(kit.concat_padded_tensors(one), areal[0].concat_padded_tensors(one))
    assert kit.concat_padded_tensors([]) == areal[0].concat_padded_tensors([]) == {}
    bad = _batches()
    bad[1].pop("names")
    for fn in (kit.concat_padded_tensors, areal[0].concat_padded_tensors):
        with pytest.raises(ValueError):
            fn(bad)


def _padded(seed: int, bs: int = 8):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (bs,), generator=g).tolist()
    rows = [
        {
            "input_ids": torch.randint(0, 50, (n,), generator=g),
            "logprobs": torch.randn(n, generator=g),
            "position_ids": torch.arange(n),
        }
        for n in lens
    ]
    from areal_lite.utils.data import pad_sequences_to_tensors

    batch = pad_sequences_to_tensors(rows)
    batch["rewards"] = torch.randn(bs, generator=g)
    return batch


def test_pack_unpack_reorder_pad_and_stack(areal):
    batch = _padded(0)
    ours, theirs = kit.pack_tensor_dict(batch), areal[0].pack_tensor_dict(batch)
    _assert_same(ours, theirs)
    x, cu = ours["logprobs"], ours["cu_seqlens"]
    lens = (cu[1:] - cu[:-1]).tolist()
    _assert_same(kit.unpack_sequence(x, cu_seqlens=cu), areal[0].unpack_sequence(x, cu_seqlens=cu))
    _assert_same(kit.unpack_sequence(x, lens=lens), areal[0].unpack_sequence(x, lens=lens))
    parts = list(kit.unpack_sequence(x, lens=lens))
    order = [3, 1, 0, 2, 7, 6, 5, 4]
    assert kit.reorder_list(parts, order) == areal[0].reorder_list(parts, order)
    stacked = areal[0].pad_and_stack_tensors_along_first_dim(parts)
    _assert_same(kit.pad_and_stack_tensors_along_first_dim(parts), stacked)
    for fn, args in [("unpack_sequence", (x,)), ("pad_and_stack_tensors_along_first_dim", ([x, x[None]],))]:
        for mod in (kit, areal[0]):
            with pytest.raises(ValueError):
                getattr(mod, fn)(*args)
    for mod in (kit, areal[0]):
        with pytest.raises(AssertionError):
            mod.reorder_list(parts, [0, 0, 1, 2, 3, 4, 5, 6])


def test_tensor_container_to(areal):
    d = {"a": torch.ones(2), "b": [torch.zeros(1), {"c": torch.ones(1)}], "n": 3}
    _assert_same(kit.tensor_container_to(d, torch.float64), areal[0].tensor_container_to(d, torch.float64))
    pair = (torch.ones(1), torch.ones(2))
    _assert_same(kit.tensor_container_to(pair, torch.int32), areal[0].tensor_container_to(pair, torch.int32))


# ------------------------------------------------------------------------------------------------ micro-batches

SPECS = [
    dict(n_mbs=1),
    dict(n_mbs=2, max_tokens_per_mb=30),
    dict(n_mbs=1, max_tokens_per_mb=16, n_mbs_divisor=2),
    dict(n_mbs=3, max_tokens_per_mb=40, granularity=2),
    dict(n_mbs=None, max_tokens_per_mb=24, n_mbs_divisor=3),
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_into_micro_batches(areal, spec, seed):
    batch = _padded(seed)
    ours = kit.split_padded_tensor_dict_into_mb_list(batch, MicroBatchSpec(**spec))
    theirs = areal[0].split_padded_tensor_dict_into_mb_list(batch, areal[1].MicroBatchSpec(**spec))
    assert type(ours).__name__ == type(theirs).__name__ == "MicroBatchList"
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    assert list(ours.forward_indices) == [int(i) for i in theirs.forward_indices]
    assert ours.backward_indices == theirs.backward_indices and ours.group_lens == theirs.group_lens
    assert len(ours) == len(theirs)
    _assert_same(ours.mbs, theirs.mbs)
    assert dataclasses.asdict(ours.mb_spec) == dataclasses.asdict(theirs.mb_spec)
    lens = batch["attention_mask"].sum(1).tolist()
    assert kit.allocate_balanced_mbs(ours.mb_spec, lens) == areal[0].allocate_balanced_mbs(theirs.mb_spec, lens)


def test_split_errors_and_micro_batch_list(areal):
    batch = _padded(0, bs=6)
    cases = [
        ({"input_ids": batch["input_ids"]}, dict(n_mbs=1), ValueError),  # not padded
        (batch, dict(granularity=4), RuntimeError),  # 6 rows are not whole groups of 4
        (batch, dict(max_tokens_per_mb=3), RuntimeError),  # a row longer than the budget
        (batch, dict(n_mbs=7, max_tokens_per_mb=100), RuntimeError),  # more micro-batches than rows
    ]
    for data, spec, exc in cases:
        for mod, spec_cls in ((kit, MicroBatchSpec), (areal[0], areal[1].MicroBatchSpec)):
            with pytest.raises(exc):
                mod.split_padded_tensor_dict_into_mb_list(data, spec_cls(**spec))
    ours = kit.split_padded_tensor_dict_into_mb_list(batch, MicroBatchSpec(n_mbs=2))
    theirs = areal[0].split_padded_tensor_dict_into_mb_list(batch, areal[1].MicroBatchSpec(n_mbs=2))
    for mbl in (ours, theirs):
        with pytest.raises(ValueError):
            list(mbl)
        mbl.padded_mbs = [kit.pack_tensor_dict(mb) for mb in mbl.mbs]
        mbl.padding_lengths = [0] * len(mbl.mbs)
    assert ours.max_seqlen == theirs.max_seqlen
    assert [tuple(type(v).__name__ for v in item) for item in ours] == [
        tuple(type(v).__name__ for v in item) for item in theirs
    ]
    assert ours.to(torch.float64).mbs[0]["logprobs"].dtype == theirs.to(torch.float64).mbs[0]["logprobs"].dtype


# ------------------------------------------------------------------------------------------------ dataloaders


class _Sampler:
    def __init__(self):
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _Loader:
    def __init__(self):
        self.sampler = _Sampler()

    def __iter__(self):
        return iter([1, 2])


@pytest.mark.parametrize("num_cycles", [1, 3])
def test_cycle_dataloader_sets_the_epoch(areal, num_cycles):
    ours, theirs = _Loader(), _Loader()
    assert list(kit.cycle_dataloader(ours, num_cycles)) == list(areal[0].cycle_dataloader(theirs, num_cycles))
    assert ours.sampler.epochs == theirs.sampler.epochs == list(range(num_cycles))


def test_get_batch_size(areal):
    for d in [{}, _padded(0), {"cu_seqlens": torch.tensor([0, 2, 5])}, {"multi_modal_input": [{}, {}]}]:
        assert kit.get_batch_size(d) == areal[0].get_batch_size(d)


# ------------------------------------------------------------------------------------------------ kit differences


def test_kit_raises_where_areal_fails_silently():
    """Group statistics over a batch that is not whole groups (AReaL divides the leftover rows by eps), a rejected
    (None) episode, a dataloader that yields nothing epoch after epoch (AReaL spins forever)."""
    with pytest.raises(ValueError, match="multiple of group_size"):
        kit.Normalization(NormConfig(mean_level="group", std_level="group", group_size=4))(torch.ones(6))
    with pytest.raises(TypeError, match="None"):
        kit.concat_padded_tensors([_batches()[0], None])
    with pytest.raises(ValueError, match="no batches"):
        next(kit.cycle_dataloader([]))
    assert kit.concat_padded_tensors(_batches(), pad_token_id=2)["input_ids"][0, 3:].tolist() == [2, 2]
