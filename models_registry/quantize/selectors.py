"""Reads for quantization: calibration datasets (the defaults are created on first use) and which schemes
the target engine serves."""

from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from packaging.version import InvalidVersion, Version

from console.audit import audit_log
from console.roles import VIEWER
from console.teams import visible_or_shared, visible_or_shared_get
from models_registry import hooks
from models_registry.quantize.models import CalibrationDataset

DATA = Path(__file__).resolve().parent / "data"
DEFAULTS = {
    "default-calibration": (
        "calibration",
        "calibration_source.txt",
        "Public-domain English prose: US founding documents, Austen, Darwin.",
    ),
    "default-evaluation": (
        "evaluation",
        "evaluation_source.txt",
        (
            "Public-domain English prose: Lincoln, Dickens, Melville, Carroll, Conan Doyle, "
            "Fitzgerald; Ruth and Jonah (King James Bible). Never overlaps default-calibration."
        ),
    ),
}
SOURCE = "Public domain (pre-1926 works); see models_registry/quantize/data/README.md"


def read_paragraphs(path: Path) -> list[str]:
    return [" ".join(p.split()) for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def ensure_defaults() -> None:
    """The built-in datasets, created on first use (a data migration's rows would not survive the transactional
    tests' flush): the one write a read makes, audited as the system like every state change."""
    for name, (purpose, filename, description) in DEFAULTS.items():
        if CalibrationDataset.objects.filter(name=name).exists():
            continue
        samples = read_paragraphs(DATA / filename)
        try:
            with transaction.atomic():
                dataset = CalibrationDataset.objects.create(
                    name=name,
                    purpose=purpose,
                    description=description,
                    source=SOURCE,
                    samples=samples,
                    sample_count=len(samples),
                    char_count=sum(map(len, samples)),
                    builtin=True,
                )
                audit_log(
                    action="calibration.create",
                    obj=dataset,
                    via="system",
                    changes={"purpose": purpose, "builtin": True, "samples": len(samples)},
                )
        except IntegrityError:  # created concurrently (and audited there)
            pass


def default_dataset(purpose: str) -> CalibrationDataset:
    ensure_defaults()
    return CalibrationDataset.objects.get(name=f"default-{purpose}")


def dataset_list(*, user):
    """The built-in datasets and those of the user's teams (every one for the console Admin)."""
    ensure_defaults()
    return visible_or_shared(CalibrationDataset.objects.all(), user)


def dataset_get(dataset_id: int, *, user, role: str = VIEWER) -> CalibrationDataset:
    """404 for another team's dataset; 403 below `role` in its team (console.teams)."""
    return visible_or_shared_get(CalibrationDataset.objects.all(), user, role=role, pk=dataset_id)


# The first vllm-ascend release whose loader has each ModelSlim scheme, read at the tags of
# vllm-project/vllm-ascend: quantization/w8a8.py and w8a8_dynamic.py first appear in v0.8.4rc2,
# w8a16.py in v0.13.0rc1 (at v0.23.0: quantization/methods/, @register_scheme("W8A16", "linear")).
MODELSLIM_SCHEME_SINCE = {"w8a8_static": "0.8.4rc2", "w8a8_dynamic": "0.8.4rc2", "w8a16": "0.13.0rc1"}


@dataclass(frozen=True)
class SchemeSupport:
    scheme: str
    since: str  # the first vllm-ascend release with it
    versions: tuple[str, ...]  # this site's vllm-ascend versions (the pinned one when no node reported)
    serving: tuple[str, ...]  # those of them that serve it

    @property
    def supported(self) -> bool:
        return bool(self.serving)

    def refusal(self) -> str:
        return (
            f"{self.scheme} for Ascend ModelSlim needs vllm-ascend v{self.since} or later (the first release "
            f"whose loader has it); this site's vllm-ascend is {', '.join(self.versions)}."
        )


def _version(raw: str) -> Version | None:
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def modelslim_scheme_support() -> dict[str, SchemeSupport]:
    """Per scheme: does a vllm-ascend this site runs (each Ascend node's reported version, or with none
    reported the release the console pins) have its method?"""
    versions = tuple(hooks.target_engine_versions("ascend-modelslim") or [settings.VLLM_ASCEND_VERSION])
    support = {}
    for scheme, since in MODELSLIM_SCHEME_SINCE.items():
        serving = tuple(v for v in versions if (parsed := _version(v.lstrip("v"))) and parsed >= Version(since))
        support[scheme] = SchemeSupport(scheme=scheme, since=since, versions=versions, serving=serving)
    return support
