"""User-level privacy: each user's summed gradient clipped, users sampled and priced (privacy_unit=).

The oracle is a loop over users: autograd's gradient of the sum of one user's rows' losses,
its norm in float64, clipped by hand, summed over users. The clipper's two routes to a user's
norm (regrouped ghost norms, materialized per-example gradients added per user) are both
compared with it, on a small network (an Embedding with padding, Linear layers on sequences and
on vectors, LayerNorm, a convolution) and on a tiny GPT-2 with tied embeddings and padded rows.
The sensitivity check adds one user of three aligned examples: the clipped sum moves by at most
C per user, where example-level clipping of the same data (the negative control) moves it by 3C.
"""

from __future__ import annotations

import contextlib
import random
import unicodedata
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import opake.dpftrl.accounting as dpftrl_acc
import opake.random
import opake.torch.private as private_module
from opake.dpftrl.noise import identity_strategy
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import PrivacyUnits
from opake.errors import OpakeError
from opake.torch import make_private
from opake.torch.losses import token_mean_per_example
from opake.torch.per_example import ClipperUsageError, PerExampleClipper
from opake.torch.per_example import units as unit_norms
from opake.torch.privacy_units import (LookAlikeIdsWarning, NaNIdError, UncomparableIdError,
                                       privacy_units)
from opake.transformers.batches import unit_micro_batches

