from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned

NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
    "Use letters, digits, '.', '_' and '-' (up to 100), starting with a letter or digit.",
)


class ModelQuerySet(models.QuerySet):
    def alive(self):
        return self.filter(deleted_at__isnull=True)


class Model(TeamOwned):
    """A model as ops staff name it; its files are Artifacts (the original and every derivative)."""

    name = models.CharField(max_length=100, unique=True, validators=[NAME_VALIDATOR])
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = ModelQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def get_absolute_url(self):
        return reverse("model_detail", args=[self.pk])


class ArtifactQuerySet(models.QuerySet):
    def alive(self):
        return self.exclude(status=Artifact.Status.DELETED)


class Artifact(TeamOwned):
    TEAM_PARENTS = ("model",)

    class Format(models.TextChoices):
        HF = "hf", "Hugging Face"
        GGUF = "gguf", "GGUF"
        MODELSLIM = "ascend-modelslim", "Ascend ModelSlim"
        COMPRESSED_TENSORS = "compressed-tensors", "compressed-tensors"
        ONNX = "onnx", "ONNX"
        OM = "om", "Ascend OM"
        LORA = "lora", "LoRA adapter"  # a PEFT directory for its model's base artifacts (models_registry.lora)

    class Status(models.TextChoices):
        READY = "ready"
        BUILDING = "building"
        FAILED = "failed"
        DELETED = "deleted"

    # Formats vLLM (and vllm-ascend) can load. OM is for ACL/MindIE, ONNX is an intermediate.
    SERVABLE_FORMATS = {Format.HF, Format.GGUF, Format.MODELSLIM, Format.COMPRESSED_TENSORS}
    # Formats that are quantized checkpoints by construction (made by ModelSlim / llm-compressor).
    QUANTIZED_FORMATS = {Format.MODELSLIM, Format.COMPRESSED_TENSORS}

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="artifacts")
    # A LoRA adapter's name, the "model" requests name it by (unique among adapters not deleted); "" otherwise.
    name = models.CharField(max_length=100, blank=True, validators=[NAME_VALIDATOR])
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    producing_job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    params = models.JSONField(default=dict, blank=True)  # the conversion/quantization parameters
    format = models.CharField(max_length=32, choices=Format.choices)
    dtype = models.CharField(max_length=32, blank=True)  # e.g. bfloat16, float16, Q4_1, W8A8
    path = models.CharField(max_length=1024)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    sha256 = models.CharField(max_length=64, blank=True)  # over the per-file digests, in name order
    file_hashes = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY, db_index=True)
    inspection = models.JSONField(default=dict, blank=True)
    verification = models.JSONField(default=dict, blank=True)  # e.g. logits comparison with the parent
    accuracy = models.JSONField(null=True, blank=True)
    recommended = models.BooleanField(default=True)
    note = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = ArtifactQuerySet.as_manager()

    class Meta:
        ordering = ["model_id", "created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["name"],
                condition=models.Q(format="lora") & ~models.Q(status="deleted"),
                name="unique_adapter_name",
            )
        ]

    def __str__(self):
        return f"{self.model.name} [{self.format}{' ' + self.dtype if self.dtype else ''}] #{self.pk}"

    def get_absolute_url(self):
        return reverse("artifact_detail", args=[self.pk])

    @property
    def servable(self) -> bool:
        return self.format in self.SERVABLE_FORMATS and self.status == self.Status.READY

    @property
    def is_quantized(self) -> bool:
        return self.format in self.QUANTIZED_FORMATS or bool((self.inspection or {}).get("quantization"))

    @property
    def is_adapter(self) -> bool:
        return self.format == self.Format.LORA

    @property
    def is_original(self) -> bool:
        return self.parent_id is None


from models_registry.quantize.models import *  # noqa: E402,F401,F403
