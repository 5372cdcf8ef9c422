"""The data behind channels 2 and 3: hint templates, teacher trace records and teacher clients.

`hints` builds the hinted teacher prompt of channel 2; `traces` defines the trace JSONL format,
`prompt_key` and the `TraceStore` channel 3 replays from; `teachers` holds the clients that produce
traces (OpenAI-compatible HTTP, local Hugging Face model, task oracle) and the `TeacherPool`.
"""

from composer_replication.data.hints import HINTED_EXAMPLE_COLUMN, HintTemplate
from composer_replication.data.traces import (
    TraceFormatError,
    TraceRecord,
    TraceStore,
    normalize_prompt,
    prompt_key,
)

__all__ = [
    "HINTED_EXAMPLE_COLUMN",
    "HintTemplate",
    "TraceFormatError",
    "TraceRecord",
    "TraceStore",
    "normalize_prompt",
    "prompt_key",
]
