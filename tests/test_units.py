"""The quantities users type: exact, bounded, one-line errors."""

import pytest

from opweave.errors import OpWeaveError
from opweave.units import MAX_TOKENS, parse_contexts, parse_duration, parse_tokens


def test_token_counts_are_exact():
    assert parse_tokens("4k") == 4096 and parse_tokens("1.5k") == 1536 and parse_tokens("1m") == 1 << 20
    assert parse_tokens(str(MAX_TOKENS)) == MAX_TOKENS
    assert parse_contexts("1k..4k") == [1024, 2048, 4096]


@pytest.mark.parametrize("text", ["0", "0.3", "1" * 400, "99999999999", "9" * 25 + "m", "-1", "1e3", ""])
def test_bad_token_counts_are_one_line(text):
    with pytest.raises(OpWeaveError) as err:
        parse_tokens(text)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("text", ["0ms", "9" * 400 + "ms", "5", "fast"])
def test_bad_durations_are_one_line(text):
    with pytest.raises(OpWeaveError) as err:
        parse_duration(text)
    assert len(str(err.value)) < 200
    assert parse_duration("50ms") == pytest.approx(0.05)
