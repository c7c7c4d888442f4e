"""The engine's one-place rules: the waiting-queue check, the length limit with and without pending tokens,
and when min_tokens lets a stop end the output."""
import pytest

from nanoserve.engine.prompts import QueueFullError, check_prompt_ids, check_prompt_length, check_queue, tokenize
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import SamplingParams


def test_check_queue():
    check_queue(3, 1, 4)  # fits exactly
    with pytest.raises(QueueFullError, match="4 sequences are already waiting.*max_waiting_requests=4"):
        check_queue(4, 1, 4)
    with pytest.raises(QueueFullError):
        check_queue(2, 3, 4)
    with pytest.raises(ValueError, match="needs 5 sequences.*max_waiting_requests=4"):
        check_queue(0, 5, 4)  # could never fit: not a retry-later


def test_check_prompt_length():
    check_prompt_length(7, 8)
    with pytest.raises(ValueError, match="empty"):
        check_prompt_length(0, 8)
    with pytest.raises(ValueError, match="the prompt has 8 tokens; max_model_len is 8"):
        check_prompt_length(8, 8)


def test_check_prompt_ids_length_first_then_the_vocabulary():
    check_prompt_ids([0, 9], vocab_size=10, max_model_len=3)
    with pytest.raises(ValueError, match="empty"):
        check_prompt_ids([], 10, 3)
    with pytest.raises(ValueError, match="the prompt has 3 tokens"):  # too long and out of range: the length first
        check_prompt_ids([1, 2, 99], 10, 3)
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary") as err:
        check_prompt_ids([1, -1], 10, 3)
    assert err.value.param == "prompt"
    assert tokenize(None, (4, 5), 10, 3) == (None, [4, 5])  # token-id prompts go through it
    with pytest.raises(ValueError, match="the prompt has 3 tokens"):
        tokenize(None, [1, 2, 99], 10, 3)


def test_length_limit_counts_pending_tokens_only_when_asked():
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=3))
    seq.output_token_ids, seq.num_pending = [5, 6], 1
    assert seq.reached_length_limit(100)  # the scheduler: the third token is on the device
    assert not seq.reached_length_limit(100, pending=False)  # the host knows two
    seq.output_token_ids, seq.num_pending = [5, 6, 7], 0
    assert seq.reached_length_limit(100, pending=False)
    long = Sequence("m", [1] * 6, SamplingParams(max_tokens=None))
    long.output_token_ids = [2]
    assert long.reached_length_limit(7, pending=False) and not long.reached_length_limit(8, pending=False)


def test_min_tokens_rule():
    p = SamplingParams(min_tokens=2)
    assert [p.reached_min_tokens(n) for n in range(4)] == [False, False, True, True]
    assert SamplingParams().reached_min_tokens(0)
