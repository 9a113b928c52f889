"""Prompt lookup: draft tokens for speculative decoding from the sequence itself.

Output often repeats spans of its prompt (quoting, code edits, summaries) or
of itself. :func:`propose_ngram` finds the latest earlier occurrence of the
sequence's last ``n`` tokens (``n`` from ``max_ngram`` down to
``min_ngram``) and proposes the tokens that followed it, so no draft model
runs (Saxena, "Prompt Lookup Decoding", 2023,
github.com/apoorvumang/prompt-lookup-decoding; transformers'
``prompt_lookup_num_tokens``). The target model then verifies the drafts.

Pure function; no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["propose_ngram"]


def propose_ngram(tokens: Sequence[int], num_draft: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``num_draft`` draft tokens continuing ``tokens`` (prompt + output so far).

    The longest suffix n-gram (``max_ngram`` ≥ n ≥ ``min_ngram``) that also
    occurs earlier wins; among its occurrences the latest one. Returns ``[]``
    when no suffix n-gram recurs or ``num_draft`` is 0. O(len(tokens) · max_ngram).
    """
    size = len(tokens)
    if num_draft <= 0:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = list(tokens[size - n:])
        # An occurrence starting at i is followed by tokens[i + n:]; it must end before the suffix.
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == tail[0] and list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + num_draft])
    return []
