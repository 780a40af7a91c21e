"""Type stubs of the Rust extension module (docstrings: ``help(exactscore.Client)``)."""

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__version__: str

# A numpy array when numpy is installed, else a list (None where a position has no value).
FloatArray = Any

class Client:
    """A client of one or more ExactScore servers."""

    def __init__(
        self,
        url: Union[str, Sequence[str]],
        api_key: Optional[str] = None,
        timeout: float = 600.0,
        retries: int = 8,
    ) -> None: ...
    @property
    def urls(self) -> List[str]: ...
    def info(self) -> Dict[str, Any]: ...
    def score(
        self,
        input: Union[str, Sequence[int]],
        /,
        *,
        top_k: int = 0,
        add_special_tokens: bool = True,
    ) -> ScoreResult: ...
    def kld(
        self,
        input: Union[str, Sequence[int]],
        /,
        *,
        add_special_tokens: bool = True,
    ) -> KldResult: ...
    def ppl(
        self,
        dataset: Union[str, "os.PathLike[str]", Sequence[str]] = "wikitext2",
        *,
        method: str = "exl3",
        ctx: int = 2048,
        stride: int = 512,
        concurrency: int = 8,
        max_windows: Optional[int] = None,
        field: str = "text",
        tokenize: str = "local",
        output: Union[str, "os.PathLike[str]", None] = None,
        resume: bool = False,
        progress: bool = True,
        wikitext_path: Union[str, "os.PathLike[str]", None] = None,
    ) -> Report: ...
    def kld_eval(
        self,
        dataset: Union[str, "os.PathLike[str]", Sequence[str]] = "wikitext2",
        *,
        method: str = "exl3",
        ctx: int = 2048,
        stride: int = 512,
        concurrency: int = 8,
        max_windows: Optional[int] = None,
        field: str = "text",
        tokenize: str = "local",
        output: Union[str, "os.PathLike[str]", None] = None,
        resume: bool = False,
        progress: bool = True,
        wikitext_path: Union[str, "os.PathLike[str]", None] = None,
    ) -> Report: ...

class ScoreResult:
    """Per-token log-probabilities of one sequence."""

    model: str
    tokens: List[int]
    logprobs: FloatArray
    token_strings: Optional[List[str]]
    greedy: Optional[List[Optional[bool]]]
    top_k: Optional[List[List[Tuple[int, float, Optional[str]]]]]
    sum_nll: float
    num_scored: int
    mean_nll: Optional[float]
    perplexity: Optional[float]
    def __len__(self) -> int: ...

class KldResult:
    """Per-token divergence of the served model from the reference model over one sequence."""

    model: str
    reference_model: str
    tokens: List[int]
    kld: FloatArray
    logprobs: FloatArray
    reference_logprobs: FloatArray
    same_top: List[Optional[bool]]
    delta_p: FloatArray
    num_scored: int
    sum_kld: float
    sum_nll: float
    reference_sum_nll: float
    same_top_count: int
    sum_delta_p: float
    sum_delta_p_squared: float
    @property
    def mean_kld(self) -> Optional[float]: ...
    def __len__(self) -> int: ...

class Report:
    """The report of ``Client.ppl`` / ``Client.kld_eval`` (``exactscore ppl --json``)."""

    method: str
    ctx: int
    stride: int
    max_windows: Optional[int]
    tokenize: str
    dataset: Dict[str, Any]
    windows: int
    tokens_scored: int
    total_nll: float
    mean_nll: float
    perplexity: float
    mean_nll_stderr: Optional[float]
    perplexity_stderr: Optional[float]
    bits_per_token: float
    bits_per_byte: float
    stderr_method: str
    resumed_windows: int
    wall_time_s: float
    tokens_per_s: float
    servers: List[str]
    server_info: Optional[Dict[str, Any]]
    kld: Optional[Dict[str, Any]]
    per_window: List[Dict[str, Any]]
    @staticmethod
    def from_json(text: str) -> Report: ...
    def to_dict(self) -> Dict[str, Any]: ...
    def to_json(self) -> str: ...
    def to_pandas(self, per_window: bool = False) -> Any: ...
