"""Text in, ids out, and back: tokenizers, chat templates and stop strings.

The engine speaks ids only; the server uses this package to build prompts and to
turn generated ids into text it can stream. Setup calls the two file writers.
"""

from .core import Tokenizer
from .files import copy_tokenizer_files
from .gguf import write_tokenizer_from_gguf
from .kimi import KimiTokenizer  # registers itself with Tokenizer.load (claims XTML folders)
from .stream import IncrementalDecoder, StopMatcher

__all__ = [
    "IncrementalDecoder",
    "KimiTokenizer",
    "StopMatcher",
    "Tokenizer",
    "copy_tokenizer_files",
    "write_tokenizer_from_gguf",
]
