"""Prompt lookup (n-gram) draft proposals."""

from kvflow.workers.engines.ngram import propose_ngram


def test_the_latest_occurrence_of_the_longest_suffix_wins():
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix (6, 7) occurs at 5 (followed by 9, 2) and at 1 (followed by 8, 1): the latest wins
    assert propose_ngram(seq, 2, max_ngram=2) == [9, 2]
    # suffix (5?) no: with n = 3, (2, 6, 7) never recurs, so n = 2 decides
    assert propose_ngram(seq, 3) == [9, 2, 6]


def test_drafts_stop_at_the_end_and_nothing_recurring_gives_none():
    assert propose_ngram([1, 2, 3, 1], 4) == [2, 3, 1]
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([1, 2, 1], 0) == []
    assert propose_ngram([], 3) == [] and propose_ngram([7], 3) == []
