"""The ``model`` section: the served model, as every instance knows it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from pdscope.config.base import NonEmpty, PositiveInt, _Frozen
from pdscope.simtokenizer import NAME as SIM_TOKENIZER


class ModelSettings(_Frozen):
    """The served model, as the instances know it."""

    name: NonEmpty
    """served model name (vLLM --served-model-name)"""
    kv_bytes_per_token: PositiveInt
    """KV-cache bytes per token across all layers (2 * layers * kv_heads * head_dim * dtype bytes; Llama-3-70B
    BF16 = 327680)"""
    kv_block_size: int = Field(default=16, ge=1, le=4096)
    """tokens per KV cache block (vLLM --block-size): the unit cached prefixes are matched in"""
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=f"the model's tokenizer, for proxy.kv_aware.mode precise: {SIM_TOKENIZER!r} (the "
        "simulator's) or the path of a tokenizer directory or tokenizer.json (it must exist); unset: none",
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str | None) -> str | None:
        if value is None or value == SIM_TOKENIZER:
            return value
        try:
            found = Path(value).exists()
        except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
            raise ValueError(f"no tokenizer at {value[:200]!r}: {exc.__class__.__name__}") from None
        if not found:
            raise ValueError(
                f"no tokenizer at {value!r} (not {SIM_TOKENIZER!r}, and no such file or directory)"
            )
        return value
