"""Planning fast and out loud (issue 29): identical stages measured once, progress told, and a budget below the
least feasible one refused as soon as that is known (before the stages' options are measured when no options
could reach it), never a feasible one."""

import dataclasses

import pytest
import torch

from planner.chain import StageOption
from planner.errors import MemschedError
from profiles import chain_profiler
from profiles.chain_profiler import profile_chain
from profiles.discover import discover, returned_loss
from profiles.synthetic import random_chain
from solvers.minimum import least_budget_bound, minimum_budget

pytest.importorskip("transformers")
QUICK = {"warmup": 0, "repeats": 1}
LAYERS = 6


def gpt2(layers: int = LAYERS):
    """An unmodified Hugging Face GPT-2 of ``layers`` identical blocks (tiny), and a batch with labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def staged():
    model, batch = gpt2()
    return discover(model, batch).staged


def counted(monkeypatch, method: str) -> list:
    """The stage indices :class:`chain_profiler._Runner`'s ``method`` is called for, as they come."""
    calls, original = [], getattr(chain_profiler._Runner, method)

    def counting(self, *args, **kwargs):
        calls.append(args[0] if method != "repeated" else args[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(chain_profiler._Runner, method, counting)
    return calls


def sizes(stage) -> tuple:
    return (stage.name, stage.out_bytes, stage.saved_bytes, stage.own_saved_bytes, stage.fwd_tmp_bytes,
            stage.nograd_tmp_bytes, stage.bwd_tmp_bytes, stage.held_bwd_tmp_bytes, stage.param_bytes)


def test_identical_blocks_are_measured_once_with_their_options(staged, monkeypatch):
    """Six identical blocks, each cut in two (attention, MLP): each half measured once, options included."""
    measured, options = counted(monkeypatch, "stage"), counted(monkeypatch, "option")
    chain = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, options=1, **QUICK)
    names = [stage.name for stage in chain.stages]
    assert len(names) == 2 * LAYERS + 3 and names[1] == "transformer.h.0[ln_1,attn]"
    assert measured == [0, 1, 2, len(names) - 2, len(names) - 1], measured  # the embedding, one block, the top
    assert set(options) <= {1, 2}  # one candidate for each half of the block and the policies beside it, measured
    # once (the embedding and the top have none)
    for k in range(3, 2 * LAYERS + 1):  # each later half as the first block's, its options included
        alike = chain.stages[1 + (k - 1) % 2]
        assert dataclasses.replace(chain.stages[k], name=alike.name) == alike, k
    assert any(stage.options for stage in chain.stages[1:3])


def test_shared_figures_are_those_each_block_measures_on_its_own(staged):
    shared = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, **QUICK)
    alone = profile_chain(staged.stages, staged.example_inputs, loss_fn=returned_loss, share_identical=False, **QUICK)
    assert [sizes(s) for s in shared.stages] == [sizes(s) for s in alone.stages]
    assert (shared.input_bytes, shared.loss.tmp_bytes, shared.loss.saved_bytes) == \
        (alone.input_bytes, alone.loss.tmp_bytes, alone.loss.saved_bytes)


def test_a_stage_with_a_hook_or_other_parameters_is_measured(monkeypatch):
    """Blocks alike but for a hook, or for their parameters, are not shared; the first stage is not either (its
    input needs no gradient)."""
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(4)]
    blocks.append(torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.ReLU()))
    blocks[3].register_forward_hook(lambda module, args, output: None)
    measured, shared = counted(monkeypatch, "stage"), counted(monkeypatch, "repeated")
    profile_chain(blocks, torch.randn(4, 8), **QUICK)
    assert (measured, shared) == ([0, 1, 3, 4], [2])


