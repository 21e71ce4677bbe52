"""The strict field types and the base model every request body part shares
(schemas.py, chat_messages.py): ``"1"`` is not an integer, ``true`` not a number,
and unknown fields inside a part are ignored (clients replay OpenAI's own objects)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)
