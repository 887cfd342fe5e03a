"""Reads for quantization: calibration datasets (the defaults are created on first use)."""
from pathlib import Path

from django.db import IntegrityError

from models_registry.quantize.models import CalibrationDataset

DATA = Path(__file__).resolve().parent / "data"
DEFAULTS = {
    "default-calibration": ("calibration", "calibration_source.txt",
                            "Public-domain English prose: US founding documents, Austen, Darwin."),
    "default-evaluation": ("evaluation", "evaluation_source.txt",
                           "Public-domain English prose: Lincoln, Dickens, Melville, Carroll, Conan Doyle, "
                           "Fitzgerald; Ruth and Jonah (King James Bible). Never overlaps default-calibration."),
}
SOURCE = "Public domain (pre-1926 works); see models_registry/quantize/data/README.md"


def read_paragraphs(path: Path) -> list[str]:
    return [" ".join(p.split()) for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def ensure_defaults() -> None:
    for name, (purpose, filename, description) in DEFAULTS.items():
        if CalibrationDataset.objects.filter(name=name).exists():
            continue
        samples = read_paragraphs(DATA / filename)
        try:
            CalibrationDataset.objects.create(
                name=name, purpose=purpose, description=description, source=SOURCE, samples=samples,
                sample_count=len(samples), char_count=sum(map(len, samples)), builtin=True)
        except IntegrityError:  # created concurrently
            pass


def default_dataset(purpose: str) -> CalibrationDataset:
    ensure_defaults()
    return CalibrationDataset.objects.get(name=f"default-{purpose}")


def dataset_list():
    ensure_defaults()
    return CalibrationDataset.objects.all()