C = 0.3
UNITS = [3, 1, 3, 2, 1, 3, 5, 7, 7]  # users of 1 to 3 rows, interleaved within the pass


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SmallNet(nn.Module):
    """Embedding (large table, padding_idx: ghost) -> Linear on (B, T, .) -> LayerNorm -> Conv1d
    (not regroupable) -> mean over positions -> Linear on (B, .)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(200, 8, padding_idx=0)
        self.first = nn.Linear(8, 32)
        self.second = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.conv = nn.Conv1d(32, 3, 3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens):
        hidden = self.norm(self.second(torch.tanh(self.first(self.embedding(tokens)))))
        hidden = torch.tanh(self.conv(hidden.transpose(1, 2))).mean(dim=2)
        return self.head(hidden)


def small_data(rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (rows, 4), generator=generator)  # token 0 is padding; repeats across rows
    return tokens, torch.randn(rows, 2, generator=generator, dtype=torch.float64)


def small_losses(model, tokens, targets):
    return 0.5 * (model(tokens) - targets).pow(2).sum(dim=1)


def middle_bound(model, row_losses, units) -> float:
    """A clipping bound between the users' gradient norms: some users are clipped, some not."""
    norms = sorted(user_reference(model, row_losses, units, float("inf"))[1].values())
    return (norms[len(norms) // 2 - 1] + norms[len(norms) // 2]) / 2


def user_reference(model, row_losses, units, max_grad_norm):
    """Sum over users of min(1, C / ||g_u||) g_u, g_u the gradient of the sum of u's rows' losses."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    norms = {}
    for unit in sorted(set(units)):
        rows = torch.tensor([row for row, owner in enumerate(units) if owner == unit])
        grads = torch.autograd.grad(row_losses(rows).sum(), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
        norms[unit] = norm
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        for name, g in zip(params, grads):
            sums[name] += factor * g.double()
    return sums, norms


def clipped_by_units(model, row_losses, units, passes, *, regroup, loss_reduction="mean", max_grad_norm=C):
    """The clipper's sums, the batch's rows run as consecutive forward passes of ``passes`` rows."""
    clipper = PerExampleClipper(model, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
    clipper.expect_units(units, regroup=regroup)
    start = 0
    for size in passes:
        losses = row_losses(torch.arange(start, start + size))
        (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
        start += size
    sums = clipper.clipped_sum()
    counts = clipper.examples, clipper.units, clipper.clipped_examples
    clipper.remove()
    model.zero_grad()
    return sums, counts


def assert_close_sums(ours, expected, rtol=1e-9):
    assert set(ours) == set(expected)
    scale = max(float(t.abs().max()) for t in expected.values())
    for name, value in expected.items():
        torch.testing.assert_close(ours[name].double(), value, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"{name}: {m}")


# -- (a) per-unit clipped sums against the loop over users ----------------------------------------


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("regroup", [True, False], ids=["regrouped", "materialized"])
def test_small_net_clips_each_users_summed_gradient(regroup, loss_reduction):
    torch.manual_seed(0)
    model = SmallNet().double()
    tokens, targets = small_data(len(UNITS))
    row_losses = lambda rows: small_losses(model, tokens[rows], targets[rows])  # noqa: E731
    bound = middle_bound(model, row_losses, UNITS)
    expected, norms = user_reference(model, row_losses, UNITS, bound)
    sums, (rows, units, clipped) = clipped_by_units(model, row_losses, UNITS, [len(UNITS)], regroup=regroup,
                                                    loss_reduction=loss_reduction, max_grad_norm=bound)
    assert_close_sums(sums, expected)
    assert (rows, units, clipped) == (len(UNITS), len(set(UNITS)), sum(n > bound for n in norms.values()))
    assert 0 < clipped < units


def test_units_in_consecutive_forward_passes_and_small_chunks(monkeypatch):
    """Micro-batches cut at user boundaries give the same sums; one user per materialized chunk."""
    torch.manual_seed(1)
    model = SmallNet().double()
    units = [4, 4, 0, 9, 9, 9, 2, 2]
    tokens, targets = small_data(len(units), seed=1)
    row_losses = lambda rows: small_losses(model, tokens[rows], targets[rows])  # noqa: E731
    bound = middle_bound(model, row_losses, units)
    expected, _ = user_reference(model, row_losses, units, bound)
    monkeypatch.setattr(unit_norms, "CHUNK_ELEMENTS", 1)
    for regroup in (True, False):
        sums, (rows, count, _) = clipped_by_units(model, row_losses, units, [3, 3, 2], regroup=regroup,
                                                  max_grad_norm=bound)
        assert_close_sums(sums, expected)
        assert (rows, count) == (8, 4)


def test_user_norms_are_not_the_sum_of_their_examples_norms():
    """The oracle itself: the cross terms matter (so a per-example route could not pass (a))."""
    torch.manual_seed(0)
    model = SmallNet().double()
    tokens, targets = small_data(len(UNITS))
    row_losses = lambda rows: small_losses(model, tokens[rows], targets[rows])  # noqa: E731
    per_user, _ = user_reference(model, row_losses, UNITS, C)
    per_example, _ = user_reference(model, row_losses, list(range(len(UNITS))), C)
    assert max(float((per_user[n] - per_example[n]).abs().max()) for n in per_user) > 1e-3


transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=29, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def padded_batch(lengths, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, 29, (length,), generator=generator)
        mask[row, :length] = 1
    positions = torch.arange(longest).expand(len(lengths), longest).clone()
    return ids, mask, positions, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("regroup", [True, False], ids=["regrouped", "materialized"])
def test_tiny_gpt2_with_padding_clips_each_users_summed_gradient(regroup):
    model = tiny_gpt2().double()
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied route
    lengths = [5, 9, 3, 7, 9, 4, 6, 8, 2]
    ids, mask, positions, labels = padded_batch(lengths)

    def row_losses(rows):
        logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[rows]).logits
        return token_mean_per_example(logits, labels[rows])

    bound = middle_bound(model, row_losses, UNITS)
    expected, norms = user_reference(model, row_losses, UNITS, bound)
    sums, (rows, units, clipped) = clipped_by_units(model, row_losses, UNITS, [len(UNITS)], regroup=regroup,
                                                    max_grad_norm=bound)
    # GPT-2 run on a user's rows alone differs from the whole batch by ~3e-8 of the gradient in
    # float64 (unclipped, per example too), the oracle's own noise; a missing cross term is O(1).
    assert_close_sums(sums, expected, rtol=1e-6)
    assert (rows, units) == (9, 5) and 0 < clipped < units


# -- (b) adding one user moves the clipped sum by at most C ---------------------------------------


def _zero_linear_model():
    """A linear model at w = 0, where an example's gradient of the half squared error is -y x."""
    model = nn.Linear(4, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _half_squared_errors(model, x, y):
    return 0.5 * (model(x) - y).pow(2).sum(dim=1)


def _aligned_rows(rows: int, target: float = 10 * C):
    """The x and y of one user whose ``rows`` examples share x and a large y: at w = 0, aligned
    gradients of norm ``target`` each (zero gradients for ``target=0``)."""
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64).repeat(rows, 1)
    return x, torch.full((rows, 1), target, dtype=torch.float64)


def _aligned_sums(units, rows_per_user_added: int, per_user: bool):
    """Clipped sums of a linear model at w = 0 (gradient -y x) without and with one added user whose
    three examples share x and a large y: aligned gradients of norm 10 C each."""
    model = _zero_linear_model()
    generator = torch.Generator().manual_seed(3)
    base_x = torch.randn(len(units), 4, generator=generator, dtype=torch.float64)
    base_y = torch.randn(len(units), 1, generator=generator, dtype=torch.float64)
    added_x, added_y = _aligned_rows(rows_per_user_added)
    results = []
    for x, y, owners in ((base_x, base_y, units),
                         (torch.cat([base_x, added_x]), torch.cat([base_y, added_y]),
                          units + [max(units) + 1] * rows_per_user_added)):
        clipper = PerExampleClipper(model, max_grad_norm=C, loss_reduction="mean")
        if per_user:
            clipper.expect_units(owners)
        _half_squared_errors(model, x, y).mean().backward()
        results.append(clipper.clipped_sum()["weight"])
        clipper.remove()
        model.zero_grad()
    return float((results[1] - results[0]).norm())


def test_one_more_user_moves_the_clipped_sum_by_at_most_c():
    units = [0, 1, 1, 2, 0, 3, 3, 3]
    moved = _aligned_sums(units, 3, per_user=True)
    assert moved <= C * (1 + 1e-12)
    assert moved == pytest.approx(C, rel=1e-12)  # the user's gradient (norm 30 C) clipped to C
    # negative control: example-level clipping of the same data adds three aligned C-vectors
    assert _aligned_sums(units, 3, per_user=False) == pytest.approx(3 * C, rel=1e-12)


# -- (c) misuse ------------------------------------------------------------------------------------


def test_a_user_split_across_two_forward_passes_is_refused():
    model = SmallNet().double()
    tokens, targets = small_data(4)
    clipper = PerExampleClipper(model, max_grad_norm=C)
    clipper.expect_units([0, 0, 1, 1])
    small_losses(model, tokens[:3], targets[:3]).mean().backward()
    with pytest.raises(ClipperUsageError, match=r"unit 1 has rows in two forward passes.*twice max_grad_norm"
                                                r".*Cut micro-batches at unit boundaries"):
        model(tokens[3:])


def test_rows_beyond_or_short_of_the_announced_units_are_refused():
    model = SmallNet().double()
    tokens, targets = small_data(4)
    clipper = PerExampleClipper(model, max_grad_norm=C)
    clipper.expect_units([0, 0, 1])
    with pytest.raises(ClipperUsageError, match="4 rows but only 3"):
        model(tokens)
    small_losses(model, tokens[:2], targets[:2]).mean().backward()
    with pytest.raises(ClipperUsageError, match="units of 3 rows.*took 2"):
        clipper.clipped_sum()
    clipper.reset()  # zero_grad: the same units, from the first row again
    model(tokens[:2])  # a forward with gradients and no backward (an evaluation) takes rows too
    small_losses(model, tokens[2:3], targets[2:3]).mean().backward()
    with pytest.raises(ClipperUsageError, match="torch.no_grad"):
        clipper.clipped_sum()
    with pytest.raises(TypeError, match="integer unit numbers"):
        clipper.expect_units(torch.tensor([0.5, 1.0]))


# -- (d) make_private end to end --------------------------------------------------------------------


class IndexedDataset(torch.utils.data.Dataset):
    """Example i: (features, target, i); user ids are given separately (privacy_unit=)."""

    def __init__(self, count: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index], index


def user_ids(count_users: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    ids = [f"user{u}" for u in range(count_users) for _ in range(rng.randint(1, 4))]
    rng.shuffle(ids)
    return ids


def test_make_private_samples_clips_and_prices_users():
    ids = user_ids(40)
    dataset = IndexedDataset(len(ids))
    mlp = lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))  # noqa: E731
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = make_private(module=model, optimizer=optimizer, dataset=dataset, batch_size=4, epochs=2,
                           max_grad_norm=0.5, noise_multiplier=1e-6, target_delta=1e-5, privacy_unit=ids,
                           key=opake.random.key(5))
    plan = private.plan
    assert plan.num_bins == 40 // 4 == plan.steps_per_epoch
    assert plan.participation == Participation(20, 10, 2)  # per user: once per epoch, 10 steps apart
    assert plan.expected_batch_size == 4.0 and plan.privacy_unit == "user (40 units)"
    # priced exactly as 40 examples in 10 bins would be
    inner = dpftrl_acc.mf_gaussian(plan.noise_multiplier, plan.strategy)
    assert plan.epsilon == dpftrl_acc.balls_in_bins(inner, num_bins=10, n_steps=20,
                                                    method=None if plan.accounting == "allocation_pld"
                                                    else plan.accounting).epsilon_at(1e-5)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen_steps = {}
    for epoch in range(2):
        for x, y, index in private.data_loader:
            step = private.steps_taken
            owners = [ids[i] for i in index.tolist()]
            seen_steps.setdefault(step, sorted(set(owners)))
            for user in set(owners):  # a drawn user brings all its examples
                assert owners.count(user) == ids.count(user)
            private.optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y, reduction="none").sum(dim=1).mean().backward()
            if step == 0:  # the first release: clipped user sums / 4 (noise 1e-6), checked by hand
                plain = mlp()  # a copy without the hooks
                plain.load_state_dict(model.state_dict())
                expected, _ = user_reference(plain, lambda rows: (plain(x[rows]) - y[rows]).pow(2).sum(1),
                                             owners, 0.5)
                before = {name: p.detach().clone() for name, p in model.named_parameters()}
            private.optimizer.step()
            assert private.optimizer.clipper.units == 0  # reset by the step
            if step == 0:
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.detach().double(), before[name].double() - 0.1 * expected[name] / 4,
                                               rtol=1e-4, atol=1e-5)
        if epoch == 0:
            spent_after_one_epoch = private.epsilon_spent()
    assert private.steps_taken == 20 and private.epsilon_spent() == plan.epsilon
    # priced as 40 examples: an example-level plan of 40 examples, 4 per batch, spends the same
    other = mlp()
    examples = make_private(module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                            dataset=IndexedDataset(40), batch_size=4, epochs=2, max_grad_norm=0.5,
                            noise_multiplier=1e-6, target_delta=1e-5, key=opake.random.key(5))
    assert (examples.plan.participation, examples.plan.epsilon) == (plan.participation, plan.epsilon)
    assert examples.plan.privacy_unit == "example"
    for x, y, _ in examples.data_loader:  # one epoch
        examples.optimizer.zero_grad()
        if len(x):
            nn.functional.mse_loss(other(x), y).backward()
        examples.optimizer.step()
    assert 0 < spent_after_one_epoch == examples.epsilon_spent() < plan.epsilon
    users = [user for step in range(10) for user in seen_steps.get(step, [])]
    assert sorted(users) == sorted(set(ids))  # every user once in the first epoch
    assert any(not torch.equal(p.detach(), initial[n]) for n, p in model.named_parameters())


