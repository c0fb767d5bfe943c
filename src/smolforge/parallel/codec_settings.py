"""The codec fields every strategy that sends through `parallel.codecs` takes, validated in one place.

DiLoCo's pseudo-gradients and the parameter servers' gradients travel through the same codecs, so their
`strategy_config` shares these fields: the codec's name (any registered in `codecs.CODECS`: a new codec is
then a choice of both at once) and the settings the codecs read. What a codec refuses (int4's odd block,
sparse's top-k above its chunk) is refused by the codec itself (`make_codec`), here at settings time, so a
job never starts with a codec that cannot be built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from smolforge.parallel.codecs import CODECS, Codec, make_codec


class CodecFields(BaseModel):
    """`codec`, `block`, `chunk`, `topk`, `bits`: the settings of `parallel.codecs`' codecs, checked by them."""

    codec: str = Field("fp32", description="how (pseudo-)gradients travel: " + ", ".join(CODECS))
    block: int = Field(256, ge=64, le=4096, description="int8, int4: values per fp32 scale")
    chunk: int = Field(4096, ge=64, le=65536, description="sparse: values per chunk (positions as uint16)")
    topk: int = Field(64, ge=1, description="sparse: values sent per chunk (64 of 4096: 1.6 %)")
    bits: Literal[2, 4] = Field(2, description="sparse: bits per value sent")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        make_codec(v)  # the registry's refusal of a name it lacks, reported on this field
        return v

    @model_validator(mode="after")
    def _codec_builds(self) -> "CodecFields":
        self.coder()  # the codec's own refusals, as ValueError
        return self

    def coder(self) -> Codec:
        """The codec these settings name, built with the settings it reads."""
        return make_codec(self.codec, block=self.block, chunk=self.chunk, topk=self.topk, bits=self.bits)
