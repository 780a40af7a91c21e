# Same document processing and metrics as lm-eval's own `wikitext` task.
from lm_eval.tasks.wikitext.preprocess_wikitext import (  # noqa: F401
    process_results,
    wikitext_detokenizer,
)