def test_a_step_on_part_of_the_users_batch_is_refused_before_release():
    ids = user_ids(12, seed=3)
    model = nn.Linear(4, 1)
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           dataset=IndexedDataset(len(ids)), batch_size=3, epochs=1, max_grad_norm=1.0,
                           noise_multiplier=1.0, target_delta=1e-5, privacy_unit=ids, key=opake.random.key(1))
    x, y, index = next(iter(private.data_loader))
    owners = [ids[i] for i in index.tolist()]
    first_user_rows = owners.count(owners[0])
    assert first_user_rows < len(owners)
    private.optimizer.zero_grad()
    nn.functional.mse_loss(model(x[:first_user_rows]), y[:first_user_rows]).backward()  # one user of three
    before = model.weight.detach().clone()
    with pytest.raises(ClipperUsageError, match="every row of the batch must go through exactly one forward pass"):
        private.optimizer.step()
    assert private.steps_taken == 0 and torch.equal(model.weight.detach(), before)


def test_checkpoints_record_the_unit_assignment():
    ids = user_ids(12, seed=2)
    dataset = IndexedDataset(len(ids))

    def run(privacy_unit):
        model = nn.Linear(4, 1)
        return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset,
                            batch_size=3, epochs=1, max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-5,
                            privacy_unit=privacy_unit, key=opake.random.key(1))

    saved = run(ids).state_dict()
    assert saved["plan"]["privacy_unit"].startswith("units 12 sha256:")
    run(list(ids)).load_state_dict(saved, draws="replay")  # the same users: accepted
    regrouped = ids[1:] + ids[:1]  # another assignment of examples to users
    for other in (regrouped, None):
        with pytest.raises(ValueError, match="privacy units"):
            run(other).load_state_dict(saved, draws="replay")


