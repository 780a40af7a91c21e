"""ExactScore client: exact per-token log-probabilities, perplexity and KL-divergence
evaluations against ExactScore servers.

    >>> import exactscore
    >>> client = exactscore.Client("http://gpu0:8000", api_key="...")
    >>> client.info()["model"]
    >>> client.score("The capital of France is Paris.").logprobs      # numpy float32 array
    >>> report = client.ppl("wikitext2", ctx=2048, stride=512, output="wt2.partial.jsonl")
    >>> report.perplexity, report.perplexity_stderr
    >>> report.to_pandas()

The evaluation itself (windows, fan-out over servers, resume, statistics, reports) is the Rust
client that the ``exactscore`` command line tool, installed with this package, runs too.
"""

from ._errors import ConnectionError, ExactScoreError, ServerError, ValidationError
from ._native import Client, KldResult, Report, ScoreResult, __version__

__all__ = [
    "Client",
    "ConnectionError",
    "ExactScoreError",
    "KldResult",
    "Report",
    "ScoreResult",
    "ServerError",
    "ValidationError",
    "__version__",
]