def test_fit_tells_its_progress(capsys):
    from planner import fit

    model, batch = gpt2(2)
    lines = []
    fit(model, batch, "100%", progress=lines.append, **QUICK)
    text = "\n".join(lines)
    for said in ("stages discovered", "stage 1 (transformer.h.0[ln_1,attn]) of 7: measured",
                 "stage 3 (transformer.h.1[ln_1,attn]) of 7: identical to stage 1", "loss: measured",
                 "options of stage 1", "least feasible budget between", "planned in"):
        assert said in text, (said, text)
    assert capsys.readouterr().err == ""
    fit(model, batch, "100%", stage_options=0, **QUICK)  # by default on stderr
    assert "stages discovered" in capsys.readouterr().err


@pytest.mark.slow
def test_a_budget_no_option_could_reach_is_refused_before_options_are_measured(monkeypatch):
    from planner import fit

    model, batch = gpt2(2)
    options = counted(monkeypatch, "with_options")
    with pytest.raises(MemschedError, match=r"below the least feasible budget for GPT2LMHeadModel, at least .* "
                                            r"whatever options 7 of its stages get"):
        fit(model, batch, "5%", progress=False, **QUICK)
    assert options == []


@pytest.mark.slow
def test_without_options_the_exact_least_is_refused_early_and_met():
    """Sizes are deterministic: the least of one profile is the least of the next, refused one byte below it (early,
    or offering the joint graph, which may meet it) and planned at it."""
    from planner import fit

    model, batch = gpt2(2)
    chain = fit(model, batch, "100%", stage_options=0, progress=False, **QUICK).chain
    least = minimum_budget(chain)
    with pytest.raises(MemschedError, match=rf"GPT2LMHeadModel.* below the least feasible .*\({least} bytes"):
        fit(model, batch, least - 1, stage_options=0, progress=False, **QUICK)
    assert fit(model, batch, least, stage_options=0, progress=False, **QUICK).predicted.peak_bytes <= least


@pytest.mark.parametrize("seed", range(20))
def test_the_bound_is_at_most_the_least_with_any_options(seed):
    chain = random_chain(12, seed, tmp=True, params=True, own_saved=True, options=3)
    bound = least_budget_bound(chain.without_options() if seed % 2 else chain)
    assert bound <= minimum_budget(chain, options=True) <= minimum_budget(chain)


def test_options_come_in_the_order_the_check_asks_until_it_refuses():
    from profiles.options import measure_options

    chain = random_chain(4, 3, options=0)
    option = StageOption(recompute=(0,), fwd_time=1.0, bwd_time=1.0, saved_bytes=chain.stages[0].out_bytes,
                         own_saved_bytes=0)
    measured, seen = [], []

    def measure(k):
        measured.append(k)
        return dataclasses.replace(chain.stages[k], options=(option,))

    def check(so_far, pending):
        seen.append(dict(pending))
        if len(seen) == 3:
            assert [bool(s.options) for s in so_far.stages] == [False, True, True, True]
            raise MemschedError("refused")
        return [3, 1, 0]

    with pytest.raises(MemschedError, match="refused"):
        measure_options(chain, [0, 1, 1, 3], measure, check)
    assert measured == [3, 1]
    assert seen[0] == {0: (0,), 1: (1, 2), 3: (3,)} and seen[2] == {0: (0,)}


class _Gate(torch.nn.Module):
    """A stage whose output's size depends on its input's values: all its rows, or the first two."""

    def __init__(self, bias: float):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.linear.bias.fill_(bias)

    def forward(self, x):
        y = self.linear(x)
        return y if y.sum() > 0 else y[:2].clone()


def test_a_twin_whose_output_is_sized_otherwise_is_measured(monkeypatch):
    torch.manual_seed(3)
    stages = [torch.nn.Linear(8, 8), _Gate(10.0), _Gate(-10.0)]  # alike but for the biases' values
    measured, shared = counted(monkeypatch, "stage"), counted(monkeypatch, "repeated")
    chain = profile_chain(stages, torch.randn(4, 8), **QUICK)
    assert shared == [2] and measured == [0, 1, 2]
    assert chain.stages[2].out_bytes == 2 * 8 * 4 != chain.stages[1].out_bytes
