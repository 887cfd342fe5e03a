"""The typed options of the registry's services.  The web forms (``forms.py``) and the API schemas
both produce these, so text is parsed once, at the edge; the services check the rules (ranges that
depend on the artifact, combinations).  ``None`` means "not given": the service's default applies."""

from dataclasses import asdict, dataclass, fields

from django.core.exceptions import ValidationError


@dataclass(frozen=True, kw_only=True)
class _Options:
    def given(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_params(cls, params: dict):
        """The options a job was queued with (its ``params``), e.g. to retry it."""
        unknown = set(params) - {f.name for f in fields(cls)}
        if unknown:
            raise ValidationError(f"Unknown option(s): {', '.join(sorted(unknown))}.")
        return cls(**params)


@dataclass(frozen=True, kw_only=True)
class ConvertOptions(_Options):
    to: str | None = None
    dtype: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    soc_version: str | None = None
    precision_mode: str | None = None


@dataclass(frozen=True, kw_only=True)
class QuantizeOptions(_Options):
    target: str | None = None
    scheme: str | None = None
    method: str | None = None
    calibration: int | str | None = None  # a dataset's id or name; None: the default set
    evaluation: int | str | None = None
    smoothing: float | None = None
    anti_outlier: str | None = None
    gate_pct: float | None = None
    fallback: bool | None = None
    max_fallback_layers: int | None = None
    num_samples: int | None = None
    max_seq_len: int | None = None
    gptq: bool | None = None
    serve_check: bool | None = None
