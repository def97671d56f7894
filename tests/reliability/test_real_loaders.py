"""The oracle itself: the real loaders accept every intact original and reject what the corpus
says they reject (else the rule "validate passes nothing they reject" would test nothing)."""

import pytest

from _cases import BY_ID

pytestmark = pytest.mark.interop  # the real loaders (Megatron-Core) are the oracle


def test_real_loaders_accept_the_intact_originals(verdicts, corpus):
    intact = {k: v for k, v in verdicts.items() if k.startswith("intact/")}
    assert len(intact) == len(corpus.pristine) and set(intact.values()) == {"ok"}, intact


def test_real_loaders_reject_most_of_the_corpus(verdicts):
    asked = [k for k in BY_ID if k in verdicts]
    rejected = [k for k in asked if verdicts[k] != "ok"]
    assert len(asked) >= 50 and len(rejected) >= 0.6 * len(asked), (len(asked), len(rejected))
