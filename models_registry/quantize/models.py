"""Calibration datasets: managed text samples for quantization (and its evaluation set)."""

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

__all__ = ["CalibrationDataset"]


class CalibrationDataset(models.Model):
    class Purpose(models.TextChoices):
        CALIBRATION = "calibration"
        EVALUATION = "evaluation"

    name = models.CharField(max_length=100, unique=True)
    purpose = models.CharField(max_length=16, choices=Purpose.choices, default=Purpose.CALIBRATION)
    description = models.TextField(blank=True)
    source = models.CharField(max_length=300, blank=True)  # where the text comes from, and its licence
    samples = models.JSONField(default=list)  # list[str]
    sample_count = models.PositiveIntegerField(default=0)
    char_count = models.PositiveIntegerField(default=0)
    builtin = models.BooleanField(default=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    # The uploader's team (console.teams): its members see the dataset; the built-in ones have none (everyone's).
    team = models.ForeignKey("console.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        app_label = "models_registry"
        ordering = ["purpose", "name"]

    def __str__(self):
        return f"{self.name} ({self.sample_count} samples)"

    def get_absolute_url(self):
        return reverse("calibration_detail", args=[self.pk])

    def preview(self, n: int = 3, chars: int = 300) -> list[str]:
        return [s[:chars] + ("…" if len(s) > chars else "") for s in (self.samples or [])[:n]]
