from django.apps import AppConfig


class ModelsRegistryConfig(AppConfig):
    name = "models_registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Defining the job kinds registers them with the job runtime (workers.jobs).
        from models_registry import jobs  # noqa: F401
        from models_registry.quantize import jobs as quantize_jobs  # noqa: F401
