"""ExactScore client: exact per-token log-probabilities, perplexity and KL-divergence
evaluations against ExactScore servers.

    >>> import exactscore
    >>> client = exactscore.Client()          # http://127.0.0.1:8000; or a URL, api_key=...
    >>> client.info()["model"]
    >>> client.score("The capital of France is Paris.").logprobs      # numpy float32 array
    >>> report = client.ppl("wikitext2", ctx=2048, stride=512, output="wt2.partial.jsonl")
    >>> report.perplexity, report.perplexity_stderr
    >>> report.to_pandas()
    >>> client.diff("wikitext2", ctx=512, windows=4).to_pandas()       # a row per layer
    >>> print(exactscore.compare(["bf16.json", "w4a16.json"], plot="cmp.png"))

The evaluation itself (windows, fan-out over servers, resume, statistics, reports) is the Rust
client that the ``exactscore`` command line tool, installed with this package, runs too.
"""

from ._errors import ConnectionError, ExactScoreError, ServerError, ValidationError
from ._native import Client, DiffReport, KldResult, Report, ScoreResult, __version__, compare

__all__ = [
    "Client",
    "ConnectionError",
    "DiffReport",
    "ExactScoreError",
    "KldResult",
    "Report",
    "ScoreResult",
    "ServerError",
    "ValidationError",
    "__version__",
    "compare",
]
