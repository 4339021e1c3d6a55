"""StepCost's prices for the scheduler's prompt budget: a step's time by batch size, a prompt token's."""
from __future__ import annotations

import pytest

from kvwire.engine.step_cost import StepCost


def test_a_step_is_priced_from_the_nearest_batch_measured_once_trusted():
    cost = StepCost(min_steps=2)
    assert cost.step(4) is None
    cost.add(4, 4, 0.010)
    assert cost.step(4) is None  # one step is not a price yet
    cost.add(4, 9, 0.020)  # any rows: a verification step counts for its batch
    assert cost.step(4) == pytest.approx(0.015)
    for _ in range(2):
        cost.add(16, 16, 0.040)
    assert cost.step(5) == pytest.approx(0.015) and cost.step(13) == pytest.approx(0.040)
    assert cost.step(10) == pytest.approx(0.015)  # a tie goes to the smaller batch


def test_a_prompt_token_is_priced_from_prefill_forwards():
    cost = StepCost(min_steps=2, weight=0.5)
    cost.add_prefill(0, 1.0)  # nothing computed: no price
    cost.add_prefill(100, 0.05)
    assert cost.prefill_token() is None
    cost.add_prefill(50, 0.05)
    assert cost.prefill_token() == pytest.approx(0.00075)
    cost.add_prefill(10, 1.0)  # a forward slowed by another process moves the mean by at most 2x
    assert cost.prefill_token() == pytest.approx(0.5 * 0.00075 + 0.5 * 0.0015)


def test_the_engine_budgets_prompt_tokens_from_its_own_prices(tmp_path):
    from kvwire import LLM
    from tests.decode_svc.harness import tiny_model
    model = tiny_model(tmp_path)
    assert LLM(model, num_pages=64).core.scheduler.prompt_budget is None  # off by default
    core = LLM(model, num_pages=64, max_prefill_stall=2.5).core
    budget, cost = core.scheduler.prompt_budget, core.runner.step_cost
    cost._batches.clear()  # the warm-up's prices
    cost._prefill = (0.0, 0)
    assert budget(8) is None  # nothing measured yet: the token budget alone
    for _ in range(cost.min_steps):
        cost.add(8, 8, 0.020)
        cost.add_prefill(100, 0.1)
    assert budget(8) == 50  # 2.5 x 20 ms at 1 ms a token