def test_poisson_sampling_draws_users():
    ids = user_ids(30, seed=4)
    model = nn.Linear(4, 1)
    private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           dataset=IndexedDataset(len(ids)), batch_size=5, epochs=1, max_grad_norm=1.0,
                           noise_multiplier=2.0, target_delta=1e-5, privacy_unit=torch.tensor(
                               [int(user[4:]) for user in ids]), sampling="poisson",
                           strategy=identity_strategy(), key=opake.random.key(2))
    assert private.plan.sample_rate == 5 / 30 and private.plan.steps_per_epoch == 6
    assert private.plan.privacy_unit == "user (30 units)" and private.plan.expected_batch_size == 5.0


# -- (f) bad input -----------------------------------------------------------------------------------


def _plan_with(privacy_unit, batch_size=2, count=10):
    model = nn.Linear(4, 1)
    return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        dataset=IndexedDataset(count), batch_size=batch_size, epochs=1, max_grad_norm=1.0,
                        noise_multiplier=1.0, target_delta=1e-5, privacy_unit=privacy_unit, key=opake.random.key(0))


def test_bad_privacy_units_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="9 ids but the dataset has 10 examples"):
        _plan_with(list(range(9)))
    with pytest.raises(TypeError, match="hashable"):
        _plan_with([{"user": u} for u in range(10)])
    with pytest.raises(TypeError, match="one id per example"):
        _plan_with("user_id")
    with pytest.raises(ValueError, match="NaN"):
        _plan_with([0.0] * 9 + [float("nan")])
    with pytest.raises(ValueError, match="3 privacy units.*batch_size=4.*counts users"):
        _plan_with([0, 1, 2, 0, 1, 2, 0, 1, 2, 0], batch_size=4)
    monkeypatch.setattr(private_module, "_rank_and_world", lambda group: (0, 2))

    def agree_alone(group, world_size, failure=None, **shared):  # no process group: this rank's verdict only
        if failure is not None:
            raise failure

    monkeypatch.setattr(private_module, "agree", agree_alone)
    with pytest.raises(ValueError, match="torch.distributed"):
        _plan_with(list(range(10)))


