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
        url: Union[str, Sequence[str]] = "http://127.0.0.1:8000",
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
        concurrency: int = 4,
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
        concurrency: int = 4,
        max_windows: Optional[int] = None,
        field: str = "text",
        tokenize: str = "local",
        output: Union[str, "os.PathLike[str]", None] = None,
        resume: bool = False,
        progress: bool = True,
        wikitext_path: Union[str, "os.PathLike[str]", None] = None,
    ) -> Report: ...
    def diff(
        self,
        dataset: Union[str, "os.PathLike[str]", Sequence[str]] = "wikitext2",
        *,
        ctx: int = 2048,
        windows: int = 4,
        reference_until: Optional[int] = None,
        attribute: bool = False,
        attribute_layers: Optional[Tuple[int, int]] = None,
        attribute_pattern: Optional[str] = None,
        field: str = "text",
        tokenize: str = "local",
        timeout: float = 3600.0,
        wikitext_path: Union[str, "os.PathLike[str]", None] = None,
    ) -> DiffReport: ...

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
    def from_json(source: Union[str, "os.PathLike[str]"]) -> Report: ...
    def to_dict(self) -> Dict[str, Any]: ...
    def to_json(self) -> str: ...
    def to_pandas(self, per_window: bool = False) -> Any: ...

class DiffReport:
    """The report of ``Client.diff`` (``exactscore diff --json``)."""

    server: str
    server_info: Optional[Dict[str, Any]]
    dataset: str
    ctx: int
    windows: int
    tokens: int
    reference_until: Optional[int]
    layers: List[Dict[str, Any]]
    kld: Dict[str, Any]
    attribution: Optional[Dict[str, Any]]
    wall_time_s: float
    @staticmethod
    def from_json(path: Union[str, "os.PathLike[str]"]) -> DiffReport: ...
    def to_dict(self) -> Dict[str, Any]: ...
    def to_json(self) -> str: ...
    def to_pandas(self, rows: str = "layers") -> Any: ...
    def plot(self, path: Union[str, "os.PathLike[str]"]) -> None: ...

def compare(
    reports: Sequence[Union[Report, str, "os.PathLike[str]"]],
    plot: Union[str, "os.PathLike[str]", None] = None,
    allow_mismatch: bool = False,
) -> str: ...
