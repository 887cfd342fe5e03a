from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Defining the job kind registers it with the job runtime (workers.jobs).
        from endpoints.bench import jobs  # noqa: F401