def test_tensor_ids_are_read_by_value():
    """A tensor's elements hash by identity; read as values, equal ids are one user."""
    assert _plan_with(torch.tensor([0, 1] * 5)).plan.privacy_unit == "user (2 units)"


USERS = [3, 1, 3, 2, 1, 3, 5, 7, 7, 2]  # 5 distinct users over 10 examples


def _id_forms() -> dict:
    column = torch.tensor(USERS)
    records = torch.utils.data.TensorDataset(torch.randn(10, 4), column)
    return {
        # docs/torch.md's [record["user_id"] for record in train_ds] on a TensorDataset (or a Hugging
        # Face dataset in torch format): a list of 0-d tensors
        "0-d tensors": [record[1] for record in records],
        "numpy scalars": list(np.asarray(USERS, dtype=np.int64)),
        "mixed": [torch.tensor(u) if i % 3 == 0 else np.int32(u) if i % 3 == 1 else u for i, u in enumerate(USERS)],
        "one-element tensors": [torch.tensor([u]) for u in USERS],
        "floats and ints": [float(u) if i % 2 else u for i, u in enumerate(USERS)],
    }


@pytest.mark.parametrize("form", sorted(_id_forms()))
def test_ids_of_every_form_group_exactly_the_examples_they_name(form):
    ids = _id_forms()[form]
    with _expect_look_alikes(form == "floats and ints"):  # 3 and 3.0: equal, of two types
        units = PrivacyUnits.from_ids(ids)
        assert _plan_with(ids).plan.privacy_unit == f"user ({len(set(USERS))} units)"
    assert np.array_equal(units.unit_of_example, PrivacyUnits.from_ids(USERS).unit_of_example)
    if form == "0-d tensors":
        # negative control: grouped by hash as they come, each tensor is a user of its own (the
        # example-level guarantee reported as a user-level one)
        assert len({value: None for value in ids}) == len(ids) == 10


@contextlib.contextmanager
def _expect_look_alikes(expected: bool):
    """A ``LookAlikeIdsWarning`` must come inside if ``expected``; otherwise no warning may."""
    if expected:
        with pytest.warns(LookAlikeIdsWarning):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield


def test_multi_element_tensors_and_int_subclasses_are_read_by_value():
    pairs = [torch.tensor([u, u]) for u in USERS]  # a tensor of n elements: the tuple of its values
    assert PrivacyUnits.from_ids(pairs).unit_of_example.tolist() == _first_appearance(USERS)

    class IdentityHashedInt(int):  # equal by value, hashed by identity: read as the int it equals
        def __hash__(self):
            return id(self)

    assert _plan_with([IdentityHashedInt(u) for u in USERS]).plan.privacy_unit == "user (5 units)"
    # negative control: grouped by hash as they come, each is a unit of its own
    assert len({value: None for value in map(IdentityHashedInt, USERS)}) == 10


# -- (g) ids read by value at any depth ---------------------------------------------------------------


def _first_appearance(ids) -> list:
    """The oracle: unit numbers of plain hashable ids, numbered by first appearance."""
    numbers: dict = {}
    return [numbers.setdefault(value, len(numbers)) for value in ids]


def _org_and_user_columns(orgs: int = 4, users_per_org: int = 4, rows_per_user: int = 4):
    """Two id columns of a tensor data set: a user is an (org, user) pair, user numbers repeat across
    orgs (so neither column alone names a user), rows of users interleaved."""
    pairs = [(org, user) for org in range(orgs) for user in range(users_per_org) for _ in range(rows_per_user)]
    random.Random(0).shuffle(pairs)
    return torch.tensor([org for org, _ in pairs]), torch.tensor([user for _, user in pairs])


