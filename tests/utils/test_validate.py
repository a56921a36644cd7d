"""minillm.utils.validate: the type tests every boundary shares, and boundaries that use them."""

from __future__ import annotations

import math

import pytest

from minillm.runtime.sampling import SamplingParams
from minillm.utils.validate import is_int, is_number, is_positive_int


@pytest.mark.parametrize("value, int_, positive, number", [
    (1, True, True, True),
    (7, True, True, True),
    (0, True, False, True),
    (-3, True, False, True),
    (True, False, False, False),  # a bool is an int to Python, never a count here
    (False, False, False, False),
    (1.0, False, False, True),
    (math.nan, False, False, True),  # a number: range checks are the caller's
    ("1", False, False, False),
    (None, False, False, False),
])
def test_each_test_on_the_values_a_request_may_carry(value, int_, positive, number):
    assert (is_int(value), is_positive_int(value), is_number(value)) == (int_, positive, number)


@pytest.mark.parametrize("field", ["top_k", "seed", "logprobs"])
def test_a_boundary_refuses_a_bool_where_an_int_is_due(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: True})
