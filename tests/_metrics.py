"""The comparison metrics live in lily.testing.metrics (benchmarks/ use them too); tests import them from here."""
from lily.testing.metrics import assert_close, perplexity, rel_rms, top1_agreement

__all__ = ["assert_close", "perplexity", "rel_rms", "top1_agreement"]