def test_pairs_of_0d_tensors_over_16_users_are_16_units():
    org_ids, user_ids = _org_and_user_columns()
    ids = list(zip(org_ids, user_ids))  # iterating a tensor gives 0-d tensors, each hashed by identity
    assert all(isinstance(part, torch.Tensor) and part.ndim == 0 for pair in ids for part in pair)
    expected = _first_appearance(zip(org_ids.tolist(), user_ids.tolist()))
    assert max(expected) + 1 == 16
    rows = torch.stack([org_ids, user_ids], dim=1)
    for form in (ids, rows, rows.numpy(), list(rows), [[np.int64(o), u] for o, u in ids],
                 [(torch.tensor([o]), np.asarray(u)) for o, u in zip(org_ids.tolist(), user_ids.tolist())]):
        units = privacy_units(form, 64)
        assert units.num_units == 16 and units.unit_of_example.tolist() == expected
    # negative control: grouped by hash as they come (the old reading), every pair is a unit of its own
    assert len({pair: None for pair in ids}) == 64


def _release_moves(ids, x, y, added_rows: slice, **options) -> tuple[list, object]:
    """How far one user moves each release: ``make_private(privacy_unit=ids)`` on (x, y), run once as
    given and once with the rows ``added_rows`` (one user's) at zero gradient; per step, the norm of
    the difference of the two clipped sums, in units of C, and the plan.

    The model stays at w = 0 (learning rate 0), so every example's gradient, -y x, is the same in
    both runs and in every step: the difference is that user's clipped contribution to the step."""
    sums = []
    for silent in (False, True):
        y_run = y.clone()
        if silent:
            y_run[added_rows] = 0.0  # at w = 0, zero gradients
        model = _zero_linear_model()
        private = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                               dataset=torch.utils.data.TensorDataset(x, y_run), max_grad_norm=C,
                               noise_multiplier=1.0, target_delta=1e-5, privacy_unit=ids, key=opake.random.key(6),
                               **options)
        per_step = []
        for _ in range(private.plan.n_steps // private.plan.steps_per_epoch):
            for batch_x, batch_y in private.data_loader:
                private.optimizer.zero_grad()
                if len(batch_x):
                    _half_squared_errors(model, batch_x, batch_y).mean().backward()
                    per_step.append(private.optimizer.clipper.clipped_sum()["weight"])
                else:
                    per_step.append(torch.zeros_like(model.weight))
                private.optimizer.step()
        sums.append(per_step)
    return [float((a - b).norm()) / C for a, b in zip(*sums)], private.plan


def test_one_user_of_0d_tensor_pairs_moves_each_release_by_at_most_c():
    """End to end: a user named by pairs of 0-d tensors is sampled and clipped as one unit, so it moves
    a release by at most C and only in the releases the plan prices."""
    org_ids, user_ids = _org_and_user_columns()
    generator = torch.Generator().manual_seed(8)
    base_x = torch.randn(64, 4, generator=generator, dtype=torch.float64)
    base_y = torch.randn(64, 1, generator=generator, dtype=torch.float64)
    added_x, added_y = _aligned_rows(8)  # user (4, 0): eight aligned gradients of norm 10 C
    x, y = torch.cat([base_x, added_x]), torch.cat([base_y, added_y])
    ids = list(zip(torch.cat([org_ids, torch.full((8,), 4)]),
                   torch.cat([user_ids, torch.zeros(8, dtype=torch.long)])))
    options = dict(batch_size=4, epochs=2)
    moves, plan = _release_moves(ids, x, y, slice(64, None), **options)
    assert plan.privacy_unit == "user (17 units)" and plan.participation.max_participations == 2
    assert max(moves) == pytest.approx(1.0, rel=1e-9)  # its summed gradient (norm 80 C) clipped to C
    assert sorted(move for move in moves if move > 0) == pytest.approx([1.0, 1.0], rel=1e-9)
    # negative control: every example a unit of its own, as the pairs of tensors were grouped before
    # (72 units): the user moves 12 releases where the plan prices 2, one of them by 3 C (three of its
    # rows in one bin), 16 C in all (8 rows x 2 epochs)
    moves, plan = _release_moves(list(range(72)), x, y, slice(64, None), **options)
    assert plan.privacy_unit == "user (72 units)" and plan.participation.max_participations == 2
    assert sum(move > 0 for move in moves) == 12
    assert (max(moves), sum(moves)) == pytest.approx((3.0, 16.0), rel=1e-9)


@pytest.mark.parametrize("nan_id", [(0, float("nan")), (torch.tensor(0), torch.tensor(float("nan"))),
                                    torch.tensor([0.0, float("nan")]), [np.float32("nan")], float("nan")],
                         ids=["tuple", "tuple of tensors", "tensor", "list of numpy", "float"])
def test_nan_anywhere_in_an_id_is_refused(nan_id):
    ids = [(u, 1.0) for u in USERS[:9]] + [nan_id]
    with pytest.raises(NaNIdError, match=r"privacy unit id .*nan.* of example 9 holds NaN.*give those examples a "
                                         r"real id") as refused:
        _plan_with(ids)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, OpakeError)
    # negative control: Python's own grouping makes a NaN id a unit of its own wherever it sits
    assert len({(0, float("nan")): None for _ in range(3)}) == 3


class _NamedUser:
    """Equal by identity only: two _NamedUser("ann") are two users."""

    def __init__(self, name):
        self.name = name


class _HashedByIdentity:
    """Equal by name, hashed by identity (a broken __hash__): equal ids would land in two groups."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, _HashedByIdentity) and other.name == self.name

    __hash__ = object.__hash__


@pytest.mark.parametrize("make_id", [_NamedUser, lambda u: (u, _NamedUser(u)), lambda u: [_HashedByIdentity(u)],
                                     lambda u: object()], ids=["object", "in a tuple", "in a list", "object()"])
def test_ids_compared_by_identity_are_refused(make_id):
    with pytest.raises(UncomparableIdError, match=r"of example 0 holds a value of type \w+, which compares or hashes "
                                                  r"by identity.*an int, a str or a tuple") as refused:
        _plan_with([make_id(u) for u in USERS])
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, OpakeError)
    # negative control: grouped by hash, equal-looking ids inside tuples are one unit each
    assert len({(u, _NamedUser(u)): None for u in USERS}) == 10


def test_look_alike_ids_warn_once_with_examples():
    nfc, nfd = unicodedata.normalize("NFC", "José"), unicodedata.normalize("NFD", "José")
    ids = [nfc, nfd, 3, "3", 1, 1.0, True, "bob", ("\uff13", "x"), (3, "x")]  # \uff13: a full-width 3
    with pytest.warns(LookAlikeIdsWarning) as record:
        plan = _plan_with(ids, batch_size=1).plan
    warned = [str(w.message) for w in record if issubclass(w.category, LookAlikeIdsWarning)]
    assert len(warned) == 1
    for example in (r"'Jos\xe9' and 'Jose\u0301'", "3 and '3'", "('\\uff13', 'x') and (3, 'x')", "1, 1.0 and True"):
        assert example in warned[0]
    assert "3 group(s) of distinct ids" in warned[0] and "1 group(s) of ids of different types" in warned[0]
    # grouped by value: the look-alikes stay two users each, the equal numbers are one
    with _expect_look_alikes(True):
        assert PrivacyUnits.from_ids(ids).unit_of_example.tolist() == [0, 1, 2, 3, 4, 4, 4, 5, 6, 7]
    assert plan.privacy_unit == "user (8 units)"
    # negative control: ids that only differ warn nothing
    with _expect_look_alikes(False):
        privacy_units(["ann", "bob", 3, 4, (3, "x"), ("Zoë", "y"), b"x", 2.5, None, True], 10)


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=30), st.lists(st.sampled_from(["a", "b", "ç", "d"]),
                                                                        min_size=1, max_size=30))
def test_flat_ids_keep_their_numbers(integers, names):
    """Flat ints, strings and 1-D tensors are numbered as before (by first appearance), so checkpoints
    and plans made with them are unchanged."""
    for form in (integers, torch.tensor(integers), np.asarray(integers), list(np.asarray(integers)),
                 [torch.tensor(u) for u in integers]):
        assert privacy_units(form, len(integers)).unit_of_example.tolist() == _first_appearance(integers)
    for form in (names, np.asarray(names), tuple(names)):
        assert privacy_units(form, len(names)).unit_of_example.tolist() == _first_appearance(names)


_INT_FORMS = [lambda v: v, torch.tensor, np.int64, lambda v: torch.tensor([v]), np.asarray]
_PLAIN_IDS = st.recursive(st.integers(0, 3) | st.sampled_from("ab"),
                          lambda parts: st.lists(parts, min_size=1, max_size=3).map(tuple), max_leaves=5)


def _disguised(value, rng):
    """``value`` (ints, strings and tuples of them) in another form equal to it by value: ints as
    tensors, one-element tensors or numpy values, strings as numpy strings, tuples as lists or, for
    several ints, as a tensor or array of them."""
    if isinstance(value, str):
        return rng.choice([str, np.str_])(value)
    if isinstance(value, int):
        return rng.choice(_INT_FORMS)(value)
    if len(value) > 1 and all(isinstance(part, int) for part in value) and rng.random() < 0.3:
        return rng.choice([torch.tensor, np.asarray])(list(value))
    parts = [_disguised(part, rng) for part in value]
    return parts if rng.random() < 0.5 else tuple(parts)


@settings(max_examples=40)
@given(st.lists(_PLAIN_IDS, min_size=1, max_size=5), st.lists(st.integers(0, 4), min_size=1, max_size=30),
       st.randoms())
def test_nested_ids_are_numbered_as_their_plain_values(pool, picks, rng):
    """Any mix of tensors, numpy values, tuples and lists at any depth is the plain id it holds."""
    ids = [pool[pick % len(pool)] for pick in picks]
    disguised = [_disguised(value, rng) for value in ids]
    assert PrivacyUnits.from_ids(disguised).unit_of_example.tolist() == _first_appearance(ids)


# -- (e) DPTrainer ----------------------------------------------------------------------------------


def test_unit_micro_batches_cut_at_user_boundaries():
    batch = {"x": torch.arange(8)}
    parts = unit_micro_batches(batch, 8, 3, [5, 5, 1, 2, 2, 2, 2, 0])
    assert [part["x"].tolist() for part in parts] == [[0, 1, 2], [3, 4, 5, 6], [7]]
    with pytest.raises(ValueError, match="not contiguous"):
        unit_micro_batches(batch, 8, 3, [5, 1, 5, 2, 2, 2, 2, 0])


CHARACTERS = "abcdefghijklmnopqrstuvwxyz ."
WORDS = "the cat dog bird sat ran saw ate on under near a mat tree log".split()


class CharDataset(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int = 0):
        rng = random.Random(seed)
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))) + "." for _ in range(count)]
        self.items = [torch.tensor([CHARACTERS.index(c) + 1 for c in text]) for text in texts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return {"input_ids": self.items[index]}


def collate(features):
    if not features:
        return {name: value[:0] for name, value in collate([{"input_ids": torch.ones(1, dtype=torch.long)}]).items()}
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros((len(features), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, :len(f["input_ids"])] = f["input_ids"]
        mask[row, :len(f["input_ids"])] = 1
    positions = torch.arange(longest).expand(len(features), longest).clone()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "position_ids": positions}


def test_dp_trainer_with_users_equals_the_hand_loop(tmp_path):
    from opake.transformers import DPTrainer

    transformers.logging.set_verbosity_error()
    ids = user_ids(16, seed=7)
    dataset = CharDataset(len(ids))
    trained, reference = tiny_gpt2(), tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=1, learning_rate=0.05, optim="sgd", report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True, seed=0)
    trainer = DPTrainer(model=trained, args=args, train_dataset=dataset, data_collator=collate,
                        noise_multiplier=0.8, target_delta=1e-5, amplification=False, privacy_unit=ids,
                        key=opake.random.key(3))
    cuts = []
    trained.register_forward_pre_hook(
        lambda module, a, kwargs: cuts.append((trainer.private.steps_taken, len(kwargs["input_ids"]))),
        with_kwargs=True)
    trainer.train()
    plan = trainer.private.plan
    assert plan.num_bins == 16 // 4 and plan.privacy_unit == "user (16 units)"
    assert trainer.private.steps_taken == plan.participation.n_steps == 4
    batches = trainer.private.optimizer.batches
    for step in range(4):
        owners = [ids[i] for i in batches.indices(step)]
        sizes = [size for taken, size in cuts if taken == step]
        assert sum(sizes) == len(owners)
        start = 0
        for size in sizes:  # whole users, at most 2 rows unless one user alone
            part = owners[start:start + size]
            assert size <= 2 or len(set(part)) == 1
            assert start == 0 or owners[start - 1] != owners[start]
            start += size
    assert any(size > 2 for _, size in cuts), "the test needs a user with more rows than a micro-batch"

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, 4)
    private = make_private(module=reference, optimizer=optimizer, dataset=dataset, batch_size=4, epochs=1,
                           max_grad_norm=1.0, noise_multiplier=0.8, target_delta=1e-5, amplification=False,
                           lr_scheduler=scheduler, privacy_unit=ids, key=opake.random.key(3), collate_fn=collate)
    assert private.plan.strategy == plan.strategy
    for batch in private.data_loader:  # each planned batch in one forward pass
        private.optimizer.zero_grad()
        reference(**batch).loss.backward()
        private.optimizer.step()
        scheduler.step()
    for (name, value), other in zip(trained.named_parameters(), reference.parameters()):
        torch.testing.assert_close(value, other, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
